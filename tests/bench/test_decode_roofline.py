"""The decode step's traffic bound (bench/roofline.py `decode_step_bytes`), worked by hand for the shape
docs/BENCHMARKS.md's target names: Qwen3-8B, 128 sequences over 16 adapters at 1k context."""

from __future__ import annotations

import pytest

from loraplex.bench.roofline import decode_step_bytes
from loraplex.model.config import DecoderConfig
from loraplex.model.presets import PUBLISHED


def test_qwen3_8b_decode_of_128_sequences_over_16_adapters_at_1k_context() -> None:
    config = DecoderConfig.from_hf(PUBLISHED["Qwen3-8B"])
    # Base weights in bf16: per layer q and o 4096², k and v 4096·1024, the MLP 3·4096·12288; the lm_head.
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    weights = 2 * (36 * per_layer + 4096 * 151936)
    # Keys and values of 128 sequences at 1024 keys plus the one written: 36 layers · 2 · 8 heads · 128 · 2 B.
    kv = 128 * 1025 * 36 * 2 * 8 * 128 * 2
    # Rank 16 in fp32: per layer Σ(in + out) over q, k, v, o, gate, up, down.
    lora = 16 * 16 * 36 * (2 * 8192 + 2 * 5120 + 3 * 16384) * 4
    got = decode_step_bytes(config, 128, 1024, 16, 16, weight_bytes=2, adapter_bytes=4)
    assert got == weights + kv + lora
    assert got / 4.8e12 * 1e3 == pytest.approx(7.8, abs=0.1)  # ms at an H200's 4.8 TB/s


def test_moe_layers_count_the_experts_a_batch_is_expected_to_touch() -> None:
    moe = dict(PUBLISHED["Qwen3-30B-A3B"], num_hidden_layers=1)
    config = DecoderConfig.from_hf(moe)
    E, P, D, Fm = (
        config.num_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
    )
    one = decode_step_bytes(config, 1, 0, 0, 16, 2, 4)
    many = decode_step_bytes(config, 4096, 0, 0, 16, 2, 4)
    expert = 3 * D * Fm * 2
    # One token reads its P experts; 4096 tokens read (nearly) all E.
    kv_one, kv_many = (n * 2 * config.num_key_value_heads * config.head_dim * 2 for n in (1, 4096))
    assert many - kv_many - (one - kv_one) == pytest.approx((E - P) * expert, rel=1e-6)
