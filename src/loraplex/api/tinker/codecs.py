"""Protobuf codecs: forward_backward request bytes (maybe zstd) -> ForwardBackward command; PassResult ->
ForwardBackwardOutput and SampleResult -> SampleResponse bytes, plus their JSON forms.

Uses the schema the SDK ships (`tinker.proto.tinker_public_pb2`); request bodies are read by
proto_reader.py. Arrays are raw little-endian numpy buffers. A body's declared sizes are checked against
the request limits (api/limits.py) before anything is decompressed or densified, and each tensor's first
dimension against its datum's tokens before it is decoded. Large bodies and results go through these
functions on the codec pool (codec_pool.py), never on the event loop. numpy only, no tensors; shape checks
against the model are the engine's (validate_pass_request).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from loraplex.api.limits import MIB, RequestLimits, current_limits
from loraplex.api.tinker.json_render import JsonList, dumps
from loraplex.api.tinker.proto_reader import (
    Buffer,
    DatumMessage,
    ForwardBackwardMessage,
    SparseCsrMessage,
    TensorMessage,
    read_forward_backward,
)
from loraplex.api.tinker.sparse import csr_problem, densify, to_csr
from loraplex.errors import UserError
from loraplex.runtime.core.commands import DatumInput, ForwardBackward, PassResult
from loraplex.runtime.core.sampling import SampleResult

# zstd output is read this much at a time: a bomb is refused at most this far past the limit.
_DECOMPRESS_PIECE_BYTES = MIB

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
_PROTO_DTYPES = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# Values the JSON forms convert to Python at a time (a few milliseconds each).
_JSON_PIECE_VALUES = 1 << 14
# What an unscored top-k cell reads as on the wire (docs/PROTOCOL.md §7.3).
_TOPK_EMPTY_ID, _TOPK_EMPTY_LOGPROB = 0, -99999.0


class PayloadTooLargeError(UserError):
    """The request body exceeds what the server accepts (413)."""

    status_code = 413


def decompress(body: Buffer, content_encoding: str | None) -> Buffer:
    """Undo Content-Encoding: zstd. A body that would decompress past the forward body limit is refused
    (413) by its frame header when that declares the size, else once that many bytes came out."""
    if not content_encoding or content_encoding == "identity":
        return body
    if content_encoding != "zstd":
        raise UserError(f"unsupported Content-Encoding {content_encoding!r}; use zstd or none")
    limit = current_limits().max_forward_body_bytes
    too_large = PayloadTooLargeError(
        f"zstd body decompresses to over {limit} bytes, the limit of forward_backward bodies on this "
        "server (set by --max-tokens-per-datum and --max-target-width)"
    )
    try:
        if zstandard.frame_content_size(body) > limit:  # -1 when the frame does not declare it
            raise too_large
        # Pieces go straight into one buffer (its pages untouched until written), not into a join that
        # would copy the whole body again with the GIL held.
        out, size = memoryview(np.empty(limit + 1, np.uint8)), 0
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while piece := reader.readinto(out[size : size + _DECOMPRESS_PIECE_BYTES]):
                size += piece
                if size > limit:
                    raise too_large
    except zstandard.ZstdError as exc:
        raise UserError(f"corrupt zstd body: {exc}") from exc
    return out[:size]


def parse_forward_backward(body: Buffer) -> ForwardBackwardMessage:
    """The ForwardBackwardRequest message of a body (UserError if it is not one); its model_id and seq_id
    are known from here on, so what `forward_backward_command` refuses can be recorded against them."""
    return read_forward_backward(body)


def forward_backward_command(msg: ForwardBackwardMessage) -> ForwardBackward:
    """The command a parsed ForwardBackwardRequest asks for (UserError naming what cannot be served)."""
    _check_declared_shapes(msg, current_limits())
    datums = [_datum(i, d) for i, d in enumerate(msg.data)]
    return ForwardBackward(msg.loss_fn, _loss_config(msg), datums, msg.forward_only)


def _check_declared_shapes(msg: ForwardBackwardMessage, limits: RequestLimits) -> None:
    """Refuse, from the declared shapes alone, tensors that would take more memory to decode than the
    limits allow: a sparse tensor's shape costs a few bytes on the wire whatever it declares. Sizes are
    Python ints, which a huge shape cannot wrap around as numpy's int64 product can."""
    total = 0
    for index, datum in enumerate(msg.data):
        for key, tensor in datum.loss_fn_inputs.items():
            where, shape = f"datum {index}: loss_fn_inputs[{key!r}]", list(tensor.shape)
            if len(shape) > 2 or min(shape, default=0) < 0:
                raise UserError(f"{where}: shape {shape} is not (N,) or (N, K) with sizes >= 0")
            if len(shape) == 2 and shape[1] > limits.max_target_width:
                raise UserError(
                    f"{where}: shape {shape} is {shape[1]} wide; this server takes (N, K) inputs up to "
                    f"K = {limits.max_target_width} (--max-target-width)"
                )
            total += math.prod(shape)
            if total > limits.max_decoded_values:
                raise UserError(
                    f"{where}: shape {shape} takes the request's loss_fn_inputs to {total} values, over the "
                    f"{limits.max_decoded_values} this server decodes per request "
                    "(--max-tokens-per-request × --max-target-width)"
                )


def _loss_config(msg: ForwardBackwardMessage) -> dict[str, float]:
    if not msg.loss_fn_config_v2:
        return dict(msg.loss_fn_config)
    config = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value is None:
            raise UserError(
                f"loss_fn_config[{key!r}] must be a number (server-side custom losses are not supported)"
            )
        config[key] = value
    return config


def _datum(index: int, datum: DatumMessage) -> DatumInput:
    pieces = []
    for chunk in datum.model_input:
        if chunk.kind != "encoded_text":
            raise UserError(f"datum {index}: {chunk.kind} chunks are not supported; send encoded_text tokens")
        pieces.append(_frombuffer(f"datum {index}: model_input", chunk.tokens, np.dtype("<i4")))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    inputs = {
        key: _tensor(f"datum {index}: loss_fn_inputs[{key!r}]", t, len(tokens))
        for key, t in datum.loss_fn_inputs.items()
    }
    return DatumInput(tokens, inputs)


def _tensor(where: str, msg: TensorMessage, n_tokens: int) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype
        raise UserError(f"{where}: unsupported dtype {name}; use float32 or int64")
    if msg.sparse_csr is not None:
        return _densify(where, list(msg.shape), msg.sparse_csr, dtype, n_tokens)
    count = _whole_values(where, msg.dense, dtype)
    shape = list(msg.shape) or [count]
    if math.prod(shape) != count:
        raise UserError(f"{where}: shape {shape} does not match its {count} values")
    _check_first_dimension(where, shape, n_tokens)
    return _frombuffer(where, msg.dense, dtype).reshape(shape)


def _densify(
    where: str, shape: list[int], csr: SparseCsrMessage, dtype: np.dtype, n_tokens: int
) -> np.ndarray:
    """Sparse CSR (the SDK sparsifies 2-D target_tokens / weights) to dense, unlisted cells 0, once its
    structure is whole: a broken one would drop values or misplace them without an error."""
    if len(shape) != 2:
        raise UserError(f"{where}: a sparse CSR tensor is 2-D, got shape {shape}")
    _check_first_dimension(where, shape, n_tokens)
    values = _frombuffer(where, csr.values, dtype)
    crow = _frombuffer(where, csr.crow_indices, np.dtype("<i8"))
    cols = _frombuffer(where, csr.col_indices, np.dtype("<i8"))
    problem = csr_problem(shape, len(values), crow, cols)
    if problem is not None:
        raise UserError(f"{where}: sparse CSR tensor of shape {shape}: {problem}")
    return densify(shape, values, crow, cols, fill=0)


def _check_first_dimension(where: str, shape: list[int], n_tokens: int) -> None:
    """Every loss_fn_inputs tensor has one row per token of its datum: checked from the declared shape
    before anything is decoded, so a datum of a few tokens cannot declare a (1_000_000, K) target (the
    engine checks the same rule on the inputs its loss reads, engine/losses.py)."""
    if shape[0] != n_tokens:
        raise UserError(
            f"{where}: shape {shape} does not start with the datum's N = {n_tokens} tokens; each "
            "loss_fn_inputs tensor is (N,) or (N, K), N the model_input length"
        )


def _whole_values(where: str, raw: Buffer, dtype: np.dtype) -> int:
    """How many `dtype` values `raw` holds (UserError if its length is not a multiple)."""
    if len(raw) % dtype.itemsize:
        raise UserError(f"{where}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return len(raw) // dtype.itemsize


def _frombuffer(where: str, raw: Buffer, dtype: np.dtype) -> np.ndarray:
    """A native-order copy of `raw`'s values (numpy copies with the GIL released)."""
    _whole_values(where, raw, dtype)
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))


def encode_forward_backward_output(result: PassResult) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord per run of datums whose fields share trailing shapes."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
    groups: list[list[dict[str, np.ndarray]]] = []
    for output in result.outputs:
        if groups and _layout(groups[-1][0]) == _layout(output):
            groups[-1].append(output)
        else:
            groups.append([output])
    for group in groups:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name in group[0]:
            arrays = [_wire_array(out[name]) for out in group]
            field = record.fields[name]
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
            field.dtype = _PROTO_DTYPES[arrays[0].dtype]
            field.trailing_shape.extend(arrays[0].shape[1:])
    return msg.SerializeToString()


def _wire_array(array: np.ndarray) -> np.ndarray:
    """Floats go out as float32 and integers as int64, the public wire dtypes."""
    return np.ascontiguousarray(array, dtype=np.float32 if array.dtype.kind == "f" else np.int64)


def _layout(output: dict[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((name, a.shape[1:], a.dtype.str) for name, a in sorted(output.items()))


def forward_backward_output_json(result: PassResult, is_lazy: bool = False) -> dict[str, Any]:
    """The JSON form of ForwardBackwardOutput, for clients that do not ask for protobuf (e.g. curl); its
    arrays as JsonLists when `is_lazy` (for json_render.py: a large result never exists whole as Python
    values)."""
    outputs = [
        {
            k: {
                "data": _values_json(v, is_lazy),
                "dtype": "int64" if v.dtype.kind == "i" else "float32",
                "shape": list(v.shape),
            }
            for k, v in out.items()
        }
        for out in result.outputs
    ]
    return json_safe(
        {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": result.metrics}
    )


def encode_sample_response(result: SampleResult) -> bytes:
    """A SampleResponse: int32 tokens and float32 logprobs per sequence, and their top-k when asked; prompt
    scores, named ids' logprobs and prompt draws when asked."""
    msg = pb.SampleResponse()
    for sequence in result.sequences:
        wire = msg.sequences.add(
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=np.ascontiguousarray(sequence.tokens, "<i4").tobytes(),
            logprobs=np.ascontiguousarray(sequence.logprobs, "<f4").tobytes(),
        )
        if sequence.topk_ids is not None and sequence.topk_logprobs is not None:
            wire.topk_sampled_logprobs.CopyFrom(_topk_message(sequence.topk_ids, sequence.topk_logprobs))
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.ascontiguousarray(result.prompt_logprobs, "<f4").tobytes()
    if result.topk_prompt_ids is not None and result.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_message(result.topk_prompt_ids, result.topk_prompt_logprobs))
    if result.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(
            _target_message(result.target_prompt_logprobs, result.target_prompt_is_sparse)
        )
    if result.prompt_alt_ids is not None and result.prompt_alt_logprobs is not None:
        msg.prompt_alt_tokens.CopyFrom(
            pb.PromptAltTokens(
                tokens=_dense_message(result.prompt_alt_ids),
                logprobs=_dense_message(result.prompt_alt_logprobs),
            )
        )
    return msg.SerializeToString()


def _topk_message(ids_NK: np.ndarray, logprobs_NK: np.ndarray) -> Any:
    """A TopkLogprobs; unscored cells (id -1, logprob NaN) become the wire's sentinel (id 0, -99999)."""
    empty = ids_NK < 0
    ids = np.ascontiguousarray(np.where(empty, _TOPK_EMPTY_ID, ids_NK), "<i4")
    logprobs = np.ascontiguousarray(np.where(empty, _TOPK_EMPTY_LOGPROB, logprobs_NK), "<f4")
    length, k = ids.shape
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=length)


def _dense_message(array: np.ndarray) -> Any:
    """A dense Tensor in a public wire dtype (float32 or int64)."""
    array = _wire_array(array)
    return pb.Tensor(dense=array.tobytes(), dtype=_PROTO_DTYPES[array.dtype], shape=array.shape)


def _target_message(logprobs_RT: np.ndarray, is_sparse: bool) -> Any:
    """The logprobs of target_prompt_logprobs in the request's layout: 0.0 where it named -1 (NaN here), or,
    for a sparse request, only the cells that named an id."""
    is_named_RT = ~np.isnan(logprobs_RT)
    if not is_sparse:
        return _dense_message(np.where(is_named_RT, logprobs_RT, 0.0))
    crow, cols = to_csr(is_named_RT)
    csr = pb.SparseCsr(
        values=_wire_array(logprobs_RT[is_named_RT]).tobytes(),
        crow_indices=crow.tobytes(),
        col_indices=cols.tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=logprobs_RT.shape)


def sample_response_json(result: SampleResult, is_lazy: bool = False) -> dict[str, Any]:
    """The JSON form of SampleResponse (None where a prompt position was not scored), e.g. for curl: top-k
    as lists of [id, logprob] per position, named ids' logprobs and prompt draws as TensorData; arrays as
    JsonLists when `is_lazy` (see forward_backward_output_json)."""
    sequences = [
        {
            "stop_reason": s.stop_reason,
            "tokens": _values_json(s.tokens, is_lazy),
            "logprobs": _values_json(s.logprobs, is_lazy),
            "topk_logprobs": _topk_json(s.topk_ids, s.topk_logprobs, is_lazy),
        }
        for s in result.sequences
    ]
    alt = None
    if result.prompt_alt_ids is not None and result.prompt_alt_logprobs is not None:
        alt = {
            "tokens": _tensor_json(result.prompt_alt_ids, is_lazy),
            "logprobs": _tensor_json(result.prompt_alt_logprobs, is_lazy),
        }
    target = None
    if result.target_prompt_logprobs is not None:
        target = _target_json(result.target_prompt_logprobs, result.target_prompt_is_sparse, is_lazy)
    prompt = result.prompt_logprobs
    return json_safe(
        {
            "type": "sample",
            "sequences": sequences,
            "prompt_logprobs": None if prompt is None else _values_json(prompt, is_lazy),
            "topk_prompt_logprobs": _topk_json(result.topk_prompt_ids, result.topk_prompt_logprobs, is_lazy),
            "target_prompt_logprobs": target,
            "prompt_alt_tokens": alt,
        }
    )


def _topk_json(
    ids_NK: np.ndarray | None, logprobs_NK: np.ndarray | None, is_lazy: bool
) -> list[Any] | JsonList | None:
    """Per position, its scored [id, logprob] pairs, or None where none was scored."""
    if ids_NK is None or logprobs_NK is None:
        return None

    def pieces() -> Iterator[str]:
        for ids_K, logprobs_K in zip(ids_NK, logprobs_NK, strict=True):
            scored = zip(ids_K.tolist(), logprobs_K.tolist(), strict=True)
            pairs = [f"[{i},{_float_json(v)}]" for i, v in scored if i >= 0]
            yield "[" + ",".join(pairs) + "]" if pairs else "null"

    return _list_json(pieces, is_lazy)


def _float_json(value: float) -> str:
    """A float as json.dumps writes it, NaN and infinities as null (json_safe)."""
    return repr(value) if math.isfinite(value) else "null"


def _values_json(array: np.ndarray, is_lazy: bool) -> list[Any] | JsonList:
    """`array.ravel().tolist()`, NaN and infinities as None, converted a piece at a time: numpy's tolist
    holds the GIL (4M values, ~180 ms)."""
    flat = array.ravel()

    def pieces() -> Iterator[str]:
        for start in range(0, flat.size, _JSON_PIECE_VALUES):
            yield dumps(json_safe(flat[start : start + _JSON_PIECE_VALUES].tolist()))[1:-1]

    return _list_json(pieces, is_lazy)


def _list_json(pieces: Callable[[], Iterator[str]], is_lazy: bool) -> list[Any] | JsonList:
    """A JsonList of the pieces, or (not lazy) the list they spell."""
    return JsonList(pieces) if is_lazy else json.loads("[" + ",".join(pieces()) + "]")


def _tensor_json(array: np.ndarray, is_lazy: bool) -> dict[str, Any]:
    """A dense TensorData."""
    array = _wire_array(array)
    return {"data": _values_json(array, is_lazy), "dtype": array.dtype.name, "shape": list(array.shape)}


def _target_json(logprobs_RT: np.ndarray, is_sparse: bool, is_lazy: bool) -> dict[str, Any]:
    """target_prompt_logprobs as TensorData, in the request's layout (see _target_message)."""
    is_named_RT = ~np.isnan(logprobs_RT)
    if not is_sparse:
        return _tensor_json(np.where(is_named_RT, logprobs_RT, 0.0), is_lazy)
    crow, cols = to_csr(is_named_RT)
    return {
        **_tensor_json(logprobs_RT[is_named_RT], is_lazy),
        "shape": list(logprobs_RT.shape),
        "sparse_crow_indices": _values_json(crow, is_lazy),
        "sparse_col_indices": _values_json(cols, is_lazy),
    }


def json_safe(value: Any) -> Any:
    """`value` with every NaN and infinity as None: JSON has neither, and a result may hold them (an
    unscored prompt position, a step skipped for a non-finite gradient norm)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value
