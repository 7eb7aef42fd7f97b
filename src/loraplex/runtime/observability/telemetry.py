"""Telemetry: what the server is doing, kept cheaply for `/metrics`, the console and the logs.

Counters, histograms and gauges are prometheus_client objects in the telemetry's own registry
(`Telemetry.registry`): the `record_*` methods update them as the engine loop, the futures and the store
work, and /metrics renders that registry as it is (api/metrics.py adds the HTTP request metrics and the
process). Slot, run, queue and future occupancy is read from the occupancy source when the registry is
collected. Rates over the last few seconds and the recent passes are not metrics: they are small plain
state under a lock of their own, for the console. No tensors, no HTTP, no SQL.

API (stable; the console and /metrics read it):

    telemetry = Telemetry(device="cuda:0", clock=time.monotonic, model_name=...)  # owned by the Runtime
    # fed by the engine loop (runtime/core/engine_loop.py, runtime/core/executor.py, runtime/core/duty.py):
    telemetry.record_pass(tokens, requests, runs, tenants, duration_s)   # one packed training pass
    telemetry.record_optim_step(runs, duration_s)                       # one fused AdamW step
    telemetry.record_park(to)                                           # a run parked: to "host" or "disk"
    telemetry.record_sampler_step(duration_s, usage)                    # one sampler step (EngineUsage)
    telemetry.record_usage(usage)                                       # memory / KV cache, ~once a second
    telemetry.record_engine_thread(seconds_by_state)                    # the engine thread's wall time
    telemetry.health.record_training(loss_fn, health)                   # a forward_backward's health
    telemetry.health.record_samples(sample_metrics)                     # a finished sampling request
    # fed by the futures, the store and the request observer:
    telemetry.record_outcomes(complete, failed)                  # futures finished; failed: category -> n
    telemetry.record_db_call(op, duration_s)                            # one Store call
    telemetry.record_response_error(category)                           # one HTTP error response
    # wired by the Runtime: where slot and queue occupancy come from (read at collection time)
    telemetry.occupancy_source = callable returning Occupancy
    # read by anyone, from any thread:
    telemetry.registry                                                  # what /metrics serves
    telemetry.snapshot() -> ServerSnapshot                              # a frozen read of it, for the console

Rates (`train_tokens_per_s`, `decode_tokens_per_s`) are over the last `window_s` seconds (10 by default),
or since start while the server is younger than that. Counters and histograms count since start.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraplex.engine.interface import EngineUsage
from loraplex.runtime.core.commands import Command, ForwardBackward, OptimStep
from loraplex.runtime.core.sampler_backend import SamplerServer
from loraplex.runtime.observability.health_metrics import HealthMetrics
from loraplex.runtime.observability.server_snapshot import (
    KvCache,
    Memory,
    PassRecord,
    ServerSnapshot,
    Totals,
    process_rss_bytes,
    read_histograms,
    read_value,
    read_values,
)

# Where a parked run's state goes, the `to` label of loraplex_parks (both present from the start).
PARK_TARGETS = ("host", "disk")
# Kinds of queued work, the `kind` label of loraplex_queue_depth (every kind is present, 0 when empty).
QUEUE_KINDS = ("create", "forward_backward", "forward", "optim_step", "save", "load", "sample")
_KIND_OF_REQUEST_TYPE = {
    "CreateModel": "create",
    "LoadWeights": "load",
    "SaveWeights": "save",
    "SaveWeightsForSampler": "save",
    "SaveWeightsExternal": "save",
}
# The `category` label of loraplex_errors_total: every category has its series from the start.
ERROR_CATEGORIES = ("user", "capacity", "server")
# The `state` label of loraplex_engine_thread_seconds_total (runtime/core/duty.py), in the order listed.
ENGINE_THREAD_STATES = ("engine", "durable", "held", "idle", "other")
# The `kind` label of loraplex_rank_parameter_bytes: the fields of engine.interface.ParameterBytes.
PARAMETER_KINDS = ("base", "adapter", "optimizer")

# Histogram bucket upper bounds (seconds), Prometheus `le` values; +Inf is implied.
PASS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OPTIM_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DECODE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DB_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# Exported once the engine reports them, i.e. on CUDA only (docs/METRICS.md).
DEVICE_MEMORY_METRICS = (
    "loraplex_device_memory_allocated_bytes",
    "loraplex_device_memory_reserved_bytes",
    "loraplex_device_memory_total_bytes",
)
# The families of each server a sampler backend samples on, exported only with `--sampler vllm`: the
# SamplerServer field each reads, its family (a counter's samples end in _total), and its help.
_SAMPLER_SERVER_FAMILIES = (
    (
        "up",
        GaugeMetricFamily,
        "loraplex_sampler_server_up",
        "1 while a vLLM sampler server answers; 0 while it is down.",
    ),
    (
        "restarts",
        CounterMetricFamily,
        "loraplex_sampler_server_down",
        "Times a vLLM sampler server went down (died or stalled); its requests failed retryably.",
    ),
    (
        "requests",
        GaugeMetricFamily,
        "loraplex_sampler_server_requests",
        "Sampling requests in flight on a vLLM server.",
    ),
    (
        "adapters",
        GaugeMetricFamily,
        "loraplex_sampler_server_adapters",
        "Snapshots loaded into a vLLM server.",
    ),
)
SAMPLER_SERVER_METRICS = tuple(
    name + ("_total" if family is CounterMetricFamily else "")
    for _, family, name, _ in _SAMPLER_SERVER_FAMILIES
)
_DEVICE_MEMORY_HELP = (
    "Device memory held by tensors (CUDA).",
    "Device memory the caching allocator holds (CUDA).",
    "Device memory in all (CUDA).",
)

_RECENT_PASSES = 32


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
    database_up: bool = True  # false while the database does not answer (control/store/outage.py)
    runs_on_host: int = 0  # runs whose state waits in host memory (the host tier, --host-slots)
    data_dir_free_bytes: int = 0  # free space where checkpoints go (core/disk_space.py)
    data_dir_reserve_bytes: int = 0  # the space saves leave free (--min-free-bytes)


def queue_depths(occupancy: Occupancy) -> dict[str, int]:
    """Requests queued by kind: every kind of QUEUE_KINDS, then any other the occupancy names."""
    return dict.fromkeys(QUEUE_KINDS, 0) | dict(occupancy.queue_depth)


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


class _OccupancyCollector:
    """The slot, run, queue and future gauges, from one read of the occupancy source per collection (so
    they agree with each other, and the service lock is taken once)."""

    def __init__(self, read: Callable[[], Occupancy]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        o = self._read()
        yield GaugeMetricFamily("loraplex_slots_used", "Adapter slots holding a run.", value=o.slots_used)
        yield GaugeMetricFamily(
            "loraplex_slots_total", "Adapter slots of the engine (--max-slots).", value=o.slots_total
        )
        yield GaugeMetricFamily(
            "loraplex_runs_parked", "Runs whose state is parked on disk.", value=o.runs_parked
        )
        yield GaugeMetricFamily(
            "loraplex_runs_on_host", "Runs whose state waits in host memory.", value=o.runs_on_host
        )
        yield GaugeMetricFamily(
            "loraplex_runs_waiting", "Runs with queued work but no slot.", value=o.runs_waiting
        )
        depth = GaugeMetricFamily(
            "loraplex_queue_depth",
            "Requests queued, by kind (sample: sampling requests not finished, waiting or generating).",
            labels=("kind",),
        )
        for kind, count in queue_depths(o).items():
            depth.add_metric((kind,), count)
        yield depth
        yield GaugeMetricFamily(
            "loraplex_futures_pending", "Requests whose future has no outcome yet.", value=o.futures_pending
        )
        yield GaugeMetricFamily(
            "loraplex_database_up",
            "1 while the database answers; 0 during an outage (requests wait, then get 503).",
            value=int(o.database_up),
        )
        yield GaugeMetricFamily(
            "loraplex_data_dir_free_bytes",
            "Free space in the data dir's filesystem; saves that would leave less than "
            "loraplex_data_dir_reserve_bytes are refused.",
            value=o.data_dir_free_bytes,
        )
        yield GaugeMetricFamily(
            "loraplex_data_dir_reserve_bytes",
            "Free space the data dir keeps for the database (--min-free-bytes).",
            value=o.data_dir_reserve_bytes,
        )


class _SamplerServersCollector:
    """The gauges of the servers a sampler backend samples on (`--sampler vllm`), by server; none for the
    in-process sampler."""

    def __init__(self, read: Callable[[], list[SamplerServer]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        servers = self._read()
        if not servers:
            return
        families = {
            attribute: family(name, doc, labels=("server",))
            for attribute, family, name, doc in _SAMPLER_SERVER_FAMILIES
        }
        for server in servers:
            for attribute, family in families.items():
                family.add_metric((str(server.index),), float(getattr(server, attribute)))
        yield from families.values()


class Telemetry:
    """The metrics of one server in a registry of its own, and the console's rates and recent passes;
    see the module docstring for the API."""

    def __init__(
        self,
        device: str = "",
        clock: Callable[[], float] = time.monotonic,
        window_s: int = 10,
        model_name: str = "",
    ) -> None:
        self.device = device  # as the engine names it; with the device's own name once reported
        self.clock = clock
        self.occupancy_source: Callable[[], Occupancy] = Occupancy
        self.registry = CollectorRegistry()
        self._started = clock()
        self._model_name = model_name
        self._lock = threading.Lock()  # the console's plain state: rates and recent passes
        self._train_rate, self._decode_rate = _Rate(window_s), _Rate(window_s)
        self._recent: deque[PassRecord] = deque(maxlen=_RECENT_PASSES)
        self._usage = EngineUsage()  # the engine's last; its token counters are cumulative (engine thread)
        self._define_metrics()
        self.health = HealthMetrics(self.registry)  # training and sampling health (health_metrics.py)
        self.registry.register(_OccupancyCollector(lambda: self.occupancy_source()))
        self.sampler_servers: Callable[[], list[SamplerServer]] = list  # set by the runtime
        self.registry.register(_SamplerServersCollector(lambda: self.sampler_servers()))

    def _define_metrics(self) -> None:
        """Every metric the telemetry records, with the names, labels and help /metrics has always had."""
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=r)

        self._passes = counter(
            "loraplex_passes", "Training passes run (forward and forward_backward, packed)."
        )
        self._pass_tokens = counter(
            "loraplex_pass_tokens", "Datum tokens of the requests packed into passes."
        )
        self._pass_requests = counter("loraplex_pass_requests", "Requests packed into passes.")
        self._pass_runs = counter("loraplex_pass_runs", "Runs packed into passes, summed over passes.")
        self._pass_tenants = counter(
            "loraplex_pass_tenants", "Tenants packed into passes, summed over passes."
        )
        self._pass_s = Histogram(
            "loraplex_pass_duration_seconds",
            "Duration of one training pass.",
            buckets=PASS_BUCKETS_S,
            registry=r,
        )
        self._optim_steps = counter("loraplex_optim_steps", "Fused optimizer steps run.")
        self._optim_step_runs = counter("loraplex_optim_step_runs", "Runs stepped, summed over fused steps.")
        parks = Counter(
            "loraplex_parks",
            "Runs whose state left the engine's slots or host memory, by where it went: host (host memory), "
            "disk (parked/).",
            ("to",),
            registry=r,
        )
        self._parks = {to: parks.labels(to) for to in PARK_TARGETS}
        self._optim_s = Histogram(
            "loraplex_optim_step_duration_seconds",
            "Duration of one fused optimizer step.",
            buckets=OPTIM_BUCKETS_S,
            registry=r,
        )
        self._sampler_steps = counter(
            "loraplex_sampler_steps", "Sampler steps run (admission, prefill, one decode step)."
        )
        self._decode_tokens = counter("loraplex_decode_tokens", "Tokens the sampler generated.")
        self._prefill_tokens = counter("loraplex_prefill_tokens", "Prompt tokens the sampler prefilled.")
        self._sampler_s = Histogram(
            "loraplex_sampler_step_duration_seconds",
            "Duration of one sampler step (admissions' prefill and one decode step of every active "
            "sequence).",
            buckets=DECODE_BUCKETS_S,
            registry=r,
        )
        self._engine_busy_s = counter(
            "loraplex_engine_busy_seconds",
            "Wall seconds the engine thread spent inside engine calls; its duty cycle is this over "
            "loraplex_engine_thread_seconds_total of the states engine, durable and other.",
        )
        engine_thread_s = Counter(
            "loraplex_engine_thread_seconds",
            "Wall seconds of the engine thread by state: engine (inside engine calls), durable (waiting for "
            "an earlier outcome to be written), held (work the scheduler holds back), idle, other "
            "(planning, bookkeeping).",
            ("state",),
            registry=r,
        )
        self._engine_thread_s = {state: engine_thread_s.labels(state) for state in ENGINE_THREAD_STATES}
        self._db_s = Histogram(
            "loraplex_db_call_duration_seconds",
            "Duration of one database call, by Store method.",
            ("op",),
            buckets=DB_BUCKETS_S,
            registry=r,
        )
        finished = Counter(
            "loraplex_futures_finished",
            "Futures finished, by state (complete or failed).",
            ("state",),
            registry=r,
        )
        self._complete, self._failed = finished.labels("complete"), finished.labels("failed")
        self._errors = Counter(
            "loraplex_errors",
            "Errors by category (user, capacity, server) and where they were reported: an HTTP error "
            "response, or a request's future that failed.",
            ("category", "source"),
            registry=r,
        )
        for category in ERROR_CATEGORIES:  # every series from the start, so rate() sees the first error
            self._errors.labels(category, "response")
            self._errors.labels(category, "future")
        self._kv_cache_bytes = gauge("loraplex_kv_cache_bytes", "KV cache storage the sampler holds.")
        self._kv_cache_tokens = gauge(
            "loraplex_kv_cache_tokens", "Tokens cached in the KV cache's rows in use."
        )
        self._sequences = gauge("loraplex_sampling_sequences", "Sequences decoding (KV cache rows in use).")
        self._rank_bytes = Gauge(
            "loraplex_rank_parameter_bytes",
            "Bytes of tensors each engine rank holds, by kind: base (the frozen model), adapter (the LoRA "
            "weights of its slots), optimizer (their gradients and AdamW moments, and the pass undo copy).",
            ("rank", "kind"),
            registry=r,
        )
        # Not in the registry until the engine reports a value (off CUDA it never does).
        self._device_memory = tuple(
            Gauge(name, doc, registry=None)
            for name, doc in zip(DEVICE_MEMORY_METRICS, _DEVICE_MEMORY_HELP, strict=True)
        )
        self._device_memory_unreported = set(self._device_memory)
        self._info = Gauge(
            "loraplex_server_info",
            "Always 1; labels name the model served and the device.",
            ("model", "device"),
            registry=r,
        )
        self._device_named = self.device  # the info gauge's device label
        self._info.labels(self._model_name, self.device).set(1)
        gauge("loraplex_uptime_seconds", "Seconds since the service started.").set_function(
            lambda: self.clock() - self._started
        )

    # --- recording (engine loop, futures, store, request observer)
    def record_pass(self, tokens: int, requests: int, runs: int, tenants: int, duration_s: float) -> None:
        """One packed training pass of `requests` requests of `runs` runs of `tenants` tenants."""
        now = self.clock()
        self._passes.inc()
        self._pass_tokens.inc(tokens)
        self._pass_requests.inc(requests)
        self._pass_runs.inc(runs)
        self._pass_tenants.inc(tenants)
        self._pass_s.observe(duration_s)
        record = PassRecord(now - self._started, tokens, requests, runs, tenants, duration_s)
        with self._lock:
            self._train_rate.add(now, tokens)
            self._recent.append(record)

    def record_optim_step(self, runs: int, duration_s: float) -> None:
        """One fused optimizer step over `runs` runs."""
        self._optim_steps.inc()
        self._optim_step_runs.inc(runs)
        self._optim_s.observe(duration_s)

    def record_park(self, to: str) -> None:
        """A run's state went to `to` (one of PARK_TARGETS)."""
        self._parks[to].inc()

    def record_sampler_step(self, duration_s: float, usage: EngineUsage) -> None:
        """One sampler step (admission, prefill, one decode step); `usage` is the engine's right after it,
        whose cumulative token counters the step's tokens are read from."""
        now = self.clock()
        self._sampler_steps.inc()
        self._sampler_s.observe(duration_s)
        drawn = self._take_usage(usage)
        with self._lock:
            self._decode_rate.add(now, drawn)

    def record_usage(self, usage: EngineUsage) -> None:
        """The engine's memory and KV cache now (the loop calls this about once a second)."""
        self._take_usage(usage)

    def record_engine_thread(self, seconds: Mapping[str, float]) -> None:
        """Wall seconds the engine thread spent in each state of ENGINE_THREAD_STATES during one cycle."""
        for state, spent in seconds.items():
            self._engine_thread_s[state].inc(spent)
        self._engine_busy_s.inc(seconds.get("engine", 0.0))

    def record_outcomes(self, complete: int, failed: Mapping[str, int]) -> None:
        """Futures finished: `complete` with a result, `failed` per error category."""
        self._complete.inc(complete)
        for category, count in failed.items():
            self._failed.inc(count)
            self._errors.labels(category, "future").inc(count)

    def record_db_call(self, op: str, duration_s: float) -> None:
        """One Store call, named by its method."""
        self._db_s.labels(op).observe(duration_s)

    def record_response_error(self, category: str) -> None:
        """One HTTP error response of an error category (the API's request observer calls this)."""
        self._errors.labels(category, "response").inc()

    def _take_usage(self, usage: EngineUsage) -> int:
        """Count the tokens the engine's counters moved by since the last usage, set the memory and KV cache
        gauges from it, and name the device once the engine does; returns the tokens drawn since."""
        last, self._usage = self._usage, usage
        drawn = max(0, usage.sampled_tokens - last.sampled_tokens)
        self._decode_tokens.inc(drawn)
        self._prefill_tokens.inc(max(0, usage.prefill_tokens - last.prefill_tokens))
        self._kv_cache_bytes.set(usage.kv_cache_bytes)
        self._kv_cache_tokens.set(usage.kv_cache_tokens)
        self._sequences.set(usage.sequences)
        if usage.parameter_bytes != last.parameter_bytes:  # they change with slots, not every sampler step
            for rank, held in enumerate(usage.parameter_bytes):
                for kind in PARAMETER_KINDS:
                    self._rank_bytes.labels(str(rank), kind).set(getattr(held, kind))
        memory = (usage.device_allocated_bytes, usage.device_reserved_bytes, usage.device_total_bytes)
        for gauge, value in zip(self._device_memory, memory, strict=True):
            if value is not None:
                gauge.set(value)
                if gauge in self._device_memory_unreported:
                    self._device_memory_unreported.discard(gauge)
                    self.registry.register(gauge)
        if usage.device_name != last.device_name:
            self._name_device(usage.device_name)
        return drawn

    def _name_device(self, device_name: str) -> None:
        """Relabel the info gauge with the device's own name (the new series first, so none is missing)."""
        old = self._device_named
        new = f"{self.device} ({device_name})" if device_name else self.device
        self._info.labels(self._model_name, new).set(1)
        self._device_named = new
        if old != new:
            self._info.remove(self._model_name, old)

    # --- reading
    def snapshot(self) -> ServerSnapshot:
        """The registry's values now, with the rates and recent passes; any thread (takes the service lock
        briefly for the occupancy)."""
        occupancy = self.occupancy_source()
        now = self.clock()
        with self._lock:
            recent = tuple(self._recent)
            train_rate = self._train_rate.per_second(now, self._started)
            decode_rate = self._decode_rate.per_second(now, self._started)
        counted = (
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
        )
        errors = read_values(self._errors, "_total").items()
        failed = {category: int(n) for (category, source), n in errors if source == "future" and n > 0}
        device_memory = (
            None if gauge in self._device_memory_unreported else int(read_value(gauge))
            for gauge in self._device_memory
        )
        kv_cache = (
            int(read_value(gauge)) for gauge in (self._kv_cache_bytes, self._kv_cache_tokens, self._sequences)
        )
        return ServerSnapshot(
            uptime_s=now - self._started,
            device=self._device_named,
            slots_used=occupancy.slots_used,
            slots_total=occupancy.slots_total,
            runs_parked=occupancy.runs_parked,
            runs_on_host=occupancy.runs_on_host,
            runs_waiting=occupancy.runs_waiting,
            queue_depth=queue_depths(occupancy),
            futures_pending=occupancy.futures_pending,
            train_tokens_per_s=train_rate,
            decode_tokens_per_s=decode_rate,
            last_pass=recent[-1] if recent else None,
            recent_passes=recent,
            memory=Memory(process_rss_bytes(), *device_memory),
            kv_cache=KvCache(*kv_cache),
            totals=Totals(
                *(int(read_value(counter, "_total")) for counter in counted), futures_failed=failed
            ),
            pass_duration=read_histograms(self._pass_s)[()],
            optim_step_duration=read_histograms(self._optim_s)[()],
            sampler_step_duration=read_histograms(self._sampler_s)[()],
            db_call_duration={op: h for (op,), h in read_histograms(self._db_s).items()},
            engine_thread_s={state: read_value(c, "_total") for state, c in self._engine_thread_s.items()},
        )
