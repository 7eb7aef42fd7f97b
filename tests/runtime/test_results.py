"""Results survive the futures table as bytes: every sample output, as stored and read back; the format the
module docstring gives, byte for byte, with arrays as raw bytes and read back without a copy; a blob
written before an output existed reads as a result without it; corrupt bytes are refused, saying why."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import numpy as np
import pytest

from loraplex.engine.types import PassResult
from loraplex.runtime.control.store.results import CorruptResultError, decode_result, encode_result
from loraplex.runtime.core.sampling import SampledSequence, SampleResult


def test_every_sample_output_reads_back_exactly_as_stored() -> None:
    result = SampleResult(
        sequences=[
            SampledSequence(
                np.array([4, 5], np.int32),
                np.array([-0.5, -0.25], np.float32),
                "length",
                np.array([[4, 2], [5, -1]], np.int32),
                np.array([[-0.5, -1.5], [-0.25, np.nan]], np.float32),
            ),
            SampledSequence(np.array([9], np.int32), np.array([-1.0], np.float32), "stop"),
        ],
        prompt_logprobs=np.array([np.nan, -1.0, -2.0], np.float32),
        target_prompt_logprobs=np.array([[-2.0, np.nan], [np.nan, -0.75]], np.float32),
        target_prompt_is_sparse=True,
        prompt_alt_ids=np.array([[3, 3], [9, 1]], np.int32),
        prompt_alt_logprobs=np.array([[-0.5, -0.5], [-1.25, -2.5]], np.float32),
    )
    decoded = decode_result(encode_result(result))
    assert isinstance(decoded, SampleResult)
    first, second = decoded.sequences
    np.testing.assert_array_equal(first.topk_ids, result.sequences[0].topk_ids)
    np.testing.assert_array_equal(first.topk_logprobs, result.sequences[0].topk_logprobs)
    assert (second.topk_ids, second.topk_logprobs) == (None, None)
    np.testing.assert_array_equal(decoded.target_prompt_logprobs, result.target_prompt_logprobs)
    assert decoded.target_prompt_is_sparse
    np.testing.assert_array_equal(decoded.prompt_alt_ids, result.prompt_alt_ids)
    np.testing.assert_array_equal(decoded.prompt_alt_logprobs, result.prompt_alt_logprobs)
    assert decoded.prompt_alt_ids.dtype == np.int32


def _blob(header: dict[str, Any], data: bytes = b"") -> bytes:
    """A result written by hand as the module docstring lays it out."""
    text = json.dumps(header).encode()
    padding = bytes(-(8 + len(text)) % 8)
    return b"LPR1" + struct.pack("<I", len(text)) + text + padding + data


def test_a_blob_written_before_the_newer_sample_outputs_reads_without_them() -> None:
    sequence = {"tokens": 0, "logprobs": 1, "stop": "stop"}
    header = {
        "kind": "sample",
        "value": {"sequences": [sequence], "prompt_logprobs": None},
        "arrays": [["<i4", [1], 0], ["<f4", [1], 8]],
    }
    data = struct.pack("<i", 1) + bytes(4) + struct.pack("<f", -1.0)
    decoded = decode_result(_blob(header, data))
    assert isinstance(decoded, SampleResult) and decoded.sequences[0].tokens.tolist() == [1]
    assert decoded.sequences[0].logprobs.tolist() == [-1.0]
    assert decoded.target_prompt_logprobs is None and not decoded.target_prompt_is_sparse
    assert decoded.prompt_alt_ids is None and decoded.sequences[0].topk_ids is None


def test_a_pass_result_is_the_magic_its_header_and_its_arrays_raw_bytes_at_multiples_of_8() -> None:
    result = PassResult(
        outputs=[{"logprobs": np.array([-0.5, -1.0, -2.0], np.float32), "ids": np.array([7], np.int64)}],
        metrics={"loss:sum": 1.5},
    )
    header = (
        b'{"kind":"pass","value":{"outputs":[{"logprobs":0,"ids":1}],"metrics":{"loss:sum":1.5}},'
        b'"arrays":[["<f4",[3],0],["<i8",[1],16]]}'
    )
    assert len(header) == 127
    data = b"\x00\x00\x00\xbf" + b"\x00\x00\x80\xbf" + b"\x00\x00\x00\xc0" + bytes(4) + b"\x07" + bytes(7)
    assert encode_result(result) == b"LPR1" + b"\x7f\x00\x00\x00" + header + bytes(1) + data


def test_a_json_result_is_its_header_alone() -> None:
    header = b'{"kind":"json","value":{"path":"tinker://r/weights/a"},"arrays":[]}'
    assert encode_result({"path": "tinker://r/weights/a"}) == b"LPR1" + bytes(
        [len(header), 0, 0, 0]
    ) + header + bytes(5)
    assert decode_result(encode_result({"path": "tinker://r/weights/a"})) == {"path": "tinker://r/weights/a"}


def _typical_pass() -> PassResult:
    """8 datums of 256 tokens: float32 logprobs and elementwise loss."""
    rng = np.random.default_rng(0)
    return PassResult(
        outputs=[
            {
                "logprobs": rng.normal(size=256).astype(np.float32),
                "elementwise_loss": rng.random(256).astype(np.float32),
            }
            for _ in range(8)
        ],
        metrics={"loss:sum": 123.25},
    )


def test_a_typical_pass_result_costs_its_array_bytes_and_under_1_kib_not_base64s_third_more() -> None:
    blob = encode_result(_typical_pass())
    raw = 8 * 2 * 256 * 4
    assert raw < len(blob) < raw + 1024
    assert len(blob) < len(base64.b64encode(bytes(raw)))  # base64 alone took 4/3 of the raw bytes


def test_decoded_arrays_are_read_only_views_of_the_blob() -> None:
    blob = encode_result(_typical_pass())
    decoded = decode_result(blob)
    assert isinstance(decoded, PassResult)
    for output in decoded.outputs:
        for array in output.values():
            assert not array.flags.owndata and not array.flags.writeable
            assert _buffer_under(array).obj is blob
    np.testing.assert_array_equal(decoded.outputs[3]["logprobs"], _typical_pass().outputs[3]["logprobs"])


def _buffer_under(array: np.ndarray) -> memoryview:
    """The buffer at the bottom of a chain of views."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview)
    return base


def test_a_big_endian_array_is_stored_little_endian_with_the_same_values() -> None:
    values = np.array([[1.5, -2.0], [3.0, np.nan]], dtype=">f8")
    decoded = decode_result(encode_result(PassResult(outputs=[{"x": values}])))
    assert isinstance(decoded, PassResult)
    assert decoded.outputs[0]["x"].dtype == np.dtype("<f8")
    np.testing.assert_array_equal(decoded.outputs[0]["x"], values)


def test_an_array_that_is_not_booleans_integers_or_floats_is_refused() -> None:
    with pytest.raises(TypeError, match="booleans, integers or floats, not <U1"):
        encode_result(PassResult(outputs=[{"x": np.array(["a"])}]))


_GOOD = encode_result(PassResult(outputs=[{"x": np.array([1.0, 2.0], np.float32)}]))
_ONE_ARRAY = {"kind": "pass", "value": {"outputs": [{"x": 0}], "metrics": {}}}


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"LPR", "result of 3 bytes: shorter than the 8-byte preamble"),
        (b"LPR2" + _GOOD[4:], "result starts with b'LPR2', not the magic b'LPR1'"),
        (_GOOD[:8] + b"{}", "cannot hold its"),
        (_GOOD[:-1], "result array 0 .* is not within the 7 data bytes"),
        (_GOOD + bytes(8), "result has 8 bytes after its last array"),
        (_blob({"kind": "pass"}), "result header is not the JSON of kind, value and arrays"),
        (b"LPR1\x02\x00\x00\x00\xff\xfe" + bytes(6), "result header is not the JSON"),
        (
            _blob({**_ONE_ARRAY, "arrays": [["|O", [1], 0]]}, bytes(8)),
            "dtype '|O' is not a little-endian number",
        ),
        (_blob({**_ONE_ARRAY, "arrays": [[">f4", [1], 0]]}, bytes(8)), "dtype '>f4' is not a little-endian"),
        (
            _blob({**_ONE_ARRAY, "arrays": [["<f4", [-1], 0]]}, bytes(8)),
            "shape \\[-1\\] or offset 0 is not sizes",
        ),
        (_blob({**_ONE_ARRAY, "arrays": [["<f4", [1], 4]]}, bytes(8)), "at a multiple of 8"),
        (_blob({**_ONE_ARRAY, "arrays": [["<f4", [1]]]}, bytes(8)), "is not \\[dtype, shape, offset\\]"),
        (
            _blob({**_ONE_ARRAY, "value": {"outputs": [{"x": 1}]}, "arrays": [["<f4", [1], 0]]}, bytes(4)),
            "pass result value is malformed",
        ),
        (
            _blob(
                {
                    "kind": "pass",
                    "value": {"outputs": [{"x": 1}], "metrics": {}},
                    "arrays": [["<f4", [1], 0]],
                },
                bytes(4),
            ),
            "array index 1 of 1 arrays",
        ),
        (
            _blob({"kind": "table", "value": {}, "arrays": []}),
            "result kind 'table' is not pass, sample or json",
        ),
        (
            _blob({"kind": "json", "value": [1], "arrays": []}),
            "is not pass, sample or json \\(an object, no arrays\\)",
        ),
    ],
)
def test_corrupt_bytes_are_refused_saying_what_is_wrong(blob: bytes, message: str) -> None:
    with pytest.raises(CorruptResultError, match=message):
        decode_result(blob)
