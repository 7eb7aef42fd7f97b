"""Checking a SampleRequest before it is queued: every field against what the model can serve and what
the operator allows one request (SamplingLimits).

Cheap (numpy and a few file stats, no torch) and side-effect free; each error is a FieldError naming the
Tinker field, the value and what is allowed (the OpenAI-compatible API renames the field to its own).
Engine code: no HTTP, no SQL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path

import numpy as np

from loraplex.engine.snapshots import CONFIG_FILE
from loraplex.engine.types import SampleRequest
from loraplex.errors import FieldError, NotFoundError

# max_tokens when a request leaves it out (Tinker's client does when None), capped by the context left.
DEFAULT_MAX_TOKENS = 128
_SEED_LIMIT = 2**64
_MIB = 1 << 20


@dataclass(frozen=True)
class SamplingLimits:
    """What the operator lets sampling use (the server's --max-topk-prompt-logprobs,
    --max-topk-sample-logprobs, --max-sample-kv-mib and --sample-kv-budget-mib); None = nothing beyond the
    model's own limits."""

    max_topk_prompt_logprobs: int | None = None  # and prompt_alt_tokens_k: both per-position widths
    max_topk_sample_logprobs: int | None = None
    max_request_kv_bytes: int | None = None  # (prompt + max_tokens) × num_samples × KV bytes per token
    kv_budget_bytes: int | None = None  # the KV cache of every running request, as allocated


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    vocab_size: int
    max_context_length: int
    max_samples: int  # num_samples of one request, at most the decode batch
    can_match_strings: bool  # a tokenizer is available for stop strings
    kv_bytes_per_token: int  # one token's keys and values, every layer
    sampling: SamplingLimits


def resolved_max_tokens(request: SampleRequest, max_context_length: int) -> int:
    """The request's max_tokens, or the default capped by the context the prompt leaves."""
    if request.params.max_tokens is not None:
        return request.params.max_tokens
    return min(DEFAULT_MAX_TOKENS, max_context_length - len(request.prompt))


def validate_sample_request(request: SampleRequest, limits: ModelLimits) -> None:
    """Raise FieldError naming the first field that this model cannot serve; touches no state."""
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise FieldError("prompt", "must be a 1-D list of integer token ids")
    if not 1 <= len(prompt) < limits.max_context_length:
        raise FieldError(
            "prompt",
            f"has {len(prompt)} tokens; expected 1..{limits.max_context_length - 1} so that at least "
            f"one token fits the model's context length {limits.max_context_length}",
        )
    _check_ids("prompt", prompt, limits.vocab_size)
    _check_int("num_samples", request.num_samples, 1, limits.max_samples)
    _check_params(request, len(prompt), limits)
    if not isinstance(request.prompt_logprobs, bool):
        raise FieldError("prompt_logprobs", f"must be true or false, got {request.prompt_logprobs!r}")
    prompt_cap = limits.sampling.max_topk_prompt_logprobs, "--max-topk-prompt-logprobs"
    _check_width("topk_prompt_logprobs", request.topk_prompt_logprobs, limits.vocab_size, *prompt_cap)
    _check_width("prompt_alt_tokens_k", request.prompt_alt_tokens_k, limits.vocab_size, *prompt_cap)
    sample_cap = limits.sampling.max_topk_sample_logprobs, "--max-topk-sample-logprobs"
    _check_width("topk_sample_logprobs", request.topk_sample_logprobs, limits.vocab_size, *sample_cap)
    if request.target_prompt_ids is not None:
        _check_target_ids(request.target_prompt_ids, len(prompt), limits.vocab_size)
    if request.prompt_logprobs_last_n is not None:
        _check_int("prompt_logprobs_last_n", request.prompt_logprobs_last_n, 0, limits.max_context_length)
    _check_kv_cache(request, len(prompt), limits)
    if request.snapshot is not None and not (Path(request.snapshot) / CONFIG_FILE).is_file():
        raise NotFoundError(f"sampler weights {Path(request.snapshot).name} do not exist (no {CONFIG_FILE})")


def _check_params(request: SampleRequest, prompt_length: int, limits: ModelLimits) -> None:
    params = request.params
    if params.max_tokens is not None:
        room = limits.max_context_length - prompt_length
        _check_int("sampling_params.max_tokens", params.max_tokens, 1, room, " (context left)")
    temperature = params.temperature
    if not _is_real(temperature) or not 0 <= temperature < math.inf:
        raise FieldError("sampling_params.temperature", f"must be a finite number ≥ 0, got {temperature!r}")
    if (
        not isinstance(params.top_k, Integral)
        or isinstance(params.top_k, bool)
        or not (params.top_k == -1 or params.top_k >= 1)
    ):
        raise FieldError("sampling_params.top_k", f"must be -1 (no limit) or ≥ 1; got {params.top_k!r}")
    if not _is_real(params.top_p) or not 0 < params.top_p <= 1:
        raise FieldError("sampling_params.top_p", f"must be in (0, 1], got {params.top_p!r}")
    if params.seed is not None:
        _check_int("sampling_params.seed", params.seed, 0, _SEED_LIMIT - 1)
    for item in params.stop or ():
        if isinstance(item, str):
            if not item:
                raise FieldError("sampling_params.stop", "has an empty stop string")
            if not limits.can_match_strings:
                raise FieldError(
                    "sampling_params.stop", "has stop strings, but this model has no tokenizer.json"
                )
        elif isinstance(item, Integral) and not isinstance(item, bool):
            _check_ids("sampling_params.stop", np.asarray([item]), limits.vocab_size)
        else:
            raise FieldError("sampling_params.stop", f"items must be strings or token ids, got {item!r}")


def _check_width(field: str, k: int, vocab_size: int, cap: int | None, flag: str) -> None:
    """A per-position width (top-k, draws): within the vocabulary and the operator's cap."""
    if cap is None or cap >= vocab_size:
        _check_int(field, k, 0, vocab_size)
    else:
        _check_int(field, k, 0, cap, f" (this server's {flag})")


def _check_target_ids(ids: np.ndarray, prompt_length: int, vocab_size: int) -> None:
    """target_prompt_logprobs: one row per prompt position after the first, at least one id, every id in
    the vocabulary or -1. Its width is the API's to bound, before the ids are decoded (api/tinker/wire.py)."""
    field = "target_prompt_logprobs"
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise FieldError(field, f"must be a 2-D tensor of integer token ids, got shape {list(ids.shape)}")
    if ids.shape[0] != prompt_length - 1:
        raise FieldError(
            field,
            f"has {ids.shape[0]} rows; it needs len(prompt) - 1 = {prompt_length - 1} (row i scores "
            "prompt position i + 1)",
        )
    if not np.any(ids >= 0):
        raise FieldError(field, "names no token id (every cell is -1)")
    low, high = int(ids.min()), int(ids.max())
    if low < -1 or high >= vocab_size:
        bad = low if low < -1 else high
        raise FieldError(field, f"has token id {bad}, outside the vocabulary [0, {vocab_size}) or -1 (none)")


def _check_kv_cache(request: SampleRequest, prompt_length: int, limits: ModelLimits) -> None:
    """Refuse a request whose samples would need more KV cache than one request may have."""
    cap = limits.sampling.max_request_kv_bytes
    max_tokens = resolved_max_tokens(request, limits.max_context_length)
    need = (prompt_length + max_tokens) * request.num_samples * limits.kv_bytes_per_token
    if cap is not None and need > cap:
        # Named after max_tokens, the field a client most often lowers; the words name no other field,
        # so that each API can name this one in its own terms.
        raise FieldError(
            "sampling_params.max_tokens",
            f"{max_tokens} needs {need} bytes of KV cache ((prompt {prompt_length} + {max_tokens} new "
            f"tokens) × {request.num_samples} samples × {limits.kv_bytes_per_token} bytes per token), over "
            f"the {cap} bytes ({cap / _MIB:g} MiB) this server allows one request (--max-sample-kv-mib); "
            "lower it or the number of samples",
        )


def _check_int(field: str, value: object, low: int, high: int, why: str = "") -> None:
    if not isinstance(value, Integral) or isinstance(value, bool) or not low <= value <= high:
        raise FieldError(field, f"must be an integer in [{low}, {high}]{why}, got {value!r}")


def _check_ids(field: str, ids: np.ndarray, vocab_size: int) -> None:
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise FieldError(field, f"has token id {bad}, outside the vocabulary [0, {vocab_size})")


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
