"""Packed attention, forward and backward, on both paths: the per-length SDPA calls (the CPU's) and the
varlen call over cu_seqlens (CUDA's flash kernel; on the CPU a flex_attention stand-in with a document mask
checks what the call is given). Each equals an explicit causal softmax per sequence, within a bound derived
from the float64 reference's distance (tests/model/rounding.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from loraplex.model import attention
from loraplex.model.attention import packed_attention, per_length_attention, varlen_attention
from loraplex.model.packing import PackedSequences
from tests.model.rounding import BF16_U, assert_within_rounding

N, K, H = 4, 2, 8  # two query heads per kv head
# Equal lengths (the one-view path), mixed lengths with a repeat, single tokens, one sequence. A lone
# token's dq is exactly zero (its output is its v), so single tokens come with a longer sequence whose dq
# the bound measures.
PACKS = [(4, 4, 4), (1, 5, 2, 5, 3), (1, 2, 1), (6,), (9, 1, 16, 1, 3)]


def causal_reference(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, lengths: tuple[int, ...]) -> Tensor:
    """Explicit causal softmax(q kᵀ/√H) v per sequence, kv heads repeated for GQA."""
    group = q_TNH.shape[1] // k_TKH.shape[1]
    out = []
    for q, k, v in zip(q_TNH.split(lengths), k_TKH.split(lengths), v_TKH.split(lengths), strict=True):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("inh,jnh->nij", q, k) / q.shape[-1] ** 0.5
        future = torch.ones(len(q), len(q), dtype=torch.bool, device=q.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        out.append(torch.einsum("nij,jnh->inh", weights, v))
    return torch.cat(out)


def _inputs(lengths: tuple[int, ...], seed: int, **factory) -> list[Tensor]:
    """q, k, v and an output cotangent for a pack of `lengths`, as leaves that collect gradients."""
    generator = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    shapes = [(T, N, H), (T, K, H), (T, K, H), (T, N, H)]
    return [torch.randn(shape, generator=generator).to(**factory).requires_grad_() for shape in shapes]


def _forward_backward(attend, inputs: list[Tensor]) -> list[Tensor]:
    """The output and the gradients of q, k, v for the cotangent, each input a fresh leaf."""
    q, k, v, cotangent = (x.detach().requires_grad_() for x in inputs)
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    return [out.detach(), *grads]


@pytest.mark.parametrize("lengths", PACKS)
def test_per_length_attention_and_its_gradients_equal_the_reference(lengths: tuple[int, ...]) -> None:
    inputs = _inputs(lengths, seed=len(lengths))
    packing = PackedSequences.from_lengths(lengths)
    got = _forward_backward(lambda q, k, v: per_length_attention(q, k, v, packing), inputs)
    want = _forward_backward(lambda q, k, v: causal_reference(q, k, v, lengths), inputs)
    exact = _forward_backward(
        lambda q, k, v: causal_reference(q, k, v, lengths), [x.double() for x in inputs]
    )
    for name, g, w, e in zip(("out", "dq", "dk", "dv"), got, want, exact, strict=True):
        assert_within_rounding(g, w, e, f"{name} of {lengths}")


def flex_varlen_stand_in(calls: list[dict]):
    """torch's `varlen_attn` contract computed by flex_attention with a document mask (the CPU has no
    varlen kernel): documents from cu_seq_q, key j visible to query i when i - left <= j <= i + right for
    window_size (left, right), -1 unbounded, as flash reads it; records each call's scalar arguments in
    `calls`. Forward only: flex has no CPU backward. Without `enable_gqa` in the call (torch before the
    keyword) the heads must match, as that torch's kernel needs."""

    def varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size, **rest):
        enable_gqa = rest.pop("enable_gqa", None)
        assert not rest and cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32
        assert enable_gqa is not None or q.shape[1] == k.shape[1] == v.shape[1]
        calls.append({"max_q": max_q, "max_k": max_k, "window_size": window_size, "enable_gqa": enable_gqa})
        enable_gqa = bool(enable_gqa)
        document_T = torch.searchsorted(cu_seq_q, torch.arange(q.shape[0], dtype=torch.int32), right=True)
        left, right = window_size

        def document_window(score, batch, head, i, j):
            visible = document_T[i] == document_T[j]
            if left >= 0:
                visible = visible & (j >= i - left)
            if right >= 0:
                visible = visible & (j <= i + right)
            return torch.where(visible, score, float("-inf"))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it materialises the scores
            q_1NTH, k_1KTH, v_1KTH = (x.transpose(0, 1)[None] for x in (q, k, v))
            out_1NTH = flex_attention(q_1NTH, k_1KTH, v_1KTH, document_window, enable_gqa=enable_gqa)
        return out_1NTH[0].transpose(0, 1)

    return varlen_attn


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["enable_gqa", "older_torch"])
@pytest.mark.parametrize("lengths", PACKS)
def test_the_varlen_call_is_one_call_over_the_packs_cu_seqlens(
    lengths: tuple[int, ...], takes_gqa: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call over the pack; where torch's varlen_attn has no `enable_gqa` (2.11) the kv heads come
    repeated to the query heads and give the same result."""
    calls: list[dict] = []
    kernel = attention.VarlenKernel(flex_varlen_stand_in(calls), takes_gqa)
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel)
    q, k, v = (x.detach() for x in _inputs(lengths, seed=len(lengths))[:3])
    packing = PackedSequences.from_lengths(lengths)
    got = varlen_attention(q, k, v, packing)
    longest = max(lengths)
    gqa = True if takes_gqa else None
    assert calls == [{"max_q": longest, "max_k": longest, "window_size": (-1, 0), "enable_gqa": gqa}]
    want = per_length_attention(q, k, v, packing)
    exact = causal_reference(q.double(), k.double(), v.double(), lengths)
    assert_within_rounding(got, want, exact, f"varlen stand-in against per-length SDPA, {lengths}")


def test_the_cpu_takes_the_per_length_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []
    kernel = attention.VarlenKernel(flex_varlen_stand_in(calls), takes_gqa=True)
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (x.detach() for x in _inputs((3, 1), seed=0, dtype=dtype)[:3])
        packed_attention(q, k, v, PackedSequences.from_lengths((3, 1)))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", PACKS)
def test_cuda_varlen_attention_and_its_gradients_equal_per_length_sdpa(lengths: tuple[int, ...]) -> None:
    """The flash varlen kernel in bf16 against the per-length SDPA calls in bf16, both within a bound of
    bf16's rounding measured against the float64 reference; forward and the three gradients."""
    inputs = _inputs(lengths, seed=len(lengths), device="cuda", dtype=torch.bfloat16)
    packing = PackedSequences.from_lengths(lengths, "cuda")
    assert attention.has_varlen_kernel(inputs[0])
    got = _forward_backward(lambda q, k, v: varlen_attention(q, k, v, packing), inputs)
    want = _forward_backward(lambda q, k, v: per_length_attention(q, k, v, packing), inputs)
    exact = _forward_backward(
        lambda q, k, v: causal_reference(q, k, v, lengths), [x.double() for x in inputs]
    )
    for name, g, w, e in zip(("out", "dq", "dk", "dv"), got, want, exact, strict=True):
        assert_within_rounding(g, w, e, f"{name} of {lengths}", unit=BF16_U)
