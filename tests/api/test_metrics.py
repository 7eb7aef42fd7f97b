"""/metrics in-process over the fake engine: who may read it, its labels, and that docs/METRICS.md and the
Grafana dashboard name exactly what it exports; the log formats of the request log."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.log_format import JsonFormatter, TextFormatter
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.keys import create_key
from loraplex.runtime.control.store import Store
from loraplex.runtime.observability.telemetry import DEVICE_MEMORY_METRICS, SAMPLER_SERVER_METRICS
from tests.fakes import FakeEngine

DOCS = Path(__file__).resolve().parents[2] / "docs"
KEY = {"X-API-Key": "tml-local"}


def _app(tmp_path: Path, **config: object) -> TestClient:
    service = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path, **config))  # type: ignore[arg-type]
    return TestClient(create_app(service))


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with _app(tmp_path) as client:
        yield client


def _samples(http: TestClient, headers: dict[str, str] = KEY) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics", headers=headers).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _exported_names(http: TestClient) -> set[str]:
    """Every sample name /metrics exports after a little traffic, the CUDA-only ones, and the vLLM
    sampler's (tests/vllm checks those are exported with --sampler vllm)."""
    http.post("/api/v1/create_session", json={}, headers=KEY)
    return {name for name, _ in _samples(http)} | set(DEVICE_MEMORY_METRICS) | set(SAMPLER_SERVER_METRICS)


def test_metrics_takes_any_tenants_key_or_none_when_public(tmp_path: Path) -> None:
    with _app(tmp_path / "keys", auth="keys") as http:
        key = create_key(Store(ServerConfig(data_dir=tmp_path / "keys").resolved_database_url()), "alice")
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"X-API-Key": "tml-unknown"}).status_code == 401
        assert http.get("/metrics", headers={"X-API-Key": key}).status_code == 200
        assert http.get("/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with _app(tmp_path / "public", auth="keys", metrics_public=True) as http:
        response = http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")


def test_routes_are_labelled_by_template_and_errors_by_category(http: TestClient) -> None:
    assert http.get("/api/v1/samplers/some-sampler-id", headers=KEY).status_code == 404
    assert http.get("/no/such/path", headers=KEY).status_code == 404
    assert http.get("/api/v1/samplers/x").status_code == 401  # no key
    samples = _samples(http)
    template = (("method", "GET"), ("route", "/api/v1/samplers/{sampler_id}"), ("status", "404"))
    assert samples[("loraplex_http_requests_total", template)] == 1
    unmatched = (("method", "GET"), ("route", "unmatched"), ("status", "404"))
    assert samples[("loraplex_http_requests_total", unmatched)] == 1
    assert samples[("loraplex_errors_total", (("category", "user"), ("source", "response")))] == 3
    assert not [labels for _, labels in samples if any("some-sampler-id" in v for _, v in labels)]


def test_metrics_serves_the_telemetry_registry_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path))
    with TestClient(create_app(runtime)) as http:
        monkeypatch.setattr(runtime.telemetry, "snapshot", _no_snapshot)  # nothing reads a translation
        before = _samples(http)[("loraplex_optim_step_runs_total", ())]
        runtime.telemetry.record_optim_step(runs=4, duration_s=0.01)
        # A metric only the registry knows: /metrics collects the registry object, not a copy of its names.
        Counter("loraplex_probe", "Made by this test alone.", registry=runtime.telemetry.registry).inc(3)
        samples = _samples(http)
    assert samples[("loraplex_optim_step_runs_total", ())] == before + 4
    assert samples[("loraplex_probe_total", ())] == 3


def _no_snapshot() -> None:
    raise AssertionError("/metrics took a telemetry snapshot")


def test_every_error_series_is_there_from_the_start_and_failed_futures_count_by_category(
    tmp_path: Path,
) -> None:
    runtime = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path))
    with TestClient(create_app(runtime)) as http:
        errors = {
            labels: v for (name, labels), v in _samples(http).items() if name == "loraplex_errors_total"
        }
        runtime.telemetry.record_outcomes(1, {"server": 2})
        samples = _samples(http)
    assert errors == {
        (("category", category), ("source", source)): 0
        for category in ("user", "capacity", "server")
        for source in ("response", "future")
    }
    assert samples[("loraplex_errors_total", (("category", "server"), ("source", "future")))] == 2
    assert samples[("loraplex_errors_total", (("category", "server"), ("source", "response")))] == 0
    assert samples[("loraplex_futures_finished_total", (("state", "failed"),))] == 2


def test_the_request_id_header_is_returned(http: TestClient) -> None:
    assert (
        http.get("/api/v1/healthz", headers={"X-Request-ID": "abc.123"}).headers["x-request-id"] == "abc.123"
    )
    generated = http.get("/api/v1/healthz", headers={"X-Request-ID": "not a token!"}).headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{16}", generated)


def test_every_exported_metric_is_documented(http: TestClient) -> None:
    documented = set(re.findall(r"`((?:loraplex|process)_[a-z_]+)`", (DOCS / "METRICS.md").read_text()))
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in _exported_names(http)}
    assert families - documented == set()
    assert documented - families == set()


def test_every_dashboard_query_reads_an_exported_metric(http: TestClient) -> None:
    dashboard = json.loads((DOCS / "grafana" / "loraplex.json").read_text())
    exported = _exported_names(http)
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    queried = {name for expr in exprs for name in re.findall(r"\b(?:loraplex|process)_[a-z_]+\b", expr)}
    assert queried - exported == set()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def _request_record(**fields: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "loraplex.requests", logging.INFO, __file__, 1, "%s %s %d %.1f ms", ("POST", "/p", 200, 2.5), None
    )
    record.__dict__.update(fields)
    return record


def test_a_text_request_line_appends_the_fields_its_message_lacks() -> None:
    record = _request_record(
        request_id="r1", method="POST", route="/p", path="/p", status=200, tenant="t", seq_id=3
    )
    line = TextFormatter().format(record)
    assert line.endswith("loraplex.requests: POST /p 200 2.5 ms request_id=r1 route=/p tenant=t seq_id=3")


def test_a_json_line_carries_the_request_fields_and_the_traceback() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = _request_record(request_id="r2", status=500, latency_ms=2.5, run_id="s:train:0")
    record.exc_info = exc_info
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "POST /p 200 2.5 ms"
    assert (entry["request_id"], entry["status"], entry["latency_ms"], entry["run_id"]) == (
        "r2",
        500,
        2.5,
        "s:train:0",
    )
    assert entry["level"] == "INFO" and entry["logger"] == "loraplex.requests"
    assert "RuntimeError: boom" in entry["exception"]
    assert "tenant" not in entry


def test_the_request_log_masks_signed_download_tokens(http: TestClient, caplog) -> None:
    secret = "s3cr3t-t0ken-value"
    with caplog.at_level(logging.INFO, logger="loraplex.requests"):
        for path in (
            f"/api/v1/downloads/{secret}/adapter_model.safetensors",
            f"/api/v1/session_traces/{secret}/s.json",
        ):
            assert http.get(path).status_code in (401, 403, 404)
    lines = [r for r in caplog.records if r.name == "loraplex.requests"]
    assert len(lines) == 2
    for record in lines:
        assert secret not in record.getMessage() and secret not in record.path  # type: ignore[attr-defined]
        assert "/<token>/" in record.path  # type: ignore[attr-defined]
