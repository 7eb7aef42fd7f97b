"""FLOP accounting and the dense matmul rate that roofline fractions divide by.

LoRA training of a frozen base costs 4N FLOPs per token (N = parameters of every matmul a token
passes, lm_head included, embeddings and the small LoRA matmuls excluded): 2N forward plus 2N for
activation gradients, no base weight gradients. In an MoE layer a token passes the router and its top-k
experts only, so N counts those (the active parameters), not all E experts. Attention's score and value
products are counted apart (docs/BENCHMARKS.md). Knows nothing of the engine or of baselines.

Shapes: N query heads, H head dim, L sequence length.
"""

from __future__ import annotations

import torch

from loraplex.model.config import DecoderConfig

# Square matmul side per device kind: large enough to reach the device's dense rate, quick to run.
_MATMUL_SIDE = {"cpu": 1024, "cuda": 8192}
_MATMUL_REPS = {"cpu": 4, "cuda": 20}


def matmul_params(config: DecoderConfig) -> int:
    """N: weights of the projections, MLP (router and picked experts in MoE layers) and lm_head a token
    passes through (embeddings excluded)."""
    D, F, H = config.hidden_size, config.intermediate_size, config.head_dim
    attn_width, kv_width = config.num_attention_heads * H, config.num_key_value_heads * H
    attention = D * attn_width + 2 * D * kv_width + attn_width * D
    dense_mlp = 3 * D * F
    sparse_mlp = D * config.num_experts + config.num_experts_per_tok * 3 * D * config.moe_intermediate_size
    mlp = sum(
        sparse_mlp if config.is_moe_layer(layer) else dense_mlp for layer in range(config.num_hidden_layers)
    )
    return config.num_hidden_layers * attention + mlp + D * config.vocab_size


def train_flops_per_token(config: DecoderConfig) -> float:
    """4N: forward plus activation gradients of a frozen base."""
    return 4.0 * matmul_params(config)


def attention_train_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Score and value products of causal attention, forward plus backward (3 × forward), per token.

    Forward per token per layer: 2·N·H FLOPs for q·k and 2·N·H for p·v per attended key, and a causal
    sequence of length L attends (L + 1) / 2 keys on average.
    """
    mean_keys = (seq_len + 1) / 2
    forward = 4.0 * config.num_attention_heads * config.head_dim * mean_keys * config.num_hidden_layers
    return 3.0 * forward


def _lora_params_per_rank(config: DecoderConfig) -> int:
    """A rank-1 adapter's A and B entries over every target (q, k, v, o and the MLP's projections, every
    expert's in an MoE layer): Σ (in + out) per target."""
    D, F, H = config.hidden_size, config.intermediate_size, config.head_dim
    attn_width, kv_width = config.num_attention_heads * H, config.num_key_value_heads * H
    attention = 2 * (D + attn_width) + 2 * (D + kv_width)
    dense_mlp = 3 * (D + F)
    sparse_mlp = config.num_experts * 3 * (D + config.moe_intermediate_size)
    mlp = sum(
        sparse_mlp if config.is_moe_layer(layer) else dense_mlp for layer in range(config.num_hidden_layers)
    )
    return config.num_hidden_layers * attention + mlp


def decode_step_bytes(
    config: DecoderConfig,
    sequences: int,
    context: float,
    adapters: int,
    rank: int,
    weight_bytes: int,
    adapter_bytes: int,
) -> float:
    """The least memory traffic of one decode step of `sequences` sequences attending `context` keys each
    on average, over `adapters` distinct adapters of rank `rank`: every base weight read once (in an MoE
    layer, the experts any sequence picks, expected under uniform routing), each adapter's A and B once,
    every sequence's cached keys and values read and one new pair written. Activations (a few
    sequences × hidden vectors per layer) are left out: under 1% of the total at the shapes we report."""
    D, H = config.hidden_size, config.head_dim
    attn_width, kv_width = config.num_attention_heads * H, config.num_key_value_heads * H
    attention = D * attn_width + 2 * D * kv_width + attn_width * D
    E, P = config.num_experts, config.num_experts_per_tok
    experts_read = E * (1.0 - (1.0 - P / E) ** sequences) if E else 0.0
    weights = D * config.vocab_size + config.num_hidden_layers * attention
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            weights += D * E + experts_read * 3 * D * config.moe_intermediate_size
        else:
            weights += 3 * D * config.intermediate_size
    kv_per_token = config.num_hidden_layers * 2 * kv_width * weight_bytes
    kv = sequences * (context + 1) * kv_per_token
    lora = adapters * rank * _lora_params_per_rank(config) * adapter_bytes
    return weights * weight_bytes + kv + lora


class DenseMatmul:
    """A callable running `reps` square matmuls in the run's dtype; `flops` is the work of one call."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        side = _MATMUL_SIDE.get(device.type, 1024)
        self.reps = _MATMUL_REPS.get(device.type, 4)
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(side, side, generator=generator).to(device=device, dtype=dtype)
        self.b = torch.randn(side, side, generator=generator).to(device=device, dtype=dtype)
        self.out = torch.empty_like(self.a)
        self.flops = 2.0 * side**3 * self.reps

    def __call__(self) -> None:
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.out)
