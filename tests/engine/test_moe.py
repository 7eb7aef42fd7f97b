"""MoE slots: a PEFT export of experts loads in peft and gives the same logits and gradients; snapshots
and checkpoints of MoE slots round-trip exactly, and the sampler attaches MoE snapshots unchanged."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loraplex.engine import checkpoints
from loraplex.engine.local import build_local_engine
from loraplex.engine.sampler.snapshot_cache import SnapshotCache
from loraplex.engine.slots import SlotPool
from loraplex.engine.snapshots import PEFT_PREFIX, WEIGHTS_FILE, load_snapshot, save_snapshot
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig, PassRequest
from loraplex.errors import UserError
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences
from loraplex.model.peft_format import to_peft
from tests.engine.conftest import randomize_lora_b
from tests.model.float64 import float64_copy, float64_experts
from tests.model.rounding import assert_within_rounding, rounding_bound
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_moe import MOE_SHAPES, moe_config

# slot -> its LoRA config; the third trains no MLP (so it has no expert parameters in PEFT).
CONFIGS = {
    0: LoraConfig(rank=4, seed=1),
    1: LoraConfig(rank=2, seed=2),
    2: LoraConfig(rank=8, seed=3, train_mlp=False),
}
SEQUENCES = [(0, 6), (0, 4), (1, 9), (None, 5), (2, 7)]  # (slot, length) in pack order
LENGTHS = tuple(length for _, length in SEQUENCES)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_moe")
    save_random_hf_model(moe_config(), directory)
    return directory


@pytest.fixture
def decoder(moe_dir: Path) -> Decoder:
    return load_decoder(moe_dir)


def slots_of(decoder: Decoder) -> SlotPool:
    """The slots of CONFIGS, with random non-zero B (fresh slots' B is zero: no effect to compare)."""
    pool = SlotPool(decoder, max_slots=4, max_rank=8)
    generator = torch.Generator().manual_seed(0)
    for slot, config in CONFIGS.items():
        assert pool.create(config) == slot
        randomize_lora_b(pool.get(slot).weights, 0.05, generator)
    return pool


@pytest.fixture
def pool(decoder: Decoder) -> SlotPool:
    return slots_of(decoder)


@pytest.fixture
def exact(moe_dir: Path) -> tuple[Decoder, SlotPool]:
    """The decoder in float64 with the same slots (their A and B fp32, as the pool keeps them)."""
    decoder = load_decoder(moe_dir, "cpu", torch.float64)
    return decoder, slots_of(decoder)


def packed_logits(decoder: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    routing = LoRARouting.from_sequences(LENGTHS, [slot for slot, _ in SEQUENCES])
    return decoder.logits(tokens, PackedSequences.from_lengths(LENGTHS), routing)


def peft_model_of(moe_dir: Path, pool: SlotPool, root: Path) -> PeftModel:
    """transformers' model with every slot's exported snapshot loaded as a trainable PEFT adapter."""
    hf_model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager")
    model = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on experimental target_parameters
        for slot in CONFIGS:
            save_snapshot(pool, slot, root / f"s{slot}", base_model_name=str(moe_dir))
            if model is None:
                model = PeftModel.from_pretrained(hf_model, root / "s0", adapter_name="s0", is_trainable=True)
            else:
                model.load_adapter(root / f"s{slot}", adapter_name=f"s{slot}", is_trainable=True)
    assert model is not None
    return model


def peft_logits(model: PeftModel, slot: int | None, tokens: torch.Tensor) -> torch.Tensor:
    if slot is None:
        with model.disable_adapter():
            return model(input_ids=tokens[None]).logits[0]
    model.set_adapter(f"s{slot}")
    return model(input_ids=tokens[None]).logits[0]


def test_snapshot_names_experts_as_peft_target_parameters(pool: SlotPool, tmp_path: Path) -> None:
    save_snapshot(pool, 0, tmp_path / "s0", base_model_name="m")
    save_snapshot(pool, 2, tmp_path / "s2", base_model_name="m")
    config = json.loads((tmp_path / "s0" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == [
        "mlp.down_proj.weight",  # layer 1's dense MLP
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    ]
    assert config["rank_pattern"] == {"mlp.experts.gate_up_proj": 8}  # gate and up at rank 4 each
    assert config["alpha_pattern"] == {"mlp.experts.gate_up_proj": 64.0}
    shapes = {
        k: tuple(v.shape) for k, v in safetensors.torch.load_file(tmp_path / "s0" / WEIGHTS_FILE).items()
    }
    E, D, F, R = 8, MOE_SHAPES["hidden_size"], MOE_SHAPES["moe_intermediate_size"], 4
    layer = PEFT_PREFIX + "model.layers.2.mlp.experts"
    assert shapes[f"{layer}.base_layer.lora_A.weight"] == (E * 2 * R, D)
    assert shapes[f"{layer}.base_layer.lora_B.weight"] == (2 * F, 2 * R * E)
    assert shapes[f"{layer}.lora_A.weight"] == (E * R, F)
    assert shapes[f"{layer}.lora_B.weight"] == (D, R * E)
    no_mlp = json.loads((tmp_path / "s2" / "adapter_config.json").read_text())
    assert "target_parameters" not in no_mlp and "rank_pattern" not in no_mlp


def test_peft_export_gives_each_sequence_its_adapters_logits(
    moe_dir: Path, decoder: Decoder, pool: SlotPool, exact: tuple[Decoder, SlotPool], tmp_path: Path
) -> None:
    model = peft_model_of(moe_dir, pool, tmp_path)
    twin = float64_copy(model)
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (sum(LENGTHS),))
    with torch.no_grad(), float64_experts():
        ours = packed_logits(decoder, tokens).split(LENGTHS)
        ours_exact = packed_logits(exact[0], tokens).split(LENGTHS)
        for i, ((slot, _), seq) in enumerate(zip(SEQUENCES, tokens.split(LENGTHS), strict=True)):
            expected, peft_exact = peft_logits(model, slot, seq), peft_logits(twin, slot, seq)
            assert_within_rounding(ours[i], expected, peft_exact, f"sequence {i}", got_exact=ours_exact[i])
            if (
                slot is not None
            ):  # the adapter moves the logits far past rounding: the comparison means something
                change = float((expected - peft_logits(model, None, seq)).norm())
                assert change > 1000 * rounding_bound(expected, peft_exact)


def test_slot_gradients_equal_peft_gradients_on_that_slots_sequences(
    moe_dir: Path, decoder: Decoder, pool: SlotPool, exact: tuple[Decoder, SlotPool], tmp_path: Path
) -> None:
    model = peft_model_of(moe_dir, pool, tmp_path)
    twin = float64_copy(model)
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (sum(LENGTHS),))
    loss_weights = torch.randn(sum(LENGTHS), MOE_SHAPES["vocab_size"])
    with float64_experts():
        for d in (decoder, exact[0]):
            (loss_weights * packed_logits(d, tokens)).sum().backward()
    for slot, config in CONFIGS.items():
        ours, ours_exact = (
            to_peft({name: t.grad for name, t in p.get(slot).weights.items()}, config.rank, config.alpha)[0]
            for p in (pool, exact[1])
        )
        # Our gate and up have no counterpart of the off-diagonal blocks of PEFT's fused gate_up B.
        weights = pool.get(slot).weights
        support, _ = to_peft({n: torch.ones_like(t) for n, t in weights.items()}, config.rank, 1.0)
        expected: dict[str, torch.Tensor] = {}
        peft_exact: dict[str, torch.Tensor] = {}
        for peft_model, grads in ((model, expected), (twin, peft_exact)):
            peft_model.zero_grad(set_to_none=True)
            reference = sum(
                (w * peft_logits(peft_model, seq_slot, seq)).sum()
                for (seq_slot, _), seq, w in zip(
                    SEQUENCES, tokens.split(LENGTHS), loss_weights.split(LENGTHS), strict=True
                )
                if seq_slot == slot
            )
            reference.backward()
            for name, p in peft_model.named_parameters():
                if f".s{slot}." in name:
                    grads[name.removeprefix(PEFT_PREFIX).replace(f".s{slot}.", ".")] = p.grad
        assert expected.keys() == ours.keys()
        for key, grad in ours.items():
            masked, masked_exact = (g[key] * (support[key] != 0) for g in (expected, peft_exact))
            assert_within_rounding(
                grad, masked, masked_exact, f"slot {slot} {key}", got_exact=ours_exact[key]
            )
            assert grad.abs().max() > 0, key


def test_snapshot_round_trips_to_the_slots_weights_and_samples_like_the_slot(
    decoder: Decoder, pool: SlotPool, tmp_path: Path
) -> None:
    for slot, config in CONFIGS.items():
        save_snapshot(pool, slot, tmp_path / f"s{slot}", base_model_name="m")
        snapshot = load_snapshot(tmp_path / f"s{slot}")
        assert snapshot.scale == 32.0 / config.rank
        weights = pool.get(slot).weights
        assert {f"{path}.lora_{ab}.weight" for path in snapshot.pairs for ab in "AB"} == set(weights)
        for path, (A, B) in snapshot.pairs.items():
            assert torch.equal(A, weights[f"{path}.lora_A.weight"].detach())
            assert torch.equal(B, weights[f"{path}.lora_B.weight"].detach())
    cache = SnapshotCache(decoder.lora_targets(), capacity=1, max_rank=config.rank)
    snapshot_id = cache.acquire(tmp_path / "s1")
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (9,))
    packing = PackedSequences.from_lengths([9])
    with torch.no_grad():
        from_slot = decoder.logits(tokens, packing, LoRARouting.from_sequences([9], [1]))
        from_snapshot = decoder.logits(tokens, packing, LoRARouting.from_sequences([9], [snapshot_id]))
    assert torch.equal(from_slot, from_snapshot)


def test_gate_up_that_is_not_block_diagonal_is_refused(pool: SlotPool, tmp_path: Path) -> None:
    save_snapshot(pool, 0, tmp_path / "s0", base_model_name="m")
    tensors = safetensors.torch.load_file(tmp_path / "s0" / WEIGHTS_FILE)
    key = PEFT_PREFIX + "model.layers.0.mlp.experts.base_layer.lora_B.weight"
    tensors[key][0, -1] = 1.0  # a gate row reading an up rank column
    safetensors.torch.save_file(tensors, tmp_path / "s0" / WEIGHTS_FILE)
    with pytest.raises(UserError, match=r"experts\.base_layer: lora_B \(64, 64\) is not block-diagonal"):
        load_snapshot(tmp_path / "s0")


def test_moe_checkpoint_resumes_exactly(pool: SlotPool, decoder: Decoder, tmp_path: Path) -> None:
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (sum(LENGTHS),))
    packed_logits(decoder, tokens).logsumexp(-1).sum().backward()
    pool.step({0: AdamParams(learning_rate=1e-2)})
    record = pool.get(0)
    assert record.weights["model.layers.0.mlp.experts.down_proj.lora_A.weight"].shape == (8 * 4, 32)
    checkpoints.save_state(pool, 0, tmp_path / "ckpt", owner_digest="o", base_model_digest="b")
    restored, config = checkpoints.load_state(pool, tmp_path / "ckpt", "o", "b", with_optimizer=True)
    assert (restored, config) == (3, CONFIGS[0])
    state, state_back = record.optimizer_state(), pool.get(3).optimizer_state()
    for name, weight in record.weights.items():
        assert torch.equal(pool.get(3).weights[name], weight)
        assert torch.equal(state_back.exp_avg_sq[name], state.exp_avg_sq[name])
    assert state_back.step == state.step == 1


def test_each_pass_records_its_expert_load_also_when_run_in_pieces(moe_dir: Path) -> None:
    config = moe_config()
    engine = build_local_engine(str(moe_dir), moe_dir, "cpu", 2, 8, "moe")
    slot = engine.create_slot(LoraConfig(rank=4, seed=1))
    generator = torch.Generator().manual_seed(3)

    def datum(length: int) -> DatumInput:
        tokens = torch.randint(0, config.vocab_size, (length + 1,), generator=generator).numpy()
        return DatumInput(tokens[:-1], {"target_tokens": tokens[1:]})

    request = PassRequest(slot, "cross_entropy", {}, [datum(n) for n in (6, 9, 5)], False)
    engine.run_pass([request])
    whole = engine.last_pass
    moe_layers = config.num_hidden_layers - len(config.mlp_only_layers)
    assert (whole.tokens, whole.requests) == (20, 1)
    assert len(whole.expert_load) == moe_layers  # type: ignore[arg-type]
    assert [sum(row) for row in whole.expert_load] == [20 * config.num_experts_per_tok] * moe_layers  # type: ignore[union-attr]

    engine.max_pass_tokens = 10  # three passes: [6] [9] [5]
    engine.run_pass([request])
    assert engine.last_pass.expert_load == whole.expert_load  # the same tokens routed the same way
