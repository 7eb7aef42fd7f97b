"""Future results as bytes for the futures table: pass results, sample results and plain JSON objects, in one
format whose arrays are their raw bytes (no base64, no text).

Format 1, integers little-endian:

    offset 0    4 bytes   magic b"LPR1" (loraplex result, format 1)
    offset 4    uint32    H, the header's length in bytes
    offset 8    H bytes   header: UTF-8 JSON {"kind": K, "value": V, "arrays": [[dtype, shape, offset], ...]}
    then        0-7 zero bytes, so that the data starts at a multiple of 8
    data        each array's bytes in C order, little-endian, at its `offset` from the data's start (a
                multiple of 8, ascending; zero bytes between); the last array ends the blob

K is "pass" (a PassResult), "sample" (a SampleResult) or "json" (a JSON object: V itself, no arrays).
In the V of a pass or sample result an array is its index in "arrays"; `dtype` is numpy's string for it
("<f4", "<i4", "|b1"; booleans, integers and floats only) and `shape` a list of sizes. A pass V is
{"outputs": [{name: array}], "metrics": {...}}; a sample V holds "sequences" (tokens, logprobs, stop,
topk_ids, topk_logprobs each) and the prompt fields of SampleResult, an absent array as null. A field
missing from V (a blob written before the field existed) decodes as absent.

Decoded arrays are read-only views of the blob, never copies. Bytes that do not follow the format raise
CorruptResultError saying what is wrong. Knows nothing of HTTP encodings or of the database.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any

import numpy as np

from loraplex.engine.types import PassResult, SampledSequence, SampleResult
from loraplex.errors import ServerError

_MAGIC = b"LPR1"
_PREAMBLE = struct.Struct("<4sI")  # magic, header length
_ALIGN = 8  # every array starts at a multiple of this: the widest dtype's alignment
_KINDS = "biuf"  # numpy kinds a result array may have: bool, signed and unsigned integer, float
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


class CorruptResultError(ServerError):
    """Stored result bytes that do not follow the format of this module."""


def encode_result(result: Result) -> bytes:
    """Serialize a future's result for the futures table."""
    arrays: list[np.ndarray] = []

    def ref(array: np.ndarray | None) -> int | None:
        if array is None:
            return None
        arrays.append(_little_endian(array))
        return len(arrays) - 1

    value: Any
    if isinstance(result, PassResult):
        outputs = [{name: ref(array) for name, array in out.items()} for out in result.outputs]
        kind, value = "pass", {"outputs": outputs, "metrics": result.metrics}
    elif isinstance(result, SampleResult):
        sequences = [
            {
                "tokens": ref(s.tokens),
                "logprobs": ref(s.logprobs),
                "stop": s.stop_reason,
                **{name: ref(getattr(s, name)) for name in _SEQUENCE_FIELDS},
            }
            for s in result.sequences
        ]
        prompt = {name: ref(getattr(result, name)) for name in _PROMPT_FIELDS}
        sparse = result.target_prompt_is_sparse
        kind, value = "sample", {"sequences": sequences, **prompt, "target_prompt_is_sparse": sparse}
    else:
        kind, value = "json", result
    offsets, end = [], 0
    for array in arrays:
        offsets.append(_aligned(end))
        end = offsets[-1] + array.nbytes
    specs = [[a.dtype.str, list(a.shape), offset] for a, offset in zip(arrays, offsets, strict=True)]
    header = json.dumps({"kind": kind, "value": value, "arrays": specs}, separators=(",", ":")).encode()
    start = _PREAMBLE.size + len(header)
    parts: list[Any] = [_PREAMBLE.pack(_MAGIC, len(header)), header, bytes(_aligned(start) - start)]
    position = 0
    for array, offset in zip(arrays, offsets, strict=True):
        parts += [bytes(offset - position), array]  # zero bytes up to the array's offset, then its bytes
        position = offset + array.nbytes
    return b"".join(parts)


def decode_result(blob: bytes) -> Result:
    """Inverse of encode_result; CorruptResultError if `blob` does not follow the format."""
    view = memoryview(blob)
    if len(view) < _PREAMBLE.size:
        raise CorruptResultError(
            f"result of {len(view)} bytes: shorter than the {_PREAMBLE.size}-byte preamble"
        )
    magic, size = _PREAMBLE.unpack_from(view)
    if magic != _MAGIC:
        raise CorruptResultError(f"result starts with {magic!r}, not the magic {_MAGIC!r}")
    start = _aligned(_PREAMBLE.size + size)
    if start > len(view):
        raise CorruptResultError(f"result of {len(view)} bytes cannot hold its {size}-byte header")
    try:
        header = json.loads(bytes(view[_PREAMBLE.size : _PREAMBLE.size + size]))
        kind, value, specs = header["kind"], header["value"], header["arrays"]
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptResultError(f"result header is not the JSON of kind, value and arrays: {exc}") from exc
    arrays = _arrays(view[start:], specs)
    try:
        if kind == "pass":
            return _pass_result(value, arrays)
        if kind == "sample":
            return _sample_result(value, arrays)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptResultError(f"{kind} result value is malformed: {type(exc).__name__}: {exc}") from exc
    if kind != "json" or not isinstance(value, dict) or arrays:
        raise CorruptResultError(f"result kind {kind!r} is not pass, sample or json (an object, no arrays)")
    return value


def _pass_result(value: dict[str, Any], arrays: list[np.ndarray]) -> PassResult:
    outputs = [{name: _at(arrays, index) for name, index in out.items()} for out in value["outputs"]]
    return PassResult(outputs=outputs, metrics=dict(value["metrics"]))


def _sample_result(value: dict[str, Any], arrays: list[np.ndarray]) -> SampleResult:
    sequences = [
        SampledSequence(
            _at(arrays, s["tokens"]),
            _at(arrays, s["logprobs"]),
            s["stop"],
            **{name: _maybe_at(arrays, s.get(name)) for name in _SEQUENCE_FIELDS},
        )
        for s in value["sequences"]
    ]
    prompt = {name: _maybe_at(arrays, value.get(name)) for name in _PROMPT_FIELDS}
    sparse = bool(value.get("target_prompt_is_sparse", False))
    return SampleResult(sequences, **prompt, target_prompt_is_sparse=sparse)


def _arrays(data: memoryview, specs: Any) -> list[np.ndarray]:
    """Views of the arrays `specs` describes in `data`, each checked to lie in order within it."""
    if not isinstance(specs, list):
        raise CorruptResultError(f"result header's arrays is not a list: {specs!r}")
    arrays, end = [], 0
    for i, spec in enumerate(specs):
        dtype, shape, offset = _spec(i, spec)
        count = math.prod(shape)
        if offset % _ALIGN or offset < end or offset + count * dtype.itemsize > len(data):
            raise CorruptResultError(
                f"result array {i} ({count} x {dtype.str} at offset {offset}) is not within the "
                f"{len(data)} data bytes, after array {i - 1} and at a multiple of {_ALIGN}"
            )
        arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
        end = offset + count * dtype.itemsize
    if end != len(data):
        raise CorruptResultError(f"result has {len(data) - end} bytes after its last array")
    return arrays


def _spec(i: int, spec: Any) -> tuple[np.dtype, list[int], int]:
    try:
        name, shape, offset = spec
        dtype = _dtype(name)
    except (TypeError, ValueError) as exc:
        raise CorruptResultError(f"result array {i}: {spec!r} is not [dtype, shape, offset]") from exc
    if dtype.kind not in _KINDS or dtype.byteorder == ">":
        raise CorruptResultError(f"result array {i}: dtype {name!r} is not a little-endian number or bool")
    if type(shape) is not list or not all(_is_size(n) for n in shape) or not _is_size(offset):
        raise CorruptResultError(f"result array {i}: shape {shape!r} or offset {offset!r} is not sizes")
    return dtype, shape, offset


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype:
    """numpy's dtype of a dtype string, parsed once per string (a result holds few, many times over)."""
    return np.dtype(name)


def _is_size(n: Any) -> bool:
    return type(n) is int and n >= 0  # not a bool, which is an int too


def _at(arrays: list[np.ndarray], index: Any) -> np.ndarray:
    if not _is_size(index) or index >= len(arrays):
        raise IndexError(f"array index {index!r} of {len(arrays)} arrays")
    return arrays[index]


def _maybe_at(arrays: list[np.ndarray], index: Any) -> np.ndarray | None:
    return None if index is None else _at(arrays, index)


def _little_endian(array: np.ndarray) -> np.ndarray:
    """`array` in C order and little-endian (itself when it is already)."""
    array = np.asarray(array)
    if array.dtype.kind not in _KINDS:
        raise TypeError(f"a result array holds booleans, integers or floats, not {array.dtype}")
    return np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
