"""Drawing one token per sequence from its logits: temperature, top-k, top-p, one uniform per draw.

The distribution a token is drawn from: logits / temperature, softmaxed in fp32; then top-k (the k
likeliest ids, ties to the lower id), then top-p on the top-k distribution renormalised (the shortest
prefix, likeliest first, whose mass reaches p; at least one id); the kept ids renormalised.
A draw walks that distribution's cumulative sum in vocabulary order to the caller's uniform u ∈ [0, 1),
so a sequence's tokens depend only on its logits and its own generator, never on its batch neighbours.
Cumulative sums of probabilities are taken in fixed point (`_cumulative_probs`), so a draw is the same
on every device and kernel, the deterministic mode's included.

Logprob convention: a sampled token's logprob is under that renormalised truncated distribution, the
exact probability with which the token was drawn. RL losses use it as the behaviour policy q in the
ratio p/q, which is unbiased only with the true sampling probability; without truncation it is the
tempered full-vocabulary logprob. Greedy rows (temperature 0) take the argmax (the lowest id among
ties) and report its temperature-1 full-vocabulary logprob, the model's own probability of it.
`top_logprobs` (topk_sample_logprobs) reports the likeliest ids of that same distribution, so a sampled
token's logprob is its own entry there. `draw_alternatives` (prompt_alt_tokens_k) draws at the
temperature alone: the SDK describes those draws as taken "at the request's temperature, from the
model's next-token distribution", without top-k or top-p.
Knows nothing of requests, caches, snapshots or tokenizers. No HTTP, no SQL.

Shapes: B sequences of one step, M of them, V vocab, K top-k width, C prompt positions (R of them in
one block), A draws each.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from loraplex.engine.types import SamplingParams
from loraplex.model.host_copy import to_device

# Prompt positions whose alternatives are drawn at once: their float64 cumulative sums take what a decode
# step of the default batch (128 rows) takes.
_ALTERNATIVE_ROWS = 128


def draw_tokens(
    logits_BV: Tensor, params: Sequence[SamplingParams], uniforms_B: Tensor
) -> tuple[Tensor, Tensor]:
    """One token per row and its logprob, each row under its own params and uniform: (B,) int64, (B,) fp32.

    Semantics (`draw_token_reference` runs exactly this per row):
        for b in range(B):
            tokens[b], logprobs[b] = draw_token_reference(logits_BV[b], params[b], uniforms_B[b])

    How: one fp32 log_softmax over all rows; only rows that truncate are sorted (stably) to find their
    kept ids and are renormalised; then one float64 cumulative sum and one searchsorted for all rows.
    """
    logits_BV = logits_BV.float()
    is_greedy_B = to_device(np.array([p.temperature == 0 for p in params]), logits_BV.device)
    lp_BV = _sampling_logprobs(logits_BV, params)
    sampled_B = _walk_cdf(lp_BV, uniforms_B[:, None]).squeeze(1)
    tokens_B = torch.where(is_greedy_B, logits_BV.argmax(-1), sampled_B)
    return tokens_B, lp_BV.gather(-1, tokens_B[:, None]).squeeze(1)


def top_logprobs(logits_MV: Tensor, params: Sequence[SamplingParams], k: int) -> tuple[Tensor, Tensor]:
    """The k likeliest ids of each row's sampling distribution and their logprobs, likeliest first:
    (M, k) int64 and fp32. Ids the distribution leaves out (top-k / top-p) are -1 with NaN logprobs.

    Semantics: with lp_MV the log-distribution `draw_tokens` draws row m from (its logprob convention),
        logprobs[m], ids[m] = lp_MV[m].topk(k)
        ids[m, j], logprobs[m, j] = -1, NaN  where logprobs[m, j] = -inf
    """
    logprobs_MK, ids_MK = _sampling_logprobs(logits_MV.float(), params).topk(k, dim=-1)
    is_left_out_MK = logprobs_MK == float("-inf")
    return ids_MK.masked_fill(is_left_out_MK, -1), logprobs_MK.masked_fill(is_left_out_MK, float("nan"))


def draw_alternatives(logits_CV: Tensor, temperature: float, uniforms_CA: Tensor) -> tuple[Tensor, Tensor]:
    """A draws per row, with replacement, from softmax(logits / temperature) (no top-k or top-p), draw a at
    uniform a: (C, A) int64 ids and their fp32 logprobs under that distribution. Temperature 0 repeats the
    argmax with its temperature-1 logprob, as greedy sampling reports it. `logits_CV` may be logprobs.

    Semantics: for c, a: ids[c, a], logprobs[c, a] = draw_tokens(logits_CV[c : c + 1],
        [SamplingParams(temperature=temperature)], uniforms_CA[c, a : a + 1])
    How: the rows go in blocks of _ALTERNATIVE_ROWS, which bounds the float64 cumulative sums.
    """
    ids, logprobs = [], []
    for logits_RV, uniforms_RA in zip(
        logits_CV.float().split(_ALTERNATIVE_ROWS), uniforms_CA.split(_ALTERNATIVE_ROWS), strict=True
    ):
        lp_RV = torch.log_softmax(logits_RV / (temperature or 1.0), dim=-1)
        if temperature == 0:
            ids_RA = logits_RV.argmax(-1, keepdim=True).expand(-1, uniforms_RA.shape[1])
        else:
            ids_RA = _walk_cdf(lp_RV, uniforms_RA)
        ids.append(ids_RA)
        logprobs.append(lp_RV.gather(-1, ids_RA))
    return torch.cat(ids), torch.cat(logprobs)


def _sampling_logprobs(logits_BV: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """(B, V) fp32: the log-distribution each row's token is drawn from (the module docstring's), -inf at
    the ids a truncating row leaves out; greedy rows get the temperature-1 distribution."""
    vocab = logits_BV.shape[-1]
    device = logits_BV.device
    temperature_B1 = to_device(np.array([[p.temperature or 1.0] for p in params], dtype=np.float32), device)
    lp_BV = torch.log_softmax(logits_BV / temperature_B1, dim=-1)
    truncated = [b for b, p in enumerate(params) if p.temperature > 0 and _truncates(p, vocab)]
    if truncated:
        index = to_device(np.array(truncated, dtype=np.int64), device)
        top_k = to_device(np.array([_top_k(params[b], vocab) for b in truncated], dtype=np.int64), device)
        top_p = to_device(np.array([params[b].top_p for b in truncated], dtype=np.float32), device)
        lp_kept = lp_BV.index_select(0, index)
        is_kept = _kept_ids(lp_kept, top_k, top_p)
        lp_kept = torch.log_softmax(lp_kept.masked_fill(~is_kept, float("-inf")), dim=-1)
        lp_BV = lp_BV.index_copy(0, index, lp_kept)
    return lp_BV


def _walk_cdf(lp_BV: Tensor, uniforms_BA: Tensor) -> Tensor:
    """(B, A) ids: for each uniform u of a row, the first id, in vocabulary order, at which the row's
    cumulative probability passes u × its total mass (float64)."""
    vocab = lp_BV.shape[-1]
    probs_BV = lp_BV.double().exp()
    cdf_BV = _cumulative_probs(probs_BV)
    targets_BA = to_device(uniforms_BA, lp_BV.device).to(torch.float64) * cdf_BV[:, -1:]
    sampled_BA = torch.searchsorted(cdf_BV, targets_BA, right=True)
    # Rounding can put the target at the total mass: fall back to the last id that has any.
    last_kept_B1 = vocab - 1 - (probs_BV > 0).flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(sampled_BA, last_kept_B1)


# Probabilities as integer multiples of 2⁻⁶²: an integer prefix sum is exact, hence the same in any
# summation order, where a floating-point one on a GPU is not (its scan kernels order the adds by timing;
# torch refuses them under deterministic algorithms). A probability and a row's total are at most 1 plus
# rounding, far inside int64; 2⁻⁶² resolves finer than float64 does near 1.
_FIXED_POINT_ONE = 2.0**62


def _cumulative_probs(probs_BV: Tensor) -> Tensor:
    """(B, V) float64 cumulative sums of each row's probabilities, the same on every device and kernel."""
    fixed_BV = torch.round(probs_BV.double() * _FIXED_POINT_ONE).to(torch.int64)
    return fixed_BV.cumsum(-1).double() / _FIXED_POINT_ONE


def draw_token_reference(logits_V: Tensor, params: SamplingParams, uniform: float) -> tuple[int, float]:
    """Plain per-row reference that `draw_tokens` must equal; for tests only (slow)."""
    logits_V = logits_V.float()
    if params.temperature == 0:
        token = int(logits_V.argmax())
        return token, float(torch.log_softmax(logits_V, -1)[token])
    lp_V = torch.log_softmax(logits_V / params.temperature, -1)
    order = sorted(range(len(lp_V)), key=lambda i: -float(lp_V[i]))[: _top_k(params, len(lp_V))]
    top_k_mass = sum(float(lp_V[i].exp()) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= params.top_p:
            break
        kept.append(i)
        mass += float(lp_V[i].exp()) / top_k_mass
    kept_lp = torch.log_softmax(lp_V[kept], -1)
    probs = {token: float(lp.exp()) for token, lp in zip(kept, kept_lp, strict=True)}
    total = sum(probs.values())
    cumulative = 0.0
    for token in sorted(probs):
        cumulative += probs[token]
        if cumulative > uniform * total:
            return token, float(kept_lp[kept.index(token)])
    return max(probs), float(kept_lp[kept.index(max(probs))])


def _top_k(params: SamplingParams, vocab: int) -> int:
    return vocab if params.top_k == -1 else min(params.top_k, vocab)


def _truncates(params: SamplingParams, vocab: int) -> bool:
    return _top_k(params, vocab) < vocab or params.top_p < 1.0


def _kept_ids(lp_MV: Tensor, top_k_M: Tensor, top_p_M: Tensor) -> Tensor:
    """(M, V) bool: the top-k ids of each row, then the top-p prefix of their renormalised distribution."""
    sorted_lp_MV, order_MV = lp_MV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(lp_MV.shape[-1], device=lp_MV.device)
    in_top_k_MV = rank_V[None, :] < top_k_M[:, None]
    probs_MV = torch.softmax(sorted_lp_MV.masked_fill(~in_top_k_MV, float("-inf")), dim=-1)
    mass_before_MV = _cumulative_probs(probs_MV) - probs_MV
    # The likeliest id has 0 mass before it, so some id is kept for any top_p > 0.
    is_kept_sorted_MV = in_top_k_MV & (mass_before_MV < top_p_M[:, None])
    return torch.zeros_like(is_kept_sorted_MV).scatter_(-1, order_MV, is_kept_sorted_MV)
