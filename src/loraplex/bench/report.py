"""Output of every bench subcommand: human-readable rows, or with --json one JSON object per line, the
last line being the summary. Also the run's context (command, date, machine) that makes a figure
reproducible. Knows nothing of what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from loraplex.bench.timing import Stat, Timings

# Configurations whose rows carry a tokens/s figure (the matmul probe does not): bench train's, bench
# sample's (generated tokens) and bench api's.
_TOKEN_CONFIGS = (
    "fused",
    "one_slot",
    "naive_peft",
    "engine",
    "base_only",
    "hf_peft",
    "vllm",
    "sdk",
    "slot_per_run",
    "host_tier",
    "disk_only",
)
# Point fields shown in the one-line human form of a sweep point.
_POINT_FIELDS = (
    "slots",
    "tokens_per_slot",
    "rank",
    "tokens_per_s",
    "speedup_vs_naive_peft",
    "fusion_efficiency",
    "roofline_fraction",
)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object."""
    return json.loads(Path(path).read_text())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def context(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rounds: int, warmup: int
) -> dict[str, Any]:
    """Command, date and machine of this run: what a published figure must state next to it."""
    argv = getattr(args, "argv", None) or sys.argv[1:]  # `main` records its argv; `loraplex` does not
    if argv[:1] == ["bench"]:  # run as `loraplex bench ...` rather than `python -m loraplex.bench ...`
        argv = argv[1:]
    return {
        "command": "loraplex bench " + " ".join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "dtype": str(dtype).removeprefix("torch."),
        "nproc": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "memory_gb": _memory_gb(),
        "torch": torch.__version__,
        "rounds": rounds,
        "warmup": warmup,
    }


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=False), flush=True)


def add_figures(summary: dict[str, Any], figures: dict[str, Stat]) -> dict[str, Any]:
    """Put each figure's median under its name and its best under `<name>_best`; return the summary."""
    for name, stat in figures.items():
        summary[name], summary[f"{name}_best"] = stat.median, stat.best
    return summary


def _probe_field(probe: str) -> str:
    """A probe's field in a round row: `<probe>_cpu_s` for CPU probes; a named counter of a probe that
    reads several (`engine:idle`, `server_threads:lpx-http`) keeps its name with `_s`."""
    return f"{probe}_s" if ":" in probe else f"{probe}_cpu_s"


def round_rows(timings: Timings) -> list[dict[str, Any]]:
    """One row per (round, configuration), in the order they ran."""
    rounds = len(next(iter(timings.seconds.values())))
    return [
        {
            "kind": "round",
            "round": r,
            "config": name,
            "seconds": times[r],
            "cpu_stall_fraction": timings.stall[name][r],
            **{_probe_field(probe): per_config[name][r] for probe, per_config in timings.cpu.items()},
        }
        for r in range(rounds)
        for name, times in timings.seconds.items()
    ]


def stall_summary(timings: Timings) -> dict[str, float | None]:
    """Median and worst CPU-stalled share over every timed call: how contended the machine was."""
    values = [v for stalls in timings.stall.values() for v in stalls if v is not None]
    if not values:
        return {"cpu_stall_fraction": None, "cpu_stall_fraction_worst": None}
    return {"cpu_stall_fraction": statistics.median(values), "cpu_stall_fraction_worst": max(values)}


def emit_rows(rows: list[dict[str, Any]], num_tokens: int | None, as_json: bool) -> None:
    """Per-round timing rows; with `num_tokens`, tokens/s of the configurations that process the step."""
    for row in rows:
        if num_tokens and row["config"] in _TOKEN_CONFIGS:
            row = {**row, "tokens_per_s": num_tokens / row["seconds"]}
        if as_json:
            _print_json(row)
        else:
            rate = f"{row['tokens_per_s']:10.1f} tok/s" if "tokens_per_s" in row else " " * 16
            stall = row["cpu_stall_fraction"]
            stalled = "" if stall is None else f"  cpu stalled {stall:4.0%}"
            print(
                f"round {row['round']:2d}  {row['config']:<13} {row['seconds']:9.4f} s  {rate}{stalled}",
                flush=True,
            )


def emit_point(point: dict[str, Any], as_json: bool) -> None:
    """One sweep point: a JSON line, or its key figures on one line."""
    if as_json:
        _print_json(point)
    else:
        print("  ".join(f"{k}={_format(point.get(k))}" for k in _POINT_FIELDS), flush=True)


def emit_summary(summary: dict[str, Any], as_json: bool) -> None:
    """The summary object: the last JSON line, or one `key: value` line per field."""
    if as_json:
        _print_json(summary)
        return
    print("summary:")
    for key, value in summary.items():
        if key != "kind":
            print(f"  {key}: {_format(value)}")


def emit_run(
    timings: Timings,
    num_tokens: int | None,
    context: dict[str, Any],
    figures: dict[str, Any],
    memory: dict[str, Any],
    as_json: bool,
) -> None:
    """A measured run: its per-round rows, then the summary (context, figures, contention, memory)."""
    emit_rows(round_rows(timings), num_tokens, as_json)
    summary = {"kind": "summary", **context, **figures, **stall_summary(timings), **memory}
    emit_summary(summary, as_json)
