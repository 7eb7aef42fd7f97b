"""`bench residency`: more active runs than adapter slots, through the official `tinker` SDK (issue 27).

The `bench api` workload (K runs × tokens, every run's forward_backward then every run's optim_step,
submitted back to back and awaited) against three `loraplex serve` subprocesses on the same model,
interleaved round by round:
- slot_per_run: --max-slots K, no run ever gives up its slot;
- host_tier: --max-slots K/2, the host tier sized by default: runs take turns, their state kept in host
  memory;
- disk_only: --max-slots K/2 --host-slots 0: runs take turns through parked/ on disk (before the tier).
residency_ratio = host_tier's tokens/s ÷ slot_per_run's, per round (the issue's target: ≥ 0.8 at K = 2 ×
slots); disk_ratio the same for disk_only. Each server's CPU during its own rounds, and where its runs'
state went (loraplex_parks_total), say what the turns cost. Every server is always stopped.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from loraplex.bench import report
from loraplex.bench.api import SdkWorkload
from loraplex.bench.launcher import Server, serve
from loraplex.bench.timing import Stat, Timings, ratios, time_interleaved
from loraplex.bench.train import run_dtype
from loraplex.bench.workloads import TrainShape

_WARMUP = 1
BASELINE = "slot_per_run"
# Configuration -> the serve flags it adds to the model's, given the number of runs.
CONFIGS = {
    BASELINE: lambda runs: ["--max-slots", str(runs)],
    "host_tier": lambda runs: ["--max-slots", str(max(1, runs // 2))],
    "disk_only": lambda runs: ["--max-slots", str(max(1, runs // 2)), "--host-slots", "0"],
}
_RATIOS = {"host_tier": "residency_ratio", "disk_only": "disk_ratio"}


def _summarize(shape: TrainShape, timings: Timings, parks: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Tokens/s of each configuration, the throughput ratios taken round by round, each server's CPU in
    its own rounds, and every server's parks (warm-up included) by where the state went."""
    seconds = timings.seconds
    figures: dict[str, Stat] = {}
    for name in CONFIGS:
        figures[f"{name}_tokens_per_s"] = Stat.of_rates([shape.num_tokens / s for s in seconds[name]])
        figures[f"{name}_step_s"] = Stat.of_times(seconds[name])
        figures[f"{name}_server_cpu_s"] = Stat.of_times(timings.cpu[f"{name}_server"][name])
    for name, ratio in _RATIOS.items():
        figures[ratio] = Stat.of_rates(ratios(seconds[BASELINE], seconds[name]))
    summary: dict[str, Any] = {**shape.summary_fields(), "runs": shape.slots}
    for name, counts in parks.items():
        for to, count in sorted(counts.items()):
            summary[f"{name}_parks_to_{to}"] = int(count)
    return report.add_figures(summary, figures)


def bench_residency(args: argparse.Namespace) -> int:
    """Entry point of `bench residency`: starts the three servers, prints per-round rows and the summary,
    stops them."""
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as scratch, ExitStack() as servers:
        work = SdkWorkload.prepare(args, Path(scratch))
        shape = work.shape
        threads = torch.get_num_threads()
        started: dict[str, Server] = {
            name: servers.enter_context(
                serve(
                    work.serve_args() + flags(shape.slots),
                    Path(scratch) / name,
                    threads,
                    args.server_timeout_s,
                )
            )
            for name, flags in CONFIGS.items()
        }
        clients = {name: work.client(server.base_url) for name, server in started.items()}
        probes = {f"{name}_server": server.cpu_seconds for name, server in started.items()}
        timings = time_interleaved(clients, work.rounds, _WARMUP, work.device, probes)
        for client in clients.values():
            client.close()
        parks = {name: server.metric("loraplex_parks_total", "to") for name, server in started.items()}
        memory = {f"{name}_server_peak_rss_mb": server.peak_rss_mb() for name, server in started.items()}
        context = report.context(args, work.device, run_dtype(work.device), work.rounds, _WARMUP)
    report.emit_run(timings, shape.num_tokens, context, _summarize(shape, timings, parks), memory, args.json)
    return 0
