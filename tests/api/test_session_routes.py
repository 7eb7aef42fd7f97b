"""The session search, trace and storage routes over HTTP, in-process over the fake engine: another
tenant's session answers like a missing one, the trace URL is its own credential and only for its file,
and what this server lacks (projects) is a 400 naming it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.keys import create_key
from loraplex.runtime.core.checkpoints import CheckpointPath
from tests.fakes import FakeEngine


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    """A client of a keyed server, and the API-key headers of alice and bob."""
    service = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path, auth="keys"))
    keys = {who: {"X-API-Key": create_key(service.store, who)} for who in ("alice", "bob")}
    with TestClient(create_app(service)) as http:
        yield http, keys


def _session(http: TestClient, key: dict[str, str], **body: object) -> str:
    return http.post("/api/v1/create_session", json=body, headers=key).json()["session_id"]


def test_another_tenants_session_is_not_found_and_never_searched(served) -> None:
    http, keys = served
    session = _session(http, keys["alice"], display_name="mine")
    assert http.get(f"/api/v1/sessions/{session}/trace_export", headers=keys["bob"]).status_code == 404
    found = http.post("/api/v1/sessions/search", json={"session_id": session}, headers=keys["bob"]).json()
    assert found == {"sessions": [], "next_cursor": None}
    mine = http.post("/api/v1/sessions/search", json={"display_name": "MINE"}, headers=keys["alice"]).json()
    assert [s["session_id"] for s in mine["sessions"]] == [session]


def test_the_trace_url_needs_no_key_and_its_token_serves_only_that_trace(served) -> None:
    http, keys = served
    session = _session(http, keys["alice"])
    answer = http.get(f"/api/v1/sessions/{session}/trace_export", headers=keys["alice"]).json()
    assert answer["status"] == "ready" and answer["error"] is None
    url = answer["url"].removeprefix(str(http.base_url))
    assert url.endswith(f"/{session}.json")
    assert http.get(url).json() == {"displayTimeUnit": "ms", "traceEvents": []}  # no API key

    token = url.split("/")[-2]
    other_file = http.get(f"/api/v1/session_traces/{token}/s0000000000000000.json")
    assert other_file.status_code == 403 and "another file" in other_file.json()["detail"]
    forged = http.get(f"/api/v1/session_traces/{token[:-4]}AAAA/{session}.json")
    assert forged.status_code == 403 and forged.json()["detail"] == "invalid download token"
    checkpoint_token = http.app.state.downloads.sign(  # type: ignore[attr-defined]
        "alice",
        CheckpointPath.parse("tinker://r:train:0/weights/a"),
        "adapter_config.json",
        int(time.time()) + 60,
    )
    refused = http.get(f"/api/v1/session_traces/{checkpoint_token}/adapter_config.json")
    assert refused.status_code == 403 and "another file" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("method", "path", "body", "where"),
    [
        ("POST", "/sessions/search", {"project_ids": ["p"]}, "project_ids of POST /api/v1/sessions/search"),
        (
            "GET",
            "/billing/usage/checkpoints/current?project_id=p",
            None,
            "project_id of GET /api/v1/billing/usage/checkpoints/current",
        ),
    ],
)
def test_naming_a_project_is_a_400_saying_projects_are_not_supported(
    served, method, path, body, where
) -> None:
    http, keys = served
    answer = http.request(method, f"/api/v1{path}", json=body, headers=keys["alice"])
    assert answer.status_code == 400 and answer.headers["x-should-retry"] == "false"
    assert answer.json()["detail"] == f"projects is not supported by this server ({where})"


def test_a_display_name_is_free_text_up_to_max_metadata_bytes(served) -> None:
    """The cookbook names sessions after long dataset paths: far past a checkpoint name's 128 bytes."""
    http, keys = served
    long_name = "chat_sl-" + "/data/" * 40
    answer = http.post("/api/v1/create_session", json={"display_name": long_name}, headers=keys["alice"])
    assert answer.status_code == 200
    answer = http.post("/api/v1/create_session", json={"display_name": "x" * 16385}, headers=keys["alice"])
    assert answer.status_code == 422 and "--max-metadata-bytes" in answer.json()["detail"]


def test_storage_usage_is_empty_without_checkpoints(served) -> None:
    http, keys = served
    answer = http.get("/api/v1/billing/usage/checkpoints/current", headers=keys["bob"]).json()
    assert answer == {"effective_rate_usd_per_gigabyte_month": None, "data": []}
