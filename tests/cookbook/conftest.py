"""tinker-cookbook as a test client: its own entry points, unmodified, against a real `loraplex serve`.

The servers are tests/e2e's fixtures (a free port, always shut down). Each cookbook run is a fresh
process, as a user starts one, whose environment is the server's machine: the server's Hugging Face
cache (where `serve` filed the served tokenizer) with HF_HUB_OFFLINE=1, so the cookbook's
`get_tokenizer("loraplex/tiny")` is answered from that cache and nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, Server, module_server  # noqa: F401  (module_server: the fixture, reused)

KEY = "tml-local"


@dataclass(frozen=True)
class Cookbook:
    """Runs cookbook entry points against one server."""

    server: Server

    @property
    def env(self) -> dict[str, str]:
        return {**self.server.env, "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}

    def run(self, module: str, *args: str, timeout_s: float = 300) -> None:
        """`python -m module args... base_url=<server>`, chz-style arguments as the cookbook's recipes
        take them; fails the test with the end of its output unless it exits 0."""
        cmd = [sys.executable, "-m", module, *args, f"base_url={self.server.base_url}"]
        done = subprocess.run(
            cmd,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-4000:]}"


@pytest.fixture(scope="module")
def cookbook(module_server: Server) -> Cookbook:  # noqa: F811  (the reused fixture)
    return Cookbook(module_server)


def metric(log_path: Path, key: str) -> dict[int, float]:
    """One metric from the cookbook's metrics.jsonl: its value at each step that logged it, by step."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[key] for row in rows if key in row}


def checkpoints(log_path: Path) -> list[dict[str, Any]]:
    """The cookbook's checkpoints.jsonl: one record per saved checkpoint, oldest first."""
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
