"""What the console reads of the telemetry: a frozen `ServerSnapshot`, and the functions that read it from
the prometheus_client metric objects /metrics serves (through their public `collect()`), so the console and
/metrics show the same numbers. Holds no state of its own. No tensors, no HTTP, no SQL.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram


@dataclass(frozen=True)
class PassRecord:
    """One training pass: when it ended (seconds since start), what it packed, how long it took."""

    at_s: float
    tokens: int
    requests: int
    runs: int
    tenants: int
    duration_s: float


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram since start: `counts[i]` observations <= `bounds[i]` and above the bound before it;
    the last count is above every bound (the registry serves these as cumulative `le` buckets)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


@dataclass(frozen=True)
class Memory:
    """Process and device memory; None where not known (no /proc, or not on CUDA)."""

    rss_bytes: int | None
    device_allocated_bytes: int | None
    device_reserved_bytes: int | None
    device_total_bytes: int | None


@dataclass(frozen=True)
class KvCache:
    """The sampler's KV cache right now."""

    bytes: int
    tokens: int
    sequences: int


@dataclass(frozen=True)
class Totals:
    """Counters since start, as the registry holds them."""

    passes: int
    pass_tokens: int
    pass_requests: int
    pass_runs: int  # summed over passes: runs packed per pass = pass_runs / passes
    pass_tenants: int
    optim_steps: int
    optim_step_runs: int
    sampler_steps: int
    decode_tokens: int  # tokens the sampler drew
    prefill_tokens: int
    futures_complete: int
    futures_failed: Mapping[str, int]  # category -> count, categories with failures only


@dataclass(frozen=True)
class ServerSnapshot:
    """A read of the registry at one moment, with the console's rates and recent passes; safe to keep and
    share (frozen, copies throughout)."""

    uptime_s: float
    device: str
    slots_used: int
    slots_total: int
    runs_parked: int
    runs_on_host: int
    runs_waiting: int
    queue_depth: Mapping[str, int]  # every kind of QUEUE_KINDS -> requests queued ("sample": unfinished)
    futures_pending: int
    train_tokens_per_s: float  # over the recent window
    decode_tokens_per_s: float
    last_pass: PassRecord | None
    recent_passes: tuple[PassRecord, ...]  # oldest first, at most 32
    memory: Memory
    kv_cache: KvCache
    totals: Totals
    pass_duration: HistogramSnapshot
    optim_step_duration: HistogramSnapshot
    sampler_step_duration: HistogramSnapshot
    db_call_duration: Mapping[str, HistogramSnapshot]  # Store method -> its calls
    # The engine thread's wall time since start by state (runtime/core/duty.py); every state is present.
    engine_thread_s: Mapping[str, float] = field(default_factory=dict)


def read_values(metric: Counter | Gauge | Histogram, suffix: str = "") -> dict[tuple[str, ...], float]:
    """A metric's samples named `name + suffix` by their label values, read as /metrics reads them."""
    return _samples_by_name(metric)[suffix]


def read_value(metric: Counter | Gauge, suffix: str = "") -> float:
    """The value of a metric without labels (or of one labelled child)."""
    return read_values(metric, suffix)[()]


def read_histograms(histogram: Histogram) -> dict[tuple[str, ...], HistogramSnapshot]:
    """Each child of a histogram by its label values, with its cumulative `le` buckets taken apart."""
    samples = _samples_by_name(histogram)  # one collection: buckets and sums of the same moment
    buckets: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for (*labels, le), cumulative in samples["_bucket"].items():  # in `le` order
        buckets.setdefault(tuple(labels), []).append((float(le), cumulative))
    out = {}
    for labels, pairs in buckets.items():
        bounds, cumulative = zip(*pairs, strict=True)
        counts = tuple(int(c - below) for c, below in zip(cumulative, (0.0, *cumulative[:-1]), strict=True))
        out[labels] = HistogramSnapshot(bounds[:-1], counts, samples["_sum"][labels], int(cumulative[-1]))
    return out


def _samples_by_name(metric: Counter | Gauge | Histogram) -> defaultdict[str, dict[tuple[str, ...], float]]:
    """A metric's samples: the suffix of each sample's name (`_total`, `_bucket`, ...) -> label values ->
    value."""
    (family,) = metric.collect()
    samples: defaultdict[str, dict[tuple[str, ...], float]] = defaultdict(dict)
    for s in family.samples:
        samples[s.name.removeprefix(family.name)][tuple(s.labels.values())] = s.value
    return samples


def process_rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
