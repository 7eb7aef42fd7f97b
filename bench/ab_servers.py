"""Two `loraplex serve` processes, A and B, each from its own source tree (or with its own flags), driven
by the official SDK with `bench api`'s step (K runs: every forward_backward, then every optim_step),
alternated round by round: A B, B A, A B ... Both servers stay up and idle while the other works, so a slow
spell of a shared host hits both alike, and the ratio is taken pair by pair. Prints each side's median SDK
step, the server's CPU per step and that CPU split by thread, then the median B/A ratios.

Why not two `bench api` runs: their rounds are minutes apart, and on a shared 2-core host two runs of the
same tree differ by up to 10% (docs/BENCHMARKS.md, sixth session).

Usage (repo root):
  .venv/bin/python bench/ab_servers.py --a /path/to/other/worktree/src --b - [--rounds 40]
      [--model tiny-qwen3-bench] [--a-args "--log-level warning"] [--b-args ...]
      [--a-env "OMP_WAIT_POLICY=passive"] [--b-env ...]
A source '-' is this checkout; any other is put first on that server's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import torch

from loraplex.bench import report
from loraplex.bench.api import SdkSteps
from loraplex.bench.launcher import Server, serve
from loraplex.bench.train import run_dtype
from loraplex.bench.workloads import TrainShape, make_slot_datums, prepare_model_dir

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process (Linux /proc), keyed 'main' or by thread id."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        found["main" if task.name == str(pid) else task.name] = (
            int(fields[11]) + int(fields[12])
        ) / _CLOCK_TICKS
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="source tree of server A ('-': this checkout)")
    parser.add_argument("--b", required=True, help="source tree of server B ('-': this checkout)")
    parser.add_argument("--a-args", default="", help="extra `loraplex serve` flags of server A")
    parser.add_argument("--b-args", default="", help="extra `loraplex serve` flags of server B")
    parser.add_argument("--a-env", default="", help="extra environment of server A (NAME=value ...)")
    parser.add_argument("--b-env", default="", help="extra environment of server B (NAME=value ...)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--model", default="tiny-qwen3-bench")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens-per-slot", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    device = torch.device("cpu")
    shape = TrainShape(args.slots, args.tokens_per_slot, args.rank, args.tokens_per_slot)
    sides = {"A": (args.a, args.a_args, args.a_env), "B": (args.b, args.b_args, args.b_env)}
    with tempfile.TemporaryDirectory(prefix="loraplex-ab-") as scratch, ExitStack() as stack:
        model_dir = prepare_model_dir(args.model, Path(scratch), run_dtype(device), device)
        datums = make_slot_datums(shape, int(report.read_json(model_dir / "config.json")["vocab_size"]))
        serve_args = ["--model", str(model_dir), "--model-name", model_dir.name, "--device", "cpu"]
        serve_args += ["--max-slots", str(shape.slots), "--max-rank", str(shape.rank)]
        servers: dict[str, tuple[Server, SdkSteps]] = {}
        for name, (source, flags, env) in sides.items():
            extra_env = dict(pair.split("=", 1) for pair in shlex.split(env))
            if source != "-":
                extra_env["PYTHONPATH"] = source
            saved = {key: os.environ.get(key) for key in extra_env}
            os.environ.update(extra_env)
            data = Path(scratch) / f"data-{name}"
            try:
                server = stack.enter_context(
                    serve(serve_args + shlex.split(flags), data, torch.get_num_threads())
                )
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key)
                    else:
                        os.environ[key] = value
            servers[name] = (server, SdkSteps(server.base_url, model_dir.name, shape, datums))
        for _, sdk in servers.values():
            sdk()  # warm-up
        threads_before = {name: thread_cpu_s(server.proc.pid) for name, (server, _) in servers.items()}
        wall: dict[str, list[float]] = {"A": [], "B": []}
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                server, sdk = servers[name]
                cpu_start, start = server.cpu_seconds(), time.perf_counter()
                sdk()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(server.cpu_seconds() - cpu_start)
        for name, (server, sdk) in servers.items():
            after = thread_cpu_s(server.proc.pid)
            per_thread = {t: (s - threads_before[name].get(t, 0.0)) / args.rounds for t, s in after.items()}
            busy = {t: round(s, 4) for t, s in sorted(per_thread.items(), key=lambda kv: -kv[1]) if s >= 5e-4}
            print(
                f"{name} ({' '.join(sides[name]).strip()}): SDK step {median(wall[name]):.3f} s, "
                f"server CPU {median(cpu[name]):.3f} s per step; by thread: {busy}"
            )
            sdk.close()
    wall_ratio = median(b / a for a, b in zip(wall["A"], wall["B"], strict=True))
    cpu_ratio = median(b / a for a, b in zip(cpu["A"], cpu["B"], strict=True) if a > 0)
    print(f"B/A, median of the {args.rounds} pairs: SDK step {wall_ratio:.3f}, server CPU {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
