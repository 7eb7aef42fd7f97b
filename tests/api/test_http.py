"""HTTP behaviour the SDK depends on, in-process over the fake engine: status codes with bodies,
long-poll then try_again, zstd bodies, JSON fallback, auth, sampling futures and 429 backpressure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from tests.fakes import FakeEngine

KEY = {"X-API-Key": "tml-local"}


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=0.3)
    with TestClient(create_app(Runtime.open(FakeEngine(), config))) as client:
        yield client


def _run(http: TestClient) -> str:
    session = http.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "fake/bigram", "lora_config": {"rank": 4}}
    future = http.post("/api/v1/create_model", json=body, headers=KEY).json()
    assert _retrieve(http, future["request_id"]) == {"model_id": future["model_id"], "type": "create_model"}
    return future["model_id"]


def _retrieve(http: TestClient, request_id: str, headers: dict | None = None):
    return http.post(
        "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers or KEY
    ).json()


def _fb_body(model_id: str, seq_id: int) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4])},
    )
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=fb_input)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_zstd_compressed_protobuf_forward_backward_is_accepted(http: TestClient) -> None:
    run = _run(http)
    body = zstandard.ZstdCompressor().compress(_fb_body(run, 1))
    headers = {**KEY, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    future = http.post("/api/v1/forward_backward", content=body, headers=headers).json()
    proto = http.post(
        "/api/v1/retrieve_future",
        json={"request_id": future["request_id"]},
        headers={**KEY, "Accept": "application/x-protobuf"},
    )
    assert proto.headers["content-type"] == "application/x-protobuf"
    as_json = _retrieve(http, future["request_id"])  # without Accept: protobuf, the JSON form
    assert as_json["metrics"]["loss:sum"] > 0 and as_json["loss_fn_outputs"][0]["logprobs"]["shape"] == [3]


def test_a_future_waiting_for_a_missing_seq_id_answers_try_again_after_the_long_poll(
    http: TestClient,
) -> None:
    run = _run(http)
    future = http.post("/api/v1/forward_backward", content=_fb_body(run, 2), headers=KEY).json()
    assert _retrieve(http, future["request_id"]) == {
        "type": "try_again",
        "request_id": future["request_id"],
        "queue_state": "active",
    }


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "detail"),
    [
        ("post", "/api/v1/forward_backward", {"content": b"\xff\xff"}, 400, "not a tinker_public"),
        ("post", "/api/v1/retrieve_future", {"json": {"request_id": "req-nope"}}, 404, "not found"),
        ("get", "/api/v1/training_runs/x:train:0", {}, 404, "not found"),
        ("delete", "/api/v1/training_runs/r/checkpoints/weights/.hidden", {}, 400, "invalid checkpoint name"),
        (
            "post",
            "/api/v1/weights_info",
            {"json": {"tinker_path": "tinker://r/secret/x"}},
            400,
            "kind must be one of",
        ),
    ],
)
def test_permanent_errors_are_4xx_with_a_body_never_409_or_5xx(
    http: TestClient, method, path, kwargs, status, detail
) -> None:
    reply = getattr(http, method)(path, headers=KEY, **kwargs)
    assert reply.status_code == status and detail in reply.json()["detail"]
    assert reply.headers["x-should-retry"] == "false"


def test_requests_without_an_api_key_get_401(http: TestClient) -> None:
    assert http.post("/api/v1/create_session", json={}).status_code == 401


def test_health_and_capabilities_need_no_session(http: TestClient) -> None:
    assert http.get("/api/v1/healthz").json()["status"] == "ok"
    models = http.get("/api/v1/get_server_capabilities", headers=KEY).json()["supported_models"]
    assert models[0]["model_name"] == "fake/bigram"


def test_heartbeats_after_finish_answer_410_so_the_sdk_stops_them(http: TestClient) -> None:
    session = http.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]
    assert (
        http.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=KEY).status_code == 200
    )
    http.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}, headers=KEY)
    assert (
        http.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=KEY).status_code == 410
    )


def test_heartbeats_of_an_unknown_session_answer_410_too_as_the_sdk_expects(http: TestClient) -> None:
    """docs/PROTOCOL.md: the SDK stops heartbeating on 410 only; a 404 would be retried forever."""
    answer = http.post("/api/v1/session_heartbeat", json={"session_id": "no-such-session"}, headers=KEY)
    assert answer.status_code == 410
    assert "no-such-session" in answer.json()["detail"]


def _sampler(http: TestClient) -> str:
    session = http.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "fake/bigram"}
    sampler = http.post("/api/v1/create_sampling_session", json=body, headers=KEY).json()
    assert http.get(f"/api/v1/samplers/{sampler['sampling_session_id']}", headers=KEY).json() == {
        "sampler_id": sampler["sampling_session_id"],
        "base_model": "fake/bigram",
        "model_path": None,
    }
    return sampler["sampling_session_id"]


def _asample(http: TestClient, sampler: str, seq_id: int = 0, **fields) -> httpx.Response:
    body = {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": 3,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "seed": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
        "prompt_logprobs": True,
        **fields,
    }
    return http.post("/api/v1/asample", json=body, headers=KEY)


def test_asample_promises_a_sequence_id_per_sample_and_answers_in_protobuf_or_json(http: TestClient) -> None:
    future = _asample(http, _sampler(http)).json()
    assert future["sample_sequence_ids"] == [f"{future['request_id']}:{i}" for i in range(3)]
    proto = http.post(
        "/api/v1/retrieve_future",
        json={"request_id": future["request_id"]},
        headers={**KEY, "Accept": "application/x-protobuf"},
    )
    decoded = deserialize_sample_response(proto.content)
    assert [(len(s.tokens), s.stop_reason) for s in decoded.sequences] == [(4, "length")] * 3
    as_json = _retrieve(http, future["request_id"])
    assert [s["tokens"] for s in as_json["sequences"]] == [s.tokens for s in decoded.sequences]
    assert as_json["prompt_logprobs"][0] is None and as_json["prompt_logprobs"][1:] == pytest.approx(
        decoded.prompt_logprobs[1:]
    )


def _targets(shape: list[int], data: list, dtype: str = "int64", **csr: list[int]) -> dict:
    """A target_prompt_logprobs TensorData as the SDK sends it; csr: its sparse_* index lists."""
    return {"target_prompt_logprobs": {"data": data, "dtype": dtype, "shape": shape, **csr}}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]}}, "'image'"),
        ({"num_samples": 0}, "num_samples"),
        (
            _targets([2, 1], [1.0, 2.0], dtype="float32"),
            "target_prompt_logprobs must be an int64 tensor of token ids, got 'float32'",
        ),
        (_targets([2], [1, 2]), "target_prompt_logprobs must be 2-D, [len(prompt) - 1, K], got shape [2]"),
        (_targets([2, 1], [1.5, 2]), "target_prompt_logprobs must hold integer token ids"),
        (
            _targets([2, 129], [1] * 258),
            "target_prompt_logprobs is 129 ids wide; this server scores up to 128 per prompt position "
            "(--max-topk-prompt-logprobs)",
        ),
        (_targets([2, 2], [1, 2, 3]), "target_prompt_logprobs: shape [2, 2] does not match its 3 values"),
        (
            _targets([2, 1], [7], sparse_crow_indices=[0, 1], sparse_col_indices=[0]),
            "sparse CSR tensor of shape [2, 1]: 2 crow_indices, expected rows + 1 = 3",
        ),
        (
            _targets([2, 1], [7], sparse_crow_indices=[0, 0, 1]),
            "a sparse CSR tensor needs both sparse_crow_indices and sparse_col_indices",
        ),
        (  # a sparse shape costs nothing on the wire: refused before anything is allocated
            _targets([10**9, 100], [], sparse_crow_indices=[0], sparse_col_indices=[]),
            "target_prompt_logprobs: shape [1000000000, 100] has over the 4194304 cells this server decodes",
        ),
    ],
)
def test_a_sampling_request_this_server_cannot_serve_is_a_400_naming_the_field(
    http: TestClient, fields: dict, named: str
) -> None:
    reply = _asample(http, _sampler(http), **fields)
    assert reply.status_code == 400 and named in reply.json()["detail"]


class _StalledSampler(FakeEngine):
    """Sampling never finishes, so the queue stays full."""

    def step_sampler(self, max_prefill_tokens=None):
        time.sleep(0.001)
        return []


def test_a_full_sampling_queue_answers_429_with_a_body_and_leaves_retrying_to_the_sdk(tmp_path: Path) -> None:
    config = ServerConfig(data_dir=tmp_path, max_queued_samples=3)
    with TestClient(create_app(Runtime.open(_StalledSampler(), config))) as http:
        sampler = _sampler(http)
        assert _asample(http, sampler, 0).status_code == 200
        refused = _asample(http, sampler, 1, num_samples=1)
        assert refused.status_code == 429 and "3 samples are queued" in refused.json()["detail"]
        assert "x-should-retry" not in refused.headers
        assert _asample(http, sampler, 0).status_code == 200  # the accepted request's resend still answers
