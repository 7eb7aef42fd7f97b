"""Admission limits of the API: every refusal names its limit and the value, and comes before anything the
request declares is allocated (shapes, decompressed sizes, body sizes); malformed input is a 4xx, never a
5xx, and a server error never shows the client more than an error id."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from loraplex.api.app import create_app
from loraplex.api.limits import DEFAULT_LIMITS, RequestLimits, limits_in_force
from loraplex.api.tinker.codecs import (
    PayloadTooLargeError,
    decompress,
    forward_backward_command,
    json_safe,
    parse_forward_backward,
)
from loraplex.api.tinker.wire import (
    AsampleRequest,
    CreateSessionRequest,
    SaveWeightsRequest,
    WireSamplingParams,
    describe_errors,
)
from loraplex.config import ServerConfig
from loraplex.engine.losses import LOSSES, resolve_loss_config, validate_datum_inputs
from loraplex.errors import ServerError, UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.futures import outcome_row
from tests.api.test_http import KEY, _asample, _retrieve, _sampler
from tests.fakes import FakeEngine

TARGETS = "datum 0: loss_fn_inputs['target_tokens']"


def _limits(**changes: int) -> RequestLimits:
    return dataclasses.replace(DEFAULT_LIMITS, **changes)


def _tensor(shape: list[int], dtype: int = pb.DTYPE_INT64, dense: bytes | None = None) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, dense=dense if dense is not None else b"")


def _sparse(shape: list[int], values: list[int], crow: list[int], cols: list[int]) -> pb.Tensor:
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape)
    tensor.sparse_csr.values = np.asarray(values, "<i8").tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
    tensor.sparse_csr.col_indices = np.asarray(cols, "<i8").tobytes()
    return tensor


def _request(*datums: dict[str, pb.Tensor], tokens: bytes = np.arange(3, dtype="<i4").tobytes()) -> Any:
    """A parsed ForwardBackwardRequest whose datums have these loss_fn_inputs (3 tokens each)."""
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    for inputs in datums:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = tokens
        for key, tensor in inputs.items():
            datum.loss_fn_inputs[key].CopyFrom(tensor)
    return parse_forward_backward(msg.SerializeToString())


def _refusal(msg: Any) -> str:
    with pytest.raises(UserError) as refused:
        forward_backward_command(msg)
    return str(refused.value)


# --- tensors: declared shapes are checked before anything is decoded


def test_a_sparse_shape_of_a_trillion_cells_is_refused_at_once_without_allocating() -> None:
    bomb = _request({"target_tokens": _sparse([1, 10**12], [7], [0, 1], [5])})  # the 88-byte tensor
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(UserError) as refused:
        forward_backward_command(bomb)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(refused.value) == (
        f"{TARGETS}: shape [1, 1000000000000] is 1000000000000 wide; this server takes (N, K) inputs up to "
        "K = 128 (--max-target-width)"
    )
    # It takes microseconds; the bound is loose so a busy CI host cannot fail it, and still far below any
    # walk over the cells.
    assert elapsed < 1.0 and peak < 64 * 1024


def test_declared_values_past_the_request_token_limit_times_k_are_refused() -> None:
    tall = _request({"target_tokens": _sparse([10**12, 1], [], [0], [])})
    assert _refusal(tall) == (
        f"{TARGETS}: shape [1000000000000, 1] takes the request's loss_fn_inputs to 1000000000000 values, "
        "over the 128000000 this server decodes per request (--max-tokens-per-request × --max-target-width)"
    )
    two_datums = _request(
        {"target_tokens": _tensor([3, 2], dense=bytes(48))},
        {"target_tokens": _tensor([2, 2], dense=bytes(32))},
    )
    with limits_in_force(_limits(max_tokens_per_request=4, max_target_width=2)):
        assert _refusal(two_datums) == (
            "datum 1: loss_fn_inputs['target_tokens']: shape [2, 2] takes the request's loss_fn_inputs to "
            "10 values, over the 8 this server decodes per request "
            "(--max-tokens-per-request × --max-target-width)"
        )


def test_a_one_token_datum_declaring_a_million_rows_is_refused_at_once_without_allocating() -> None:
    one_token = np.arange(1, dtype="<i4").tobytes()
    bomb = _request({"target_tokens": _sparse([1_000_000, 128], [7], [0, 1], [5])}, tokens=one_token)
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(UserError) as refused:
        forward_backward_command(bomb)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(refused.value) == (
        f"{TARGETS}: shape [1000000, 128] does not start with the datum's N = 1 tokens; each loss_fn_inputs "
        "tensor is (N,) or (N, K), N the model_input length"
    )
    # Densified, it would have taken 1 GB and seconds; refused, microseconds and a few KiB (loose bounds
    # for a busy host).
    assert elapsed < 1.0 and peak < 64 * 1024


@pytest.mark.parametrize(
    ("tensor", "shape"),
    [
        (_tensor([4], dense=bytes(32)), [4]),
        (_tensor([], dense=bytes(16)), [2]),  # no shape: 1-D, as long as its values
        (_tensor([2, 5], dense=bytes(80)), [2, 5]),
        (_sparse([4, 2], [5], [0, 1, 1, 1, 1], [0]), [4, 2]),
    ],
    ids=["dense", "without shape", "2-D", "sparse"],
)
def test_every_tensor_has_one_row_per_token_of_its_datum(tensor: pb.Tensor, shape: list[int]) -> None:
    inputs = {"target_tokens": _tensor([3], dense=bytes(24)), "any_key": tensor}  # keys the loss ignores too
    assert _refusal(_request(inputs)) == (
        f"datum 0: loss_fn_inputs['any_key']: shape {shape} does not start with the datum's N = 3 tokens; "
        "each loss_fn_inputs tensor is (N,) or (N, K), N the model_input length"
    )


@pytest.mark.parametrize("rows", [3, 4, 5])
def test_the_api_and_the_engine_refuse_the_same_first_dimensions(rows: int) -> None:
    """For every input every loss reads, a datum of 4 tokens: both take 4 rows, both refuse 3 and 5."""
    fills = {"target_tokens": 7, "clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "logprobs": -1.0}
    for loss, spec in LOSSES.items():
        for key in (*spec.required, *spec.optional):
            inputs = {
                name: np.full((rows if name == key else 4,), fills.get(name, 1.0), _INPUT_DTYPES[name])
                for name in (*spec.required, *spec.optional)
            }
            msg = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn=loss)
            datum = msg.data.add()
            datum.model_input.add().encoded_text.tokens = np.arange(4, dtype="<i4").tobytes()
            for name, array in inputs.items():
                dtype = pb.DTYPE_INT64 if array.dtype == np.int64 else pb.DTYPE_FLOAT32
                datum.loss_fn_inputs[name].CopyFrom(_tensor([len(array)], dtype, array.tobytes()))
            try:
                forward_backward_command(parse_forward_backward(msg.SerializeToString()))
                api_takes = True
            except UserError:
                api_takes = False
            try:
                validate_datum_inputs(loss, 0, 4, inputs, vocab_size=64, config=resolve_loss_config(loss, {}))
                engine_takes = True
            except UserError:
                engine_takes = False
            assert api_takes == engine_takes == (rows == 4), (loss, key)


_INPUT_DTYPES = {name: np.float32 for name in LOSSES["gspo"].optional + LOSSES["ppo"].required}
_INPUT_DTYPES["target_tokens"] = np.int64


@pytest.mark.parametrize("shape", [[2, 2, 2], [-1], [3, -2]])
def test_a_shape_other_than_n_or_n_by_k_is_refused(shape: list[int]) -> None:
    assert _refusal(_request({"target_tokens": _tensor(shape)})) == (
        f"{TARGETS}: shape {shape} is not (N,) or (N, K) with sizes >= 0"
    )


@pytest.mark.parametrize(
    ("crow", "cols", "problem"),
    [
        ([0, 1, 2], [1, 0], "3 crow_indices, expected rows + 1 = 4"),
        ([1, 1, 2, 2], [1, 0], "crow_indices start at 1, not 0"),
        ([0, 2, 1, 2], [1, 0], "crow_indices decrease"),
        ([0, 1, 1, 1], [1, 0], "crow_indices end at 1, not at the 2 values"),
        ([0, 1, 1, 2], [1], "1 col_indices for 2 values"),
        ([0, 1, 1, 2], [1, 2], "a col_index is outside [0, 2)"),
        ([0, 1, 1, 2], [-1, 0], "a col_index is outside [0, 2)"),
    ],
)
def test_a_broken_csr_structure_is_refused_not_densified(
    crow: list[int], cols: list[int], problem: str
) -> None:
    msg = _request({"target_tokens": _sparse([3, 2], [5, 6], crow, cols)})
    assert _refusal(msg) == f"{TARGETS}: sparse CSR tensor of shape [3, 2]: {problem}"


def test_a_whole_csr_tensor_densifies_with_its_values_in_place() -> None:
    msg = _request({"target_tokens": _sparse([3, 2], [5, 6], [0, 1, 1, 2], [1, 0])})
    dense = forward_backward_command(msg).datums[0].loss_fn_inputs["target_tokens"]
    np.testing.assert_array_equal(dense, [[0, 5], [0, 0], [6, 0]])


@pytest.mark.parametrize(
    ("tensor", "problem"),
    [
        (_sparse([3], [5], [0, 1], [0]), "a sparse CSR tensor is 2-D, got shape [3]"),
        (_tensor([4], dense=bytes(24)), "shape [4] does not match its 3 values"),
        (_tensor([3], dense=bytes(23)), "23 bytes is not a whole number of int64 values"),
        (_tensor([3], dtype=99, dense=bytes(24)), "unsupported dtype 99; use float32 or int64"),
        (_tensor([3], dtype=pb.DTYPE_BFLOAT16), "unsupported dtype DTYPE_BFLOAT16; use float32 or int64"),
    ],
)
def test_a_tensor_whose_bytes_do_not_fit_its_declaration_is_refused(tensor: pb.Tensor, problem: str) -> None:
    assert _refusal(_request({"target_tokens": tensor})) == f"{TARGETS}: {problem}"


def test_token_bytes_not_a_multiple_of_four_are_refused() -> None:
    msg = _request({"target_tokens": _tensor([1], dense=bytes(8))}, tokens=b"\x01\x00\x00\x00\x02")
    assert _refusal(msg) == "datum 0: model_input: 5 bytes is not a whole number of int32 values"


# --- zstd bodies: bounded before and while decompressing


def test_the_forward_body_limit_holds_the_heaviest_datum_the_sdk_sends() -> None:
    # The SDK sends 2-D inputs as CSR only below half density; just below it is their heaviest form.
    n, k = 64, 128
    filled = torch.zeros(n, k, dtype=torch.bool)
    filled[:, : k // 2 - 1] = True
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={
            "target_tokens": torch.where(filled, 7, 0),
            "weights": torch.where(filled, 0.5, 0.0),
            "logprobs": torch.full((n,), -1.0),
            "advantages": torch.ones(n),
        },
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="importance_sampling")
    request = types.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, forward_backward_input=fb_input)
    body = forward_backward_request_to_proto(request).SerializeToString()
    limits = _limits(max_tokens_per_datum=n, max_tokens_per_request=n, max_target_width=k)
    assert len(body) <= limits.max_forward_body_bytes - 2**20  # the datum's share, framing aside
    assert DEFAULT_LIMITS.max_forward_body_bytes == 32768 * (64 + 128 * 32) + 2**20


SMALL = _limits(max_tokens_per_datum=16, max_tokens_per_request=16, max_target_width=1)  # 1 MiB + 1536


@pytest.mark.parametrize("declares_its_size", [True, False])
def test_a_zstd_bomb_is_refused_before_it_expands(declares_its_size: bool) -> None:
    bomb = zstandard.ZstdCompressor(write_content_size=declares_its_size).compress(bytes(256 * 2**20))
    assert len(bomb) < 16 * 1024
    tracemalloc.start()
    with limits_in_force(SMALL), pytest.raises(PayloadTooLargeError) as refused:
        decompress(bomb, "zstd")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(refused.value) == (
        "zstd body decompresses to over 1050112 bytes, the limit of forward_backward bodies on this server "
        "(set by --max-tokens-per-datum and --max-target-width)"
    )
    assert refused.value.status_code == 413
    assert peak < (1 if declares_its_size else 4) * 2**20


def test_a_zstd_body_within_the_limit_decompresses_whole() -> None:
    body = bytes(range(256)) * 4096  # exactly 1 MiB
    with limits_in_force(SMALL):
        assert decompress(zstandard.ZstdCompressor().compress(body), "zstd") == body
    with pytest.raises(UserError, match=r"^corrupt zstd body: "):
        decompress(b"\x28\xb5\x2f\xfd garbage", "zstd")


# --- JSON bodies: sizes the operator limits, integers the database can hold


def _invalid(model: type[BaseModel], body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> str:
    with limits_in_force(limits), pytest.raises(ValidationError) as refused:
        model.model_validate(body)
    return describe_errors(refused.value.errors())


def test_user_metadata_is_bounded_in_entries_and_bytes_and_kept_as_text() -> None:
    metadata = {"a": "1", "b": "22", "c": "333"}
    assert _invalid(CreateSessionRequest, {"user_metadata": metadata}, _limits(max_metadata_entries=2)) == (
        "invalid request body: user_metadata: Value error, 3 entries, over the 2 this server keeps "
        "(--max-metadata-entries)"
    )
    assert _invalid(CreateSessionRequest, {"user_metadata": metadata}, _limits(max_metadata_bytes=8)) == (
        "invalid request body: user_metadata: Value error, 9 bytes of keys and values, over the 8 this "
        "server keeps (--max-metadata-bytes)"
    )
    session = CreateSessionRequest.model_validate({"user_metadata": {"step": 3, "lr": 1e-4, "on": True}})
    assert session.user_metadata == {"step": "3", "lr": "0.0001", "on": "True"}


def test_stop_lists_are_bounded_in_items_and_characters() -> None:
    assert _invalid(WireSamplingParams, {"stop": ["a", "b", "c"]}, _limits(max_stop_sequences=2)) == (
        "invalid request body: stop: Value error, 3 stop items, over the 2 this server takes "
        "(--max-stop-sequences)"
    )
    assert _invalid(WireSamplingParams, {"stop": "é" * 5}, _limits(max_stop_chars=4)) == (
        "invalid request body: stop: Value error, a stop string of 5 characters, over the 4 this server "
        "takes (--max-stop-chars)"
    )


def test_checkpoint_names_are_bounded_in_bytes() -> None:
    body = {"model_id": "s:train:0", "seq_id": 2, "path": "é" * 65}
    assert _invalid(SaveWeightsRequest, body) == (
        "invalid request body: path: Value error, a name of 130 bytes, over the 128 this server takes "
        "(--max-name-bytes)"
    )


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"seq_id": 2**63}, "seq_id: Input should be less than 9223372036854775808"),
        ({"seq_id": -1}, "seq_id: Input should be greater than or equal to 0"),
        (
            {"sampling_params": {"top_k": 2**63}},
            "sampling_params.top_k: Input should be less than 9223372036854775808",
        ),
        (
            {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2**64]}]}},
            "prompt.chunks.0.tokens.1: Input should be less than 9223372036854775808",
        ),
    ],
)
def test_an_integer_the_database_cannot_hold_is_refused(body: dict[str, Any], problem: str) -> None:
    valid = {"sampling_session_id": "s:sample:0", "seq_id": 0, "prompt": {"chunks": []}}
    assert _invalid(AsampleRequest, {**valid, **body}) == f"invalid request body: {problem}"


def test_a_ttl_is_an_hour_up_to_ten_years() -> None:
    body = {"model_id": "s:train:0", "seq_id": 2, "ttl_seconds": 10**12}
    assert _invalid(SaveWeightsRequest, body) == (
        "invalid request body: ttl_seconds: Input should be less than or equal to 315360000"
    )


def test_nan_and_infinity_in_results_become_null() -> None:
    value = {"metrics": {"grad_norm": math.nan, "loss:sum": 1.5}, "rows": [[-math.inf, 2.0], (math.inf,)]}
    assert json_safe(value) == {
        "metrics": {"grad_norm": None, "loss:sum": 1.5},
        "rows": [[None, 2.0], [None]],
    }


# --- over HTTP (the fake engine)

CONFIG = {
    "max_json_body_mib": 1,
    "max_tokens_per_datum": 16,
    "max_tokens_per_request": 16,
    "max_target_width": 1,
}


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=0.3, **CONFIG)
    with TestClient(create_app(Runtime.open(FakeEngine(), config))) as client:
        yield client


def _chunks(total: int, piece: int = 64 * 1024) -> Iterator[bytes]:
    """A body streamed without Content-Length."""
    for _ in range(total // piece):
        yield bytes(piece)


@pytest.mark.parametrize("is_chunked", [False, True])
@pytest.mark.parametrize(
    ("path", "limit", "why"),
    [
        ("/api/v1/asample", 2**20, "--max-json-body-mib 1"),  # a prompt may be large
        # Every field of a create_session is bounded: its body is, at 12 x 16 KiB of metadata + 64 KiB.
        ("/api/v1/create_session", 2**18, "this route's fields are bounded: --max-metadata-bytes 16384"),
        ("/api/v1/forward_backward", 2**20 + 16 * 96, "set by --max-tokens-per-datum and --max-target-width"),
    ],
)
def test_a_body_over_its_routes_limit_is_a_413_naming_the_limit(
    http: TestClient, is_chunked: bool, path: str, limit: int, why: str
) -> None:
    body = _chunks(4 * 2**20) if is_chunked else bytes(limit + 1)
    reply = http.post(path, content=body, headers=KEY)
    assert reply.status_code == 413
    assert reply.json() == {
        "detail": f"request body of {path} is over {limit} bytes, the limit of this server ({why})"
    }


def test_nan_in_a_field_that_fails_validation_is_a_422_with_a_json_body(http: TestClient) -> None:
    body = '{"sampling_session_id": "s:sample:0", "seq_id": NaN, "prompt": {"chunks": []}}'
    reply = http.post("/api/v1/asample", content=body, headers={**KEY, "Content-Type": "application/json"})
    assert reply.status_code == 422
    assert reply.json() == {"detail": "invalid request body: body.seq_id: Input should be a finite number"}


def test_an_offset_past_64_bits_is_a_422(http: TestClient) -> None:
    reply = http.get("/api/v1/training_runs", params={"offset": 2**63}, headers=KEY)
    assert reply.status_code == 422
    assert reply.json() == {
        "detail": "invalid request body: query.offset: Input should be less than 9223372036854775808"
    }


def test_num_samples_past_what_the_server_queues_is_refused_also_in_a_resend(http: TestClient) -> None:
    sampler = _sampler(http)
    assert _asample(http, sampler, 0).status_code == 200
    resend = _asample(http, sampler, 0, num_samples=2**31)  # would promise 2**31 sequence ids
    assert resend.status_code == 422
    assert resend.json() == {
        "detail": "invalid request body: body.num_samples: Value error, 2147483648 samples, over the 4096 "
        "this server queues (--max-queued-samples)"
    }


def test_a_result_holding_nan_reaches_a_json_client_as_null(http: TestClient) -> None:
    futures = http.app.state.futures
    record = futures.create("local", "OptimStep")
    result = {"metrics": {"grad_norm": math.nan, "loss:sum": 1.5}, "rows": [-math.inf]}
    futures.settle([(outcome_row(record.id, result), result)], is_written=True)
    assert _retrieve(http, record.id) == {"metrics": {"grad_norm": None, "loss:sum": 1.5}, "rows": [None]}


@pytest.mark.parametrize("error", [ServerError("cannot read /var/lib/loraplex/db"), OSError("/srv/secret")])
def test_a_server_error_answers_an_error_id_and_logs_the_detail(
    http: TestClient, monkeypatch, caplog, error: Exception
) -> None:
    def broken(*_args: object) -> None:
        raise error

    monkeypatch.setattr(http.app.state.catalog, "runs", broken)
    quiet = TestClient(http.app, raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="loraplex.api.app"):
        reply = quiet.get("/api/v1/training_runs", headers=KEY)
    detail = reply.json()["detail"]
    error_id = detail.removeprefix("internal server error (error id ")[:12]
    assert reply.status_code == 500
    assert detail == f"internal server error (error id {error_id}; the server log has the details)"
    assert caplog.records[0].getMessage() == f"server error {error_id}: {error!r}"
