"""Learner logprobs of target tokens, computed in token chunks so [T × V] logits are never held whole.

The caller supplies the output head as a closure (lm_head weights plus any per-slot LoRA on it);
this module only chunks, normalises in fp32 and gathers. Engine code: no HTTP, no SQL.

Shapes: T tokens, D hidden, V vocab, K top-k width, C tokens in one chunk (C ≤ chunk_size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# head_fn(hidden_CD, start, end) -> logits_CV for packed tokens [start, end); any float dtype.
HeadFn = Callable[[Tensor, int, int], Tensor]


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
