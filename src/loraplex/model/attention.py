"""Attention math between the projections: rotary position embedding, then causal attention over a pack.

Functions over already-projected q, k, v plus packing metadata; the projections live in decoder.py.
`decode_attention` is the KV-cache sibling of `packed_attention`: one new token per sequence against
that sequence's cached keys and values (model/kv_cache.py holds them). Knows nothing of slots,
checkpoints or HF.

Shapes: T packed tokens, N query heads, K kv heads, H head dim, G = N/K query heads per kv head,
M sequences of one length, L that length (or the longest cached span), B sequences of a decode step,
P blocks of the paged cache's pool, S tokens a block.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loraplex.model.config import DecoderConfig
from loraplex.model.packing import PackedSequences


class VarlenKernel(NamedTuple):
    """torch's flash varlen kernel, and whether it takes `enable_gqa`: GQA inside the kernel came with the
    pinned torch; an older one (torch 2.11, as an H200 machine had it) refuses the keyword, and there the
    keys and values are repeated to the query heads."""

    call: Callable[..., Tensor]
    takes_gqa: bool


@functools.cache
def varlen_kernel() -> VarlenKernel | None:
    """The varlen kernel (torch 2.9 on; a device machine may bring an older torch), imported at its first
    use: its module imports torch._dynamo, about 1.5 s that every process would otherwise pay at start,
    on the CPU, where the kernel never runs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenKernel(varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters)


def _default_inv_freq(config: DecoderConfig) -> Tensor:
    """Plain rope: theta^(-2i/H) for i in [0, H/2)."""
    # int64 arange then float, as HF does, so the frequencies agree bit for bit.
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / (config.rope_theta**exponents)


def _llama3_inv_freq(config: DecoderConfig) -> Tensor:
    """Llama 3.1 context extension: low frequencies divided by `factor`, a smooth blend in between."""
    scaling = config.rope_scaling
    assert scaling is not None  # DecoderConfig.from_hf guarantees the llama3 keys
    inv_freq = _default_inv_freq(config)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (
        wavelen <= old_context_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


_INV_FREQ_BY_ROPE_TYPE = {"default": _default_inv_freq, "llama3": _llama3_inv_freq}


class RotaryEmbedding(nn.Module):
    """Holds the fp32 inverse frequencies; maps positions to the (cos, sin) tables every layer shares."""

    def __init__(self, config: DecoderConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        rope_type = config.rope_scaling["rope_type"] if config.rope_scaling else "default"
        inv_freq = _INV_FREQ_BY_ROPE_TYPE[rope_type](config)
        # Not persistent: derived from config, never read from or written to a checkpoint.
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions_T: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos_TH, sin_TH) for each token's position, computed in fp32 and cast to the activation dtype."""
        freqs_TH2 = positions_T[:, None].float() * self.inv_freq[None, :]
        angles_TH = torch.cat((freqs_TH2, freqs_TH2), dim=-1)
        return angles_TH.cos().to(dtype), angles_TH.sin().to(dtype)


def apply_rope(x_TNH: Tensor, cos_TH: Tensor, sin_TH: Tensor) -> Tensor:
    """Rotate each head's (first half, second half) pairs by the token's angles (HF's rotate_half layout)."""
    half = x_TNH.shape[-1] // 2
    rotated_TNH = torch.cat((-x_TNH[..., half:], x_TNH[..., :half]), dim=-1)
    return x_TNH * cos_TH[:, None, :] + rotated_TNH * sin_TH[:, None, :]


def packed_attention(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packing: PackedSequences) -> Tensor:
    """Causal softmax attention within each sequence of the pack, with GQA; returns out_TNH.

    Semantics (the per-sequence loop this equals):
        for start, end in consecutive pairs of packing.cu_seqlens_Q1:
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
    with kv head j serving query heads j*N/K ... (j+1)*N/K - 1 and scale 1/sqrt(H).

    Where the flash varlen kernel runs (CUDA, 16-bit activations) the whole pack is one call over
    `cu_seqlens_Q1`; elsewhere one SDPA call per distinct length (`per_length_attention`).
    """
    if has_varlen_kernel(q_TNH):
        return varlen_attention(q_TNH, k_TKH, v_TKH, packing)
    return per_length_attention(q_TNH, k_TKH, v_TKH, packing)


def has_varlen_kernel(q_TNH: Tensor) -> bool:
    """Whether torch's varlen (flash) kernel takes these activations: CUDA, and fp16 or bf16 (flash has no
    fp32). The CPU has no varlen kernel in the pinned torch, and flex_attention's document mask is no
    substitute there: it has no CPU backward, and its eager forward materialises the scores. Measured
    forward on 2 cores with the tiny model's heads (N=4, K=2, H=64), median ms, per-length SDPA / flex:
    8 × 64 tokens 8 / 99; lengths 1..250 (T=664) 8 / 197; 4 × 512 43 / 782; lengths 1..900 (T=1856)
    200 / 688."""
    return q_TNH.is_cuda and q_TNH.dtype in (torch.float16, torch.bfloat16) and varlen_kernel() is not None


def varlen_attention(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packing: PackedSequences) -> Tensor:
    """The whole pack in one varlen call: causal (window (-1, 0)) within the sequences `cu_seqlens_Q1`
    bounds, GQA in the kernel (no repeated keys) where torch's kernel takes it; differentiable. The longest
    length is a host int the packing already holds, so the call needs no sync."""
    kernel = varlen_kernel()
    assert kernel is not None, "varlen_attention runs only where has_varlen_kernel holds"
    longest = max(packing.lengths)
    group = q_TNH.shape[1] // k_TKH.shape[1]
    gqa: dict[str, bool] = {}
    if kernel.takes_gqa:
        gqa["enable_gqa"] = group > 1
    elif group > 1:
        k_TKH, v_TKH = k_TKH.repeat_interleave(group, dim=1), v_TKH.repeat_interleave(group, dim=1)
    return kernel.call(
        q_TNH,
        k_TKH,
        v_TKH,
        packing.cu_seqlens_Q1,
        packing.cu_seqlens_Q1,
        longest,
        longest,
        window_size=(-1, 0),
        **gqa,
    )


def per_length_attention(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packing: PackedSequences) -> Tensor:
    """`packed_attention` as one SDPA call per distinct sequence length, that length's sequences stacked
    as its batch (a zero-copy view when all lengths are equal), so scores cost O(sum of L^2) per head
    instead of a (T, T) block-diagonal mask, and the Python loop runs over distinct lengths, not
    sequences."""
    num_heads, head_dim = q_TNH.shape[1:]
    num_kv_heads = k_TKH.shape[1]
    outputs = []
    for group in packing.groups:
        rows = (group.num_seqs, group.length)
        if group.token_index_ML is None:
            q_MLNH = q_TNH.view(*rows, num_heads, head_dim)
            k_MLKH = k_TKH.view(*rows, num_kv_heads, head_dim)
            v_MLKH = v_TKH.view(*rows, num_kv_heads, head_dim)
        else:
            index = group.token_index_ML.flatten()
            q_MLNH = q_TNH.index_select(0, index).view(*rows, num_heads, head_dim)
            k_MLKH = k_TKH.index_select(0, index).view(*rows, num_kv_heads, head_dim)
            v_MLKH = v_TKH.index_select(0, index).view(*rows, num_kv_heads, head_dim)
        out_MLNH = _causal_sdpa(q_MLNH, k_MLKH, v_MLKH)
        outputs.append(out_MLNH.reshape(-1, num_heads, head_dim))
    if packing.restore_index_T is None:
        return outputs[0]
    return torch.cat(outputs).index_select(0, packing.restore_index_T)


def _causal_sdpa(q_MLNH: Tensor, k_MLKH: Tensor, v_MLKH: Tensor) -> Tensor:
    """Causal SDPA over a batch of equal-length rows; softmax runs in fp32 inside SDPA for bf16 inputs."""
    out_MNLH = F.scaled_dot_product_attention(
        q_MLNH.transpose(1, 2),
        k_MLKH.transpose(1, 2),
        v_MLKH.transpose(1, 2),
        is_causal=True,
        enable_gqa=q_MLNH.shape[2] != k_MLKH.shape[2],
    )
    return out_MNLH.transpose(1, 2)


def decode_attention(
    q_BNH: Tensor, k_pool_PSKH: Tensor, v_pool_PSKH: Tensor, slots_BL: Tensor, is_visible_BL: Tensor
) -> Tensor:
    """Attention of one new token per sequence over its cached tokens (the cache already holds its k, v).

    Semantics (the per-sequence loop this equals):
        for b in range(B):
            L_b = number of True in is_visible_BL[b] (a prefix)
            out[b] = causal_attention's last row over the pool's flat slots slots_BL[b, :L_b] for q[b]
    with kv head j serving query heads j*G ... (j+1)*G - 1 and scale 1/sqrt(H).

    How: the rows' keys and values are gathered from the paged pool (P, S, K, H) into batch order by one
    index_select each, and one SDPA call attends them under the (B, 1, 1, L) padding mask; the G query
    heads of a kv head act as G query positions sharing it, so GQA needs no repeated keys. Masked slots
    must hold finite values (kv_cache.py points them at a written token).
    """
    num_seqs, span = slots_BL.shape
    num_heads, head_dim = q_BNH.shape[1:]
    num_kv_heads = k_pool_PSKH.shape[2]
    group = num_heads // num_kv_heads
    index = slots_BL.flatten()
    k_BKLH, v_BKLH = (
        pool.flatten(0, 1).index_select(0, index).view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2)
        for pool in (k_pool_PSKH, v_pool_PSKH)
    )
    out_BKGH = F.scaled_dot_product_attention(
        q_BNH.view(num_seqs, num_kv_heads, group, head_dim),
        k_BKLH,
        v_BKLH,
        attn_mask=is_visible_BL[:, None, None, :],
    )
    return out_BKGH.reshape(num_seqs, num_heads, head_dim)
