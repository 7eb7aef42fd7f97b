"""Prompt scores: each prompt token's logprob given the tokens before it, and the top-k ids at each position.

Computed from the prefill's hidden states one token chunk at a time, so no (P, V) logits are held for a
long prompt. Position 0 has nothing before it and is never scored; with `last_n`, neither is anything
before the last n positions. Knows nothing of requests, caches or snapshots. No HTTP, no SQL.

Shapes: P prompt tokens, D hidden, V vocab, C tokens in one chunk, K top-k width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# head_fn(hidden_CD) -> logits_CV, the output head with the request's adapter.
HeadFn = Callable[[Tensor], Tensor]


@dataclass
class PromptScores:
    """Per prompt position; unscored positions hold NaN logprobs and -1 ids."""

    logprobs_P: np.ndarray | None  # (P,) float32
    topk_ids_PK: np.ndarray | None  # (P, K) int32
    topk_logprobs_PK: np.ndarray | None  # (P, K) float32


def score_prompt(
    hidden_PD: Tensor,
    prompt_P: Tensor,
    head_fn: HeadFn,
    first: int,
    want_logprobs: bool,
    top_k: int,
    chunk_size: int,
) -> PromptScores:
    """Score positions [first, P) of a prompt (first ≥ 1) from its hidden states.

    Semantics: for t in [first, P), with lp_V = log_softmax(head_fn(hidden_PD[t - 1]).float()):
        logprobs[t] = lp_V[prompt[t]];  topk_ids[t], topk_logprobs[t] = lp_V.topk(top_k), likeliest first
    """
    num_tokens = prompt_P.shape[0]
    logprobs_P = torch.full((num_tokens,), float("nan"))
    topk_ids_PK = torch.full((num_tokens, top_k), -1, dtype=torch.int32)
    topk_logprobs_PK = torch.full((num_tokens, top_k), float("nan"))
    for start in range(first, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        lp_CV = torch.log_softmax(head_fn(hidden_PD[start - 1 : end - 1]).float(), dim=-1)
        if want_logprobs:
            logprobs_P[start:end] = lp_CV.gather(-1, prompt_P[start:end, None]).squeeze(1).cpu()
        if top_k:
            values_CK, ids_CK = lp_CV.topk(top_k, dim=-1)
            topk_logprobs_PK[start:end], topk_ids_PK[start:end] = values_CK.cpu(), ids_CK.int().cpu()
    return PromptScores(
        logprobs_P.numpy() if want_logprobs else None,
        topk_ids_PK.numpy() if top_k else None,
        topk_logprobs_PK.numpy() if top_k else None,
    )
