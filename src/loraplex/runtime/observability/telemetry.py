"""Telemetry: what the server is doing, kept cheaply for `/metrics`, the console and the logs.

The engine loop feeds it as it works; readers take a `ServerSnapshot`. Recording costs a lock held for a
few additions and no allocation, except one small record per training pass; everything derived (rates,
the occupancy of slots and queues, memory) is computed when a snapshot is taken. No tensors, no HTTP, no
SQL, no Prometheus: the API layer turns snapshots into metrics (api/metrics.py).

API (stable; the console and /metrics read it):

    telemetry = Telemetry(device="cuda:0", clock=time.monotonic)  # owned by the Runtime
    # fed by the engine loop (runtime/core/engine_loop.py, runtime/core/executor.py):
    telemetry.record_pass(tokens, requests, runs, tenants, duration_s)   # one packed training pass
    telemetry.record_optim_step(runs, duration_s)                       # one fused AdamW step
    telemetry.record_sampler_step(duration_s, usage)                    # one sampler step (EngineUsage)
    telemetry.record_usage(usage)                                       # memory / KV cache, ~once a second
    telemetry.record_engine_thread(seconds_by_state)                    # the engine thread's wall time
    # fed by the futures and the store:
    telemetry.record_outcomes(complete, failed)                  # futures finished; failed: category -> n
    telemetry.record_db_call(op, duration_s)                            # one Store call
    # wired by the service: where slot and queue occupancy come from (read at snapshot time)
    telemetry.occupancy_source = callable returning Occupancy
    # read by anyone, from any thread:
    telemetry.snapshot() -> ServerSnapshot                              # frozen; see its fields

Rates (`train_tokens_per_s`, `decode_tokens_per_s`) are over the last `window_s` seconds (10 by default),
or since start while the server is younger than that. Totals and histograms count since start.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from loraplex.engine.interface import EngineUsage
from loraplex.runtime.core.commands import Command, ForwardBackward, OptimStep

# Kinds of queued work, the keys of `ServerSnapshot.queue_depth` (every kind is present, 0 when empty).
QUEUE_KINDS = ("create", "forward_backward", "forward", "optim_step", "save", "load", "sample")
_KIND_OF_REQUEST_TYPE = {
    "CreateModel": "create",
    "LoadWeights": "load",
    "SaveWeights": "save",
    "SaveWeightsForSampler": "save",
    "SaveWeightsExternal": "save",
}

# Histogram bucket upper bounds (seconds), Prometheus `le` values; +Inf is implied.
PASS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OPTIM_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DECODE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DB_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

_RECENT_PASSES = 32
# The states of the engine thread's wall time (runtime/core/duty.py), in the order /metrics lists them.
ENGINE_THREAD_STATES = ("engine", "durable", "held", "idle", "other")


def queue_kind(command: Command) -> str:
    """The `queue_depth` kind a queued command counts under."""
    if isinstance(command, ForwardBackward):
        return "forward" if command.forward_only else "forward_backward"
    if isinstance(command, OptimStep):
        return "optim_step"
    return _KIND_OF_REQUEST_TYPE.get(command.request_type, "other")


@dataclass(frozen=True)
class Occupancy:
    """Slots, runs and queues as the service holds them at one moment (read under its lock)."""

    slots_used: int = 0
    slots_total: int = 0
    runs_parked: int = 0  # runs whose state is on disk, waiting for a slot or idle
    runs_waiting: int = 0  # runs with work but no slot
    queue_depth: Mapping[str, int] = field(default_factory=dict)  # kind -> queued requests
    futures_pending: int = 0


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
    the last count is above every bound (Prometheus turns these into cumulative `le` buckets)."""

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
    """Counters since start (Prometheus counters read these)."""

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
    futures_failed: Mapping[str, int]  # category -> count


@dataclass(frozen=True)
class ServerSnapshot:
    """Everything telemetry knows at one moment; safe to keep and share (frozen, copies throughout)."""

    uptime_s: float
    device: str
    slots_used: int
    slots_total: int
    runs_parked: int
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
    # The engine thread's wall time since start by state (runtime/core/duty.py: engine, durable, held, idle,
    # other); every state is present.
    engine_thread_s: Mapping[str, float] = field(default_factory=dict)


class _Histogram:
    """Fixed buckets, updated under the telemetry lock."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum, sum(self.counts))


class _Rate:
    """Events per second over the last `window_s` whole seconds, kept in one bucket per second."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._second = [-1] * window_s  # which second each bucket holds
        self._amount = [0] * window_s

    def add(self, now: float, amount: int) -> None:
        second = int(now)
        index = second % self.window_s
        if self._second[index] != second:
            self._second[index], self._amount[index] = second, 0
        self._amount[index] += amount

    def per_second(self, now: float, started: float) -> float:
        first = int(now) - self.window_s + 1
        total = sum(a for s, a in zip(self._second, self._amount, strict=True) if s >= first)
        span = min(now - first, now - started)
        return total / span if span > 0 else 0.0


class Telemetry:
    """Counters, histograms and recent passes of one server; see the module docstring for the API."""

    def __init__(
        self, device: str = "", clock: Callable[[], float] = time.monotonic, window_s: int = 10
    ) -> None:
        self.device = device
        self.clock = clock
        self.occupancy_source: Callable[[], Occupancy] = Occupancy
        self._started = clock()
        self._lock = threading.Lock()
        self._train_rate, self._decode_rate = _Rate(window_s), _Rate(window_s)
        self._recent: deque[PassRecord] = deque(maxlen=_RECENT_PASSES)
        self._pass_s, self._optim_s = _Histogram(PASS_BUCKETS_S), _Histogram(OPTIM_BUCKETS_S)
        self._sampler_s = _Histogram(DECODE_BUCKETS_S)
        self._db_s: dict[str, _Histogram] = {}
        self._passes = self._pass_tokens = self._pass_requests = self._pass_runs = self._pass_tenants = 0
        self._optim_steps = self._optim_step_runs = 0
        self._sampler_steps = self._decode_tokens = self._prefill_tokens = 0
        self._complete = 0
        self._failed: dict[str, int] = {}
        self._usage = EngineUsage()
        self._engine_thread_s: dict[str, float] = dict.fromkeys(ENGINE_THREAD_STATES, 0.0)

    # --- recording (engine loop, futures, store)
    def record_pass(self, tokens: int, requests: int, runs: int, tenants: int, duration_s: float) -> None:
        """One packed training pass of `requests` requests of `runs` runs of `tenants` tenants."""
        now = self.clock()
        record = PassRecord(now - self._started, tokens, requests, runs, tenants, duration_s)
        with self._lock:
            self._passes += 1
            self._pass_tokens += tokens
            self._pass_requests += requests
            self._pass_runs += runs
            self._pass_tenants += tenants
            self._pass_s.observe(duration_s)
            self._train_rate.add(now, tokens)
            self._recent.append(record)

    def record_optim_step(self, runs: int, duration_s: float) -> None:
        """One fused optimizer step over `runs` runs."""
        with self._lock:
            self._optim_steps += 1
            self._optim_step_runs += runs
            self._optim_s.observe(duration_s)

    def record_sampler_step(self, duration_s: float, usage: EngineUsage) -> None:
        """One sampler step (admission, prefill, one decode step); `usage` is the engine's right after it,
        whose cumulative token counters the step's tokens are read from."""
        now = self.clock()
        with self._lock:
            drawn = max(0, usage.sampled_tokens - self._usage.sampled_tokens)
            self._prefill_tokens += max(0, usage.prefill_tokens - self._usage.prefill_tokens)
            self._decode_tokens += drawn
            self._sampler_steps += 1
            self._sampler_s.observe(duration_s)
            self._decode_rate.add(now, drawn)
            self._usage = usage

    def record_usage(self, usage: EngineUsage) -> None:
        """The engine's memory and KV cache now (the loop calls this about once a second)."""
        with self._lock:
            self._prefill_tokens += max(0, usage.prefill_tokens - self._usage.prefill_tokens)
            self._decode_tokens += max(0, usage.sampled_tokens - self._usage.sampled_tokens)
            self._usage = usage

    def record_engine_thread(self, seconds: Mapping[str, float]) -> None:
        """Wall seconds the engine thread spent in each state during one cycle of its loop."""
        with self._lock:
            for state, spent in seconds.items():
                self._engine_thread_s[state] = self._engine_thread_s.get(state, 0.0) + spent

    def record_outcomes(self, complete: int, failed: Mapping[str, int]) -> None:
        """Futures finished: `complete` with a result, `failed` per error category."""
        with self._lock:
            self._complete += complete
            for category, count in failed.items():
                self._failed[category] = self._failed.get(category, 0) + count

    def record_db_call(self, op: str, duration_s: float) -> None:
        """One Store call, named by its method."""
        with self._lock:
            histogram = self._db_s.get(op)
            if histogram is None:
                histogram = self._db_s[op] = _Histogram(DB_BUCKETS_S)
            histogram.observe(duration_s)

    # --- reading
    def snapshot(self) -> ServerSnapshot:
        """Everything at this moment; any thread (takes the service lock briefly for the occupancy)."""
        occupancy = self.occupancy_source()
        depth = dict.fromkeys(QUEUE_KINDS, 0) | dict(occupancy.queue_depth)
        now = self.clock()
        with self._lock:
            usage, recent = self._usage, tuple(self._recent)
            totals = Totals(
                self._passes,
                self._pass_tokens,
                self._pass_requests,
                self._pass_runs,
                self._pass_tenants,
                self._optim_steps,
                self._optim_step_runs,
                self._sampler_steps,
                self._decode_tokens,
                self._prefill_tokens,
                self._complete,
                dict(self._failed),
            )
            train_rate = self._train_rate.per_second(now, self._started)
            decode_rate = self._decode_rate.per_second(now, self._started)
            histograms = (self._pass_s.snapshot(), self._optim_s.snapshot(), self._sampler_s.snapshot())
            db = {op: h.snapshot() for op, h in self._db_s.items()}
            engine_thread = dict(self._engine_thread_s)
        device = f"{self.device} ({usage.device_name})" if usage.device_name else self.device
        return ServerSnapshot(
            uptime_s=now - self._started,
            device=device,
            slots_used=occupancy.slots_used,
            slots_total=occupancy.slots_total,
            runs_parked=occupancy.runs_parked,
            runs_waiting=occupancy.runs_waiting,
            queue_depth=depth,
            futures_pending=occupancy.futures_pending,
            train_tokens_per_s=train_rate,
            decode_tokens_per_s=decode_rate,
            last_pass=recent[-1] if recent else None,
            recent_passes=recent,
            memory=Memory(
                _process_rss_bytes(),
                usage.device_allocated_bytes,
                usage.device_reserved_bytes,
                usage.device_total_bytes,
            ),
            kv_cache=KvCache(usage.kv_cache_bytes, usage.kv_cache_tokens, usage.sequences),
            totals=totals,
            pass_duration=histograms[0],
            optim_step_duration=histograms[1],
            sampler_step_duration=histograms[2],
            db_call_duration=db,
            engine_thread_s=engine_thread,
        )


def _process_rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
