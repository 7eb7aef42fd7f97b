"""Future results as database text: JSON objects as they are; pass and sample results tagged, their
numpy arrays as base64.

Knows nothing of HTTP encodings; the API turns the decoded value into JSON or protobuf. A field missing
from older text (a result stored before the field existed) decodes as absent.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from loraplex.engine.types import PassResult, SampledSequence, SampleResult

_PASS_TAG, _SAMPLE_TAG = "pass_result", "sample_result"
_PROMPT_FIELDS = (
    "prompt_logprobs",
    "topk_prompt_ids",
    "topk_prompt_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_ids",
    "prompt_alt_logprobs",
)
_SEQUENCE_FIELDS = ("topk_ids", "topk_logprobs")

Result = dict[str, Any] | PassResult | SampleResult


def encode_result(result: Result) -> str:
    """Serialize a future's result for the futures table."""
    if isinstance(result, PassResult):
        outputs = [{k: _encode_array(v) for k, v in out.items()} for out in result.outputs]
        return json.dumps({_PASS_TAG: {"outputs": outputs, "metrics": result.metrics}})
    if isinstance(result, SampleResult):
        sequences = [
            {
                "tokens": _encode_array(s.tokens),
                "logprobs": _encode_array(s.logprobs),
                "stop": s.stop_reason,
                **{name: _maybe_encode(getattr(s, name)) for name in _SEQUENCE_FIELDS},
            }
            for s in result.sequences
        ]
        prompt = {name: _maybe_encode(getattr(result, name)) for name in _PROMPT_FIELDS}
        body = {"sequences": sequences, **prompt, "target_prompt_is_sparse": result.target_prompt_is_sparse}
        return json.dumps({_SAMPLE_TAG: body})
    return json.dumps(result)


def decode_result(text: str) -> Result:
    """Inverse of encode_result."""
    value = json.loads(text)
    if isinstance(value, dict) and _PASS_TAG in value:
        body = value[_PASS_TAG]
        outputs = [{k: _decode_array(v) for k, v in out.items()} for out in body["outputs"]]
        return PassResult(outputs=outputs, metrics=body["metrics"])
    if isinstance(value, dict) and _SAMPLE_TAG in value:
        body = value[_SAMPLE_TAG]
        sequences = [
            SampledSequence(
                _decode_array(s["tokens"]),
                _decode_array(s["logprobs"]),
                s["stop"],
                **{name: _maybe_decode(s.get(name)) for name in _SEQUENCE_FIELDS},
            )
            for s in body["sequences"]
        ]
        prompt = {name: _maybe_decode(body.get(name)) for name in _PROMPT_FIELDS}
        is_sparse = body.get("target_prompt_is_sparse", False)
        return SampleResult(sequences, **prompt, target_prompt_is_sparse=is_sparse)
    return value


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "data": base64.b64encode(array.tobytes()).decode(),
    }


def _decode_array(value: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(value["data"])
    return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()


def _maybe_encode(array: np.ndarray | None) -> dict[str, Any] | None:
    return None if array is None else _encode_array(array)


def _maybe_decode(value: dict[str, Any] | None) -> np.ndarray | None:
    return None if value is None else _decode_array(value)
