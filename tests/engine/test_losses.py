"""The loss registry against docs/LOSSES.md: golden values, an independent per-token reference, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from loraplex.engine.losses import (
    LOSSES,
    compute_loss,
    pack_loss_inputs,
    resolve_loss_config,
    validate_datum_inputs,
    validate_loss_request,
)
from loraplex.engine.types import DatumInput, PassRequest
from loraplex.errors import UserError
from tests.model.rounding import U, assert_at_most, assert_within_rounding, sums_bound

VOCAB = 50
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
Inputs = dict[str, np.ndarray]


# A per-token loss in fp32 rounds each input (U), each of its few arithmetic results (U) and its exp or
# log (within one ulp, 2U): under 16 roundings of U for any loss here, so 32U relative to the terms it
# combines (logprobs, weights, advantages and ratios of at most 4 here) bounds it with room to spare.
FORMULA_TOLERANCE = 32 * U
TERM_SCALE = 4.0


def _run(loss_fn: str, lp: torch.Tensor, datums: list[Inputs], config: dict | None = None):
    """Per-token loss, metrics and ∂(Σℓ)/∂lp of one request, through the engine's calls (in lp's dtype,
    float64 for the exact twin of a run)."""
    resolved = resolve_loss_config(loss_fn, config)
    for index, inputs in enumerate(datums):
        validate_datum_inputs(loss_fn, index, len(inputs["target_tokens"]), inputs, VOCAB, resolved)
    lp = lp.detach().clone().requires_grad_(True)
    loss_T, metrics = compute_loss(loss_fn, lp, pack_loss_inputs(loss_fn, resolved, datums), resolved)
    loss_T.sum().backward()
    return loss_T.detach(), metrics, lp.grad


# --- golden values of docs/LOSSES.md, as literals ---------------------------------------------------------

LN = math.log
GOLDEN_LP = [LN(1 / 4), LN(1 / 2)]
GOLDEN_CE = {"target_tokens": np.array([3, 7]), "weights": np.array([2.0, -0.5], np.float32)}
GOLDEN_RL = {
    "target_tokens": np.array([3, 7]),
    "advantages": np.array([-1.0, 2.0], np.float32),
    "logprobs": np.array([LN(1 / 2), LN(1 / 4)], np.float32),
}
GOLDEN_CLIP = {"clip_low_threshold": 0.75, "clip_high_threshold": 1.5}


@pytest.mark.parametrize(
    ("loss_fn", "inputs", "config", "loss", "grad"),
    [
        ("cross_entropy", GOLDEN_CE, {}, -2 * LN(1 / 4) + 0.5 * LN(1 / 2), [-2.0, 0.5]),
        ("importance_sampling", GOLDEN_RL, {}, -3.5, [0.5, -4.0]),
        ("ppo", GOLDEN_RL, GOLDEN_CLIP, -2.25, [0.0, 0.0]),
        ("cispo", GOLDEN_RL, GOLDEN_CLIP, 0.75 * LN(1 / 4) - 3 * LN(1 / 2), [0.75, -3.0]),
        ("dro", GOLDEN_RL, {"beta": 0.3}, 0.3 * LN(2) ** 2, [1 - 0.3 * LN(2), -2 + 0.3 * LN(2)]),
    ],
)
def test_golden_values_of_losses_md(
    loss_fn: str, inputs: Inputs, config: dict, loss: float, grad: list
) -> None:
    loss_T, metrics, grad_T = _run(loss_fn, torch.tensor(GOLDEN_LP), [inputs], config)
    tolerance = {"rel": FORMULA_TOLERANCE, "abs": FORMULA_TOLERANCE * TERM_SCALE}
    assert metrics["loss:sum"].item() == pytest.approx(loss, **tolerance)
    assert loss_T.sum().item() == pytest.approx(loss, **tolerance)
    assert grad_T.tolist() == pytest.approx(grad, **tolerance)


# --- an independent reference: per datum, per token, straight from the formulas ----------------------


def _reference(loss_fn: str, lp_N: torch.Tensor, inputs: Inputs, config: dict) -> list[torch.Tensor]:
    """ℓ_t for one datum, written token by token from docs/LOSSES.md (Python min/max, no masking tricks)."""
    n = len(inputs["target_tokens"])
    w = inputs.get("weights", np.ones(np.shape(inputs["target_tokens"])))
    if loss_fn == "cross_entropy":
        return [-(torch.tensor(w[t], dtype=torch.float64) * lp_N[t]).sum() for t in range(n)]
    q, a = inputs["logprobs"].astype(float), inputs["advantages"].astype(float)
    lo = inputs.get("clip_low_threshold", np.full(n, config.get("clip_low_threshold", 0.0)))
    hi = inputs.get("clip_high_threshold", np.full(n, config.get("clip_high_threshold", 0.0)))
    counts = [(a[t] != 0 or q[t] != 0) and w[t] != 0 for t in range(n)]
    zero = lp_N.sum() * 0

    def clipped(r: torch.Tensor, t: int) -> torch.Tensor:
        return -min(r * a[t], min(max(r, lo[t]), hi[t]) * a[t])

    if loss_fn == "gspo":
        srm = inputs.get("sequence_ratio_mask")
        m = [t for t in range(n) if (srm[t] != 0 if srm is not None else counts[t])]
        s = math.exp(sum(lp_N[t].item() - q[t] for t in m) / len(m)) if m else 1.0
        return [
            w[t] * clipped(s * torch.exp(lp_N[t] - lp_N[t].detach()), t) if t in m and counts[t] else zero
            for t in range(n)
        ]
    out = []
    for t in range(n):
        if not counts[t]:
            out.append(zero)
            continue
        r = torch.exp(lp_N[t] - q[t])
        if loss_fn == "importance_sampling":
            value = -r * a[t]
        elif loss_fn == "ppo":
            value = clipped(r, t)
        elif loss_fn == "cispo":
            value = -min(max(r.item(), lo[t]), hi[t]) * a[t] * lp_N[t]
        else:
            value = -(a[t] * lp_N[t] - config["beta"] / 2 * (lp_N[t] - q[t]) ** 2)
        out.append(w[t] * value)
    return out


def _reference_run(
    loss_fn: str,
    lp: torch.Tensor,
    datums: list[Inputs],
    config: dict | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Per-token loss and ∂(Σℓ)/∂lp from the reference, with lp in `dtype` (float64: the exact values;
    fp32: a run whose distance to them is this formula's rounding on this data)."""
    resolved = resolve_loss_config(loss_fn, config)
    lp_ = lp.detach().to(dtype).requires_grad_(True)
    per_token, start = [], 0
    for inputs in datums:
        n = len(inputs["target_tokens"])
        per_token += _reference(loss_fn, lp_[start : start + n], inputs, resolved)
        start += n
    loss_T = torch.stack([torch.as_tensor(v).to(dtype) for v in per_token])
    loss_T.sum().backward()
    return loss_T.detach(), lp_.grad


def _assert_equals_reference(loss_fn: str, lp: torch.Tensor, datums: list[Inputs], config: dict) -> None:
    """The engine's per-token loss and gradient within rounding of the reference's (its fp32 run against
    its float64 one), and loss:sum within the rounding of summing them."""
    loss_T, metrics, grad_T = _run(loss_fn, lp, datums, config)
    (ref_loss_T, ref_grad_T), (exact_loss_T, exact_grad_T) = (
        _reference_run(loss_fn, lp, datums, config, dtype) for dtype in (torch.float32, torch.float64)
    )
    assert_within_rounding(loss_T, ref_loss_T, exact_loss_T, "loss")
    assert_within_rounding(grad_T, ref_grad_T, exact_grad_T, "grad")
    assert_at_most(
        abs(metrics["loss:sum"].item() - exact_loss_T.sum().item()),
        sums_bound(loss_T, exact_loss_T),
        "loss:sum",
    )


def _rl_datum(
    rng: np.random.Generator, n_prompt: int, log_ratio: np.ndarray, lp_N: np.ndarray, **extra
) -> Inputs:
    """An RL datum: prompt positions with q = A = 0, completion positions with q = lp − log_ratio."""
    n = n_prompt + len(log_ratio)
    q = np.zeros(n, np.float32)
    q[n_prompt:] = lp_N[n_prompt:] - log_ratio
    a = np.zeros(n, np.float32)
    a[n_prompt:] = rng.choice([-1.0, 1.0], len(log_ratio)) * rng.uniform(0.2, 2.0, len(log_ratio))
    return {"target_tokens": rng.integers(0, VOCAB, n), "logprobs": q, "advantages": a, **extra}


def _random_request(loss_fn: str, seed: int) -> tuple[torch.Tensor, list[Inputs]]:
    """Four datums of different lengths; optional keys sent by some datums only; random ratios."""
    rng = np.random.default_rng(seed)
    lengths, n_prompts = (7, 12, 1, 18), (3, 4, 0, 5)
    lp = -rng.uniform(0.05, 5.0, sum(lengths)).astype(np.float32)
    if loss_fn == "cross_entropy":
        datums = [{"target_tokens": rng.integers(0, VOCAB, n)} for n in lengths]
        for inputs in datums[1:]:
            inputs["weights"] = rng.normal(size=len(inputs["target_tokens"])).astype(np.float32)
        datums[2]["weights"][:] = 0
        return torch.tensor(lp), datums
    datums, start = [], 0
    for index, (n, n_prompt) in enumerate(zip(lengths, n_prompts, strict=True)):
        extra: Inputs = {}
        if index == 1:
            extra["weights"] = rng.uniform(0, 2, n).astype(np.float32) * (rng.random(n) > 0.3)
        if index == 3 and loss_fn in ("ppo", "cispo", "gspo"):
            extra["clip_low_threshold"] = rng.uniform(0.3, 0.9, n).astype(np.float32)
            extra["clip_high_threshold"] = rng.uniform(1.1, 3.0, n).astype(np.float32)
        if index == 3 and loss_fn == "gspo":
            extra["sequence_ratio_mask"] = (rng.random(n) > 0.4).astype(np.float32)
        log_ratio = rng.uniform(-2.0, 2.0, n - n_prompt)
        datums.append(_rl_datum(rng, n_prompt, log_ratio, lp[start : start + n], **extra))
        start += n
    return torch.tensor(lp), datums


CONFIGS = {
    "cross_entropy": [{}],
    "importance_sampling": [{}],
    "ppo": [{}, {"clip_low_threshold": 0.6, "clip_high_threshold": 2.0}],
    "cispo": [{}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}],
    "dro": [{}, {"beta": 0.7}],
    "gspo": [{}, {"clip_low_threshold": 0.6, "clip_high_threshold": 2.0}],
}
CASES = [(loss_fn, config) for loss_fn in LOSSES for config in CONFIGS[loss_fn]]


def test_the_reference_covers_every_registered_loss() -> None:
    assert set(CONFIGS) == set(LOSSES)


@pytest.mark.parametrize(("loss_fn", "config"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_loss_equals_the_per_token_reference_on_random_datums(
    loss_fn: str, config: dict, seed: int
) -> None:
    lp, datums = _random_request(loss_fn, seed)
    _assert_equals_reference(loss_fn, lp, datums, config)


@pytest.mark.parametrize(("loss_fn", "config"), [c for c in CASES if c[0] in RL_LOSSES])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ratios_half_one_and_five_cross_both_clip_edges_with_either_advantage_sign(
    loss_fn: str, config: dict, sign: float
) -> None:
    rng = np.random.default_rng(3)
    datums, lps = [], []
    for ratio in (0.5, 1.0, 5.0):
        lp_N = -rng.uniform(0.1, 3.0, 5).astype(np.float32)
        inputs = _rl_datum(rng, 1, np.full(4, math.log(ratio)), lp_N)
        inputs["advantages"] = np.abs(inputs["advantages"]) * np.float32(sign)
        datums.append(inputs)
        lps.append(lp_N)
    lp = torch.tensor(np.concatenate(lps))
    _assert_equals_reference(loss_fn, lp, datums, config)


@pytest.mark.parametrize(
    ("ratio", "advantage", "has_gradient"),
    [(5.0, 1.0, False), (5.0, -1.0, True), (0.5, 1.0, True), (0.5, -1.0, False), (1.0, 1.0, True)],
)
def test_ppo_gradient_vanishes_exactly_where_the_clip_binds(
    ratio: float, advantage: float, has_gradient: bool
) -> None:
    lp = torch.tensor([-1.0])
    inputs = {
        "target_tokens": np.array([0]),
        "logprobs": np.array([-1.0 - math.log(ratio)], np.float32),
        "advantages": np.array([advantage], np.float32),
    }
    loss_T, metrics, grad_T = _run("ppo", lp, [inputs])
    clipped_ratio = min(max(ratio, 0.8), 1.2)
    tolerance = {"rel": FORMULA_TOLERANCE, "abs": FORMULA_TOLERANCE * TERM_SCALE}
    assert loss_T.item() == pytest.approx(-min(ratio * advantage, clipped_ratio * advantage), **tolerance)
    assert grad_T.item() == (pytest.approx(-ratio * advantage, **tolerance) if has_gradient else 0.0)
    assert metrics["clip_fraction:mean"].item() == (0.0 if ratio == 1.0 else 1.0)


# --- zero rows, masking and additivity -----------------------------------------------------------------


def _zero_datum(loss_fn: str, n: int) -> Inputs:
    """A datum that must count for nothing: zero weights, or an RL mask that is off everywhere."""
    targets = np.arange(n) % VOCAB
    if loss_fn == "cross_entropy":
        return {"target_tokens": targets, "weights": np.zeros(n, np.float32)}
    return {
        "target_tokens": targets,
        "logprobs": np.zeros(n, np.float32),
        "advantages": np.zeros(n, np.float32),
    }


def _overflowing_datum(n: int) -> Inputs:
    """Weights 0 on tokens whose ratio exp(lp − q) overflows fp32: must stay 0, never NaN."""
    return {
        "target_tokens": np.arange(n),
        "logprobs": np.full(n, -500.0, np.float32),
        "advantages": np.full(n, 3.0, np.float32),
        "weights": np.zeros(n, np.float32),
    }


@pytest.mark.parametrize("loss_fn", list(LOSSES))
def test_a_zero_mask_datum_adds_exactly_zero_loss_and_gradient(loss_fn: str) -> None:
    lp, datums = _random_request(loss_fn, 5)
    n_first = len(datums[0]["target_tokens"])
    alone_T, _, alone_grad_T = _run(loss_fn, lp[:n_first], datums[:1])
    exact_T, _, exact_grad_T = _run(loss_fn, lp[:n_first].double(), datums[:1])
    zeros = [_zero_datum(loss_fn, 6)] + ([_overflowing_datum(4)] if loss_fn in RL_LOSSES else [])
    n_zero = sum(len(d["target_tokens"]) for d in zeros)
    lp_zero = torch.cat([lp[:n_first], -torch.rand(n_zero) * 3])
    loss_T, metrics, grad_T = _run(loss_fn, lp_zero, [datums[0], *zeros])
    assert torch.equal(loss_T[n_first:], torch.zeros(n_zero))
    assert torch.equal(grad_T[n_first:], torch.zeros(n_zero))
    assert_within_rounding(loss_T[:n_first], alone_T, exact_T, "loss")
    assert_within_rounding(grad_T[:n_first], alone_grad_T, exact_grad_T, "grad")
    assert_at_most(
        abs(metrics["loss:sum"].item() - alone_T.sum().item()), sums_bound(loss_T, alone_T), "loss:sum"
    )


@pytest.mark.parametrize("loss_fn", list(LOSSES))
def test_per_datum_elementwise_losses_sum_to_the_loss_of_that_datum_sent_alone(loss_fn: str) -> None:
    lp, datums = _random_request(loss_fn, 7)
    loss_T, metrics, grad_T = _run(loss_fn, lp, datums)
    start = 0
    for inputs in datums:
        n = len(inputs["target_tokens"])
        alone_T, alone_metrics, alone_grad_T = _run(loss_fn, lp[start : start + n], [inputs])
        _, _, exact_grad_T = _run(loss_fn, lp[start : start + n].double(), [inputs])
        error = abs(loss_T[start : start + n].sum().item() - alone_metrics["loss:sum"].item())
        assert_at_most(error, sums_bound(loss_T[start : start + n], alone_T), "datum loss sum")
        assert_within_rounding(grad_T[start : start + n], alone_grad_T, exact_grad_T, "grad")
        start += n
    error = abs(metrics["loss:sum"].item() - loss_T.sum().item())
    assert_at_most(error, sums_bound(loss_T, loss_T), "loss:sum")


def test_cross_entropy_takes_top_k_targets_and_sums_over_k() -> None:
    rng = np.random.default_rng(0)
    targets, weights = rng.integers(0, VOCAB, (5, 3)), rng.normal(size=(5, 3)).astype(np.float32)
    lp = -torch.rand(5, 3) * 4
    loss_T, _, grad_T = _run("cross_entropy", lp, [{"target_tokens": targets, "weights": weights}])
    want, exact = (
        -(torch.tensor(weights).to(dtype) * lp.to(dtype)).sum(-1) for dtype in (lp.dtype, torch.float64)
    )
    assert_within_rounding(loss_T, want, exact, "loss")
    assert torch.equal(grad_T, -torch.tensor(weights))  # ∂/∂lp of a weighted sum: -w, no rounding


def test_cross_entropy_weights_default_to_ones() -> None:
    lp = torch.tensor([-0.5, -2.0, -1.25])
    loss_T, _, grad_T = _run("cross_entropy", lp, [{"target_tokens": np.array([1, 2, 3])}])
    assert loss_T.tolist() == [0.5, 2.0, 1.25]
    assert grad_T.tolist() == [-1.0, -1.0, -1.0]


def test_per_token_clip_thresholds_override_the_config() -> None:
    rng = np.random.default_rng(2)
    lp_N = -rng.uniform(0.1, 3.0, 8).astype(np.float32)
    inputs = _rl_datum(rng, 2, rng.uniform(-2, 2, 6), lp_N)
    per_token = {
        **inputs,
        "clip_low_threshold": np.full(8, 0.5, np.float32),
        "clip_high_threshold": np.full(8, 1.7, np.float32),
    }
    by_config = _run(
        "ppo", torch.tensor(lp_N), [inputs], {"clip_low_threshold": 0.5, "clip_high_threshold": 1.7}
    )
    by_token = _run("ppo", torch.tensor(lp_N), [per_token])
    assert torch.equal(by_token[0], by_config[0])  # the same thresholds, the same ops: the same bits
    assert torch.equal(by_token[2], by_config[2])


def test_gspo_sequence_ratio_mask_defaults_to_the_rl_mask() -> None:
    rng = np.random.default_rng(4)
    lp_N = -rng.uniform(0.1, 3.0, 9).astype(np.float32)
    inputs = _rl_datum(rng, 3, rng.uniform(-1, 1, 6), lp_N)
    explicit = {**inputs, "sequence_ratio_mask": np.array([0, 0, 0, 1, 1, 1, 1, 1, 1], np.float32)}
    implicit_loss_T, _, implicit_grad_T = _run("gspo", torch.tensor(lp_N), [inputs])
    explicit_loss_T, _, explicit_grad_T = _run("gspo", torch.tensor(lp_N), [explicit])
    assert torch.equal(implicit_loss_T, explicit_loss_T)  # the same mask, the same ops: the same bits
    assert torch.equal(implicit_grad_T, explicit_grad_T)


def test_forward_without_grad_gives_the_same_loss_and_metrics() -> None:
    lp, datums = _random_request("ppo", 9)
    config = resolve_loss_config("ppo", {})
    batch = pack_loss_inputs("ppo", config, datums)
    with torch.no_grad():
        loss_T, metrics = compute_loss("ppo", lp, batch, config)
    grad_loss_T, grad_metrics, _ = _run("ppo", lp, datums)
    assert torch.equal(loss_T, grad_loss_T)
    assert {k: v.item() for k, v in metrics.items()} == {k: v.item() for k, v in grad_metrics.items()}
    assert all(key.count(":") == 1 for key in metrics)


def test_every_loss_is_a_function_with_a_one_line_docstring() -> None:
    for spec in LOSSES.values():
        assert spec.fn.__doc__ and "\n" not in spec.fn.__doc__.split("\n\n")[0].strip()


# --- config validation ---------------------------------------------------------------------------------


def test_config_defaults_follow_losses_md() -> None:
    assert resolve_loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_loss_config("gspo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("dro", {}) == {"beta": 0.05}
    assert resolve_loss_config("dro", {"beta": 1}) == {"beta": 1.0}
    assert resolve_loss_config("cross_entropy", {}) == {}


@pytest.mark.parametrize(
    ("loss_fn", "config", "expected_words"),
    [
        (
            "ppo",
            {"clip_epsilon": 0.2},
            ["'clip_epsilon'", "0.2", "clip_low_threshold", "clip_high_threshold"],
        ),
        ("cross_entropy", {"beta": 0.1}, ["'beta'", "0.1", "accepted keys: none"]),
        ("dro", {"beta": float("nan")}, ["'beta'", "nan", "finite"]),
        ("ppo", {"clip_high_threshold": float("inf")}, ["'clip_high_threshold'", "inf", "finite"]),
        ("dro", {"beta": "0.1"}, ["'beta'", "'0.1'", "number"]),
        ("dro", {"beta": True}, ["'beta'", "True", "number"]),
        ("dro", {"beta": -0.1}, ["'beta'", "-0.1", "≥ 0"]),
        ("ppo", {"clip_low_threshold": -0.2}, ["'clip_low_threshold'", "-0.2", "≥ 0"]),
        (
            "ppo",
            {"clip_low_threshold": 1.5},
            ["clip_low_threshold = 1.5", "clip_high_threshold = 1.2", "not epsilons"],
        ),
    ],
)
def test_a_bad_config_is_a_user_error_naming_key_value_and_rule(
    loss_fn: str, config: dict, expected_words: list[str]
) -> None:
    with pytest.raises(UserError) as error:
        resolve_loss_config(loss_fn, config)
    for word in expected_words:
        assert word in str(error.value)


def test_an_unknown_loss_is_a_user_error_listing_the_supported_ones() -> None:
    with pytest.raises(UserError, match="unknown loss_fn 'grpo'") as error:
        resolve_loss_config("grpo", {})
    assert all(name in str(error.value) for name in LOSSES)


def test_stable_reinforce_is_rejected_with_the_reason_and_the_alternatives() -> None:
    with pytest.raises(
        UserError, match="'stable_reinforce' is not supported: its objective is not public"
    ) as error:
        resolve_loss_config("stable_reinforce", {})
    assert "use 'ppo' instead, or 'importance_sampling'" in str(error.value)
    assert 'pass AsyncConfig(loss_fn="ppo")' in str(error.value)  # the cookbook's async default
    assert all(name in str(error.value) for name in LOSSES)


def test_custom_is_rejected_and_points_to_client_side_forward_backward_custom() -> None:
    with pytest.raises(UserError, match="server-side custom loss graphs are not supported") as error:
        resolve_loss_config("custom", {"loss_id": "abc"})
    assert "forward_backward_custom" in str(error.value)


# --- datum validation ----------------------------------------------------------------------------------


def _rl_inputs(n: int = 4, **changes) -> Inputs:
    inputs = {
        "target_tokens": np.arange(n),
        "logprobs": np.full(n, -1.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    inputs.update(changes)
    return {k: v for k, v in inputs.items() if v is not None}


def _datum_error(loss_fn: str, inputs: Inputs, n_tokens: int = 4, index: int = 3) -> str:
    config = resolve_loss_config(loss_fn, {})
    with pytest.raises(UserError) as error:
        validate_datum_inputs(loss_fn, index, n_tokens, inputs, VOCAB, config)
    return str(error.value)


@pytest.mark.parametrize(
    ("loss_fn", "inputs", "n_tokens", "message"),
    [
        (
            "ppo",
            _rl_inputs(advantages=np.ones(7, np.float32)),
            4,
            "datum 3: loss_fn_inputs['advantages'] has shape (7,), expected first dimension 4 "
            "(the model_input length)",
        ),
        (
            "ppo",
            _rl_inputs(),
            9,
            "datum 3: loss_fn_inputs['target_tokens'] has shape (4,), expected first dimension 9",
        ),
        (
            "dro",
            _rl_inputs(advantages=None),
            4,
            "datum 3: loss 'dro' needs loss_fn_inputs['advantages'], which is",
        ),
        (
            "cross_entropy",
            {"weights": np.ones(4, np.float32)},
            4,
            "datum 3: loss 'cross_entropy' needs loss_fn_inp",
        ),
        (
            "ppo",
            _rl_inputs(target_tokens=np.array([0, 1, VOCAB, 2])),
            4,
            f"holds token id {VOCAB}, expected ids in",
        ),
        (
            "ppo",
            _rl_inputs(target_tokens=np.array([0, -1, 2, 2])),
            4,
            "datum 3: loss_fn_inputs['target_tokens'] hol",
        ),
        (
            "ppo",
            _rl_inputs(target_tokens=np.zeros(4, np.float32)),
            4,
            "['target_tokens'] has dtype float32, expecte",
        ),
        (
            "ppo",
            _rl_inputs(logprobs=np.zeros(4, np.int64)),
            4,
            "datum 3: loss_fn_inputs['logprobs'] has dtype int6",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.arange(4), "weights": np.ones(4, np.int64)},
            4,
            "['weights'] has dt",
        ),
        (
            "ppo",
            _rl_inputs(advantages=np.array([1, np.nan, 0, 0], np.float32)),
            4,
            "['advantages'] holds nan at",
        ),
        (
            "ppo",
            _rl_inputs(logprobs=np.array([0, 0, -np.inf, 0], np.float32)),
            4,
            "datum 3: loss_fn_inputs['logp",
        ),
        (
            "ppo",
            _rl_inputs(target_tokens=np.zeros((4, 2), np.int64)),
            4,
            "only cross_entropy takes (N, K) targets",
        ),
        (
            "ppo",
            _rl_inputs(weights=np.ones((4, 2), np.float32)),
            4,
            "['weights'] has shape (4, 2), expected (4,)",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.zeros((4, 2), np.int64), "weights": np.ones(4, np.float32)},
            4,
            "datum 3: loss_fn_inputs['weights'] has shape (4,), expected (4, 2)",
        ),
        (
            "cross_entropy",
            {"target_tokens": np.zeros((4, 0), np.int64)},
            4,
            "expected (4,) or (4, K) with K ≥ 1",
        ),
        (
            "gspo",
            _rl_inputs(sequence_ratio_mask=np.ones(3, np.float32)),
            4,
            "['sequence_ratio_mask'] has shape (3",
        ),
        (
            "ppo",
            _rl_inputs(clip_low_threshold=np.array([0.8, 0.8, 1.3, 0.8], np.float32)),
            4,
            "datum 3: loss_fn_inputs clip_low_threshold / clip_high_threshold at position 2 are (1.3",
        ),
        ("cispo", _rl_inputs(clip_high_threshold=np.full(4, -1.0, np.float32)), 4, "expected 0 ≤ low ≤ high"),
    ],
)
def test_a_bad_datum_is_a_user_error_naming_datum_key_and_expectation(
    loss_fn: str, inputs: Inputs, n_tokens: int, message: str
) -> None:
    assert message in _datum_error(loss_fn, inputs, n_tokens)


def test_unknown_keys_and_keys_the_loss_does_not_read_are_ignored() -> None:
    config = resolve_loss_config("cross_entropy", {})
    inputs = {"target_tokens": np.arange(4), "my_key": np.zeros((2, 9)), "advantages": np.full(3, np.nan)}
    validate_datum_inputs("cross_entropy", 0, 4, inputs, VOCAB, config)


def test_a_request_mixing_top_k_widths_is_rejected_naming_the_datum() -> None:
    def datum(shape: tuple[int, ...]) -> DatumInput:
        return DatumInput(
            tokens=np.zeros(shape[0], np.int64), loss_fn_inputs={"target_tokens": np.zeros(shape, np.int64)}
        )

    request = PassRequest(
        slot=0,
        loss_fn="cross_entropy",
        loss_fn_config={},
        datums=[datum((3, 2)), datum((4, 2)), datum((2,))],
        forward_only=False,
    )
    with pytest.raises(
        UserError, match=r"datum 2: loss_fn_inputs\['target_tokens'\] has shape \(2,\) but datum 0"
    ):
        validate_loss_request(request, VOCAB)


def test_validate_loss_request_returns_the_resolved_config() -> None:
    request = PassRequest(
        slot=None,
        loss_fn="dro",
        loss_fn_config={"beta": 0.2},
        datums=[DatumInput(np.zeros(4, np.int64), _rl_inputs())],
        forward_only=True,
    )
    assert validate_loss_request(request, VOCAB) == {"beta": 0.2}
