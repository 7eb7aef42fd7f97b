"""The loss registry: every loss the server computes, what it reads, its config and its validation.

`LOSSES` is the only list of supported losses (request validation, docs and tests read it). A loss
is a pure function of one request's datums packed flat and returns the per-token loss ℓ; the engine
sums ℓ, never averages: normalisation is the client's (docs/LOSSES.md has the math).
Validation is numpy only and runs before any compute. Engine code: no HTTP, no SQL.

Shapes: T tokens of one request (its datums packed, no padding), K top-k width, Q datums.

Readings of the protocol made here:
- RL mask: for the RL losses a token counts only where A≠0 or q≠0, times `weights` when sent;
  `pack_loss_inputs` folds that mask into `weights`, so every loss sees one effective weight.
- `clip_low_threshold` / `clip_high_threshold` sent as loss_fn_inputs (N,) override the config's
  threshold per token; tokens of datums that do not send them use the config value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loraplex.engine.types import PassRequest
from loraplex.errors import UserError
from loraplex.model.host_copy import to_device


@dataclass(frozen=True)
class LossBatch:
    """One request's loss inputs with its datums packed flat, as built by `pack_loss_inputs`.

    `inputs` holds the canonical keys of the loss: target_tokens int64 (T,)|(T,K), weights float32
    like target_tokens (RL mask folded in), and float32 (T,) logprobs, advantages, thresholds, ...
    """

    inputs: dict[str, Tensor]
    seq_index_T: Tensor  # int64, the datum (0..Q-1) each token belongs to
    lengths: tuple[int, ...]  # tokens per datum, to split per-token outputs back into datums

    @property
    def n_seqs(self) -> int:
        """Number of datums Q."""
        return len(self.lengths)


LossOutput = tuple[Tensor, dict[str, Tensor]]  # per-token loss ℓ (T,) and extra metrics (0-D tensors)
LossFn = Callable[[Tensor, LossBatch, Mapping[str, float]], LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """What a loss reads and accepts; `fn(lp, batch, config)` returns ℓ (T,) and extra metrics."""

    fn: LossFn
    required: tuple[str, ...]  # loss_fn_inputs keys that must be sent
    optional: tuple[str, ...]  # keys read when sent; a config key listed here is a per-token override
    config: dict[str, float]  # loss_fn_config keys and their defaults
    is_rl: bool  # the RL mask applies
    allows_top_k: bool = False  # (N,K) target_tokens and weights
    # ℓ_t depends on token t's logprob alone, so ∂ℓ_t/∂lp_t is known chunk by chunk (gspo's sequence
    # ratio needs the whole sequence first).
    is_per_token: bool = True


# --- losses: ℓ per token, exactly 0 wherever the effective weight is 0 ---------------------------------


def _log_ratio(lp_T: Tensor, q_T: Tensor, on_T: Tensor) -> Tensor:
    """lp − q where the token counts, 0 elsewhere: exp of it never overflows into a 0·inf NaN."""
    return torch.where(on_T, lp_T - q_T, 0.0)


def _weighted(on_T: Tensor, w_T: Tensor, value_T: Tensor) -> Tensor:
    """w·value on counted tokens, an exact 0 (value and gradient) elsewhere."""
    return torch.where(on_T, w_T * value_T, 0.0)


def _clipped_ratio(ratio_T: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """clamp(r, lo, hi) with per-token absolute bounds."""
    return torch.clamp(ratio_T, inputs["clip_low_threshold"], inputs["clip_high_threshold"])


def _clip_fraction(ratio_T: Tensor, on_T: Tensor, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Share of counted tokens whose ratio lies outside [lo, hi] (0 when none count)."""
    ratio_T = ratio_T.detach()
    is_out_T = (ratio_T < inputs["clip_low_threshold"]) | (ratio_T > inputs["clip_high_threshold"])
    n_clipped = (is_out_T & on_T).sum(dtype=torch.float32)
    return {"clip_fraction:mean": n_clipped / on_T.sum(dtype=torch.float32).clamp(min=1.0)}


def _ppo_objective(ratio_T: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """−min(r·A, clamp(r, lo, hi)·A), the clipped surrogate shared by ppo and gspo."""
    a_T = inputs["advantages"]
    return -torch.minimum(ratio_T * a_T, _clipped_ratio(ratio_T, inputs) * a_T)


def cross_entropy(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """−w·lp, summed over the top-k axis when targets are (T,K); exactly linear in w."""
    loss = -(batch.inputs["weights"] * lp)
    return (loss.sum(-1) if loss.dim() == 2 else loss), {}


def importance_sampling(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """−r·A with r = exp(lp − q); the gradient flows through r."""
    w_T = batch.inputs["weights"]
    on_T = w_T != 0
    ratio_T = torch.exp(_log_ratio(lp, batch.inputs["logprobs"], on_T))
    return _weighted(on_T, w_T, -ratio_T * batch.inputs["advantages"]), {}


def ppo(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """−min(r·A, clamp(r, lo, hi)·A) with absolute ratio bounds."""
    w_T = batch.inputs["weights"]
    on_T = w_T != 0
    ratio_T = torch.exp(_log_ratio(lp, batch.inputs["logprobs"], on_T))
    loss_T = _weighted(on_T, w_T, _ppo_objective(ratio_T, batch.inputs))
    return loss_T, _clip_fraction(ratio_T, on_T, batch.inputs)


def cispo(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """−sg(clamp(r, lo, hi))·A·lp: the clipped ratio is a constant weight on the REINFORCE term."""
    w_T = batch.inputs["weights"]
    on_T = w_T != 0
    ratio_T = torch.exp(_log_ratio(lp.detach(), batch.inputs["logprobs"], on_T))
    coef_T = _clipped_ratio(ratio_T, batch.inputs) * batch.inputs["advantages"]
    return _weighted(on_T, w_T, -coef_T * lp), _clip_fraction(ratio_T, on_T, batch.inputs)


def dro(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """−(A·lp − (β/2)·(lp − q)²); the quadratic term is why the RL mask matters here."""
    w_T = batch.inputs["weights"]
    on_T = w_T != 0
    log_ratio_T = _log_ratio(lp, batch.inputs["logprobs"], on_T)
    value_T = batch.inputs["advantages"] * lp - 0.5 * config["beta"] * log_ratio_T.square()
    return _weighted(on_T, w_T, -value_T), {}


def gspo(lp: Tensor, batch: LossBatch, config: Mapping[str, float]) -> LossOutput:
    """GSPO-token: ppo's surrogate on s_t = sg(s)·exp(lp − sg(lp)), s the datum's geometric mean ratio.

    Semantics: per datum, s = exp(mean over M of (lp_t − q_t)) with M = {sequence_ratio_mask ≠ 0}
    (s = 1 when M is empty); ℓ_t = −w_t·min(s_t·A_t, clamp(s_t, lo, hi)·A_t) on counted tokens of M.
    The per-datum means use one segment sum over the packed tokens instead of a loop over datums.
    """
    inputs = batch.inputs
    w_T = inputs["weights"]
    in_m_T = inputs["sequence_ratio_mask"] != 0
    log_ratio_T = _log_ratio(lp.detach(), inputs["logprobs"], in_m_T)
    zeros_Q = lp.new_zeros(batch.n_seqs)
    sum_Q = zeros_Q.index_add(0, batch.seq_index_T, log_ratio_T)
    count_Q = zeros_Q.index_add(0, batch.seq_index_T, in_m_T.to(lp.dtype))
    seq_ratio_Q = torch.exp(sum_Q / count_Q.clamp(min=1.0))
    ratio_T = seq_ratio_Q[batch.seq_index_T] * torch.exp(lp - lp.detach())
    on_T = in_m_T & (w_T != 0)
    loss_T = _weighted(on_T, w_T, _ppo_objective(ratio_T, inputs))
    return loss_T, _clip_fraction(ratio_T, on_T, inputs)


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")


def _clip_defaults(lo: float, hi: float) -> dict[str, float]:
    """Default absolute ratio bounds; loss_fn_inputs of the same names override them per token."""
    return dict(zip(_CLIP_INPUTS, (lo, hi), strict=True))


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(
        cross_entropy,
        required=("target_tokens",),
        optional=("weights",),
        config={},
        is_rl=False,
        allows_top_k=True,
    ),
    "importance_sampling": LossSpec(
        importance_sampling, required=_RL_INPUTS, optional=("weights",), config={}, is_rl=True
    ),
    "ppo": LossSpec(
        ppo,
        required=_RL_INPUTS,
        optional=("weights", *_CLIP_INPUTS),
        config=_clip_defaults(0.8, 1.2),
        is_rl=True,
    ),
    "cispo": LossSpec(
        cispo,
        required=_RL_INPUTS,
        optional=("weights", *_CLIP_INPUTS),
        config=_clip_defaults(0.0, 4.0),
        is_rl=True,
    ),
    "dro": LossSpec(dro, required=_RL_INPUTS, optional=("weights",), config={"beta": 0.05}, is_rl=True),
    "gspo": LossSpec(
        gspo,
        required=_RL_INPUTS,
        optional=("weights", "sequence_ratio_mask", *_CLIP_INPUTS),
        config=_clip_defaults(0.8, 1.2),
        is_rl=True,
        is_per_token=False,
    ),
}

# Names the protocol defines that we reject on purpose, with the reason given to the client.
_UNSUPPORTED = {
    "stable_reinforce": "its objective is not public (Tinker documents only that it uses information its own "
    "sampler records under record_stability_info=True, which datums name by sequence_id provenance); use "
    "'ppo' instead, or 'importance_sampling' on on-policy data. tinker-cookbook's async RL defaults to it: "
    'pass AsyncConfig(loss_fn="ppo")',
    "custom": "server-side custom loss graphs are not supported; forward_backward_custom with a Python "
    "loss function works, because the client then sends only 'cross_entropy'",
}

_BOUNDS_RULE = "thresholds are absolute ratio bounds (e.g. 0.8 and 1.2), not epsilons, and need low ≤ high"


def is_per_token_loss(loss_fn: str) -> bool:
    """Whether each token's loss depends on that token's logprob alone (see LossSpec.is_per_token)."""
    return _spec(loss_fn).is_per_token


def _spec(loss_fn: str) -> LossSpec:
    """The registry entry of a loss name, or a UserError naming the supported losses."""
    supported = ", ".join(LOSSES)
    if loss_fn in _UNSUPPORTED:
        raise UserError(
            f"loss_fn {loss_fn!r} is not supported: {_UNSUPPORTED[loss_fn]}. Supported: {supported}"
        )
    if loss_fn not in LOSSES:
        raise UserError(f"unknown loss_fn {loss_fn!r}; supported losses: {supported}")
    return LOSSES[loss_fn]


# --- validation (numpy only, before any compute) --------------------------------------------------------


def resolve_loss_config(loss_fn: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config with defaults filled in; UserError on an unknown key or a value out of range."""
    spec = _spec(loss_fn)
    resolved = dict(spec.config)
    for key, value in (config or {}).items():
        if key not in spec.config:
            accepted = ", ".join(spec.config) or "none"
            raise UserError(
                f"loss_fn_config key {key!r} (value {value!r}) is not accepted by loss {loss_fn!r}; "
                f"accepted keys: {accepted}"
            )
        is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value):
            raise UserError(f"loss_fn_config[{key!r}] = {value!r}: expected a finite number")
        if value < 0:
            raise UserError(
                f"loss_fn_config[{key!r}] = {value!r}: expected a number ≥ 0 for loss {loss_fn!r}"
            )
        resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and hi is not None and lo > hi:
        raise UserError(
            f"loss_fn_config clip_low_threshold = {lo} > clip_high_threshold = {hi} for loss "
            f"{loss_fn!r}: {_BOUNDS_RULE}"
        )
    return resolved


def validate_datum_inputs(
    loss_fn: str,
    index: int,
    n_tokens: int,
    loss_fn_inputs: Mapping[str, np.ndarray],
    vocab_size: int,
    config: Mapping[str, float],
) -> None:
    """UserError naming the datum, the key and what was expected if this datum's inputs break a rule.

    `config` is the resolved config (per-token thresholds are checked against it). Keys the loss
    does not read are ignored, as the protocol allows arbitrary extra keys.
    """
    spec = _spec(loss_fn)
    where = f"datum {index}"
    missing = [key for key in spec.required if key not in loss_fn_inputs]
    if missing:
        raise UserError(
            f"{where}: loss {loss_fn!r} needs loss_fn_inputs[{missing[0]!r}], which is missing "
            f"(required: {', '.join(spec.required)})"
        )
    read = (*spec.required, *spec.optional)
    arrays = {key: np.asarray(loss_fn_inputs[key]) for key in read if key in loss_fn_inputs}
    for key, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != n_tokens:
            raise UserError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {array.shape}, expected first dimension "
                f"{n_tokens} (the model_input length)"
            )
    targets = arrays.pop("target_tokens")
    _check_targets(where, spec, targets, vocab_size)
    for key, array in arrays.items():
        _check_float_input(where, key, array, targets.shape if key == "weights" else (n_tokens,))
    if any(key in arrays for key in _CLIP_INPUTS):
        lo_T, hi_T = (arrays.get(key, np.full(n_tokens, config[key])) for key in _CLIP_INPUTS)
        is_bad_T = (lo_T < 0) | (lo_T > hi_T)
        if is_bad_T.any():
            t = int(np.flatnonzero(is_bad_T)[0])
            raise UserError(
                f"{where}: loss_fn_inputs clip_low_threshold / clip_high_threshold at position {t} are "
                f"({lo_T[t]!s}, {hi_T[t]!s}), expected 0 ≤ low ≤ high: {_BOUNDS_RULE}"
            )


def _check_targets(where: str, spec: LossSpec, targets: np.ndarray, vocab_size: int) -> None:
    """target_tokens: (N,) or, where the loss allows it, (N,K) integer ids in [0, vocab)."""
    n_tokens = targets.shape[0]
    if targets.ndim > (2 if spec.allows_top_k else 1) or targets.size == 0:
        allowed = (
            f"({n_tokens},) or ({n_tokens}, K) with K ≥ 1"
            if spec.allows_top_k
            else f"({n_tokens},); only cross_entropy takes (N, K) targets"
        )
        raise UserError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {targets.shape}, expected {allowed}"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise UserError(f"{where}: loss_fn_inputs['target_tokens'] has dtype {targets.dtype}, expected int64")
    lowest, highest = targets.min(), targets.max()
    if lowest < 0 or highest >= vocab_size:
        raise UserError(
            f"{where}: loss_fn_inputs['target_tokens'] holds token id {lowest if lowest < 0 else highest}, "
            f"expected ids in [0, {vocab_size})"
        )


def _check_float_input(where: str, key: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    """A float input: the expected shape, a floating dtype, finite everywhere."""
    if array.shape != shape:
        raise UserError(f"{where}: loss_fn_inputs[{key!r}] has shape {array.shape}, expected {shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise UserError(f"{where}: loss_fn_inputs[{key!r}] has dtype {array.dtype}, expected float32")
    is_bad = ~np.isfinite(array)
    if is_bad.any():
        position = tuple(int(i) for i in np.unravel_index(np.flatnonzero(is_bad)[0], shape))
        raise UserError(
            f"{where}: loss_fn_inputs[{key!r}] holds {array[position]!s} at position {position}, "
            "expected finite values"
        )


def validate_loss_request(request: PassRequest, vocab_size: int) -> dict[str, float]:
    """Validate a request's loss, config and every datum's inputs; return the resolved config."""
    config = resolve_loss_config(request.loss_fn, request.loss_fn_config)
    first_shape: tuple[int, ...] | None = None
    for index, datum in enumerate(request.datums):
        inputs = datum.loss_fn_inputs
        validate_datum_inputs(request.loss_fn, index, len(datum.tokens), inputs, vocab_size, config)
        # The datums are packed into one (T,) or (T,K) tensor, so they must agree on K.
        shape = np.shape(inputs["target_tokens"])
        first_shape = first_shape or shape
        if shape[1:] != first_shape[1:]:
            raise UserError(
                f"datum {index}: loss_fn_inputs['target_tokens'] has shape {shape} but datum 0 has "
                f"{first_shape}; every datum of one request must use the same (N,) or (N, K) form"
            )
    return config


# --- packing and the entry point the engine calls ------------------------------------------------------


def _canonical_inputs(
    spec: LossSpec, loss_fn_inputs: Mapping[str, np.ndarray], config: Mapping[str, float]
) -> dict[str, np.ndarray]:
    """A validated datum's inputs as its loss reads them: defaults filled, RL mask folded into weights."""
    targets = np.asarray(loss_fn_inputs["target_tokens"], dtype=np.int64)
    n_tokens = targets.shape[0]
    out = {"target_tokens": targets}
    for key in (*spec.required, *spec.optional):
        if key in loss_fn_inputs and key != "target_tokens":
            out[key] = np.asarray(loss_fn_inputs[key], dtype=np.float32)
    for key in spec.config:
        if key in spec.optional and key not in out:
            out[key] = np.full(n_tokens, config[key], dtype=np.float32)
    weights = out.get("weights", np.ones(targets.shape, dtype=np.float32))
    if spec.is_rl:
        weights = weights * ((out["advantages"] != 0) | (out["logprobs"] != 0))
    out["weights"] = weights
    if "sequence_ratio_mask" in spec.optional:
        # gspo's sequence ratio runs over the sent mask, or by default over the counted tokens.
        out["sequence_ratio_mask"] = (out.get("sequence_ratio_mask", weights) != 0).astype(np.float32)
    return out


def pack_loss_inputs(
    loss_fn: str,
    config: Mapping[str, float],
    datum_inputs: Sequence[Mapping[str, np.ndarray]],
    device: torch.device | str = "cpu",
) -> LossBatch:
    """Pack a validated request's per-datum loss_fn_inputs into one flat LossBatch on `device`."""
    spec = _spec(loss_fn)
    canonical = [_canonical_inputs(spec, inputs, config) for inputs in datum_inputs]
    lengths = tuple(datum["target_tokens"].shape[0] for datum in canonical)
    inputs = {key: to_device(np.concatenate([d[key] for d in canonical]), device) for key in canonical[0]}
    seq_index_T = to_device(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths), device)
    return LossBatch(inputs, seq_index_T, lengths)


def compute_loss(
    loss_fn: str, lp: Tensor, batch: LossBatch, config: Mapping[str, float]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ℓ (T,) of a packed request, and its metrics as detached 0-D tensors (incl. loss:sum).

    `lp` is the learner's fp32 logprobs of batch.inputs["target_tokens"], (T,) or (T,K), with autograd.
    Semantics: each datum's slice of ℓ equals that datum's docs/LOSSES.md formula applied to it alone;
    packing only replaces a Python loop over datums. Masked tokens give exactly 0 and 0 gradient.
    """
    loss_T, metrics = _spec(loss_fn).fn(lp, batch, config)
    return loss_T, {"loss:sum": loss_T.detach().sum(), **metrics}
