"""The slot pool: own-rank fp32 tensors under PEFT names, attached by reference, nothing left after free."""

import gc
import weakref

import pytest
import torch

from loraplex.engine.slots import OptimizerState, SlotPool
from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.errors import CapacityError, NotFoundError, UserError
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.multi_lora import LoRARouting, init_slot_weights
from loraplex.model.packing import PackedSequences
from loraplex.model.tiny import ensure_tiny_model

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("data"))


@pytest.fixture
def decoder(model_dir):
    """A fresh decoder per test, so no slot stays attached from another test."""
    return load_decoder(model_dir)


@pytest.fixture
def pool(decoder):
    return SlotPool(decoder, max_slots=3, max_rank=8)


def _is_zero(*tensors: torch.Tensor) -> bool:
    return all(torch.count_nonzero(t) == 0 for t in tensors)


def _train(decoder, slot: int, tokens: list[int]) -> None:
    """One forward + backward of a single sequence routed to `slot` (adds into its accumulators)."""
    routing = LoRARouting.from_sequences([len(tokens)], [slot])
    logits = decoder.logits(torch.tensor(tokens), PackedSequences.from_lengths([len(tokens)]), routing)
    logits.logsumexp(-1).sum().backward()


def test_slot_holds_a_and_b_per_target_at_its_own_rank_under_peft_names(pool):
    small, big = pool.create(LoraConfig(rank=2, seed=1)), pool.create(LoraConfig(rank=8, seed=1))
    for slot, rank in ((small, 2), (big, 8)):
        record = pool.get(slot)
        assert len(record.weights) == 2 * len(pool.targets) == 2 * 29
        for path, (layer, _) in pool.targets.items():
            A, B = record.weights[f"{path}.lora_A.weight"], record.weights[f"{path}.lora_B.weight"]
            assert A.shape == (rank, layer.in_features) and B.shape == (layer.out_features, rank)
            assert A.dtype == B.dtype == torch.float32 and A.requires_grad and B.requires_grad
            assert torch.count_nonzero(B) == 0 and torch.count_nonzero(A) > 0
            assert layer.has_slot(slot)
        assert record.scale == 32.0 / rank
        assert record.adam.step == 0
        assert list(record.weights.values()) == record.adam.params
        assert _is_zero(record.adam.grad_rows, record.adam.exp_avg_N, record.adam.exp_avg_sq_N)


def test_a_is_the_peft_init_drawn_from_the_slot_seed(pool):
    slot = pool.create(LoraConfig(rank=4, seed=7, train_mlp=False))
    expected = init_slot_weights(pool.targets, 4, 7, {"attn", "unembed"})
    weights = pool.get(slot).weights
    assert {name.rsplit(".lora_", 1)[0] for name in weights} == set(expected)
    for path, (A, _) in expected.items():
        assert torch.equal(weights[f"{path}.lora_A.weight"], A)
    other = pool.create(LoraConfig(rank=4, seed=8, train_mlp=False))
    assert not torch.equal(pool.get(other).weights["lm_head.lora_A.weight"], weights["lm_head.lora_A.weight"])


@pytest.mark.parametrize(
    ("flags", "leaves"),
    [
        ({"train_mlp": False, "train_unembed": False}, ATTN),
        ({"train_attn": False, "train_unembed": False}, MLP),
        ({"train_attn": False, "train_mlp": False}, ("lm_head",)),
    ],
)
def test_targets_follow_the_train_flags(pool, flags, leaves):
    slot = pool.create(LoraConfig(rank=2, **flags))
    paths = {name.rsplit(".lora_", 1)[0] for name in pool.get(slot).weights}
    assert paths == {path for path in pool.targets if path.rsplit(".", 1)[-1] in leaves}
    for path, (layer, _) in pool.targets.items():
        assert layer.has_slot(slot) == (path in paths)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LoraConfig(rank=0), "lora rank 0 is not allowed; this server supports ranks 1..8"),
        (LoraConfig(rank=9), "lora rank 9 is not allowed"),
        (LoraConfig(rank=4, alpha=0.0), "lora alpha 0.0 is not allowed"),
        (
            LoraConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=False),
            "at least one of train_attn",
        ),
    ],
)
def test_invalid_config_is_a_user_error_and_allocates_nothing(pool, config, message):
    with pytest.raises(UserError, match=message):
        pool.create(config)
    assert pool.live_slots == []
    assert not any(layer.has_slot(0) for layer, _ in pool.targets.values())


def test_full_pool_raises_capacity_error_naming_the_limit(pool):
    assert [pool.create(LoraConfig(rank=1)) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(CapacityError, match="all 3 adapter slots are in use"):
        pool.create(LoraConfig(rank=1))
    pool.free(1)
    assert pool.create(LoraConfig(rank=1)) == 1


def test_backward_accumulates_only_into_the_routed_slots_gradients(pool, decoder):
    routed, idle = pool.create(LoraConfig(rank=4, seed=1)), pool.create(LoraConfig(rank=4, seed=2))
    _train(decoder, routed, [1, 2, 3, 4])
    first = [g.clone() for g in pool.get(routed).adam.grads]
    _train(decoder, routed, [1, 2, 3, 4])
    # B starts at zero, so A's gradient is zero until a step; B's is not.
    assert torch.count_nonzero(pool.get(routed).weights["lm_head.lora_B.weight"].grad) > 0
    for acc, g in zip(pool.get(routed).adam.grads, first, strict=True):
        assert torch.equal(acc, 2 * g)  # the same gradient again (same inputs, same kernels): 0 + g + g
    assert _is_zero(pool.get(idle).adam.grad_rows)


@pytest.mark.parametrize("change", ["step", "load_weights", "load_with_optimizer"])
def test_backward_lands_in_the_flat_buffers_after_a_step_or_an_in_place_load(pool, decoder, change):
    """The named tensors and their gradients stay views of the slot's flat buffers (what the fused step
    reads and writes) through a step and through `assign`, the in-place load checkpoints use."""
    slot = pool.create(LoraConfig(rank=4, seed=1))
    record, adam = pool.get(slot), pool.get(slot).adam
    _train(decoder, slot, [1, 2, 3])
    if change == "step":
        pool.step({slot: AdamParams(learning_rate=1e-2)})
    else:
        weights = {name: torch.full_like(t, 0.01) for name, t in record.weights.items()}
        ones = {name: torch.ones_like(t) for name, t in record.weights.items()}
        record.assign(weights, OptimizerState(ones, ones, 7) if change == "load_with_optimizer" else None)
        assert torch.equal(adam.weights_N, torch.full_like(adam.weights_N, 0.01))
        moment = 1.0 if change == "load_with_optimizer" else 0.0
        assert torch.equal(adam.exp_avg_sq_N, torch.full_like(adam.exp_avg_sq_N, moment))
    assert _is_zero(adam.grad_rows)

    _train(decoder, slot, [4, 5, 6])

    assert torch.count_nonzero(adam.grads_N) > 0
    views = zip(record.weights.values(), adam.views(adam.weights_N), adam.views(adam.grads_N), strict=True)
    for t, weight, grad in views:
        assert t.data_ptr() == weight.data_ptr() and t.grad.data_ptr() == grad.data_ptr()


def test_freed_slot_leaves_nothing_and_its_id_starts_fresh(pool, decoder):
    config = LoraConfig(rank=4, seed=3)
    slot = pool.create(config)
    fresh = {name: t.detach().clone() for name, t in pool.get(slot).weights.items()}
    for _ in range(2):
        _train(decoder, slot, [5, 6, 7])
        pool.step({slot: AdamParams(learning_rate=1e-2)})
    _train(decoder, slot, [5, 6, 7])  # pending gradients at free time
    adam = pool.get(slot).adam
    buffers = [adam.weights_N, adam.grads_N, adam.grad_rows, adam.exp_avg_N, adam.exp_avg_sq_N]
    tracked = [weakref.ref(t) for t in adam.params + buffers]
    del adam, buffers

    pool.free(slot)

    gc.collect()
    assert all(ref() is None for ref in tracked)
    assert not any(layer.has_slot(slot) for layer, _ in pool.targets.values())
    with pytest.raises(NotFoundError, match=f"slot {slot} is not in use"):
        pool.get(slot)
    again = pool.create(config)
    assert again == slot
    record = pool.get(again)
    assert all(torch.equal(record.weights[name], t) for name, t in fresh.items())
    assert record.adam.step == 0
    assert _is_zero(record.adam.grad_rows, record.adam.exp_avg_N, record.adam.exp_avg_sq_N)


def test_step_checks_every_slot_before_stepping_any(pool, decoder):
    slot = pool.create(LoraConfig(rank=2))
    _train(decoder, slot, [1, 2])
    with pytest.raises(NotFoundError, match="slot 2 is not in use"):
        pool.step({slot: AdamParams(), 2: AdamParams()})
    assert pool.get(slot).adam.step == 0
    assert torch.count_nonzero(pool.get(slot).weights["lm_head.lora_B.weight"].grad) > 0
    metrics = pool.step({slot: AdamParams(learning_rate=0.5)})
    assert metrics[slot]["learning_rate"] == 0.5 and metrics[slot]["grad_norm"] > 0
    assert pool.get(slot).adam.step == 1
