"""Learner logprobs of target tokens, computed in token chunks so [T × V] logits are never held whole.

The caller supplies the output head as a closure (lm_head weights plus any per-slot LoRA on it);
this module only chunks, normalises in fp32 and gathers, and, for objectives that are per token,
runs the head's backward chunk by chunk inside the forward. Engine code: no HTTP, no SQL.

Shapes: T tokens, D hidden, V vocab, K top-k width, C tokens in one chunk (C ≤ chunk_size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# head_fn(hidden_CD, start, end) -> logits_CV for packed tokens [start, end); any float dtype.
HeadFn = Callable[[Tensor, int, int], Tensor]
# objective_fn(lp_CK, start, end) -> 0-D objective of packed tokens [start, end), a function of lp_CK alone.
ObjectiveFn = Callable[[Tensor, int, int], Tensor]


def _chunk_logprobs(hidden_CD: Tensor, targets_CK: Tensor, head_fn: HeadFn, start: int, end: int) -> Tensor:
    """fp32 log_softmax of one chunk's logits, gathered at its targets: (C, K)."""
    logits_CV = head_fn(hidden_CD, start, end).float()
    return torch.log_softmax(logits_CV, dim=-1).gather(-1, targets_CK)


def chunked_token_logprobs(hidden_TD: Tensor, head_fn: HeadFn, targets: Tensor, chunk_size: int) -> Tensor:
    """Log-probabilities (fp32) of `targets` (T,) or (T,K) under head_fn's logits, one token chunk at a time.

    Semantics: equals `torch.log_softmax(head_fn(hidden_TD, 0, T).float(), -1).gather(-1, targets_TK)`
    (a (T,) target is gathered as (T,1) and squeezed), in value and in gradient wrt hidden_TD and
    every tensor head_fn captures. Each chunk runs under activation checkpointing: its logits are
    dropped after the forward and recomputed during its own backward, so forward and backward
    hold O(chunk_size × V) of logits, never O(T × V). head_fn must therefore be deterministic.
    Under torch.no_grad() the chunks are simply computed in turn.
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
        args = (hidden_CD, targets_CK, head_fn, start, start + hidden_CD.shape[0])
        if torch.is_grad_enabled():
            lp_chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            lp_chunks.append(_chunk_logprobs(*args))
    lp_TK = torch.cat(lp_chunks)
    return lp_TK if is_top_k else lp_TK.squeeze(-1)


def chunked_token_logprobs_backward(
    hidden_TD: Tensor, head_fn: HeadFn, targets: Tensor, chunk_size: int, objective_fn: ObjectiveFn
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
    O(chunk_size × V).
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
        lp_chunks.append(_chunk_backward(hidden_CD, targets_CK, head_fn, objective_fn, start))
        if needs_hidden_grad:
            grad_chunks.append(hidden_CD.grad if hidden_CD.grad is not None else torch.zeros_like(hidden_CD))
    lp_TK = torch.cat(lp_chunks)
    grad_TD = torch.cat(grad_chunks) if needs_hidden_grad else None
    return (lp_TK if is_top_k else lp_TK.squeeze(-1)), grad_TD


def _chunk_backward(
    hidden_CD: Tensor, targets_CK: Tensor, head_fn: HeadFn, objective_fn: ObjectiveFn, start: int
) -> Tensor:
    """One chunk of `chunked_token_logprobs_backward`: its lp (C, K); gradients land in `.grad`."""
    end = start + hidden_CD.shape[0]
    with torch.enable_grad():
        logits_CV = head_fn(hidden_CD, start, end)
    with torch.no_grad():
        logp_CV = torch.log_softmax(logits_CV.float(), dim=-1)  # the ops of _chunk_logprobs: same bits
        lp_CK = logp_CV.gather(-1, targets_CK)
    with torch.enable_grad():
        lp_leaf_CK = lp_CK.clone().requires_grad_()
        objective = objective_fn(lp_leaf_CK, start, end)
    if objective.requires_grad and logits_CV.requires_grad:
        (g_CK,) = torch.autograd.grad(objective, lp_leaf_CK)
        with torch.no_grad():
            grad_CV = logp_CV.exp_().mul_(-g_CK.sum(-1, keepdim=True)).scatter_add_(-1, targets_CK, g_CK)
        logits_CV.backward(grad_CV.to(logits_CV.dtype))
    return lp_CK
