"""`bench train|sample --profile DIR`: one more round of the engine under `torch.profiler`, after the timed
ones, so that a measured figure (a step's time, a decode step against its bound) comes with the timeline
that explains it.

Writes `DIR/<bench>.trace.json` (open it in Perfetto or chrome://tracing: host ops, the engine's phases,
and on CUDA the kernels and the launches that queued them) and `DIR/<bench>.ops.txt` (the round's wall
and host CPU time, its phases, then the ops by device time and by host time). The phases are the engine's
`phase()` ranges (engine/phases.py): `pass.*` for a training pass, `sampler.*` for a sampler step.
The summary gets the same figures as `profile_*` fields. Timings of the profiled round are not the
benchmark's: the profiler adds its own host time to every op.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from loraplex.bench.timing import synchronize

_PHASE_PREFIXES = ("pass.", "sampler.")
# The runtime calls that queue device work: one per kernel, or one per replayed CUDA graph.
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_TABLE_ROWS = 40


def profile_round(
    run: Callable[[], object], device: torch.device, directory: Path, name: str
) -> dict[str, Any]:
    """Run `run` once under the profiler; write `name`'s trace and op tables under `directory` and return
    the round's figures (see the module docstring)."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    directory.mkdir(parents=True, exist_ok=True)
    synchronize(device)
    with profile(activities=activities) as profiler:
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trace = directory / f"{name}.trace.json"
    profiler.export_chrome_trace(str(trace))
    events = profiler.key_averages()
    phases = {
        event.key: {"calls": event.count, "host_ms": event.cpu_time_total / 1e3}
        for event in events
        if event.key.startswith(_PHASE_PREFIXES)
    }
    figures: dict[str, Any] = {
        "profile_trace": str(trace),
        "profile_wall_s": wall,
        "profile_host_cpu_s": cpu,
        "profile_phases": phases,
    }
    if on_cuda:
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        figures |= {
            "profile_device_busy": kernel_us / 1e6 / wall,
            "profile_kernel_launches": sum(e.count for e in events if e.key in _LAUNCHES),
            "profile_graph_launches": sum(e.count for e in events if e.key in _GRAPH_LAUNCHES),
        }
    _write_tables(directory / f"{name}.ops.txt", events, figures, on_cuda)
    return figures


def _write_tables(path: Path, events: Any, figures: dict[str, Any], on_cuda: bool) -> None:
    """The round's figures, its phases (host time per call), then the op tables."""
    lines = [f"{key}: {value}" for key, value in figures.items() if key != "profile_phases"]
    lines += ["", "phase                              calls   host ms   host ms/call"]
    for key, phase in sorted(figures["profile_phases"].items()):
        calls, host_ms = phase["calls"], phase["host_ms"]
        lines.append(f"{key:<34} {calls:>5} {host_ms:>9.2f} {host_ms / calls:>14.3f}")
    sorts = (["self_device_time_total"] if on_cuda else []) + ["self_cpu_time_total"]
    for sort_by in sorts:
        lines += ["", f"ops by {sort_by}:", events.table(sort_by=sort_by, row_limit=_TABLE_ROWS)]
    path.write_text("\n".join(lines) + "\n")
