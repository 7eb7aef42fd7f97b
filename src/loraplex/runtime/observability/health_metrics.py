"""Training and sampling health on /metrics: server-wide sums of what each run's history holds per request.

No label names a run, tenant or sampler (docs/METRICS.md, "Scraping"): the per-run series live in each run's
metric history, and /metrics keeps sums from which PromQL takes token-weighted means over any window, by
loss (`loss_fn`, one of the engine's few losses) and stop reason. Advantage statistics are per run by
nature, and kl_sample_train_v1's sum is signed (a counter only grows), so both stay in the history only.
No tensors, no HTTP, no SQL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from loraplex.engine.health import CLIPPED_TOKENS, KL_V2, LOGPROB_DIFF_MAX, TRAINED_TOKENS
from loraplex.engine.losses import LOSSES
from loraplex.runtime.core.sample_history import STOP_NAMES, TOKENS

# |q − lp| per request: from fp32 noise (~1e-6) through an off-policy batch (≥ 1).
LOGPROB_DIFF_BUCKETS = (1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class HealthMetrics:
    """The health counters of one telemetry registry; the engine thread records into them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        trained = Counter(
            "loraplex_trained_tokens",
            "Tokens trained by forward_backward requests (effective weight != 0), by loss.",
            ("loss_fn",),
            registry=registry,
        )
        clipped = Counter(
            "loraplex_rl_clipped_tokens",
            "Trained tokens whose ratio lay outside the clip bounds (ppo, cispo, gspo), by loss.",
            ("loss_fn",),
            registry=registry,
        )
        diff_sq = Counter(
            "loraplex_rl_logprob_diff_squared",
            "Sum over trained RL tokens of (q - lp)^2, q the sampler's logprob and lp the learner's; half "
            "of it over loraplex_trained_tokens_total of the same losses is kl_sample_train_v2.",
            ("loss_fn",),
            registry=registry,
        )
        # Every loss's series from the start, at 0 (a rate needs the zero), each where the loss has it.
        self._trained = {loss_fn: trained.labels(loss_fn) for loss_fn in LOSSES}
        self._clipped = {
            loss_fn: clipped.labels(loss_fn)
            for loss_fn, spec in LOSSES.items()
            if "clip_low_threshold" in spec.config
        }
        self._diff_sq = {loss_fn: diff_sq.labels(loss_fn) for loss_fn, spec in LOSSES.items() if spec.is_rl}
        self._diff_max = Histogram(
            "loraplex_rl_logprob_abs_diff_max",
            "Per RL forward_backward request, the largest |q - lp| over its trained tokens.",
            buckets=LOGPROB_DIFF_BUCKETS,
            registry=registry,
        )
        sequences = Counter(
            "loraplex_sampled_sequences",
            "Sampled sequences finished, by stop reason: stop (EOS, stop token or stop string), length "
            "(max_tokens).",
            ("stop_reason",),
            registry=registry,
        )
        self._sequences = {name: sequences.labels(reason) for reason, name in STOP_NAMES.items()}
        self._sampled_tokens = Counter(
            "loraplex_sampled_tokens",
            "Tokens of finished sampled sequences; over loraplex_sampled_sequences_total, their mean length.",
            registry=registry,
        )

    def record_training(self, loss_fn: str, health: Mapping[str, float]) -> None:
        """One forward_backward request's health (engine/health.py); non-finite values are left out."""
        n = health.get(TRAINED_TOKENS, 0.0)
        self._trained[loss_fn].inc(n)
        if CLIPPED_TOKENS in health:
            self._clipped[loss_fn].inc(health[CLIPPED_TOKENS])
        if math.isfinite(health.get(KL_V2, math.nan)):  # an RL loss, with tokens trained
            self._diff_sq[loss_fn].inc(2.0 * health[KL_V2] * n)
            self._diff_max.observe(health[LOGPROB_DIFF_MAX])

    def record_samples(self, metrics: Mapping[str, float]) -> None:
        """One finished sampling request's samples (sample_history.sample_metrics)."""
        for name, counter in self._sequences.items():
            counter.inc(metrics[name])
        self._sampled_tokens.inc(metrics[TOKENS])
