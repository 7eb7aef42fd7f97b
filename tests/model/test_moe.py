"""Qwen3-MoE: the packed Decoder equals transformers, every HF expert layout loads, and the fused
(expert, slot) compute equals a per-token loop in values and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig

from loraplex.model.config import DecoderConfig, ModelLoadError
from loraplex.model.decoder import Decoder
from loraplex.model.grouped_mm import grouped_mm, grouped_mm_reference
from loraplex.model.hf_checkpoint import load_decoder, to_hf_layout
from loraplex.model.kv_cache import KVCache
from loraplex.model.moe import SparseMoE, count_ids, sparse_moe_reference
from loraplex.model.multi_lora import LoRARouting, Segment
from loraplex.model.packing import PackedSequences
from tests.model.float64 import float64_copy, float64_experts
from tests.model.rounding import BF16_U, U, assert_within_rounding
from tests.model.test_decoder_parity import (
    assert_logits_equal_transformers,
    save_random_hf_model,
)

LENGTHS = (7, 3, 12, 7)
# 4 layers, 8 experts, top-2; layer 1 keeps the dense MLP.
MOE_SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}
VARIANTS = {
    "dense_layer_1_normalised_top_k": {"mlp_only_layers": [1], "norm_topk_prob": True},
    "every_second_layer_sparse_raw_top_k": {"decoder_sparse_step": 2, "norm_topk_prob": False},
}


def moe_config(**overrides: object) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**MOE_SHAPES, **VARIANTS["dense_layer_1_normalised_top_k"], **overrides})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_moe")
    save_random_hf_model(moe_config(), directory)
    return directory


def attach_random_slots(decoder: Decoder, ranks: dict[int, int], seed: int = 1) -> None:
    """Random non-zero A and B for each slot on every LoRA target, at the slot's rank."""
    generator = torch.Generator().manual_seed(seed)
    for slot, rank in ranks.items():
        for layer, _ in decoder.lora_targets().values():
            A_shape, B_shape = layer.lora_shapes(rank)
            A = 0.1 * torch.randn(A_shape, generator=generator)
            layer.attach(slot, A, 0.1 * torch.randn(B_shape, generator=generator), scale=32.0 / rank)


# ---- the base model against transformers ----


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_logits_equal_transformers_per_sequence(variant: str, tmp_path: Path) -> None:
    hf_model = save_random_hf_model(Qwen3MoeConfig(**MOE_SHAPES, **VARIANTS[variant]), tmp_path)
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (sum(LENGTHS),))
    assert_logits_equal_transformers(tmp_path, hf_model, tokens, LENGTHS)


def test_expert_load_counts_the_experts_transformers_routes_to(tmp_path: Path) -> None:
    hf_model = save_random_hf_model(moe_config(), tmp_path)
    decoder = load_decoder(tmp_path)
    tokens = torch.randint(0, MOE_SHAPES["vocab_size"], (sum(LENGTHS),))
    with torch.no_grad():
        decoder(tokens, PackedSequences.from_lengths(LENGTHS))
        router_logits = [  # per sequence, one (L, E) tensor per MoE layer
            hf_model(input_ids=seq[None], output_router_logits=True).router_logits
            for seq in tokens.split(LENGTHS)
        ]
    expected = torch.stack(
        [
            torch.bincount(torch.cat(layer).topk(2, dim=-1).indices.flatten(), minlength=8)
            for layer in zip(*router_logits, strict=True)
        ]
    )
    load = decoder.expert_load()
    assert load is not None and load.shape == (3, 8)  # layers 0, 2 and 3 are sparse
    assert torch.equal(load, expected)
    assert load.sum(1).tolist() == [2 * sum(LENGTHS)] * 3


def test_dense_model_reports_no_expert_load(tmp_path: Path) -> None:
    config = DecoderConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], **MOE_SHAPES})
    assert config.num_experts == 0 and Decoder(config, device="meta").expert_load() is None


def test_transformers_fused_expert_layout_loads_like_the_per_expert_one(
    moe_dir: Path, tmp_path: Path
) -> None:
    """save_pretrained writes experts.{e}.gate_proj.weight; transformers holds gate_up_proj (E, 2F, D)."""
    per_expert = load_file(moe_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in per_expert
    fused = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    for layer in (0, 2, 3):
        prefix = f"model.layers.{layer}.mlp.experts"

        def stack(proj: str, prefix: str = prefix) -> torch.Tensor:
            return torch.stack([per_expert[f"{prefix}.{e}.{proj}.weight"] for e in range(8)])

        fused[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        fused[f"{prefix}.down_proj"] = stack("down_proj")
    (tmp_path / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = load_decoder(moe_dir).state_dict()
    loaded = load_decoder(tmp_path).state_dict()
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_to_hf_layout_writes_what_transformers_saves(moe_dir: Path) -> None:
    written = to_hf_layout(load_decoder(moe_dir).state_dict())
    saved = load_file(moe_dir / "model.safetensors")
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[key], saved[key]) for key in saved)


def test_missing_experts_are_named_as_hf_names_them(moe_dir: Path, tmp_path: Path) -> None:
    weights = load_file(moe_dir / "model.safetensors")
    del weights["model.layers.2.mlp.experts.3.gate_proj.weight"]
    del weights["model.layers.2.mlp.experts.5.gate_proj.weight"]
    weights["model.layers.2.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)  # expert 8 of 0..7
    (tmp_path / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_decoder(tmp_path)
    assert "model.layers.2.mlp.experts.N.gate_proj.weight for N in [3, 5]" in str(error.value)
    assert "unexpected keys: ['model.layers.2.mlp.experts.8.gate_proj.weight']" in str(error.value)


def test_expert_shape_mismatch_names_the_key_and_both_shapes(moe_dir: Path, tmp_path: Path) -> None:
    weights = load_file(moe_dir / "model.safetensors")
    weights["model.layers.3.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 30)
    (tmp_path / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"experts\.0\.down_proj\.weight: checkpoint \(64, 30\) vs model \(64, 32\)"
    ):
        load_decoder(tmp_path)


def test_config_reads_moe_fields_under_either_name_with_hf_defaults() -> None:
    hub = {"architectures": ["Qwen3MoeForCausalLM"], **MOE_SHAPES, "mlp_only_layers": [1]}
    transformers_5 = {**hub, "num_local_experts": hub.pop("num_experts")}
    assert DecoderConfig.from_hf(transformers_5) == DecoderConfig.from_hf({**hub, "num_experts": 8})
    config = DecoderConfig.from_hf({**hub, "num_experts": 8, "decoder_sparse_step": 2})
    assert [config.is_moe_layer(layer) for layer in range(4)] == [False, False, False, True]
    defaults = DecoderConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], **MOE_SHAPES})
    assert (defaults.norm_topk_prob, defaults.decoder_sparse_step, defaults.mlp_only_layers) == (False, 1, ())
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9"):
        DecoderConfig.from_hf({**hub, "num_experts": 8, "num_experts_per_tok": 9})


# ---- the fused (expert, slot) compute against its references ----


@pytest.mark.parametrize("columns", [(16, 12), (5, 3)], ids=["aligned", "unaligned"])
# The last two leave rows 7..9 and all 10 rows in no group (other ranks' experts' rows): zero, no gradient.
@pytest.mark.parametrize(
    "offsets", [[2, 5, 5, 10], [0, 0, 10, 10], [10, 10, 10, 10], [2, 5, 5, 7], [0, 0, 0, 0]]
)
def test_grouped_mm_equals_its_loop_in_values_and_gradients(
    columns: tuple[int, int], offsets: list[int]
) -> None:
    has_ungrouped_rows = offsets[-1] < 10
    torch.manual_seed(0)
    contraction, out = columns
    a = torch.randn(10, contraction, requires_grad=True)
    b = torch.randn(4, out, contraction, requires_grad=True)  # used transposed, as the layers use W
    offsets_G = torch.tensor(offsets, dtype=torch.int32)
    weight_NM = torch.randn(10, out)

    def run(fn, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        y = fn(a, b.transpose(1, 2), offsets_G, has_ungrouped_rows)
        return [y.detach(), *torch.autograd.grad((y * weight_NM).sum(), (a, b))]

    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    fused, reference = run(grouped_mm, a, b), run(grouped_mm_reference, a, b)
    exact = run(grouped_mm_reference, a64, b64)
    for name, *values in zip(("out", "grad a", "grad b"), fused, reference, exact, strict=True):
        assert_within_rounding(*values, name)
    out, grad_a, _ = fused
    assert not out[offsets[-1] :].any() and not grad_a[offsets[-1] :].any()


# A base-only run, a slot appearing in two segments, an unattached slot, three ranks (1 and 3 are not
# a multiple of 16 bytes in fp32, so the grouped kernel gets padded copies).
ROUTING = LoRARouting(
    (
        Segment(0, 0, 5),
        Segment(None, 5, 9),
        Segment(1, 9, 12),
        Segment(2, 12, 20),
        Segment(9, 20, 22),
        Segment(0, 22, 25),
    )
)
RANKS = {0: 1, 1: 4, 2: 3}


@pytest.mark.parametrize(
    "ids",
    [[], [3], [0, 0, 0], [5, 1, 5, 5, 0, 1, 7, 7], list(range(8))],
    ids=["empty", "one", "one_id_repeated", "some_ids_absent", "each_id_once"],
)
def test_count_ids_counts_as_bincount_does(ids: list[int]) -> None:
    ids_N = torch.tensor(ids, dtype=torch.int64)
    counts = count_ids(ids_N, 8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(ids_N, minlength=8).tolist()


def random_block(seed: int = 0) -> SparseMoE:
    config = DecoderConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], **MOE_SHAPES})
    block = SparseMoE(config, device="cpu", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    block.requires_grad_(False)
    return block


def test_fused_experts_equal_the_per_token_loop_in_values_and_gradients() -> None:
    block = random_block()
    generator = torch.Generator().manual_seed(1)
    leaves: list[torch.Tensor] = []
    for slot, rank in RANKS.items():
        for layer in block.experts.values():
            A_shape, B_shape = layer.lora_shapes(rank)
            A = (0.3 * torch.randn(A_shape, generator=generator)).requires_grad_()
            B = (0.3 * torch.randn(B_shape, generator=generator)).requires_grad_()
            layer.attach(slot, A, B, scale=2.0 / rank)
            leaves += [A, B]
    x = torch.randn(ROUTING.num_tokens, MOE_SHAPES["hidden_size"], generator=generator).requires_grad_()
    weight_TD = torch.randn(ROUTING.num_tokens, MOE_SHAPES["hidden_size"], generator=generator)
    slot_of_token = [s.slot for s in ROUTING.segments for _ in range(s.start, s.end)]

    def run(forward) -> list[torch.Tensor]:
        out = forward()
        return [out.detach(), *torch.autograd.grad((out * weight_TD).sum(), [x, *leaves])]

    fused = run(lambda: block(x, ROUTING))
    reference = run(lambda: sparse_moe_reference(block, x, slot_of_token))
    # The reference loop in float64 (the slots' fp32 A and B are used in x's dtype), with the same leaves.
    twin = float64_copy(block)
    for name, layer in block.experts.items():
        for slot, weights in layer._slots.items():
            twin.experts[name].attach(slot, weights.A_RI, weights.B_OR, weights.scale)
    assert torch.equal(twin.route(x.double())[1], block.route(x)[1])  # the same experts for every token
    exact = run(lambda: sparse_moe_reference(twin, x.double(), slot_of_token))
    names = ["out", "grad x", *(f"grad {i}" for i in range(len(leaves)))]
    for name, ours, expected, exact_value in zip(names, fused, reference, exact, strict=True):
        assert_within_rounding(ours, expected, exact_value, name)
    assert all(grad.abs().max() > 0 for grad in fused[2:])  # every slot's every projection trained


def test_in_bf16_the_fused_experts_stay_within_rounding_of_the_per_token_loop() -> None:
    """bf16 is what a GPU runs the experts' base and LoRA matmuls in; the sums run in other orders."""
    block = random_block().to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    for slot, rank in RANKS.items():
        for layer in block.experts.values():
            A_shape, B_shape = layer.lora_shapes(rank)
            A, B = (0.3 * torch.randn(shape, generator=generator) for shape in (A_shape, B_shape))
            layer.attach(slot, A, B, scale=2.0 / rank)
    x = torch.randn(ROUTING.num_tokens, MOE_SHAPES["hidden_size"], generator=generator).bfloat16()
    slot_of_token = [s.slot for s in ROUTING.segments for _ in range(s.start, s.end)]
    # The same loop in float64 on the same bf16 values (A and B as bf16 rounds them), routed as in bf16:
    # the bf16 router's near-ties may pick other experts in float64, which is no rounding of this sum.
    twin = float64_copy(block)
    for name, layer in block.experts.items():
        for slot, weights in layer._slots.items():
            A, B = (t.bfloat16().float() for t in (weights.A_RI, weights.B_OR))
            twin.experts[name].attach(slot, A, B, weights.scale)
    weights_TP, experts_TP = block.route(x)
    twin.route = lambda x_TD: (weights_TP.double(), experts_TP)
    with torch.no_grad():
        fused, reference = block(x, ROUTING), sparse_moe_reference(block, x, slot_of_token)
        exact = sparse_moe_reference(twin, x.double(), slot_of_token)
    assert fused.dtype == torch.bfloat16
    assert_within_rounding(fused, reference, exact, "bf16 experts", unit=BF16_U)


def test_the_grouped_kernel_gets_only_operands_a_gpu_can_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's grouped GEMM reads each operand through 16-byte aligned tiles: every stride but the unit
    one, the group stride of a 3-D operand included, a multiple of 16 bytes, from a 16-byte aligned
    address. torch checks the last two dims only; a rank-4 expert B in bf16, viewed per expert, steps 8
    bytes from one expert to the next, and the H200 stopped with "misaligned address" on it. The forward
    and backward of bf16 experts with slots of ranks 1 to 4 hand the kernel only operands that fit."""
    block = random_block().to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    leaves = []
    for slot, rank in {**RANKS, 3: 2}.items():
        for layer in block.experts.values():
            A_shape, B_shape = layer.lora_shapes(rank)
            A, B = ((0.3 * torch.randn(s, generator=generator)).requires_grad_() for s in (A_shape, B_shape))
            layer.attach(slot, A, B, scale=2.0 / rank)
            leaves += [A, B]
    routing = LoRARouting((*ROUTING.segments[:-1], Segment(3, 22, 25)))
    x = torch.randn(routing.num_tokens, MOE_SHAPES["hidden_size"], generator=generator).bfloat16()
    operands: list[torch.Tensor] = []
    kernel = torch._grouped_mm

    def recording_kernel(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        operands.extend((a, b))
        return kernel(a, b, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording_kernel)
    block(x.requires_grad_(), routing).float().square().sum().backward()
    assert all(leaf.grad is not None and leaf.grad.abs().max() > 0 for leaf in leaves)
    unit = 16 // 2  # bf16 elements in 16 bytes
    unaligned = [
        (tuple(t.shape), t.stride())
        for t in operands
        if t.data_ptr() % 16
        or 1 not in t.stride()[-2:]
        or any(stride % unit for stride in t.stride() if stride != 1)
    ]
    # Per projection: the base matmul (and its backward for x, the base weights being frozen), and the
    # shrink and expand of the 4 slots the routing uses (each with its 2 backward calls): 2 operands each.
    assert len(operands) == 2 * 3 * (2 + 4 * 2 * 3)
    assert not unaligned


def test_a_slot_changes_only_its_own_tokens() -> None:
    block = random_block()
    x = torch.randn(ROUTING.num_tokens, MOE_SHAPES["hidden_size"])
    with torch.no_grad():
        base = block(x, None)
        for layer in block.experts.values():
            A_shape, B_shape = layer.lora_shapes(4)
            layer.attach(1, torch.randn(A_shape), torch.randn(B_shape), scale=1.0)
        routed = block(x, ROUTING)
    # Another pack of the same rows may round each row's sums (at most 64 terms: within 64U of the row's
    # scale) otherwise; a LoRA delta of random A and B moves a row by about its own scale.
    changed = (routed - base).abs().amax(-1) > 1000 * U * base.abs().amax(-1)
    assert changed.tolist() == [9 <= t < 12 for t in range(ROUTING.num_tokens)]


def test_an_expert_layer_takes_one_rank_block_per_expert_and_nothing_else() -> None:
    layer = random_block().experts["down_proj"]  # 8 experts of 32 -> 64
    assert layer.lora_shapes(3) == ((24, 32), (64, 24))
    layer.attach(0, torch.zeros(24, 32), torch.zeros(64, 24), scale=1.0)
    for A_shape, B_shape in [((20, 32), (64, 20)), ((24, 64), (64, 24)), ((24, 32), (64, 16))]:
        with pytest.raises(ValueError, match=r"expected \(E·R, 32\) and \(64, E·R\) with E = 8"):
            layer.attach(1, torch.zeros(A_shape), torch.zeros(B_shape), scale=1.0)
    assert layer.has_slot(0) and not layer.has_slot(1)


# ---- sampling: the KV cache path through experts ----


@torch.no_grad()
def test_decode_through_experts_equals_the_packed_forward(moe_dir: Path) -> None:
    decoder, twin = load_decoder(moe_dir), load_decoder(moe_dir, "cpu", torch.float64)
    attach_random_slots(decoder, {3: 4, 5: 2})
    attach_random_slots(twin, {3: 4, 5: 2})
    torch.manual_seed(0)
    lengths, prompt_lengths, slots = (9, 6, 11), (4, 1, 6), (3, None, 5)
    sequences = [torch.randint(0, MOE_SHAPES["vocab_size"], (n,)) for n in lengths]

    def full_logits(decoder: Decoder, seq: torch.Tensor, slot: int | None) -> torch.Tensor:
        routing = LoRARouting.from_sequences([len(seq)], [slot])
        return decoder.logits(seq, PackedSequences.from_lengths([len(seq)]), routing)

    expected = [full_logits(decoder, seq, s) for seq, s in zip(sequences, slots, strict=True)]
    with float64_experts():
        exact = [full_logits(twin, seq, s) for seq, s in zip(sequences, slots, strict=True)]
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=1024)
    rows = [cache.allocate(n) for n in lengths]
    routing = LoRARouting.from_sequences(prompt_lengths, slots)
    prompts = torch.cat([seq[:p] for seq, p in zip(sequences, prompt_lengths, strict=True)])
    hidden = decoder.forward_cached(prompts, cache.prefill(rows, prompt_lengths), routing)
    for i, logits in enumerate(decoder.lm_head(hidden, routing).split(prompt_lengths)):
        p = prompt_lengths[i]
        assert_within_rounding(logits, expected[i][:p], exact[i][:p], f"prefill {i}")
    positions = list(prompt_lengths)
    while active := [i for i in range(len(lengths)) if positions[i] < lengths[i]]:
        routing = LoRARouting.from_sequences([1] * len(active), [slots[i] for i in active])
        tokens = torch.stack([sequences[i][positions[i]] for i in active])
        hidden = decoder.forward_cached(tokens, cache.decode([rows[i] for i in active]), routing)
        logits = decoder.lm_head(hidden, routing)
        for b, i in enumerate(active):
            p = positions[i]
            assert_within_rounding(logits[b], expected[i][p], exact[i][p], f"sequence {i} position {p}")
            positions[i] += 1
