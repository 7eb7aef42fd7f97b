"""The RL example and `loraplex demo`, run as users run them: the reward must clearly rise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, Server


def _rewards(output: str) -> list[float]:
    return [float(r) for r in re.findall(r"^step +\d+ +reward ([0-9.]+)$", output, re.MULTILINE)]


def test_examples_rl_raises_the_mean_reward_within_ten_steps(server: Server) -> None:
    command = [sys.executable, "examples/rl.py", "--base-url", server.base_url, "--steps", "10"]
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    rewards = _rewards(done.stdout)
    assert len(rewards) == 10, done.stdout + done.stderr
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, rewards


def test_loraplex_demo_plots_the_reward_curve_and_stops_its_server(tmp_path: Path) -> None:
    plot, data_dir = tmp_path / "reward.png", tmp_path / "data"
    command = ["--data-dir", str(data_dir), "--output", str(plot), "--steps", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "demo", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert f"reward plot: {plot}" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    port = re.search(r"server http://127\.0\.0\.1:(\d+)", done.stdout)
    assert port is not None
    with pytest.raises(httpx.ConnectError):  # the server it started is gone
        httpx.get(f"http://127.0.0.1:{port.group(1)}/api/v1/healthz", timeout=2)
