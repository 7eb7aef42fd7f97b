"""The memory plan (model/memory_plan.py): at T = 1 it counts exactly what the decoder and the KV cache
allocate, the published shapes give the published parameter totals, and at T > 1 each rank holds what
the sharding rules give it, written out by hand for one dense and one MoE model, and what each rank's
decoder allocates for an MoE model whose splits are all even."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from loraplex.bench.presets import PRESETS
from loraplex.engine.sampler.snapshot_cache import SnapshotCache
from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import LORA_GROUPS, Decoder
from loraplex.model.kv_cache import KVCache
from loraplex.model.memory_plan import (
    GRADIENT_ROW,
    LORA_GROUP_NAMES,
    Card,
    LoraSpec,
    ShardingError,
    SlotBytes,
    base_parameters,
    kv_bytes_per_token,
    lora_parameters,
    plan_rank,
    snapshot_pool_bytes,
)
from loraplex.model.presets import PUBLISHED, QWEN3
from loraplex.model.tensor_parallel import TensorParallel

# The totals the model cards publish, in parameters.
PUBLISHED_TOTALS = {
    "Qwen3-8B": 8.2e9,
    "Llama-3.3-70B": 70.6e9,
    "Qwen3-30B-A3B": 30.5e9,
    "Qwen3-235B-A22B": 235e9,
}
# Shapes that take every branch of the counting: biases of each kind, tied embeddings, a dense layer
# among MoE layers.
_BIASED: dict[str, dict[str, Any]] = {
    "qwen2-qkv-bias": {
        **QWEN3,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **{k: PRESETS["smoke"][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 500,
        "tie_word_embeddings": True,
    },
    "llama-all-biases": {
        **PRESETS["smoke"],
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": True,
        "mlp_bias": True,
    },
}
SHAPES = {**PUBLISHED, **{name: PRESETS[name] for name in ("smoke", "smoke-moe")}, **_BIASED}


def config_of(name: str) -> DecoderConfig:
    return DecoderConfig.from_hf(SHAPES[name])


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_published_shapes_give_the_published_parameter_totals(name: str) -> None:
    assert base_parameters(config_of(name)) == pytest.approx(PUBLISHED_TOTALS[name], rel=0.01)


@pytest.mark.parametrize("name", SHAPES)
def test_at_one_rank_the_plan_counts_what_the_decoder_allocates(name: str) -> None:
    config = config_of(name)
    decoder = Decoder(config, device="meta", dtype=torch.bfloat16)  # shapes only, nothing allocated
    assert base_parameters(config) == sum(p.numel() for p in decoder.parameters())  # tied: counted once
    plan = plan_rank(config, 1, 2, LoraSpec(8), slots=1, kv_tokens=0)
    held = sum(t.nbytes for t in (*decoder.parameters(), *decoder.buffers()))
    assert plan.base == held
    _assert_lora_counted(config, decoder, 1)
    assert set(LORA_GROUP_NAMES) == set(LORA_GROUPS.values())


@pytest.mark.parametrize("rank", [0, 1])
def test_at_two_ranks_the_plan_counts_what_each_rank_of_an_moe_decoder_allocates(rank: int) -> None:
    """smoke-moe splits evenly at T = 2 (4 heads, 2 KV heads, 8 experts, 128 MLP columns, 512 vocabulary
    rows), so every rank holds what the plan states for one: 4 experts, the router whole."""
    config = config_of("smoke-moe")
    decoder = Decoder(config, device="meta", dtype=torch.bfloat16, tp=TensorParallel(None, rank, 2))
    assert base_parameters(config, 2) == sum(p.numel() for p in decoder.parameters())
    _assert_lora_counted(config, decoder, 2)


@pytest.mark.parametrize(("name", "tp", "rank"), [("smoke", 1, 0), ("smoke-moe", 1, 0), ("smoke-moe", 2, 1)])
def test_the_plan_counts_the_snapshot_pool_each_rank_allocates(name: str, tp: int, rank: int) -> None:
    config = config_of(name)
    decoder = Decoder(config, device="meta", dtype=torch.bfloat16, tp=TensorParallel(None, rank, tp))
    pools = SnapshotCache(decoder.lora_targets(), capacity=5, max_rank=8)
    assert pools.pool_bytes == snapshot_pool_bytes(config, tp, 2, entries=5, rank=8)


def _assert_lora_counted(config: DecoderConfig, decoder: Decoder, tp: int) -> None:
    """The plan's LoRA parameters of one rank-8 slot per target group are what the decoder's layers take."""
    targets = decoder.lora_targets().values()
    for groups in ({"attn"}, {"mlp"}, {"unembed"}, set(LORA_GROUP_NAMES)):
        shapes = [shape for layer, group in targets if group in groups for shape in layer.lora_shapes(8)]
        assert lora_parameters(config, tp, LoraSpec(8, frozenset(groups))) == sum(map(math.prod, shapes))


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen3-30B-A3B", "smoke-moe"])
def test_at_one_rank_the_kv_cache_takes_what_the_plan_says(name: str) -> None:
    config = config_of(name)
    for dtype in (torch.bfloat16, torch.float32):
        cache = KVCache(config, "meta", dtype, max_tokens=0)
        assert kv_bytes_per_token(config, 1, dtype.itemsize) == cache.bytes_per_token


def test_a_dense_rank_holds_its_heads_its_mlp_columns_and_its_vocabulary_rows() -> None:
    config = config_of("Qwen3-8B")  # D 4096, 32 heads, 8 KV heads of 128, F 12288, V 151936, 36 layers
    vocab = 37984  # ceil(151936 / 4)
    attention = 4096 * 1024 + 2 * 4096 * 256 + 1024 * 4096  # q, k, v columns; o rows
    mlp = 2 * 4096 * 3072 + 3072 * 4096
    norms = 2 * 4096 + 2 * 128  # replicated: the two RMSNorms and Qwen3's q/k norms
    assert base_parameters(config, 4) == 36 * (attention + mlp + norms) + 2 * vocab * 4096 + 4096
    r = 32
    lora_attention = r * (4096 + 1024) + 2 * r * (4096 + 256) + r * (1024 + 4096)  # A whole / B split
    lora_mlp = 2 * r * (4096 + 3072) + r * (3072 + 4096)
    lora = 36 * (lora_attention + lora_mlp) + r * (4096 + vocab)
    assert lora_parameters(config, 4, LoraSpec(r)) == lora
    assert lora_parameters(config, 4, LoraSpec(r, frozenset({"unembed"}))) == r * (4096 + vocab)
    assert kv_bytes_per_token(config, 4, 2) == 2 * 36 * 2 * 128 * 2  # two of the 8 KV heads
    plan = plan_rank(config, 4, 2, LoraSpec(r), slots=3, kv_tokens=1000)
    assert plan.base == base_parameters(config, 4) * 2 + 64 * 4  # bf16, and the fp32 rope frequencies
    assert (plan.adapter, plan.kv) == (3 * 4 * lora, 1000 * 2 * 36 * 2 * 128 * 2)
    rows = -(-lora // GRADIENT_ROW)
    assert plan.optimizer == 3 * (4 * rows * GRADIENT_ROW + 8 * lora + 4 * lora)
    assert plan.total == plan.base + plan.adapter + plan.optimizer + plan.kv


def test_an_moe_rank_holds_a_share_of_the_experts_and_the_whole_router() -> None:
    config = config_of("Qwen3-30B-A3B")  # D 2048, 32 heads, 4 KV heads of 128, 128 experts of F 768
    attention = 2048 * 2048 + 2 * 2048 * 256 + 2048 * 2048  # at T = 2: 16 query heads, 2 KV heads
    experts = 64 * 3 * 2048 * 768
    router = 2048 * 128
    norms = 2 * 2048 + 2 * 128
    vocab = 151936 // 2
    assert base_parameters(config, 2) == 48 * (attention + experts + router + norms) + 2 * vocab * 2048 + 2048
    r = 16
    lora_attention = r * (2048 + 2048) + 2 * r * (2048 + 256) + r * (2048 + 2048)
    lora_experts = 64 * 3 * r * (2048 + 768)  # each expert on this rank: its own A and B
    assert lora_parameters(config, 2, LoraSpec(r)) == 48 * (lora_attention + lora_experts) + r * (
        2048 + vocab
    )


@pytest.mark.parametrize(
    ("name", "overrides", "tp", "reason"),
    [
        ("Qwen3-30B-A3B", {}, 8, "T = 8 does not divide the 4 KV heads"),
        ("Qwen3-235B-A22B", {}, 8, "T = 8 does not divide the 4 KV heads"),
        ("Qwen3-8B", {}, 3, "T = 3 does not divide the 32 query heads"),
        ("smoke-moe", {"num_key_value_heads": 4, "num_experts": 6}, 4, "T = 4 does not divide the 6 experts"),
        ("smoke", {"intermediate_size": 129}, 2, None),  # an uneven MLP split: 65 and 64 columns
        ("smoke-moe", {}, 2, None),  # 4 heads, 2 KV heads, 8 experts, its dense layer's 128 columns
    ],
)
def test_a_split_the_rules_cannot_make_is_refused_with_its_reason(
    name: str, overrides: dict[str, int], tp: int, reason: str | None
) -> None:
    config = DecoderConfig.from_hf({**SHAPES[name], **overrides})
    if reason is None:
        assert plan_rank(config, tp, 2, LoraSpec(4), 1, 1).tp == tp
        return
    with pytest.raises(ShardingError) as refused:
        plan_rank(config, tp, 2, LoraSpec(4), 1, 1)
    assert str(refused.value) == reason


def test_a_slot_allocates_its_gradients_in_whole_rows_and_a_card_fits_what_it_has_room_for() -> None:
    slot = SlotBytes.of(GRADIENT_ROW + 1)
    assert (slot.weights, slot.gradients, slot.moments, slot.undo) == (
        4 * (GRADIENT_ROW + 1),
        4 * 2 * GRADIENT_ROW,
        8 * (GRADIENT_ROW + 1),
        4 * (GRADIENT_ROW + 1),
    )
    assert slot.total == slot.weights + slot.optimizer
    plan = plan_rank(config_of("smoke"), 1, 4, LoraSpec(8), slots=4, kv_tokens=100)
    exact = Card("exact", plan.total + 1000)
    assert plan.free_bytes(exact) == 1000
    assert plan.fits(exact, headroom=1000) and not plan.fits(exact, headroom=1001)
    assert plan.slots_that_fit(exact, headroom=1000) == 4
    assert plan.slots_that_fit(exact, headroom=1000 + plan.slot.total) == 3
    assert plan.slots_that_fit(Card("tiny", plan.base), headroom=0) == 0
