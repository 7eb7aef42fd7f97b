"""No database call runs on the API's event loop (it would stall every other request) or under the
service lock the engine worker plans under (it would stall the engine): a whole SDK-shaped session over
HTTP, with every Store method checking where it is called from."""

from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path

from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.keys import create_key
from tests.api.test_http import _fb_body, _retrieve
from tests.fakes import FakeEngine


def _guard(service: Runtime, violations: list[str]) -> None:
    """Wrap every public Store method of the service's store with the two checks."""
    store = service.store
    for name, method in inspect.getmembers(store, inspect.ismethod):
        if name.startswith("_") or name in ("close", "display_url"):
            continue

        def guarded(*args, _name=name, _method=method, **kwargs):
            try:
                asyncio.get_running_loop()
                violations.append(f"{_name} on the event loop")
            except RuntimeError:
                pass  # no loop in this thread: a worker thread
            if service.state.cond._is_owned():  # type: ignore[attr-defined]
                violations.append(f"{_name} under the service lock")
            return _method(*args, **kwargs)

        setattr(store, name, guarded)


def test_a_whole_session_over_http_never_touches_the_database_on_the_loop_or_under_the_lock(
    tmp_path: Path,
) -> None:
    config = ServerConfig(data_dir=tmp_path, long_poll_s=2.0, auth="keys")
    service = Runtime.open(FakeEngine(), config)
    key = {"X-API-Key": create_key(service.store, "alice")}
    violations: list[str] = []
    _guard(service, violations)
    with TestClient(create_app(service)) as http:
        run = _run_with(http, key)
        fb = http.post("/api/v1/forward_backward", content=_fb_body(run, 1), headers=key).json()
        step = http.post(
            "/api/v1/optim_step", json={"model_id": run, "seq_id": 2, "adam_params": {}}, headers=key
        ).json()
        save = http.post(
            "/api/v1/save_weights_for_sampler", json={"model_id": run, "seq_id": 3, "path": "s1"}, headers=key
        ).json()
        for future in (fb, step, save):
            assert "error" not in _retrieve(http, future["request_id"], key)
        path = _retrieve(http, save["request_id"], key)["path"]
        session = http.post("/api/v1/create_session", json={}, headers=key).json()["session_id"]
        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": session, "sampling_session_seq_id": 0, "model_path": path},
            headers=key,
        ).json()["sampling_session_id"]
        sample = http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler,
                "seq_id": 0,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 3, "seed": 1},
            },
            headers=key,
        ).json()
        assert "sequences" in _retrieve(http, sample["request_id"], key)
        assert http.get(f"/api/v1/samplers/{sampler}", headers=key).status_code == 200
        assert http.get("/api/v1/training_runs", headers=key).status_code == 200
        assert http.get(f"/api/v1/training_runs/{run}/checkpoints", headers=key).status_code == 200
        assert http.get("/api/v1/checkpoints", headers=key).status_code == 200
        assert http.post("/api/v1/weights_info", json={"tinker_path": path}, headers=key).status_code == 200
        assert http.post("/api/v1/sessions/search", json={}, headers=key).status_code == 200
        assert http.get("/api/v1/billing/usage/checkpoints/current", headers=key).status_code == 200
        trace = http.get(f"/api/v1/sessions/{session}/trace_export", headers=key).json()["url"]
        assert http.get(trace.removeprefix(str(http.base_url))).status_code == 200
        assert (
            http.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=key).status_code
            == 200
        )
        assert http.post(f"/api/v1/sessions/{session}/finish", json={}, headers=key).status_code == 200
        alias = {"alias": "sft/latest", "model": path}
        assert http.post("/v1/aliases", json=alias, headers=key).status_code == 200
        assert http.get("/v1/aliases", headers=key).json()["data"] == [{"object": "alias", **alias}]
        assert http.delete("/v1/aliases/sft/latest", headers=key).status_code == 200
        assert http.post("/console/login", data={"key": key["X-API-Key"]}).status_code == 200  # to runs
        pages = ("runs", f"runs/{run}", f"compare?run={run}", "samplers", f"requests?run={run}", "server")
        for page in pages:
            assert http.get(f"/console/{page}").status_code == 200
    assert violations == []


def _run_with(http: TestClient, key: dict[str, str]) -> str:
    session = http.post("/api/v1/create_session", json={}, headers=key).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "fake/bigram", "lora_config": {"rank": 4}}
    future = http.post("/api/v1/create_model", json=body, headers=key).json()
    assert _retrieve(http, future["request_id"], key)["model_id"] == future["model_id"]
    return future["model_id"]


def test_training_submissions_are_written_on_the_one_submission_thread_which_stops_with_the_app(
    tmp_path: Path,
) -> None:
    service = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path, long_poll_s=2.0, auth="keys"))
    key = {"X-API-Key": create_key(service.store, "alice")}
    threads: list[str] = []
    submit_many = service.training.submit_many

    def recorded(submissions):
        threads.extend(threading.current_thread().name for _ in submissions)
        return submit_many(submissions)

    service.training.submit_many = recorded  # type: ignore[method-assign]
    app = create_app(service)
    with TestClient(app) as http:
        run = _run_with(http, key)
        futures = [
            http.post("/api/v1/forward_backward", content=_fb_body(run, seq), headers=key).json()
            for seq in (1, 2, 3)
        ]
        refused = {"model_id": run, "seq_id": 4, "adam_params": []}  # recorded as seq_id 4's failed future
        futures.append(http.post("/api/v1/optim_step", json=refused, headers=key).json())
        outcomes = [_retrieve(http, future["request_id"], key) for future in futures]
    assert ["error" in outcome for outcome in outcomes] == [False, False, False, True]
    assert threads == ["loraplex-submit"] * 4
    assert not app.state.submissions._thread.is_alive()  # the app's shutdown stopped the thread
