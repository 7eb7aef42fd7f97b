"""Training health of one pass request: what its loss inputs and the learner's logprobs say about its data.

For the server's own records (each run's metric history, /metrics), never for the client: the Tinker SDK
sees only the metrics hosted Tinker returns (losses.py). Every statistic is a reduction on the device over
the request's packed tokens, read back with its outputs in the pass's one copy (passes.py _to_results),
so it adds no host sync. docs/METRICS.md defines each one. Engine code: no HTTP, no SQL.

Shapes: T tokens of one request (its datums packed), K top-k width.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from loraplex.engine.losses import LossBatch

TRAINED_TOKENS = "train/tokens"
ADVANTAGE_MEAN, ADVANTAGE_STD = "rl/advantage_mean", "rl/advantage_std"
# tinker-cookbook's names and estimators (tinker_cookbook/rl/metrics.py compute_kl_sample_train), so a
# server chart reads like the cookbook's own log: v1 = mean(q − lp), v2 = ½·mean((q − lp)²).
KL_V1, KL_V2 = "rl/kl_sample_train_v1", "rl/kl_sample_train_v2"
LOGPROB_DIFF_MAX = "rl/logprob_abs_diff_max"
CLIPPED_TOKENS = "rl/clipped_tokens"


def _trained_mask(batch: LossBatch) -> Tensor:
    """Tokens whose loss can be non-zero (T,) bool: effective weight ≠ 0 (any of K for (T,K) weights),
    and for gspo also in its sequence-ratio mask M."""
    weights = batch.inputs["weights"]
    on_T = weights != 0 if weights.dim() == 1 else (weights != 0).any(-1)
    if "sequence_ratio_mask" in batch.inputs:
        on_T = on_T & (batch.inputs["sequence_ratio_mask"] != 0)
    return on_T


def health_stats(lp: Tensor, batch: LossBatch, metrics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The request's health statistics as detached fp32 0-D tensors; NaN where no token is trained.

    `lp` is the learner's logprobs (T,)|(T,K), `metrics` the loss's own (for the clip count). RL losses
    (inputs with `logprobs` and `advantages`) add the advantage and sampler/learner statistics.
    Semantics, with M the trained tokens and n = |M|: train/tokens = n; over M, advantage mean and
    population std; d = q − lp: kl_v1 = Σd/n, kl_v2 = ½Σd²/n, logprob_abs_diff_max = max|d|;
    clipped_tokens = clip_fraction:mean · n (the loss's own clip rule).
    """
    on_T = _trained_mask(batch)
    n = on_T.sum(dtype=torch.float32)
    stats = {TRAINED_TOKENS: n}
    if "logprobs" not in batch.inputs or "advantages" not in batch.inputs:
        return stats
    lp_T = lp.detach().float()

    def mean(value_T: Tensor) -> Tensor:
        return torch.where(on_T, value_T, 0.0).sum() / n  # 0/0 = NaN when nothing is trained

    a_T = batch.inputs["advantages"]
    a_mean = mean(a_T)
    diff_T = torch.where(on_T, batch.inputs["logprobs"] - lp_T, 0.0)
    stats[ADVANTAGE_MEAN] = a_mean
    stats[ADVANTAGE_STD] = mean((a_T - a_mean).square()).sqrt()
    stats[KL_V1] = mean(diff_T)
    stats[KL_V2] = 0.5 * mean(diff_T.square())
    stats[LOGPROB_DIFF_MAX] = torch.where(n > 0, diff_T.abs().max(), torch.nan)
    if "clip_fraction:mean" in metrics:
        # The fraction's own numerator: n_clipped / n · n, exact after rounding for n < 2^24.
        stats[CLIPPED_TOKENS] = torch.round(metrics["clip_fraction:mean"].float() * n)
    return stats
