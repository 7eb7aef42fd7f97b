"""Learner logprobs of target tokens, computed in token chunks so [T × V] logits are never held whole.

The caller supplies the output head as a closure (lm_head weights plus any per-slot LoRA on it);
this module only chunks, normalises in fp32 and gathers, and, for objectives that are per token,
runs the head's backward chunk by chunk inside the forward. Under tensor parallelism the head gives this
rank's vocabulary rows of the logits (`vocab`, a VocabShard): the softmax is normalised over every rank's
rows with two small all-reduces per chunk (the row max, then the sum of exponentials together with the
target logits, which only their owning rank contributes), so every rank gets every target's logprob,
exactly as one rank would up to summation order; each rank's logit gradient is then complete for its own
rows, with no collective in backward. Engine code: no HTTP, no SQL.

Shapes: T tokens, D hidden, V vocab (this rank's rows of it under tensor parallelism), K top-k width,
C tokens in one chunk (C ≤ chunk_size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from loraplex.model.tensor_parallel import VocabShard, collective

# head_fn(hidden_CD, start, end) -> logits_CV for packed tokens [start, end); any float dtype. The lm_head's
# are fp32 already (model/fp32_linear.py), so the `.float()` below copies nothing; others are upcast there.
HeadFn = Callable[[Tensor, int, int], Tensor]
# objective_fn(lp_CK, start, end) -> 0-D objective of packed tokens [start, end), a function of lp_CK alone.
ObjectiveFn = Callable[[Tensor, int, int], Tensor]


class _Normalised(NamedTuple):
    """One chunk's fp32 log-softmax and its targets' logprobs, with where the targets sit in its rows."""

    logp_CV: Tensor  # log_softmax over the whole vocabulary, at this rank's rows
    lp_CK: Tensor  # every target's logprob, whichever rank holds its row
    index_CK: Tensor  # each target's row in logp_CV (any row where is_local_CK is False)
    is_local_CK: Tensor | None  # whether this rank holds the target's row; None = every rank holds all


def _normalise(logits_CV: Tensor, targets_CK: Tensor, vocab: VocabShard | None) -> _Normalised:
    """fp32 log_softmax of a chunk's logits (this rank's rows of them under `vocab`), gathered at its
    targets; differentiable with one rank, no autograd graph under tensor parallelism (_ShardedLogprobs
    is its backward)."""
    if vocab is None:
        logp_CV = torch.log_softmax(logits_CV, dim=-1)
        return _Normalised(logp_CV, logp_CV.gather(-1, targets_CK), targets_CK, None)
    split, group = vocab.split, vocab.tp.group
    with torch.no_grad():
        max_C1 = logits_CV.max(-1, keepdim=True).values
        with collective():
            dist.all_reduce(max_C1, op=dist.ReduceOp.MAX, group=group)
        shifted_CV = logits_CV - max_C1
        index_CK = targets_CK - split.start
        is_local_CK = (index_CK >= 0) & (index_CK < split.size)
        index_CK = torch.where(is_local_CK, index_CK, 0)
        # Σ exp and each target's shifted logit in one all-reduce; a target's only non-zero term is its
        # owner's, so its sum is exact. The same x - max - log Σ exp(x - max) as torch.log_softmax.
        sums_CK1 = torch.cat(
            (
                shifted_CV.exp().sum(-1, keepdim=True),
                torch.where(is_local_CK, shifted_CV.gather(-1, index_CK), 0),
            ),
            dim=-1,
        )
        with collective():
            dist.all_reduce(sums_CK1, group=group)
        log_sum_C1 = sums_CK1[:, :1].log()
        return _Normalised(shifted_CV.sub_(log_sum_C1), sums_CK1[:, 1:] - log_sum_C1, index_CK, is_local_CK)


def _logits_grad(probs_CV: Tensor, g_CK: Tensor, index_CK: Tensor, is_local_CK: Tensor | None) -> Tensor:
    """∂objective/∂logits of this rank's rows given g = ∂objective/∂lp, written over `probs_CV` (the
    chunk's softmax, exp(logp)): scatter(g) − (Σ_k g)·softmax, each target's g landing on its owner's row
    only (index and is_local as in `_Normalised`)."""
    g_local_CK = g_CK if is_local_CK is None else torch.where(is_local_CK, g_CK, 0)
    return probs_CV.mul_(-g_CK.sum(-1, keepdim=True)).scatter_add_(-1, index_CK, g_local_CK)


class _ShardedLogprobs(torch.autograd.Function):
    """lp_CK of `_normalise` under tensor parallelism, with its exact gradient wrt this rank's logits."""

    @staticmethod
    def forward(ctx: Any, logits_CV: Tensor, targets_CK: Tensor, vocab: VocabShard) -> Tensor:
        normalised = _normalise(logits_CV, targets_CK, vocab)
        ctx.save_for_backward(normalised.logp_CV, normalised.index_CK, normalised.is_local_CK)
        return normalised.lp_CK

    @staticmethod
    def backward(ctx: Any, g_CK: Tensor) -> tuple[Tensor, None, None]:
        logp_CV, index_CK, is_local_CK = ctx.saved_tensors
        return _logits_grad(logp_CV.exp(), g_CK, index_CK, is_local_CK), None, None


def _chunk_logprobs(
    hidden_CD: Tensor, targets_CK: Tensor, head_fn: HeadFn, start: int, end: int, vocab: VocabShard | None
) -> Tensor:
    """fp32 log_softmax of one chunk's logits, gathered at its targets: (C, K)."""
    logits_CV = head_fn(hidden_CD, start, end).float()
    if vocab is None:  # plain autograd through log_softmax and gather
        return _normalise(logits_CV, targets_CK, None).lp_CK
    return _ShardedLogprobs.apply(logits_CV, targets_CK, vocab)


def chunked_token_logprobs(
    hidden_TD: Tensor, head_fn: HeadFn, targets: Tensor, chunk_size: int, vocab: VocabShard | None = None
) -> Tensor:
    """Log-probabilities (fp32) of `targets` (T,) or (T,K) under head_fn's logits, one token chunk at a time.

    Semantics: equals `torch.log_softmax(head_fn(hidden_TD, 0, T).float(), -1).gather(-1, targets_TK)`
    (a (T,) target is gathered as (T,1) and squeezed), in value and in gradient wrt hidden_TD and
    every tensor head_fn captures. Each chunk runs under activation checkpointing: its logits are
    dropped after the forward and recomputed during its own backward, so forward and backward
    hold O(chunk_size × V) of logits, never O(T × V). head_fn must therefore be deterministic.
    Under torch.no_grad() the chunks are simply computed in turn.
    Under tensor parallelism (`vocab`), head_fn gives this rank's vocabulary rows, and the full logits
    above are every rank's rows side by side; the result is the same on every rank, and the gradient
    wrt hidden_TD is this rank's rows' part of it (Decoder.forward's output sums the parts in backward).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    is_top_k = targets.dim() == 2
    targets_TK = targets if is_top_k else targets.unsqueeze(-1)
    # split (not slicing) so that backward assembles the hidden gradient once, not once per chunk.
    hidden_chunks = hidden_TD.split(chunk_size)
    target_chunks = targets_TK.split(chunk_size)
    lp_chunks = []
    for i, (hidden_CD, targets_CK) in enumerate(zip(hidden_chunks, target_chunks, strict=True)):
        start = i * chunk_size
        args = (hidden_CD, targets_CK, head_fn, start, start + hidden_CD.shape[0], vocab)
        if torch.is_grad_enabled():
            lp_chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            lp_chunks.append(_chunk_logprobs(*args))
    lp_TK = torch.cat(lp_chunks)
    return lp_TK if is_top_k else lp_TK.squeeze(-1)


def chunked_token_logprobs_backward(
    hidden_TD: Tensor,
    head_fn: HeadFn,
    targets: Tensor,
    chunk_size: int,
    objective_fn: ObjectiveFn,
    vocab: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(lp, ∂objective/∂hidden_TD), the head's backward done chunk by chunk while its logits are live.

    Semantics: with lp = chunked_token_logprobs(hidden_TD, head_fn, targets, chunk_size) (the same
    values, bit for bit) and objective = Σ over chunks of objective_fn(lp[start:end], start, end),
    returns lp (detached) and the gradient of objective wrt hidden_TD (None when hidden_TD needs none),
    and adds into `.grad` of every leaf head_fn captures what `objective.backward()` would add there.
    The caller sends the hidden gradient on with `hidden_TD.backward(grad)`. Valid only when each
    chunk's objective depends on that chunk's lp alone (per-token losses), and when head_fn's backward
    does not need its output (a linear layer's does not).
    How: per chunk, g = ∂objective/∂lp by autograd on the (C, K) lp, then ∂objective/∂logits =
    scatter(g) − (Σ_k g)·softmax, written over the log_softmax buffer and pushed through head_fn's
    graph. The logits are computed once; the checkpointed path computes them twice and holds the same
    O(chunk_size × V). Under tensor parallelism (`vocab`), as in `chunked_token_logprobs`: the hidden
    gradient returned is this rank's part, which `hidden_TD.backward` sums over the ranks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    is_top_k = targets.dim() == 2
    targets_TK = targets if is_top_k else targets.unsqueeze(-1)
    needs_hidden_grad = hidden_TD.requires_grad
    lp_chunks, grad_chunks = [], []
    for i, (hidden_CD, targets_CK) in enumerate(
        zip(hidden_TD.detach().split(chunk_size), targets_TK.split(chunk_size), strict=True)
    ):
        start = i * chunk_size
        hidden_CD = hidden_CD.detach().requires_grad_(needs_hidden_grad)
        lp_chunks.append(_chunk_backward(hidden_CD, targets_CK, head_fn, objective_fn, start, vocab))
        if needs_hidden_grad:
            grad_chunks.append(hidden_CD.grad if hidden_CD.grad is not None else torch.zeros_like(hidden_CD))
    lp_TK = torch.cat(lp_chunks)
    grad_TD = torch.cat(grad_chunks) if needs_hidden_grad else None
    return (lp_TK if is_top_k else lp_TK.squeeze(-1)), grad_TD


def _chunk_backward(
    hidden_CD: Tensor,
    targets_CK: Tensor,
    head_fn: HeadFn,
    objective_fn: ObjectiveFn,
    start: int,
    vocab: VocabShard | None,
) -> Tensor:
    """One chunk of `chunked_token_logprobs_backward`: its lp (C, K); gradients land in `.grad`."""
    end = start + hidden_CD.shape[0]
    with torch.enable_grad():
        logits_CV = head_fn(hidden_CD, start, end)
    with torch.no_grad():
        normalised = _normalise(logits_CV.float(), targets_CK, vocab)  # the ops of _chunk_logprobs: same bits
    with torch.enable_grad():
        lp_leaf_CK = normalised.lp_CK.clone().requires_grad_()
        objective = objective_fn(lp_leaf_CK, start, end)
    if objective.requires_grad and logits_CV.requires_grad:
        (g_CK,) = torch.autograd.grad(objective, lp_leaf_CK)
        with torch.no_grad():
            grad_CV = _logits_grad(
                normalised.logp_CV.exp_(), g_CK, normalised.index_CK, normalised.is_local_CK
            )
        logits_CV.backward(grad_CV.to(logits_CV.dtype))
    return normalised.lp_CK
