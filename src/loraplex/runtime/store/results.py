"""Future results as database text: JSON objects as they are, pass results with base64 numpy arrays.

Knows nothing of HTTP encodings; the API turns the decoded value into JSON or protobuf.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from loraplex.engine.types import PassResult

_PASS_TAG = "pass_result"


def encode_result(result: dict[str, Any] | PassResult) -> str:
    """Serialize a future's result for the futures table."""
    if isinstance(result, PassResult):
        outputs = [{k: _encode_array(v) for k, v in out.items()} for out in result.outputs]
        return json.dumps({_PASS_TAG: {"outputs": outputs, "metrics": result.metrics}})
    return json.dumps(result)


def decode_result(text: str) -> dict[str, Any] | PassResult:
    """Inverse of encode_result."""
    value = json.loads(text)
    if isinstance(value, dict) and _PASS_TAG in value:
        body = value[_PASS_TAG]
        outputs = [{k: _decode_array(v) for k, v in out.items()} for out in body["outputs"]]
        return PassResult(outputs=outputs, metrics=body["metrics"])
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
