"""Every seq_id a request names is consumed, whatever becomes of the request, so a refusal never wedges
the run; SDK routes this server lacks answer a clear, non-retryable 400 naming the feature."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from tests.api.test_http import KEY, _fb_body, _retrieve, _run
from tests.fakes import FakeEngine


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=2.0)
    with TestClient(create_app(Runtime.open(FakeEngine(), config))) as client:
        yield client


def _submit_then_train(http: TestClient, run: str, path: str, **kwargs: object) -> dict:
    """Submit a refused request as seq 1, then a forward_backward as seq 2; the refusal's outcome."""
    refused = http.post(f"/api/v1/{path}", headers=KEY, **kwargs)
    assert refused.status_code == 200, refused.text  # accepted as a future: its seq_id is consumed
    fb = http.post("/api/v1/forward_backward", content=_fb_body(run, 2), headers=KEY).json()
    assert "loss_fn_outputs" in _retrieve(http, fb["request_id"])  # the run goes on
    return _retrieve(http, refused.json()["request_id"])


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "optim_step",
            {"optimizer_params": {"type": "dimuon", "learning_rate": 0.01}},
            r"invalid request body: .*(adam_params|optim_params|optimizer_params)",
        ),
        ("optim_step", {"adam_params": {"learning_rate": -1.0}}, r"learning_rate: Input should be greater"),
        ("save_weights", {"path": "x", "ttl_seconds": 60}, r"ttl_seconds: Input should be greater than or"),
        ("save_weights_for_sampler", {"path": "a/b"}, r"checkpoint name"),
        (
            "save_weights_external",
            {"path": "x", "age_encryption_recipients": ["age1xyz"]},
            r"age_encryption_recipients\[0\] 'age1xyz' is not an age recipient",
        ),
        ("load_weights", {"path": "not-a-tinker-path"}, r"tinker://"),
    ],
)
def test_a_refused_json_request_fails_as_its_seq_ids_future_and_the_run_goes_on(
    http: TestClient, path: str, body: dict, message: str
) -> None:
    run = _run(http)
    outcome = _submit_then_train(http, run, path, json={"model_id": run, "seq_id": 1, **body})
    assert outcome["category"] == "user"
    assert re.search(message, outcome["error"]), outcome["error"]


def _proto(run: str, seq_id: int, datum: types.Datum, config: dict | None = None) -> bytes:
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy", loss_fn_config=config)
    request = types.ForwardBackwardRequest(model_id=run, seq_id=seq_id, forward_backward_input=fb_input)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_that_cannot_be_decoded_fails_as_its_seq_ids_future(http: TestClient) -> None:
    run = _run(http)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4])},
    )
    body = _proto(run, 1, datum, config={"mode": "fancy"})  # a string: only numbers are served
    outcome = _submit_then_train(http, run, "forward_backward", content=body)
    assert outcome == {
        "error": "loss_fn_config['mode'] must be a number (server-side custom losses are not supported)",
        "category": "user",
    }


def test_a_datum_declaring_more_rows_than_tokens_fails_as_its_seq_ids_future(http: TestClient) -> None:
    run = _run(http)
    targets = types.TensorData(
        data=[7], dtype="int64", shape=[1_000_000, 128], sparse_crow_indices=[0, 1], sparse_col_indices=[5]
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": targets}
    )
    outcome = _submit_then_train(http, run, "forward_backward", content=_proto(run, 1, datum))
    assert outcome == {
        "error": "datum 0: loss_fn_inputs['target_tokens']: shape [1000000, 128] does not start with the "
        "datum's N = 1 tokens; each loss_fn_inputs tensor is (N,) or (N, K), N the model_input length",
        "category": "user",
    }


def test_a_body_that_names_no_run_or_seq_id_is_a_422_with_a_body(http: TestClient) -> None:
    answer = http.post("/api/v1/optim_step", json={"adam_params": {}}, headers=KEY)
    assert answer.status_code == 422
    assert "model_id" in answer.json()["detail"] and answer.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("method", "path", "feature"),
    [
        ("PUT", "/sessions/s/project", "projects is not supported"),
        ("GET", "/billing/usage/events", "billing is not supported"),
        ("GET", "/no/such/route", "GET /api/v1/no/such/route is not a route of this server"),
        ("GET", "/create_model", "GET /api/v1/create_model is not a route of this server"),
    ],
)
def test_routes_this_server_lacks_answer_a_400_naming_them_never_a_bare_404_or_405(
    http: TestClient, method: str, path: str, feature: str
) -> None:
    answer = http.request(method, f"/api/v1{path}", headers=KEY)
    assert answer.status_code == 400 and answer.headers["x-should-retry"] == "false"
    assert feature in answer.json()["detail"]
