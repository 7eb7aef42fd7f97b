"""Prompt scores: what a request asks about its own prompt, computed from the prefill's hidden states.

At each position, given the tokens before it: the prompt token's logprob, the top-k ids, the logprobs of
ids the caller names (target_prompt_logprobs), and independent draws (prompt_alt_tokens_k). Computed one
token chunk at a time, so no (P, V) logits are held for a long prompt. Position 0 has nothing before it
and is never scored; with `last_n`, prompt logprobs and top-k skip the positions before the last n (named
ids and draws cover every position, as the SDK says). Knows nothing of requests, caches or snapshots.
No HTTP, no SQL.

Shapes: P prompt tokens, R = P - 1 positions after the first, D hidden, V vocab, C tokens in one chunk,
K top-k width, T named ids per position, A draws per position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loraplex.engine.sampler.sampling import draw_alternatives
from loraplex.model.host_copy import to_device

# head_fn(hidden_CD) -> logits_CV, the output head with the request's adapter, over the whole vocabulary.
HeadFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class PromptAsks:
    """What to compute over one prompt; an output left at its default is not computed."""

    first: int = 1  # first position whose logprob and top-k are scored (≥ 1)
    want_logprobs: bool = False
    top_k: int = 0
    # (R, T) int64 on the host: row r names ids to score at position r + 1; -1 none.
    target_ids_RT: np.ndarray | None = None
    alt_uniforms_RA: Tensor | None = None  # (R, A) float64: one uniform per draw at position r + 1
    temperature: float = 1.0  # the draws'

    @property
    def is_empty(self) -> bool:
        """Whether nothing at all is asked."""
        is_drawing = self.alt_uniforms_RA is not None
        return not (self.want_logprobs or self.top_k or self.target_ids_RT is not None or is_drawing)

    def start(self, num_tokens: int) -> int:
        """The first position any asked output needs (num_tokens when none needs one): rows before the first
        that names an id are not scored, as the SDK says."""
        starts = [num_tokens]
        if self.want_logprobs or self.top_k:
            starts.append(self.first)
        if self.target_ids_RT is not None:
            (named_rows,) = (self.target_ids_RT >= 0).any(-1).nonzero()  # numpy: no device sync
            starts.append(1 + int(named_rows[0]) if len(named_rows) else num_tokens)
        if self.alt_uniforms_RA is not None:
            starts.append(1)
        return min(starts)


@dataclass
class PromptScores:
    """Per prompt position; unscored positions hold NaN logprobs and -1 ids."""

    logprobs_P: np.ndarray | None  # (P,) float32
    topk_ids_PK: np.ndarray | None  # (P, K) int32
    topk_logprobs_PK: np.ndarray | None  # (P, K) float32
    target_logprobs_RT: np.ndarray | None = None  # (R, T) float32; NaN where the id is -1
    alt_ids_RA: np.ndarray | None = None  # (R, A) int32
    alt_logprobs_RA: np.ndarray | None = None  # (R, A) float32


def score_prompt(
    hidden_PD: Tensor, prompt_P: Tensor, head_fn: HeadFn, asks: PromptAsks, chunk_size: int
) -> PromptScores:
    """Compute what `asks` asks of a prompt from its hidden states.

    Semantics: for t in [1, P), with lp_V = log_softmax(head_fn(hidden_PD[t - 1]).float()):
        for t ≥ first: logprobs[t] = lp_V[prompt[t]];  topk_ids[t], topk_logprobs[t] = lp_V.topk(top_k)
        target_logprobs[t - 1, j] = lp_V[target_ids[t - 1, j]], NaN where that id is -1
        alt_ids[t - 1], alt_logprobs[t - 1] = draw_alternatives(lp_V, temperature, alt_uniforms[t - 1])
    """
    num_tokens = prompt_P.shape[0]
    rows = max(num_tokens - 1, 0)
    logprobs_P = torch.full((num_tokens,), float("nan"))
    topk_ids_PK = torch.full((num_tokens, asks.top_k), -1, dtype=torch.int32)
    topk_logprobs_PK = torch.full((num_tokens, asks.top_k), float("nan"))
    targets = None if asks.target_ids_RT is None else to_device(asks.target_ids_RT, hidden_PD.device)
    target_logprobs_RT = torch.full((rows, 0 if targets is None else targets.shape[1]), float("nan"))
    draws = 0 if asks.alt_uniforms_RA is None else asks.alt_uniforms_RA.shape[1]
    alt_ids_RA = torch.zeros((rows, draws), dtype=torch.int32)
    alt_logprobs_RA = torch.zeros((rows, draws))
    for start in range(asks.start(num_tokens), num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        lp_CV = torch.log_softmax(head_fn(hidden_PD[start - 1 : end - 1]).float(), dim=-1)
        scored = max(start, asks.first)  # this chunk's first position whose logprob and top-k are asked
        if asks.want_logprobs and scored < end:
            lp_scored = lp_CV[scored - start :]
            logprobs_P[scored:end] = lp_scored.gather(-1, prompt_P[scored:end, None]).squeeze(1).cpu()
        if asks.top_k and scored < end:
            values_CK, ids_CK = lp_CV[scored - start :].topk(asks.top_k, dim=-1)
            topk_logprobs_PK[scored:end], topk_ids_PK[scored:end] = values_CK.cpu(), ids_CK.int().cpu()
        chunk_rows = slice(start - 1, end - 1)  # row r is position r + 1
        if targets is not None:
            ids_CT = targets[chunk_rows]
            values_CT = lp_CV.gather(-1, ids_CT.clamp(min=0)).masked_fill(ids_CT < 0, float("nan"))
            target_logprobs_RT[chunk_rows] = values_CT.cpu()
        if asks.alt_uniforms_RA is not None:
            ids_CA, values_CA = draw_alternatives(lp_CV, asks.temperature, asks.alt_uniforms_RA[chunk_rows])
            alt_ids_RA[chunk_rows], alt_logprobs_RA[chunk_rows] = ids_CA.int().cpu(), values_CA.cpu()
    return PromptScores(
        logprobs_P.numpy() if asks.want_logprobs else None,
        topk_ids_PK.numpy() if asks.top_k else None,
        topk_logprobs_PK.numpy() if asks.top_k else None,
        target_logprobs_RT.numpy() if targets is not None else None,
        alt_ids_RA.numpy() if asks.alt_uniforms_RA is not None else None,
        alt_logprobs_RA.numpy() if asks.alt_uniforms_RA is not None else None,
    )
