"""The sampling part of a Tinker request as a vLLM /v1/completions body, and vLLM's answer as a SampleResult.

Token ids go in and come out as ids (`prompt` as a list of ids, `return_token_ids`), never through text.
Prompt scores are not asked of vLLM (the sampler computes them on the engine: sampler.py says why). What
vLLM cannot express exactly is refused with a message that names the backend (docs/VLLM.md has the
table), never answered approximately:
- `prompt_alt_tokens_k` (draws at prompt positions) and `target_prompt_logprobs` (logprobs of named ids at
  prompt positions);
- a topk_sample_logprobs width above what the vLLM server returns (its --max-logprobs).
Logprobs are those of the distribution each token was drawn from (temperature, top-k and top-p applied,
renormalised) when vLLM runs with `--logprobs-mode processed_logprobs`, as loraplex starts it; greedy
rows report the model's own temperature-1 logprob either way. No tensors.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from loraplex.engine.types import SampledSequence, SampleRequest, SampleResult
from loraplex.errors import FieldError, ServerError

BACKEND = "the vLLM sampler (serve --sampler vllm)"
_INT64 = 2**63


def refuse_unsupported(request: SampleRequest, max_logprobs: int) -> None:
    """FieldError for a field vLLM cannot answer exactly."""
    if request.prompt_alt_tokens_k:
        raise FieldError(
            "prompt_alt_tokens_k",
            f"is not served by {BACKEND}: vLLM draws no tokens at prompt positions; use a server with "
            "the built-in sampler (--sampler loraplex)",
        )
    if request.target_prompt_ids is not None:
        raise FieldError(
            "target_prompt_logprobs",
            f"is not served by {BACKEND}: vLLM returns the logprobs of the top ids at prompt positions, "
            "not of ids one names; use a server with the built-in sampler (--sampler loraplex)",
        )
    if request.topk_sample_logprobs > max_logprobs:
        raise FieldError(
            "topk_sample_logprobs",
            f"{request.topk_sample_logprobs} is over the {max_logprobs} that {BACKEND} returns per position "
            "(vLLM's --max-logprobs)",
        )


def vllm_seed(seed: int) -> int:
    """A Tinker seed in [0, 2**64) as vLLM's int64: the same 64 bits, which seed its generator alike. vLLM
    reads -1 as no seed at all, so 2**64 - 1 (whose bits are -1) takes 2**63 - 1's stream instead: the one
    pair of Tinker seeds that draw alike on this backend."""
    if seed == 2**64 - 1:
        return _INT64 - 1
    return seed - 2**64 if seed >= _INT64 else seed


def completion_body(request: SampleRequest, model: str, max_tokens: int) -> dict[str, Any]:
    """The /v1/completions body that samples `request` from `model` (a served adapter name, or the base)."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in request.prompt],
        "n": calls(request),
        "max_tokens": max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "logprobs": int(request.topk_sample_logprobs),  # 0: the sampled token's logprob alone
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # top-logprob keys as "token_id:N", never as text
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,  # Tinker keeps the tokens that complete a stop string
    }
    if params.seed is not None:
        body["seed"] = vllm_seed(params.seed)
    if params.stop is not None:
        body["stop"] = [item for item in params.stop if isinstance(item, str)]
        body["stop_token_ids"] = [int(item) for item in params.stop if not isinstance(item, str)]
        body["ignore_eos"] = not params.stop  # () : only max_tokens stops
    return body


def sample_result(answer: dict[str, Any], request: SampleRequest) -> SampleResult:
    """The samples of vLLM's /v1/completions answer to `completion_body(request, ...)`."""
    choices = sorted(answer.get("choices") or [], key=lambda choice: choice["index"])
    if len(choices) != calls(request):
        raise ServerError(f"vLLM answered {len(choices)} samples where {calls(request)} were asked")
    sequences = [_sequence(choice, request.topk_sample_logprobs) for choice in choices]
    if len(sequences) < request.num_samples:  # greedy: every sample is the one
        sequences = [sequences[0]] + [copy.deepcopy(sequences[0]) for _ in range(request.num_samples - 1)]
    return SampleResult(sequences)


def calls(request: SampleRequest) -> int:
    """Samples vLLM is asked for: one for a greedy request (vLLM refuses n > 1 there; they are all the
    same), else num_samples."""
    return 1 if request.params.temperature == 0 else request.num_samples


def _sequence(choice: dict[str, Any], k: int) -> SampledSequence:
    tokens = np.asarray(choice.get("token_ids") or [], dtype=np.int32)
    scored = choice.get("logprobs") or {}
    logprobs = np.asarray([_logprob(v) for v in scored.get("token_logprobs") or []], dtype=np.float32)
    if len(logprobs) != len(tokens):
        raise ServerError(f"vLLM answered {len(tokens)} tokens with {len(logprobs)} logprobs")
    # "length" when max_tokens ran out; "stop" for EOS, a stop id or a stop string ("abort" never reaches
    # here: an aborted request's connection is gone).
    sequence = SampledSequence(
        tokens, logprobs, "length" if choice.get("finish_reason") == "length" else "stop"
    )
    if k:
        ids, values = _top(scored.get("top_logprobs") or [], k)
        sequence.topk_ids, sequence.topk_logprobs = ids, values
    return sequence


def _top(positions: list[dict[str, float] | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, k) ids and logprobs, likeliest first, from vLLM's per-position {"token_id:N": logprob}; ids the
    distribution leaves out (top-k / top-p: -inf) are -1 with NaN, as the built-in sampler gives them."""
    ids = np.full((len(positions), k), -1, dtype=np.int32)
    values = np.full((len(positions), k), np.nan, dtype=np.float32)
    for row, entries in enumerate(positions):
        ranked = sorted(
            ((_logprob(v), _token_id(t)) for t, v in (entries or {}).items()), key=lambda e: (-e[0], e[1])
        )
        for column, (value, token) in enumerate(ranked[:k]):
            if math.isfinite(value):
                ids[row, column], values[row, column] = token, value
    return ids, values


def _token_id(key: str) -> int:
    """An id from vLLM's "token_id:N" (return_tokens_as_token_ids)."""
    if not key.startswith("token_id:"):
        raise ServerError(
            f"vLLM named a token {key!r}, not token_id:N (was return_tokens_as_token_ids dropped?)"
        )
    return int(key.removeprefix("token_id:"))


def _logprob(value: float | str | None) -> float:
    """A logprob as vLLM writes one: a number, or -inf (which JSON cannot carry) as null or "-inf"."""
    if value is None:
        return -math.inf
    return float(value)
