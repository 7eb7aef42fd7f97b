"""The zero-copy reader reads every forward_backward body as protobuf (upb) does: the same message, or the
same refusal, for the SDK's bodies, for hand-built ones, and for thousands of mutations of them (cut,
flipped, merged by concatenation, padded with unknown fields); and it takes the SDK's bodies without
copying their arrays."""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from loraplex.api.tinker.proto_reader import (
    ForwardBackwardMessage,
    _from_protobuf,
    _LeftToProtobuf,
    _request,
    read_forward_backward,
)
from loraplex.errors import UserError

SEED = 1405


def _sdk_body(seq_id: int, config: dict[str, float] | None = None, forward_only: bool = False) -> bytes:
    """What the 0.38.0 SDK sends: dense 1-D inputs, a 2-D target it sparsifies, both config maps."""
    sparse = torch.zeros(5, 4, dtype=torch.int64)
    sparse[1, 2], sparse[4, 0] = 7, 9
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints([3, 17, 9, 41, 5]),
            loss_fn_inputs={"target_tokens": sparse, "weights": torch.ones(5, 4)},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={
                "target_tokens": np.array([2, 3]),
                "advantages": np.array([0.5, -1.0], np.float32),
                "logprobs": np.array([-0.25, -2.0], np.float32),
            },
        ),
    ]
    loss = "cross_entropy" if not config else "ppo"
    fb_input = types.ForwardBackwardInput(data=datums, loss_fn=loss, loss_fn_config=config)
    request = types.ForwardBackwardRequest(
        model_id="s:train:0", seq_id=seq_id, forward_backward_input=fb_input
    )
    body = forward_backward_request_to_proto(request)
    body.forward_only = forward_only
    return body.SerializeToString()


def _hand_built() -> list[bytes]:
    """Bodies the SDK does not send, each with something of its own."""
    msg = pb.ForwardBackwardRequest(model_id="é:train:1", seq_id=-3, loss_fn="ppo", forward_only=True)
    msg.loss_fn_config["clip"] = 0.5
    msg.loss_fn_config_v2["text"].text = "custom"
    msg.loss_fn_config_v2["empty"].SetInParent()
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(3, dtype="<i4").tobytes()
    datum.model_input.add().encoded_text.tokens = b""
    datum.model_input.add()  # an empty chunk
    datum.loss_fn_inputs["no_encoding"].dtype = 77
    datum.loss_fn_inputs["negative"].shape[:] = [-1, 2**40]
    datum.loss_fn_inputs[""].sparse_csr.SetInParent()
    datum.model_input_spans.add().prompt_tokens.sequence_id = "prompt"
    image = pb.ForwardBackwardRequest()
    image.data.add().model_input.add().image.data = b"\x89PNG"
    return [msg.SerializeToString(), image.SerializeToString(), b"", _unpacked_shape(), *_merged_fields()]


def _merged_fields() -> list[bytes]:
    """Bodies with a field given twice deep inside, which protobuf merges or lets the last one win."""
    dense = pb.Tensor(dense=np.arange(2, dtype="<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[2])
    sparse = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 2])
    sparse.sparse_csr.values = np.array([5], "<i8").tobytes()
    sparse.sparse_csr.crow_indices = np.array([0, 1, 1], "<i8").tobytes()
    more = pb.Tensor()
    more.sparse_csr.col_indices = np.array([1], "<i8").tobytes()
    tensors = [
        dense.SerializeToString() + sparse.SerializeToString(),  # a oneof: the last wins
        sparse.SerializeToString() + more.SerializeToString(),  # sparse_csr merged
    ]
    bodies = [_field(3, _field(2, _field(1, b"t") + _field(2, tensor))) for tensor in tensors]
    value_twice = _field(1, b"t") + _field(2, dense.SerializeToString()) + _field(2, more.SerializeToString())
    bodies.append(_field(3, _field(2, value_twice)))
    tokens = [_field(1, _field(1, np.arange(n, dtype="<i4").tobytes())) for n in (2, 3)]
    bodies.append(_field(3, _field(1, tokens[0] + tokens[1])))  # encoded_text merged: the last tokens
    bodies.append(_field(3, _field(1, tokens[0] + _field(2, b""))))  # then an image chunk
    number_then_text = _field(1, b"k") + _field(2, b"\x09" + struct.pack("<d", 1.5) + _field(2, b"x"))
    bodies.append(_field(7, number_then_text))
    return bodies


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _unpacked_shape() -> bytes:
    """A Tensor whose repeated shape is written one varint field per size (protobuf accepts both forms)."""
    tensor = b"\x18\x02" + b"\x20\x03" + b"\x20\x02" + b"\x0a\x00"  # dtype INT64, shape 3, shape 2, dense b""
    entry = b"\x0a\x01t" + b"\x12" + bytes([len(tensor)]) + tensor
    datum = b"\x12" + bytes([len(entry)]) + entry
    return b"\x1a" + bytes([len(datum)]) + datum


BASES = [
    _sdk_body(1),
    _sdk_body(2, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, forward_only=True),
    *_hand_built(),
]


def _unknown_fields(rng: random.Random) -> bytes:
    """A few well-formed fields of numbers no message here uses, of every wire type."""
    number = rng.choice([9, 15, 100, 2**20])
    fields = [
        _varint(number << 3) + _varint(rng.getrandbits(64)),
        _varint(number << 3 | 1) + rng.randbytes(8),
        _varint(number << 3 | 2) + _varint(3) + b"abc",
        _varint(number << 3 | 5) + rng.randbytes(4),
    ]
    return b"".join(rng.sample(fields, rng.randint(1, 4)))


def _mutations(rng: random.Random, count: int) -> list[bytes]:
    bodies = []
    for _ in range(count):
        body = bytearray(rng.choice(BASES))
        kind = rng.randrange(5)
        if kind == 0 and body:  # cut short
            del body[rng.randrange(len(body)) :]
        elif kind == 1 and body:  # bytes flipped
            for _ in range(rng.randint(1, 3)):
                body[rng.randrange(len(body))] = rng.randrange(256)
        elif kind == 2:  # two bodies in one: protobuf merges them
            body += rng.choice(BASES)
        elif kind == 3:  # unknown fields before or after
            body = (
                bytearray(_unknown_fields(rng) + body) if rng.random() < 0.5 else body + _unknown_fields(rng)
            )
        elif body:  # a field's wire type changed
            body[0] = (body[0] & ~7) | rng.choice([0, 1, 2, 3, 5])
        bodies.append(bytes(body))
    return bodies


def _plain(msg: ForwardBackwardMessage) -> Any:
    """The message as comparable values: bytes for buffers, bit patterns for floats (NaN equals itself),
    maps sorted (upb iterates them in hash order)."""

    def number(value: float | None) -> bytes | None:
        return None if value is None else struct.pack("<d", value)

    def tensor(t: Any) -> Any:
        csr = t.sparse_csr
        sparse = None if csr is None else (bytes(csr.values), bytes(csr.crow_indices), bytes(csr.col_indices))
        return (t.dtype, tuple(t.shape), bytes(t.dense), sparse)

    data = [
        (
            [(chunk.kind, bytes(chunk.tokens)) for chunk in datum.model_input],
            sorted((key, tensor(t)) for key, t in datum.loss_fn_inputs.items()),
        )
        for datum in msg.data
    ]
    return (
        msg.model_id,
        msg.seq_id,
        msg.loss_fn,
        msg.forward_only,
        sorted((key, number(value)) for key, value in msg.loss_fn_config.items()),
        sorted((key, number(value)) for key, value in msg.loss_fn_config_v2.items()),
        data,
    )


def _by_protobuf(body: bytes) -> tuple[str, Any]:
    try:
        return "message", _plain(_from_protobuf(pb.ForwardBackwardRequest.FromString(body)))
    except DecodeError as exc:
        return "refused", f"body is not a tinker_public.ForwardBackwardRequest protobuf: {exc}"


def _by_reader(body: bytes) -> tuple[str, Any]:
    try:
        return "message", _plain(read_forward_backward(body))
    except UserError as refusal:
        return "refused", str(refusal)


@pytest.mark.parametrize("body", BASES, ids=[f"base{i}" for i in range(len(BASES))])
def test_every_base_body_reads_as_protobuf_reads_it(body: bytes) -> None:
    assert _by_reader(body) == _by_protobuf(body)


def test_thousands_of_mutated_bodies_read_as_protobuf_reads_them_and_the_walk_takes_many() -> None:
    rng = random.Random(SEED)
    walked = 0
    for body in _mutations(rng, 20_000):
        assert _by_reader(body) == _by_protobuf(body), body
        try:
            _request(memoryview(body))
            walked += 1
        except _LeftToProtobuf:
            pass
    assert walked > 2500  # the walk itself answered, not only protobuf behind it


def test_the_sdks_bodies_are_read_without_copying_their_arrays() -> None:
    body = _sdk_body(1)
    msg = read_forward_backward(body)
    buffers = [msg.data[1].model_input[0].tokens, msg.data[1].loss_fn_inputs["advantages"].dense]
    csr = msg.data[0].loss_fn_inputs["target_tokens"].sparse_csr
    assert csr is not None
    buffers += [csr.values, csr.crow_indices, csr.col_indices]
    assert all(isinstance(buffer, memoryview) and buffer.obj is body for buffer in buffers)


def test_a_body_that_is_not_protobuf_is_refused_with_protobufs_words() -> None:
    with pytest.raises(UserError) as refused:
        read_forward_backward(b"\xff\xff\xff\xff")
    assert str(refused.value) == (
        "body is not a tinker_public.ForwardBackwardRequest protobuf: Error parsing message with type "
        "'tinker_public.ForwardBackwardRequest': Wire format was corrupt"
    )
