"""Chunked logprobs equal the full log_softmax gather, and never hold more than a chunk of logits."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loraplex.engine.logprobs import chunked_token_logprobs
from tests.model.rounding import assert_within_rounding

T, D, V, R = 37, 8, 29, 4


class _LoraHead:
    """lm_head with a LoRA delta on it, the shape of the engine's head closure: logits = h·(W + B·A)ᵀ."""

    def __init__(self, seed: int, d: int = D, v: int = V) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w_VD = torch.randn(v, d, generator=g).requires_grad_(True)
        self.a_RD = (torch.randn(R, d, generator=g) * 0.3).requires_grad_(True)
        self.b_VR = (torch.randn(v, R, generator=g) * 0.3).requires_grad_(True)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, hidden_CD: torch.Tensor, start: int, end: int) -> torch.Tensor:
        self.calls.append((start, end))
        return hidden_CD @ self.w_VD.T + (hidden_CD @ self.a_RD.T) @ self.b_VR.T

    def params(self) -> list[torch.Tensor]:
        return [self.w_VD, self.a_RD, self.b_VR]

    def double(self) -> _LoraHead:
        """The same head with float64 copies of its weights as its own leaves."""
        twin = _LoraHead.__new__(_LoraHead)
        twin.w_VD, twin.a_RD, twin.b_VR = (p.detach().double().requires_grad_(True) for p in self.params())
        twin.calls = []
        return twin


def _full_reference(hidden_TD: torch.Tensor, head: _LoraHead, targets: torch.Tensor) -> torch.Tensor:
    """The plain path the chunked one must equal: all logits at once (normalised in fp32, or float64)."""
    logits_TV = head(hidden_TD, 0, hidden_TD.shape[0])
    lp_TV = torch.log_softmax(logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32)), dim=-1)
    return lp_TV.gather(-1, targets) if targets.dim() == 2 else lp_TV.gather(-1, targets[:, None])[:, 0]


def _value_and_grads(fn, hidden_TD: torch.Tensor, head: _LoraHead, targets: torch.Tensor):
    """lp and the gradients of a fixed random functional of lp wrt hidden and every head parameter."""
    hidden_TD = hidden_TD.detach().clone().requires_grad_(True)
    lp = fn(hidden_TD, head, targets)
    cotangent = torch.randn(lp.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad((lp * cotangent).sum(), [hidden_TD, *head.params()])
    return lp.detach(), grads


@pytest.mark.parametrize("chunk_size", [1, 7, T, T + 5])
@pytest.mark.parametrize("top_k", [None, 3])
def test_chunked_logprobs_equal_the_full_log_softmax_gather(chunk_size: int, top_k: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    hidden_TD = torch.randn(T, D, generator=g)
    shape = (T,) if top_k is None else (T, top_k)
    targets = torch.randint(0, V, shape, generator=g)
    head = _LoraHead(1)
    lp, grads = _value_and_grads(
        lambda h, hd, t: chunked_token_logprobs(h, hd, t, chunk_size), hidden_TD, head, targets
    )
    ref_lp, ref_grads = _value_and_grads(_full_reference, hidden_TD, head, targets)
    exact_lp, exact_grads = _value_and_grads(_full_reference, hidden_TD.double(), head.double(), targets)
    assert lp.shape == shape and lp.dtype == torch.float32
    assert_within_rounding(lp, ref_lp, exact_lp, "lp")
    for name, *values in zip(("hidden", "w", "a", "b"), grads, ref_grads, exact_grads, strict=True):
        assert_within_rounding(*values, f"grad {name}")


def test_head_fn_sees_each_chunk_with_its_token_range() -> None:
    head = _LoraHead(2)
    with torch.no_grad():
        chunked_token_logprobs(torch.randn(T, D), head, torch.zeros(T, dtype=torch.long), 10)
    assert head.calls == [(0, 10), (10, 20), (20, 30), (30, T)]


def test_low_precision_logits_are_normalised_in_fp32() -> None:
    hidden_TD = torch.randn(T, D)
    targets = torch.randint(0, V, (T,))
    head = _LoraHead(3)

    def bf16_head(h: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return head(h, start, end).bfloat16()

    with torch.no_grad():
        lp = chunked_token_logprobs(hidden_TD, bf16_head, targets, 8)
        logits = bf16_head(hidden_TD, 0, T)
        ref, exact = (
            torch.log_softmax(logits.to(dtype), -1).gather(-1, targets[:, None])[:, 0]
            for dtype in (torch.float32, torch.float64)
        )
    assert lp.dtype == torch.float32
    assert_within_rounding(lp, ref, exact, "lp")


def test_under_no_grad_the_result_is_the_same_and_keeps_no_graph() -> None:
    hidden_TD = torch.randn(T, D, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    head = _LoraHead(4)
    with torch.no_grad():
        lp = chunked_token_logprobs(hidden_TD, head, targets, 5)
    assert not lp.requires_grad
    # The same chunks through the same ops (checkpointing only keeps less): the same bits.
    assert torch.equal(lp, chunked_token_logprobs(hidden_TD, head, targets, 5).detach())


class _LiveMemory(TorchDispatchMode):
    """Tracks the bytes of live storages created by ops while active (forward and backward), and their peak.

    A storage counts from the op that creates it until it is freed (a weakref finalizer on the
    storage, whose Python object lives as long as the storage does), so tensors autograd saves
    for backward count too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = self.peak_bytes = self.max_numel = 0
        self._live: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            self.max_numel = max(self.max_numel, leaf.numel())
            storage = leaf.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self._live:
                self._live.add(key)
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


def _measure(fn, n_tokens: int, top_k: int | None) -> _LiveMemory:
    """Peak memory of fn's forward and a backward to the hidden states and every head parameter."""
    hidden_TD = torch.randn(n_tokens, MEM_D, requires_grad=True)
    targets = torch.randint(0, MEM_V, (n_tokens,) if top_k is None else (n_tokens, top_k))
    head = _LoraHead(5, d=MEM_D, v=MEM_V)
    with _LiveMemory() as memory:
        lp = fn(hidden_TD, head, targets)
        torch.autograd.grad(lp.sum(), [hidden_TD, *head.params()])
        del lp
    return memory


MEM_D, MEM_V, MEM_CHUNK, MEM_T = 16, 1000, 32, 1024  # T·V = 32 × chunk·V; V·D, T·D < chunk·V
FP32 = 4


@pytest.mark.parametrize("top_k", [None, 2])
def test_peak_memory_scales_with_the_chunk_not_the_tokens(top_k: int | None) -> None:
    def chunked(h: torch.Tensor, head: _LoraHead, t: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(h, head, t, MEM_CHUNK)

    full = _measure(_full_reference, MEM_T, top_k)
    small = _measure(chunked, MEM_T, top_k)
    large = _measure(chunked, 4 * MEM_T, top_k)
    chunk_logits_bytes = MEM_CHUNK * MEM_V * FP32
    assert full.peak_bytes >= MEM_T * MEM_V * FP32  # the probe does see [T × V] logits when they exist
    assert small.max_numel <= MEM_CHUNK * MEM_V
    assert small.peak_bytes <= 8 * chunk_logits_bytes  # a few chunk-sized buffers, a quarter of T·V
    # 3T more tokens add their hidden-size gradients and outputs (O(D) bytes each), never O(V).
    bytes_per_extra_token = (large.peak_bytes - small.peak_bytes) / (3 * MEM_T)
    assert bytes_per_extra_token < MEM_V * FP32 / 10
