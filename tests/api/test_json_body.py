"""asample reads its own body (to validate a long prompt off the event loop) and answers every malformed one
as FastAPI answers a route that declares the body: the same status and the same error, field by field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.api.tinker.wire import AsampleRequest, describe_errors
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from tests.api.test_http import KEY
from tests.fakes import FakeEngine

JSON = "application/json"
BODIES = [
    (b"", JSON),
    (b"{", JSON),
    (b'{"seq_id": 1,}', JSON),
    (b"\xff\xfe{}", JSON),  # not text
    (b"[" * 100_000 + b"]" * 100_000, JSON),  # nested past the decoder's recursion limit
    (b"null", JSON),
    (b"[]", JSON),
    (b'"text"', JSON),
    (b"{}", JSON),
    (b'{"sampling_session_id": 5, "seq_id": -1, "prompt": {"chunks": [{"tokens": ["a"]}]}}', JSON),
    (b'{"sampling_session_id": "s", "seq_id": NaN, "prompt": {"chunks": []}}', JSON),
    (b'{"sampling_session_id": "s", "seq_id": 0, "prompt": {}, "num_samples": 0}', JSON),
    (b'{"sampling_session_id": "s", "seq_id": 0, "prompt": {"chunks": []}, "num_samples": 99999}', JSON),
    (b'{"sampling_session_id": "\\ud800", "seq_id": 0, "prompt": {"chunks": []}}', JSON),
    (b"{}", None),  # no Content-Type: FastAPI's strict default does not read it as JSON
    (b"{}", "text/plain"),
    (b"{}", "application/xml"),
    (b"{", "application/json; charset=utf-8"),
    (b"{}", "application/vnd.loraplex+json"),
]


@pytest.fixture
def ours(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path)))) as client:
        yield client


@pytest.fixture
def fastapis() -> Iterator[TestClient]:
    """A route that lets FastAPI read the body (the one asample had), its errors put as loraplex puts them
    (api/app.py)."""
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_errors(error.errors())}, status_code=422)

    @app.post("/api/v1/asample")
    def asample(body: AsampleRequest) -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        yield client


def _answer(client: TestClient, body: bytes, content_type: str | None) -> tuple[int, str]:
    headers = {**KEY, **({"Content-Type": content_type} if content_type else {})}
    reply = client.post("/api/v1/asample", content=body, headers=headers)
    return reply.status_code, reply.json()["detail"]


@pytest.mark.parametrize(("body", "content_type"), BODIES, ids=[f"body{i}" for i in range(len(BODIES))])
def test_a_malformed_asample_body_is_answered_as_fastapi_answers_it(
    ours: TestClient, fastapis: TestClient, body: bytes, content_type: str | None
) -> None:
    theirs = _answer(fastapis, body, content_type)
    assert theirs[0] in (400, 422)
    assert _answer(ours, body, content_type) == theirs
