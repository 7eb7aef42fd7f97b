"""Training health statistics of a pass request (engine/health.py): exact values on designed data.

The learner's own logprobs come from a `forward` of the same datums first (a pass is bit-reproducible:
tests/engine/test_passes.py), so sampler logprobs q can be set to exactly the learner's, or to the learner's
plus a known δ. δ is dyadic, positive and below |lp|, so q = lp + δ and q − lp = δ are exact in fp32; the
only rounding left in the statistics is the final division by the token count (one fp32 rounding, a
relative 2⁻²⁴). Expected values are computed here from the formulas of docs/METRICS.md in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from loraplex.engine.local import LocalEngine
from loraplex.engine.types import DatumInput, LoraConfig, PassRequest, PassResult

FP32_DIVISION = 2.0**-24  # the relative rounding of the one fp32 division each mean ends with
LENGTHS = (9, 6)
PROMPT = 2  # the first PROMPT positions of each datum are prompt: q = 0, A = 0, outside the RL mask
RL_KEYS = {
    "train/tokens",
    "rl/advantage_mean",
    "rl/advantage_std",
    "rl/kl_sample_train_v1",
    "rl/kl_sample_train_v2",
    "rl/logprob_abs_diff_max",
}


@pytest.fixture(scope="module")
def slot(engine: LocalEngine) -> int:
    return engine.create_slot(LoraConfig(rank=4, seed=3))


def _tokens(rng: np.random.Generator, engine: LocalEngine) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, targets) per datum, random ids of the tiny model's vocabulary."""
    vocab = engine.info.vocab_size
    return [(rng.integers(0, vocab, n), rng.integers(0, vocab, n)) for n in LENGTHS]


def _ok(result: object) -> PassResult:
    assert isinstance(result, PassResult), result
    return result


def _learner_logprobs(engine: LocalEngine, slot: int, data: list[tuple[np.ndarray, np.ndarray]]) -> list:
    datums = [DatumInput(tokens, {"target_tokens": targets}) for tokens, targets in data]
    (result,) = engine.run_pass([PassRequest(slot, "cross_entropy", {}, datums, forward_only=True)])
    return [out["logprobs"].astype(np.float32) for out in _ok(result).outputs]


def _rl_request(
    slot: int,
    loss_fn: str,
    data: list[tuple[np.ndarray, np.ndarray]],
    q: list[np.ndarray],
    advantages: list[np.ndarray],
    config: dict[str, float] | None = None,
) -> PassRequest:
    """An RL request whose prompt positions carry q = 0 and A = 0."""
    datums = []
    for (tokens, targets), q_N, a_N in zip(data, q, advantages, strict=True):
        q_N, a_N = q_N.astype(np.float32).copy(), a_N.astype(np.float32).copy()
        q_N[:PROMPT] = 0.0
        a_N[:PROMPT] = 0.0
        inputs = {"target_tokens": targets, "logprobs": q_N, "advantages": a_N}
        datums.append(DatumInput(tokens, inputs))
    return PassRequest(slot, loss_fn, config or {}, datums, forward_only=False)


def _actions(values: list[np.ndarray]) -> np.ndarray:
    """The action (non-prompt) positions of every datum, concatenated, in float64."""
    return np.concatenate([v[PROMPT:] for v in values]).astype(np.float64)


def test_sampler_logprobs_equal_to_the_learners_give_zero_kl_and_zero_max_difference(
    engine: LocalEngine, slot: int
) -> None:
    rng = np.random.default_rng(1)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    advantages = [rng.normal(size=n) for n in LENGTHS]
    (result,) = engine.run_pass([_rl_request(slot, "importance_sampling", data, lp, advantages)])
    health = _ok(result).health
    assert set(health) == RL_KEYS
    assert health["train/tokens"] == sum(LENGTHS) - PROMPT * len(LENGTHS)
    assert health["rl/kl_sample_train_v1"] == 0.0
    assert health["rl/kl_sample_train_v2"] == 0.0
    assert health["rl/logprob_abs_diff_max"] == 0.0


def test_a_known_shift_of_the_sampler_logprobs_gives_its_analytic_kl_and_max_difference(
    engine: LocalEngine, slot: int
) -> None:
    rng = np.random.default_rng(2)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    # Dyadic shifts below every |lp| (asserted), so lp + δ and (lp + δ) − lp are exact in fp32.
    shifts = [np.resize(np.array([0.5, 0.25, 0.125, 1.0, 0.75], np.float32), n) for n in LENGTHS]
    assert min(-_actions(lp)) > 1.0, "the shifts must stay below |lp| for exact fp32 arithmetic"
    q = [lp_N + d_N for lp_N, d_N in zip(lp, shifts, strict=True)]
    advantages = [np.ones(n) for n in LENGTHS]
    (result,) = engine.run_pass([_rl_request(slot, "importance_sampling", data, q, advantages)])
    health = _ok(result).health
    d = _actions(shifts)  # the sampler minus learner difference, exactly δ
    assert health["rl/kl_sample_train_v1"] == pytest.approx(d.mean(), rel=FP32_DIVISION)
    assert health["rl/kl_sample_train_v2"] == pytest.approx(0.5 * (d**2).mean(), rel=FP32_DIVISION)
    assert health["rl/logprob_abs_diff_max"] == 1.0


def test_advantage_mean_and_std_are_over_the_trained_tokens_only(engine: LocalEngine, slot: int) -> None:
    rng = np.random.default_rng(3)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    advantages = [
        np.array([0, 0, 1.0, -1.0, 2.0, 0.0, 0.5, 3.0, -2.0]),
        np.array([0, 0, 4.0, 1.0, -0.5, 1.5]),
    ]
    request = _rl_request(slot, "importance_sampling", data, lp, advantages)
    # A weight of 0 takes a position out; A = 0 with q ≠ 0 (position 5 of datum 0) stays in.
    weights = np.ones(LENGTHS[1], np.float32)
    weights[3] = 0.0
    request.datums[1].loss_fn_inputs["weights"] = weights
    (result,) = engine.run_pass([request])
    health = _ok(result).health
    trained = np.array([1.0, -1.0, 2.0, 0.0, 0.5, 3.0, -2.0, 4.0, -0.5, 1.5])
    assert health["train/tokens"] == len(trained)
    assert health["rl/advantage_mean"] == pytest.approx(trained.mean(), rel=1e-6)
    assert health["rl/advantage_std"] == pytest.approx(trained.std(), rel=1e-6)


@pytest.mark.parametrize(
    ("loss_fn", "config", "expected_clipped"),
    [
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 6),  # 0.5, 5.0, 0.7, 1.3 out
        ("cispo", {}, 2),  # defaults (0, 4): only 5.0 out
    ],
)
def test_the_clipped_token_count_follows_the_losses_own_clip_rule(
    engine: LocalEngine, slot: int, loss_fn: str, config: dict[str, float], expected_clipped: int
) -> None:
    rng = np.random.default_rng(4)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    # Designed ratios r = exp(lp − q), every one at least 0.1 from a bound.
    ratios = [np.array([1, 1, 0.5, 1.0, 5.0, 0.7, 1.1, 0.9, 1.3]), np.array([1, 1, 0.5, 5.0, 1.0, 1.05])]
    q = [(lp_N - np.log(r_N)).astype(np.float32) for lp_N, r_N in zip(lp, ratios, strict=True)]
    advantages = [np.ones(n) for n in LENGTHS]
    (result,) = engine.run_pass([_rl_request(slot, loss_fn, data, q, advantages, config)])
    result = _ok(result)
    n = sum(LENGTHS) - PROMPT * len(LENGTHS)
    assert result.health["rl/clipped_tokens"] == expected_clipped
    assert set(result.metrics) == {"loss:sum", "clip_fraction:mean"}  # the client's metrics, unchanged
    assert result.metrics["clip_fraction:mean"] == pytest.approx(expected_clipped / n, rel=1e-6)


def test_trained_tokens_count_nonzero_weights_and_only_them(engine: LocalEngine, slot: int) -> None:
    rng = np.random.default_rng(5)
    (tokens, targets), (tokens_k, _) = _tokens(rng, engine)
    weights = np.array([0, 0, 1, 2, -1, 0, 0.5, 0, 0], np.float32)
    top_k = rng.integers(0, engine.info.vocab_size, (len(tokens_k), 3))
    weights_k = np.zeros((len(tokens_k), 3), np.float32)
    weights_k[1, 2] = 1.0  # one of K non-zero counts its position once
    weights_k[4] = [0.5, 0.5, 0.0]
    datums = [
        DatumInput(tokens, {"target_tokens": targets, "weights": weights}),
    ]
    wide = [DatumInput(tokens_k, {"target_tokens": top_k, "weights": weights_k})]
    narrow_result, wide_result = engine.run_pass(
        [
            PassRequest(slot, "cross_entropy", {}, datums, forward_only=False),
            PassRequest(slot, "cross_entropy", {}, wide, forward_only=True),
        ]
    )
    assert _ok(narrow_result).health == {"train/tokens": 4.0}
    assert _ok(wide_result).health == {"train/tokens": 2.0}
    assert set(_ok(narrow_result).metrics) == {"loss:sum"}


def test_gspo_trains_only_the_tokens_of_its_sequence_ratio_mask(engine: LocalEngine, slot: int) -> None:
    rng = np.random.default_rng(6)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    request = _rl_request(slot, "gspo", data, lp, [np.ones(n) for n in LENGTHS])
    mask = np.ones(LENGTHS[0], np.float32)
    mask[:PROMPT] = 0.0  # prompt positions in M would enter the sequence ratio with q = 0
    mask[-3:] = 0.0
    request.datums[0].loss_fn_inputs["sequence_ratio_mask"] = mask
    (result,) = engine.run_pass([request])
    health = _ok(result).health
    assert health["train/tokens"] == sum(LENGTHS) - PROMPT * len(LENGTHS) - 3
    assert health["rl/clipped_tokens"] == 0.0  # q = lp: every ratio is 1
    assert health["rl/logprob_abs_diff_max"] == 0.0


def test_an_rl_request_with_nothing_trained_has_no_rl_statistics(engine: LocalEngine, slot: int) -> None:
    rng = np.random.default_rng(7)
    data = _tokens(rng, engine)
    zeros = [np.zeros(n) for n in LENGTHS]
    (result,) = engine.run_pass([_rl_request(slot, "ppo", data, zeros, zeros)])
    health = _ok(result).health
    assert health["train/tokens"] == 0.0
    assert health["rl/clipped_tokens"] == 0.0
    others = [health[key] for key in RL_KEYS - {"train/tokens"}]
    assert all(math.isnan(value) for value in others), health


def test_a_request_split_by_the_token_budget_has_the_health_of_the_whole_pass(
    engine: LocalEngine, slot: int
) -> None:
    rng = np.random.default_rng(8)
    data = _tokens(rng, engine)
    lp = _learner_logprobs(engine, slot, data)
    q = [lp_N + rng.uniform(0.0, 0.5, lp_N.shape).astype(np.float32) for lp_N in lp]
    request = _rl_request(slot, "ppo", data, q, [rng.normal(size=n) for n in LENGTHS])
    (whole,) = engine.run_pass([request])
    engine.max_pass_tokens = LENGTHS[0]  # one datum per pass
    try:
        (split,) = engine.run_pass([request])
    finally:
        engine.max_pass_tokens = None
    assert set(_ok(split).health) == set(_ok(whole).health) == RL_KEYS | {"rl/clipped_tokens"}
    for key, value in _ok(whole).health.items():
        assert _ok(split).health[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
