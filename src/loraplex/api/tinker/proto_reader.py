"""A ForwardBackwardRequest body read without copying its arrays: the messages below hold memoryviews into
the body, found by walking the protobuf wire format in Python.

Why not protobuf's own parser: upb parses a message in one C call and copies every bytes field again when
Python reads it, holding the GIL throughout; on a 100 MiB body that held it 90-160 ms at a time (and the
event loop's thread with it), where this walk holds it for a few microseconds per field and numpy copies
the arrays out with the GIL released.

The walk takes the encodings the SDK writes. Anything else (a group, a wire type that does not fit its
field, a message field or oneof given twice, which protobuf would merge, text that is not UTF-8, an image
chunk, a malformed body) is left to upb, which parses the whole body and has the last word on what it
means or what is wrong with it. No tensors, no HTTP.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from loraplex.errors import UserError

Buffer = bytes | memoryview

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_U64 = 1 << 64
_MAX_FIELD_NUMBER = (1 << 29) - 1


@dataclass(frozen=True)
class SparseCsrMessage:
    """A SparseCsr: raw little-endian values, int64 crow_indices and col_indices."""

    values: Buffer = b""
    crow_indices: Buffer = b""
    col_indices: Buffer = b""


@dataclass(frozen=True)
class TensorMessage:
    """A Tensor: its dtype (a DType number), declared shape, and dense bytes or sparse CSR."""

    dtype: int = 0
    shape: list[int] = field(default_factory=list)
    dense: Buffer = b""
    sparse_csr: SparseCsrMessage | None = None


@dataclass(frozen=True)
class ChunkMessage:
    """A model_input Chunk: which of the oneof it is (None for an empty chunk) and, for encoded_text, its
    int32 token bytes."""

    kind: str | None
    tokens: Buffer = b""


@dataclass(frozen=True)
class DatumMessage:
    """A Datum: its chunks and loss_fn_inputs (provenance spans are not kept)."""

    model_input: list[ChunkMessage]
    loss_fn_inputs: dict[str, TensorMessage]


@dataclass(frozen=True)
class ForwardBackwardMessage:
    """A ForwardBackwardRequest; loss_fn_config_v2 values are None where they are not numbers."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float]
    loss_fn_config_v2: dict[str, float | None]
    data: list[DatumMessage]


class _LeftToProtobuf(Exception):
    """An encoding the walk does not take; upb reads the body instead."""


def read_forward_backward(body: Buffer) -> ForwardBackwardMessage:
    """The ForwardBackwardRequest of a body (UserError if it is not one), its bytes fields views of `body`
    when the walk takes its encoding."""
    view = memoryview(body).cast("B")
    try:
        return _request(view)
    except _LeftToProtobuf:
        pass
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(view)
    except DecodeError as exc:
        raise UserError(f"body is not a tinker_public.ForwardBackwardRequest protobuf: {exc}") from exc
    return _from_protobuf(msg)


# --- the walk


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    if pos < len(buf) and buf[pos] < 0x80:  # most tags and lengths: one byte
        return buf[pos], pos + 1
    result, shift = 0, 0
    while pos < len(buf) and shift < 70:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >= _U64:
                raise _LeftToProtobuf
            return result, pos
        shift += 7
    raise _LeftToProtobuf


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field in order: an int for varints, a memoryview else."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if not 0 < number <= _MAX_FIELD_NUMBER or key >> 32:
            raise _LeftToProtobuf
        if wire_type == _VARINT:
            value, pos = _varint(buf, pos)
        else:
            if wire_type == _LEN:
                size, pos = _varint(buf, pos)
            elif wire_type in (_I64, _I32):
                size = 8 if wire_type == _I64 else 4
            else:  # groups, and the wire types protobuf does not define
                raise _LeftToProtobuf
            if pos + size > end:
                raise _LeftToProtobuf
            value, pos = buf[pos : pos + size], pos + size
        yield number, wire_type, value


def _expect(wire_type: int, expected: int) -> None:
    if wire_type != expected:  # protobuf keeps such a field as unknown: upb knows how
        raise _LeftToProtobuf


def _text(value: memoryview) -> str:
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError:
        raise _LeftToProtobuf from None


def _signed(value: int, bits: int) -> int:
    """A varint as protobuf reads it into an int32 or int64 (and an enum): its low bits, two's complement."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _request(buf: memoryview) -> ForwardBackwardMessage:
    model_id, seq_id, loss_fn, forward_only = "", 0, "", False
    config: dict[str, float] = {}
    config_v2: dict[str, float | None] = {}
    data: list[DatumMessage] = []
    for number, wire_type, value in _fields(buf):
        if number == 1:
            _expect(wire_type, _LEN)
            model_id = _text(value)
        elif number == 2:
            _expect(wire_type, _VARINT)
            seq_id = _signed(value, 32)
        elif number == 3:
            _expect(wire_type, _LEN)
            data.append(_datum(value))
        elif number == 4:
            _expect(wire_type, _LEN)
            loss_fn = _text(value)
        elif number == 5:
            _expect(wire_type, _LEN)
            key, number_value = _entry(value, _I64)
            config[key] = struct.unpack("<d", number_value)[0] if number_value is not None else 0.0
        elif number == 6:
            _expect(wire_type, _VARINT)
            forward_only = value != 0
        elif number == 7:
            _expect(wire_type, _LEN)
            key, message = _entry(value, _LEN)
            config_v2[key] = _config_value(message) if message is not None else None
    return ForwardBackwardMessage(model_id, seq_id, loss_fn, forward_only, config, config_v2, data)


def _entry(buf: memoryview, value_wire_type: int) -> tuple[str, Any]:
    """A map entry's key ("" when absent) and its raw value (None when absent)."""
    key, value = "", None
    for number, wire_type, item in _fields(buf):
        if number == 1:
            _expect(wire_type, _LEN)
            key = _text(item)
        elif number == 2:
            _expect(wire_type, value_wire_type)
            if value is not None and value_wire_type == _LEN:  # a message given twice is merged
                raise _LeftToProtobuf
            value = item
        else:  # protobuf keeps such an entry out of the map
            raise _LeftToProtobuf
    return key, value


def _config_value(buf: memoryview) -> float | None:
    """A LossConfigValue: its number, or None when it holds text or nothing."""
    fields = list(_fields(buf))
    if len(fields) > 1:  # a oneof set twice
        raise _LeftToProtobuf
    for number, wire_type, value in fields:
        if number == 1:
            _expect(wire_type, _I64)
            return struct.unpack("<d", value)[0]
        if number == 2:
            _expect(wire_type, _LEN)
            _text(value)
    return None


def _datum(buf: memoryview) -> DatumMessage:
    chunks: list[ChunkMessage] = []
    inputs: dict[str, TensorMessage] = {}
    for number, wire_type, value in _fields(buf):
        if number == 1:
            _expect(wire_type, _LEN)
            chunks.append(_chunk(value))
        elif number == 2:
            _expect(wire_type, _LEN)
            key, tensor = _entry(value, _LEN)
            inputs[key] = _tensor(tensor) if tensor is not None else TensorMessage()
        elif number in (3, 4):  # provenance spans: unused, but protobuf checks them
            _expect(wire_type, _LEN)
            try:
                pb.ProvenanceSpan.FromString(value)
            except DecodeError:
                raise _LeftToProtobuf from None
    return DatumMessage(chunks, inputs)


def _chunk(buf: memoryview) -> ChunkMessage:
    fields = list(_fields(buf))
    if len(fields) > 1:  # a oneof set twice, or merged
        raise _LeftToProtobuf
    chunk = ChunkMessage(None)
    for number, wire_type, value in fields:
        if number != 1:  # image and dmel chunks are refused anyway; upb checks their structure
            raise _LeftToProtobuf
        _expect(wire_type, _LEN)
        tokens: Buffer = b""
        for inner, inner_type, item in _fields(value):
            if inner == 1:
                _expect(inner_type, _LEN)
                tokens = item
        chunk = ChunkMessage("encoded_text", tokens)
    return chunk


def _tensor(buf: memoryview) -> TensorMessage:
    dtype, shape = 0, []
    encodings: list[tuple[int, memoryview]] = []
    for number, wire_type, value in _fields(buf):
        if number in (1, 2):
            _expect(wire_type, _LEN)
            encodings.append((number, value))
        elif number == 3:
            _expect(wire_type, _VARINT)
            dtype = _signed(value, 32)
        elif number == 4:
            if wire_type == _VARINT:
                shape.append(_signed(value, 64))
            else:
                _expect(wire_type, _LEN)
                pos = 0
                while pos < len(value):
                    size, pos = _varint(value, pos)
                    shape.append(_signed(size, 64))
    if len(encodings) > 1:  # the oneof set twice (the last wins, or a repeated sparse_csr is merged)
        raise _LeftToProtobuf
    if not encodings:
        return TensorMessage(dtype, shape)
    number, value = encodings[0]
    if number == 1:
        return TensorMessage(dtype, shape, dense=value)
    return TensorMessage(dtype, shape, sparse_csr=_sparse_csr(value))


def _sparse_csr(buf: memoryview) -> SparseCsrMessage:
    arrays: dict[int, memoryview] = {}
    for number, wire_type, value in _fields(buf):
        if number in (1, 2, 3):
            _expect(wire_type, _LEN)
            arrays[number] = value  # a bytes field given twice: the last wins
    return SparseCsrMessage(*(arrays.get(number, b"") for number in (1, 2, 3)))


# --- what upb parsed, as the same messages


def _from_protobuf(msg: Any) -> ForwardBackwardMessage:
    v2 = {
        key: value.number if value.WhichOneof("value") == "number" else None
        for key, value in msg.loss_fn_config_v2.items()
    }
    data = [
        DatumMessage(
            [_chunk_from_protobuf(chunk) for chunk in datum.model_input],
            {key: _tensor_from_protobuf(tensor) for key, tensor in datum.loss_fn_inputs.items()},
        )
        for datum in msg.data
    ]
    return ForwardBackwardMessage(
        msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only, dict(msg.loss_fn_config), v2, data
    )


def _chunk_from_protobuf(chunk: Any) -> ChunkMessage:
    kind = chunk.WhichOneof("chunk")
    return ChunkMessage(kind, chunk.encoded_text.tokens if kind == "encoded_text" else b"")


def _tensor_from_protobuf(tensor: Any) -> TensorMessage:
    sparse = None
    if tensor.HasField("sparse_csr"):
        csr = tensor.sparse_csr
        sparse = SparseCsrMessage(csr.values, csr.crow_indices, csr.col_indices)
    return TensorMessage(tensor.dtype, list(tensor.shape), tensor.dense, sparse)
