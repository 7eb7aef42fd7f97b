"""`loraplex demo`: serve the built-in model in the background, run the RL example against it with a
progress bar, and plot the reward per step.

The RL loop is examples/rl.py's `train` (loaded from the source checkout), so the demo runs exactly
the code users read. This module only starts, watches and stops: the server is a subprocess, and
nothing heavy (engine, SDK, matplotlib) is imported until the demo runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from loraplex.errors import UserError

HELP = "Start a server, run the RL example (examples/rl.py) with a progress bar, plot its reward curve."
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl.py"
API_KEY = "tml-local"  # any tml- key: the demo server runs with --auth none
_RL_FLAGS = {"steps": int, "group_size": int, "learning_rate": float, "seed": int}  # RLConfig overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="Server data directory (default: a temporary one)."
    )
    parser.add_argument(
        "--output", type=Path, default=Path("loraplex-demo.png"), help="Where the reward plot is written."
    )
    for name, kind in _RL_FLAGS.items():
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(
            flag, type=kind, default=None, help=f"examples/rl.py's {flag} (default: its own)."
        )


def run(args: argparse.Namespace) -> int:
    """The `loraplex demo` command."""
    rl = load_rl_example()
    config = rl.RLConfig(**{k: v for k in _RL_FLAGS if (v := getattr(args, k)) is not None})
    with (
        tempfile.TemporaryDirectory(prefix="loraplex-demo-") as scratch,
        background_server(args.data_dir or Path(scratch)) as base_url,
    ):
        curve = _train_with_progress(rl, base_url, config)
    plot_rewards(curve, args.output)
    print(f"mean reward {curve[0]:.3f} -> {curve[-1]:.3f} over {len(curve)} steps")
    print(f"reward plot: {args.output.resolve()}")
    return 0


def load_rl_example() -> ModuleType:
    """examples/rl.py as a module (it is not part of the installed package)."""
    if not EXAMPLE.is_file():
        raise UserError(f"loraplex demo runs {EXAMPLE}, which this installation lacks; use a source checkout")
    spec = importlib.util.spec_from_file_location("loraplex_rl_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


@contextmanager
def background_server(data_dir: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """`loraplex serve` on a free loopback port until the block ends; yields its base URL."""
    from rich.console import Console

    data_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    base_url, log_path = f"http://127.0.0.1:{port}", data_dir / "server.log"
    serve = ["serve", "--port", str(port), "--data-dir", str(data_dir)]
    print(f"server {base_url} (data and server.log in {data_dir})", flush=True)
    with log_path.open("ab") as log:
        server = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *serve], stdout=log, stderr=log)
        try:
            with Console(stderr=True).status("starting the server"):
                _wait_until_healthy(server, base_url, log_path, timeout_s)
            yield base_url
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_until_healthy(server: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise UserError(f"the demo server exited with code {server.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/api/v1/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UserError(f"the demo server did not answer within {timeout_s:.0f} s; see {log_path}")


def _train_with_progress(rl: ModuleType, base_url: str, config: Any) -> list[float]:
    import tinker
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logging.getLogger("tinker").setLevel(logging.WARNING)  # its per-client INFO lines would break the bar
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    base_model = rest.get_server_capabilities().result().supported_models[0].model_name
    columns = (TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with (
        Progress(*columns, TextColumn("mean reward {task.fields[reward]:.3f}")) as progress,
        tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as service,
    ):
        task = progress.add_task("rl", total=config.steps, reward=0.0)
        return rl.train(
            service, base_model, config, lambda _step, mean: progress.update(task, advance=1, reward=mean)
        )


def plot_rewards(curve: Sequence[float], path: Path) -> None:
    """A PNG of the mean reward per step."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.6), layout="tight")
    axes = figure.add_subplot()
    axes.plot(range(len(curve)), curve, marker="o")
    axes.set(
        xlabel="RL step",
        ylabel="mean reward",
        ylim=(-0.02, 1.02),
        title="loraplex demo: RL on the tiny model",
    )
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
