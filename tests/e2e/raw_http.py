"""Plain-HTTP helpers for the e2e tests that send what the SDK never would (hand-built bodies, seq_ids of
their choosing), and the server process's memory as /proc reports it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import Server


def settled(http: httpx.Client, future: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """The outcome of a future, polled until it is not `try_again`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = http.post("/retrieve_future", json={"request_id": future["request_id"]}).json()
        if result.get("type") != "try_again":
            return result
    raise TimeoutError(f"future {future['request_id']} did not settle in {timeout_s} s")


def new_run(http: httpx.Client, session: str | None = None) -> str:
    """A rank-4 run of the tiny model in `session` (a new one if None); its next expected seq_id is 1."""
    session = session or http.post("/create_session", json={}).json()["session_id"]
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "loraplex/tiny",
        "lora_config": {"rank": 4},
    }
    return settled(http, http.post("/create_model", json=body).json())["model_id"]


def memory_bytes(server: Server, field: str) -> int:
    """A memory figure of the server process from /proc: VmRSS (resident now) or VmHWM (its peak)."""
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024
