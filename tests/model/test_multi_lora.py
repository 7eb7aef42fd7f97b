"""Multi-LoRA layers: the fused delta equals its per-token loop, and a packed mixed batch equals PEFT."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config

from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.lora_precision import _StackCache
from loraplex.model.multi_lora import (
    LoRARouting,
    MultiLoRALinear,
    Segment,
    SlotWeights,
    add_lora_delta,
    add_lora_delta_reference,
    init_lora_pair,
    init_slot_weights,
)
from loraplex.model.packing import PackedSequences
from tests.model.float64 import float64_copy
from tests.model.rounding import BF16_U, U, assert_within_rounding, rounding_bound

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALPHA = 32
# slot -> (PEFT adapter name, rank, targets); slot 2 is a train_mlp=False slot.
SLOTS = {
    0: ("s0", 4, [*ATTN, *MLP, "lm_head"]),
    1: ("s1", 8, [*ATTN, *MLP, "lm_head"]),
    2: ("s2", 2, [*ATTN, "lm_head"]),
}
# Pack order: each slot's sequences contiguous, one base-only sequence in between.
SEQUENCES = [(0, 6), (0, 4), (1, 9), (None, 5), (2, 7)]  # (slot, length)
LENGTHS = tuple(length for _, length in SEQUENCES)
TINY_SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 128,
    "tie_word_embeddings": False,
}


# ---- the delta op against its reference ----


def random_slots(rank_by_slot: dict[int, int], in_features: int, out_features: int) -> dict[int, SlotWeights]:
    return {
        slot: SlotWeights(torch.randn(rank, in_features), torch.randn(out_features, rank), ALPHA / rank)
        for slot, rank in rank_by_slot.items()
    }


def delta_exact(
    y: torch.Tensor, x: torch.Tensor, routing: LoRARouting, slots: dict[int, SlotWeights]
) -> torch.Tensor:
    """y + scale · (x Aᵀ) Bᵀ on every routed segment, in float64 (differentiable): the exact value the
    fused op and its per-token reference both round."""
    rows = []
    for segment in routing.segments:
        part = y[segment.start : segment.end].double()
        weights = slots.get(segment.slot) if segment.slot is not None else None
        if weights is not None:
            x_part = x[segment.start : segment.end].double()
            part = part + weights.scale * (x_part @ weights.A_RI.double().T) @ weights.B_OR.double().T
        rows.append(part)
    return torch.cat(rows)


LAYOUTS = {
    "one_slot_everywhere": [Segment(0, 0, 10)],
    "base_between_slots": [Segment(0, 0, 3), Segment(None, 3, 7), Segment(1, 7, 8), Segment(2, 8, 10)],
    "unattached_slot_and_repeat": [Segment(9, 0, 4), Segment(1, 4, 6), Segment(0, 6, 7), Segment(1, 7, 10)],
    "base_only": [Segment(None, 0, 10)],
}


@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_delta_equals_per_token_loop(rank: int, layout: str, dtype: torch.dtype) -> None:
    torch.manual_seed(rank)
    slots = random_slots({0: rank, 1: max(1, rank // 2), 2: rank + 3}, in_features=12, out_features=20)
    routing = LoRARouting(tuple(LAYOUTS[layout]))
    x, y = torch.randn(10, 12, dtype=dtype), torch.randn(10, 20, dtype=dtype)
    expected = add_lora_delta_reference(y, x, routing, slots)
    # Each delta sums rank x in_features products in another order than the reference (the order the BLAS
    # picks differs between CPUs), in fp32, then rounds to the base dtype: within rounding of the
    # reference, against the exact value, in that dtype's unit roundoff.
    exact = delta_exact(y, x, routing, slots)
    unit = {torch.float32: U, torch.bfloat16: BF16_U}[dtype]
    assert_within_rounding(add_lora_delta(y, x, routing, slots), expected, exact, "delta", unit=unit)


# Adjacent equal-length, equal-rank segments run as one batched matmul; the rest one by one.
BATCHED_LAYOUT = [
    Segment(0, 0, 4),
    Segment(1, 4, 8),
    Segment(3, 8, 12),
    Segment(None, 12, 15),
    Segment(2, 15, 20),
    Segment(0, 20, 24),
]


@pytest.mark.parametrize("ranks", [{0: 4, 1: 4, 2: 8, 3: 4}, {0: 1, 1: 2, 2: 3, 3: 4}])
def test_fused_delta_gradients_equal_the_per_token_loop(ranks: dict[int, int]) -> None:
    torch.manual_seed(0)
    routing = LoRARouting(tuple(BATCHED_LAYOUT))
    y = torch.randn(routing.num_tokens, 6)
    x = torch.randn(routing.num_tokens, 5)
    slots = random_slots(ranks, 5, 6)
    weight_O = torch.randn(6)

    def grads(fn) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_()]
        pairs = {
            s: (w.A_RI.clone().requires_grad_(), w.B_OR.clone().requires_grad_()) for s, w in slots.items()
        }
        routed = {s: SlotWeights(A, B, slots[s].scale) for s, (A, B) in pairs.items()}
        out = fn(y, leaves[0], routing, routed)
        (out * weight_O).sum().backward()
        return [out.detach(), leaves[0].grad, *(t.grad for pair in pairs.values() for t in pair)]

    names = ["out", "grad x", *(f"slot {s} grad {t}" for s in slots for t in "AB")]
    values = zip(
        names, grads(add_lora_delta), grads(add_lora_delta_reference), grads(delta_exact), strict=True
    )
    for name, fused, reference, exact in values:
        assert_within_rounding(fused, reference, exact, name)


def test_delta_without_gradients_equals_the_differentiable_one_and_records_no_graph() -> None:
    torch.manual_seed(1)
    routing = LoRARouting(tuple(BATCHED_LAYOUT))
    y, x = torch.randn(routing.num_tokens, 6), torch.randn(routing.num_tokens, 5)
    trained = {
        s: SlotWeights(w.A_RI.requires_grad_(), w.B_OR.requires_grad_(), w.scale)
        for s, w in random_slots({0: 4, 1: 4, 2: 8, 3: 4}, 5, 6).items()
    }

    differentiable = add_lora_delta(y, x, routing, trained)
    with torch.no_grad():
        plain = add_lora_delta(y, x, routing, trained)

    assert differentiable.grad_fn is not None and plain.grad_fn is None
    assert torch.equal(plain, differentiable.detach())


def test_delta_reaches_only_its_segment_and_keeps_the_base_dtype() -> None:
    slots = random_slots({0: 4}, in_features=6, out_features=5)
    routing = LoRARouting((Segment(None, 0, 2), Segment(0, 2, 3), Segment(None, 3, 4)))
    x, y = torch.randn(4, 6, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    out = add_lora_delta(y, x, routing, slots)
    A, B, scale = slots[0]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[[0, 1, 3]], y[[0, 1, 3]])
    want = (y[2].float() + scale * B @ A @ x[2].float()).bfloat16()
    exact = y[2].double() + scale * B.double() @ A.double() @ x[2].double()
    assert_within_rounding(out[2], want, exact, "delta", unit=BF16_U)


def test_routing_merges_neighbouring_sequences_of_a_slot_and_slices_renumbered() -> None:
    routing = LoRARouting.from_sequences(LENGTHS, [slot for slot, _ in SEQUENCES])
    assert routing.segments == (
        Segment(0, 0, 10),
        Segment(1, 10, 19),
        Segment(None, 19, 24),
        Segment(2, 24, 31),
    )
    assert routing.slice(8, 21).segments == (Segment(0, 0, 2), Segment(1, 2, 11), Segment(None, 11, 13))
    assert routing.slice(5, 5).num_tokens == 0
    with pytest.raises(ValueError, match="tile"):
        LoRARouting((Segment(0, 0, 3), Segment(1, 4, 6)))


def test_attach_keeps_references_and_rejects_wrong_shapes() -> None:
    layer = MultiLoRALinear(6, 5, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    A, B = torch.randn(3, 6), torch.zeros(5, 3)
    layer.attach(7, A, B, scale=2.0)
    x, routing = torch.randn(4, 6), LoRARouting((Segment(7, 0, 4),))
    assert torch.equal(layer(x, routing), layer(x))  # B = 0: y + 0, exactly
    B.fill_(1.0)  # the slot pool updates its tensors in place; the layer must see it
    x64, W64, b64, A64, B64 = (t.detach().double() for t in (x, layer.weight, layer.bias, A, B))
    exact = x64 @ W64.t() + b64 + 2.0 * x64 @ A64.t() @ B64.t()
    assert_within_rounding(layer(x, routing), layer(x) + 2.0 * x @ A.t() @ B.t(), exact, "delta")
    with pytest.raises(ValueError, match=r"A \(3, 5\)"):
        layer.attach(8, torch.randn(3, 5), torch.zeros(5, 3), scale=1.0)
    assert layer.has_slot(7) and not layer.has_slot(8)
    layer.detach(7)
    layer.detach(7)
    assert not layer.has_slot(7)


def test_init_lora_pair_matches_peft_kaiming_init() -> None:
    """PEFT draws A with kaiming_uniform_(a=√5) from the global RNG; seeded alike, the values agree."""
    A, B = init_lora_pair(in_features=24, out_features=10, rank=4, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(5)
    expected = torch.nn.init.kaiming_uniform_(torch.empty(4, 24), a=math.sqrt(5))
    assert torch.equal(A, expected) and A.abs().max() <= 1 / math.sqrt(24)
    assert torch.equal(B, torch.zeros(10, 4))


def test_initial_A_depends_on_seed_and_target_only_not_on_trained_groups() -> None:
    config = DecoderConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], **TINY_SHAPES})
    targets = Decoder(config, device="meta").lora_targets()
    everything = init_slot_weights(targets, rank=4, seed=11, groups={"attn", "mlp", "unembed"})
    attn_only = init_slot_weights(targets, rank=4, seed=11, groups={"attn"})
    other_seed = init_slot_weights(targets, rank=4, seed=12, groups={"attn"})
    assert list(everything) == list(targets)
    assert set(attn_only) == {name for name, (_, group) in targets.items() if group == "attn"}
    name = "model.layers.1.self_attn.q_proj"
    assert torch.equal(attn_only[name][0], everything[name][0])
    assert not torch.equal(other_seed[name][0], attn_only[name][0])


# ---- a packed mixed batch against PEFT ----


@pytest.fixture(scope="module")
def peft_and_decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[PeftModel, Decoder, Decoder]:
    """A tiny Qwen3 as PEFT with the adapters of SLOTS (random non-zero A and B), as our Decoder, and as
    our Decoder in float64."""
    directory = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(
        Qwen3Config(**TINY_SHAPES), attn_implementation="eager", dtype=torch.float32
    )
    hf_model.save_pretrained(directory)
    peft_model = None
    for adapter, rank, targets in SLOTS.values():
        lora_config = LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(hf_model, lora_config, adapter_name=adapter)
        else:
            peft_model.add_adapter(adapter, lora_config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".lora_" in name:
                parameter.normal_(0.0, 0.05)
    return peft_model.eval(), load_decoder(directory), load_decoder(directory, "cpu", torch.float64)


def attach_peft_adapters(
    peft_model: PeftModel, decoder: Decoder
) -> dict[int, dict[str, tuple[torch.Tensor, ...]]]:
    """Copy each adapter's A and B into its slot as fresh leaf tensors that collect gradients."""
    hf_root = peft_model.base_model.model
    attached: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {}
    for slot, (adapter, rank, _) in SLOTS.items():
        attached[slot] = {}
        for name, (layer, _) in decoder.lora_targets().items():
            module = hf_root.get_submodule(name)
            if adapter not in module.lora_A:
                continue
            A = module.lora_A[adapter].weight.detach().clone().requires_grad_(True)
            B = module.lora_B[adapter].weight.detach().clone().requires_grad_(True)
            layer.attach(slot, A, B, ALPHA / rank)
            attached[slot][name] = (A, B)
    return attached


def peft_logits(peft_model: PeftModel, slot: int | None, tokens: torch.Tensor) -> torch.Tensor:
    """One sequence through PEFT with the slot's adapter active (adapters disabled for None)."""
    if slot is None:
        with peft_model.disable_adapter():
            return peft_model(input_ids=tokens[None]).logits[0]
    peft_model.set_adapter(SLOTS[slot][0])
    return peft_model(input_ids=tokens[None]).logits[0]


def packed_slot_logits(decoder: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    routing = LoRARouting.from_sequences(LENGTHS, [slot for slot, _ in SEQUENCES])
    return decoder.logits(tokens, PackedSequences.from_lengths(LENGTHS), routing)


def test_mixed_packed_batch_gives_each_sequence_its_peft_adapter_logits(
    peft_and_decoder: tuple[PeftModel, Decoder, Decoder],
) -> None:
    peft_model, decoder, decoder_exact = peft_and_decoder
    attach_peft_adapters(peft_model, decoder)
    attach_peft_adapters(peft_model, decoder_exact)
    mlp_layer, _ = decoder.lora_targets()["model.layers.0.mlp.up_proj"]
    assert mlp_layer.has_slot(0) and not mlp_layer.has_slot(2)  # slot 2 trains no MLP
    tokens = torch.randint(0, TINY_SHAPES["vocab_size"], (sum(LENGTHS),))
    twin = float64_copy(peft_model)
    with torch.no_grad():
        ours, ours_exact = (packed_slot_logits(d, tokens).split(LENGTHS) for d in (decoder, decoder_exact))
        for i, ((slot, _), seq) in enumerate(zip(SEQUENCES, tokens.split(LENGTHS), strict=True)):
            expected, exact = peft_logits(peft_model, slot, seq), peft_logits(twin, slot, seq)
            assert_within_rounding(ours[i], expected, exact, f"sequence {i}", got_exact=ours_exact[i])
            if (
                slot is not None
            ):  # the adapters move the logits far past rounding: the comparison means something
                change = float((expected - peft_logits(peft_model, None, seq)).norm())
                assert change > 1000 * rounding_bound(expected, exact)


def test_slot_gradients_from_a_mixed_batch_equal_peft_on_that_slots_sequences(
    peft_and_decoder: tuple[PeftModel, Decoder, Decoder],
) -> None:
    peft_model, decoder, decoder_exact = peft_and_decoder
    attached, attached_exact = (attach_peft_adapters(peft_model, d) for d in (decoder, decoder_exact))
    tokens = torch.randint(0, TINY_SHAPES["vocab_size"], (sum(LENGTHS),))
    loss_weights = torch.randn(sum(LENGTHS), TINY_SHAPES["vocab_size"])
    for d in (decoder, decoder_exact):
        (loss_weights * packed_slot_logits(d, tokens)).sum().backward()

    twin = float64_copy(peft_model)
    for slot, (adapter, _, _) in SLOTS.items():
        for model in (peft_model, twin):
            model.zero_grad(set_to_none=True)
            reference_loss = sum(
                (w * peft_logits(model, slot, seq)).sum()
                for (seq_slot, _), seq, w in zip(
                    SEQUENCES, tokens.split(LENGTHS), loss_weights.split(LENGTHS), strict=True
                )
                if seq_slot == slot
            )
            reference_loss.backward()
        for name, pair in attached[slot].items():
            module, twin_module = (m.base_model.model.get_submodule(name) for m in (peft_model, twin))
            for key, ours, ours_exact in zip(
                ("lora_A", "lora_B"), pair, attached_exact[slot][name], strict=True
            ):
                expected, exact = (getattr(m, key)[adapter].weight.grad for m in (module, twin_module))
                what = f"slot {slot} {name} {key}"
                assert_within_rounding(ours.grad, expected, exact, what, got_exact=ours_exact.grad)
    assert all(parameter.grad is None and not parameter.requires_grad for parameter in decoder.parameters())


def test_a_loss_on_one_slots_tokens_gives_other_slots_no_gradient(
    peft_and_decoder: tuple[PeftModel, Decoder, Decoder],
) -> None:
    peft_model, decoder, _ = peft_and_decoder
    attached = attach_peft_adapters(peft_model, decoder)
    tokens = torch.randint(0, TINY_SHAPES["vocab_size"], (sum(LENGTHS),))
    logits = packed_slot_logits(decoder, tokens)
    start, end = 10, 19  # slot 1's only sequence
    assert SEQUENCES[2] == (1, end - start)
    logits[start:end].sum().backward()
    for slot, tensors in attached.items():
        grads = [tensor.grad for pair in tensors.values() for tensor in pair]
        if slot == 1:
            assert all(grad is not None and grad.abs().max() > 0 for grad in grads)
        else:
            assert all(grad is None or not grad.any() for grad in grads)


F32, BF16 = torch.float32, torch.bfloat16


def test_stacked_snapshot_weights_are_reused_until_a_source_changes_and_training_ones_never() -> None:
    cache = _StackCache(max_bytes=3 * 2 * 4 * 5 * 4)  # room for three (2, 4, 5) fp32 stacks
    a, b, c = (torch.randn(4, 5) for _ in range(3))
    first = cache.stacked([a, b], F32)
    assert cache.stacked([a, b], F32) is first  # sampling's next decode step: no copy
    assert cache.stacked([b, a], F32) is not first  # another order is another stack
    before = a.clone()
    with torch.no_grad():
        a.add_(1.0)  # an optimizer step on a training slot
    fresh = cache.stacked([a, b], F32)
    assert fresh is not first and torch.equal(fresh[0], a) and torch.equal(first[0], before)
    cache.stacked([a, c], F32)
    cache.stacked([b, c], F32)  # a fourth stack: the least recently used, [b, a], is dropped
    assert cache.stacked([a, b], F32) is fresh
    assert cache.stacked([a], F32).data_ptr() == a.data_ptr()  # one tensor: a view, never cached
    trained = [torch.randn(4, 5, requires_grad=True) for _ in range(2)]  # a training slot's leaves
    assert cache.stacked(trained, F32) is not cache.stacked(trained, F32)  # always stacked afresh


def test_compute_dtype_copies_of_snapshot_weights_are_cached_and_training_ones_cast_afresh() -> None:
    cache = _StackCache(max_bytes=2**20)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    cast = cache.stacked([a], BF16)  # one snapshot's bf16 copy: cached like a stack
    assert cast.dtype == BF16 and torch.equal(cast[0], a.bfloat16())
    assert cache.stacked([a], BF16) is cast and cache.stacked([a, b], BF16) is cache.stacked([a, b], BF16)
    assert cache.stacked([a, b], F32).dtype == F32  # the fp32 stack of the same sources is another entry
    trained = torch.randn(4, 5, requires_grad=True)
    copy = cache.stacked([trained], BF16)
    assert copy is not cache.stacked([trained], BF16) and copy.requires_grad  # differentiable, never cached
