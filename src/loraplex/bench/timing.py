"""Interleaved timing: warm every configuration up, then run them A B C A B C … for a number of rounds.

Ratios between configurations are taken pair by pair inside one round, so a noisy neighbour slowing the
machine for a while moves both sides of a ratio together. Each call also records the share of its wall
time during which some task on the machine waited for a CPU (Linux PSI), so contended rounds are visible
in the output rather than silently averaged in. Knows nothing of what the configurations do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock interval covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PSI_CPU = Path("/proc/pressure/cpu")


def cpu_stall_us() -> int | None:
    """Microseconds during which some task waited for a CPU since boot (PSI "some"), None if unavailable."""
    try:
        first_line = _PSI_CPU.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return int(first_line.rsplit("total=", 1)[1])


# Seconds a probe has counted so far (CPU of this process or another; or several named counters at once,
# recorded as "probe:name"); read around each call.
CpuProbe = Callable[[], float | Mapping[str, float]]


@dataclass
class Timings:
    """Per configuration, one entry per round: wall seconds, the CPU-stalled share of that time, and the
    CPU seconds each probe counted during the call (`cpu[probe][configuration]`)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    stall: dict[str, list[float | None]] = field(default_factory=dict)
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def time_interleaved(
    configurations: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    device: torch.device,
    cpu_probes: Mapping[str, CpuProbe] | None = None,
) -> Timings:
    """Time each configuration once per round, rounds interleaved, after `warmup` untimed rounds.

    The CPU of this process is always counted (probe "process"); `cpu_probes` adds others.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be ≥ 1, got {rounds}")
    probes = {"process": time.process_time, **(cpu_probes or {})}
    for _ in range(warmup):
        for run in configurations.values():
            run()
    names = list(configurations)
    timings = Timings({name: [] for name in names}, {name: [] for name in names}, {})
    for _ in range(rounds):
        for name, run in configurations.items():
            synchronize(device)
            cpu_start = {probe: read() for probe, read in probes.items()}
            stall_start, start = cpu_stall_us(), time.perf_counter()
            run()
            synchronize(device)
            elapsed, stall_end = time.perf_counter() - start, cpu_stall_us()
            for probe, read in probes.items():
                for key, spent in _spent(probe, cpu_start[probe], read()).items():
                    timings.cpu.setdefault(key, {n: [] for n in names})[name].append(spent)
            timings.seconds[name].append(elapsed)
            stalled = None if stall_start is None or stall_end is None else (stall_end - stall_start) / 1e6
            timings.stall[name].append(None if stalled is None else min(1.0, stalled / elapsed))
    return timings


def _spent(
    probe: str, start: float | Mapping[str, float], end: float | Mapping[str, float]
) -> dict[str, float]:
    """What a probe counted between two reads: one value under its name, or one per counter it reads
    (`probe:counter`; a counter that appeared meanwhile started at 0)."""
    if isinstance(start, Mapping) and isinstance(end, Mapping):
        return {f"{probe}:{key}": value - start.get(key, 0.0) for key, value in end.items()}
    assert not isinstance(start, Mapping) and not isinstance(end, Mapping)
    return {probe: end - start}


@dataclass(frozen=True)
class Stat:
    """Median and best of one figure over the rounds; `best` is the max for rates, the min for times."""

    median: float
    best: float

    @classmethod
    def of_rates(cls, values: list[float]) -> Stat:
        """Higher is better (tokens/s, FLOP/s, speedups)."""
        return cls(statistics.median(values), max(values))

    @classmethod
    def of_times(cls, values: list[float]) -> Stat:
        """Lower is better (seconds, milliseconds)."""
        return cls(statistics.median(values), min(values))


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round-by-round ratios of two equally long series."""
    return [n / d for n, d in zip(numerators, denominators, strict=True)]
