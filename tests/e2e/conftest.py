"""End-to-end fixtures: a real `loraplex serve` subprocess on a free port, driven by the official SDK.

The engine is the built-in tiny model.
Every server started here is killed when its test ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server process and how to reach it."""

    data_dir: Path
    args: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    # SDK clients of this server (tests/e2e/sdk.py `client`), closed while it still runs: an open
    # client keeps heartbeating its session and prints a warning once the server has gone.
    clients: list[Any] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The server's environment: a Hugging Face cache of its own, not the user's (serve files the
        served tokenizer there)."""
        return {**os.environ, "HF_HOME": str(self.data_dir.parent / "hf-home")}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> Server:
        cmd = [
            sys.executable,
            "-m",
            "loraplex.cli",
            "serve",
            "--deterministic",  # the default in tests (docs/OPERATIONS.md, "Deterministic mode")
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        log = open(self.data_dir.parent / f"server-{self.port}.log", "ab")  # noqa: SIM115 (outlives this call)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).json().get("status") == "ok":
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # also while it answers "starting": no busy loop beside a server that starts
        raise TimeoutError("server did not become healthy")

    def kill(self) -> None:
        """kill -9: no shutdown hooks run."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close_clients(self) -> None:
        """Finish every SDK client's session (the server must be running)."""
        while self.clients:
            self.clients.pop().close("success").result(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.close_clients()
        finally:  # a client that cannot finish its session must not keep the server running
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def _servers(root: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*args: str, after: Server | None = None) -> Server:
        data_dir = root / "data"
        data_dir.mkdir(exist_ok=True)
        if after is None:
            servers.append(Server(data_dir, list(args)).start())
        else:  # a restart: same port, and the clients of the server it replaces carry on with it
            servers.append(Server(data_dir, list(args), after.port, clients=after.clients).start())
            after.clients = []
        return servers[-1]

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """start_server(*args) -> a healthy Server on tmp_path/data (the same dir each call: a restart);
    start_server(*args, after=old) restarts on old's port, where old's SDK clients reconnect."""
    with _servers(tmp_path) as start:
        yield start


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    """One default server for this test."""
    return start_server()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One default server shared by a module's tests (they must not depend on each other)."""
    with _servers(tmp_path_factory.mktemp("server")) as start:
        yield start()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """start_module_server(*args) -> a healthy Server shared by a module's tests, stopped after them."""
    with _servers(tmp_path_factory.mktemp("server")) as start:
        yield start


@pytest.fixture(params=["sqlite", "postgresql"])
def database_args(request: pytest.FixtureRequest) -> list[str]:
    """Server arguments selecting each supported database: the default SQLite file, then PostgreSQL."""
    if request.param == "sqlite":
        return []
    from tests.e2e.postgres import create_database

    prefix = request.getfixturevalue("postgres_url_prefix")
    return ["--database-url", create_database(prefix, f"loraplex_{request.node.name.split('[')[0][-40:]}")]
