"""A `loraplex serve` subprocess for benchmarks: bound to 127.0.0.1 on a free port, waited on until
healthy, and always stopped (terminate, then kill) when its `with` block ends, whatever happened.
Knows nothing of what is measured.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

_HOST = "127.0.0.1"
_STOP_WAIT_S = 15.0
_KIB_PER_MB = 1024
# utime and stime in /proc/<pid>/stat, counted from the field after the command name's ")".
_UTIME, _STIME = 11, 12


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server process and how to reach it."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        """The server's HTTP root."""
        return f"http://{_HOST}:{self.port}"

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far (Linux /proc; 10 ms ticks)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[_UTIME]) + int(fields[_STIME])) / os.sysconf("SC_CLK_TCK")

    def thread_cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds of the server's threads so far, by kernel thread name (os_threads.py:
        lpx-engine, lpx-http, lpx-submit, ...; threads a named one started inherit its name), the unnamed
        ones under "other". A thread that exited no longer counts."""
        by_name: dict[str, float] = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread exited meanwhile
                continue
            key = name if name.startswith("lpx-") else "other"
            ticks = int(fields[_UTIME]) + int(fields[_STIME])
            by_name[key] = by_name.get(key, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
        return by_name

    def engine_thread_seconds(self) -> dict[str, float]:
        """The engine thread's wall seconds so far by state, from the server's /metrics
        (loraplex_engine_thread_seconds_total; docs/METRICS.md)."""
        return self.metric("loraplex_engine_thread_seconds_total", "state")

    def metric(self, name: str, label: str) -> dict[str, float]:
        """The samples of one metric of the server's /metrics (docs/METRICS.md), by the value of `label`."""
        text = httpx.get(f"{self.base_url}/metrics", headers={"X-API-Key": "tml-local"}, timeout=10).text
        return {
            sample.labels[label]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        }

    def peak_rss_mb(self) -> float | None:
        """The server process's resident-set high-water mark (VmHWM), None where /proc cannot say."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / _KIB_PER_MB
        except OSError:
            pass
        return None


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"loraplex serve exited with {server.proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{server.base_url}/api/v1/healthz", timeout=1).json().get("status") == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"loraplex serve was not healthy after {timeout_s:.0f} s; log: {server.log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_WAIT_S)


@contextmanager
def serve(serve_args: list[str], data_dir: Path, threads: int, timeout_s: float = 300.0) -> Iterator[Server]:
    """`loraplex serve *serve_args` on 127.0.0.1, a free port and `data_dir`, with `threads` torch threads."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir.parent / f"server-{port}.log"
    command = [sys.executable, "-m", "loraplex.cli", "serve", "--host", _HOST, "--port", str(port)]
    command += ["--data-dir", str(data_dir), *serve_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        server = Server(proc, port, log)
        _wait_healthy(server, timeout_s)
        yield server
    finally:
        _stop(proc)
