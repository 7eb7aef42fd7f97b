"""`GET /metrics`: the server's metrics in the Prometheus text format (docs/METRICS.md lists them).

Each app has its own CollectorRegistry (several apps may live in one process, as in the tests). Request
metrics are updated per request by the request observer (request_log.py); everything else is read from
the runtime's `Telemetry.snapshot()` when scraped, by a custom collector, so the engine's hot path only
adds to plain counters. No label names a tenant, run or sampler: one tenant's key may read /metrics
(unless `--metrics-public`, which needs none), and sees only server-wide figures. No tensors, no SQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from loraplex.errors import AuthenticationError
from loraplex.runtime.control.keys import TenantResolver
from loraplex.runtime.observability.telemetry import (
    ENGINE_THREAD_STATES,
    HistogramSnapshot,
    ServerSnapshot,
    Telemetry,
)

router = APIRouter()

HTTP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BEARER = "bearer "
ERROR_CATEGORIES = ("user", "capacity", "server")


def error_category(status: int) -> str | None:
    """The error category of an HTTP status: capacity (429, 503: the client retries), server (other 5xx),
    user (other 4xx); None for success."""
    if status in (429, 503):
        return "capacity"
    if status >= 500:
        return "server"
    return "user" if status >= 400 else None


class Metrics:
    """The registry of one app: request instruments, plus a collector over the service's telemetry."""

    def __init__(self, telemetry: Telemetry, model_name: str) -> None:
        disable_created_metrics()  # no *_created series: Prometheus's text format does not use them
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplex_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "loraplex_http_request_duration_seconds",
            "Time from a request's arrival to its last byte sent, by method and route template.",
            ("method", "route"),
            buckets=HTTP_BUCKETS_S,
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}  # labels() costs a lock and a dict
        self._lock = threading.Lock()
        self.response_errors: dict[str, int] = {}  # category -> error responses
        self.registry.register(TelemetryCollector(telemetry, model_name, self))
        ProcessCollector(registry=self.registry)

    def observe_request(self, method: str, route: str, status: int, latency_s: float) -> None:
        """One answered request (the request observer calls this)."""
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            children = self.requests.labels(method, route, str(status)), self.latency.labels(method, route)
            self._children[key] = children
        children[0].inc()
        children[1].observe(latency_s)
        if status >= 400 and (category := error_category(status)) is not None:
            with self._lock:
                self.response_errors[category] = self.response_errors.get(category, 0) + 1

    def response_error_counts(self) -> dict[str, int]:
        """Error responses so far, by category."""
        with self._lock:
            return dict(self.response_errors)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class TelemetryCollector(Collector):
    """Metric families from a telemetry snapshot taken at scrape time."""

    def __init__(self, telemetry: Telemetry, model_name: str, metrics: Metrics) -> None:
        self.telemetry, self.model_name, self.metrics = telemetry, model_name, metrics

    def collect(self) -> Iterator[Metric]:
        s = self.telemetry.snapshot()
        yield from _occupancy(s)
        yield from _work(s)
        yield from _memory(s)
        yield _errors(self.metrics.response_error_counts(), s.totals.futures_failed)
        info = GaugeMetricFamily(
            "loraplex_server_info",
            "Always 1; labels name the model served and the device.",
            labels=("model", "device"),
        )
        info.add_metric((self.model_name, s.device), 1)
        yield info
        yield _gauge("loraplex_uptime_seconds", "Seconds since the service started.", s.uptime_s)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, h: HistogramSnapshot) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], _buckets(h), h.sum)
    return family


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last."""
    out, running = [], 0
    for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out


def _errors(responses: dict[str, int], futures: Mapping[str, int]) -> CounterMetricFamily:
    errors = CounterMetricFamily(
        "loraplex_errors",
        "Errors by category (user, capacity, server) and where they were reported: an HTTP error "
        "response, or a request's future that failed.",
        labels=("category", "source"),
    )
    for category in ERROR_CATEGORIES:  # every series from the start, so rate() sees the first error
        errors.add_metric((category, "response"), responses.get(category, 0))
        errors.add_metric((category, "future"), futures.get(category, 0))
    return errors


def _occupancy(s: ServerSnapshot) -> Iterator[Metric]:
    yield _gauge("loraplex_slots_used", "Adapter slots holding a run.", s.slots_used)
    yield _gauge("loraplex_slots_total", "Adapter slots of the engine (--max-slots).", s.slots_total)
    yield _gauge("loraplex_runs_parked", "Runs whose state is parked on disk.", s.runs_parked)
    yield _gauge("loraplex_runs_waiting", "Runs with queued work but no slot.", s.runs_waiting)
    depth = GaugeMetricFamily(
        "loraplex_queue_depth",
        "Requests queued, by kind (sample: sampling requests not finished, waiting or generating).",
        labels=("kind",),
    )
    for kind, count in s.queue_depth.items():
        depth.add_metric((kind,), count)
    yield depth
    yield _gauge("loraplex_futures_pending", "Requests whose future has no outcome yet.", s.futures_pending)
    finished = CounterMetricFamily(
        "loraplex_futures_finished", "Futures finished, by state (complete or failed).", labels=("state",)
    )
    finished.add_metric(("complete",), s.totals.futures_complete)
    finished.add_metric(("failed",), sum(s.totals.futures_failed.values()))
    yield finished


def _work(s: ServerSnapshot) -> Iterator[Metric]:
    t = s.totals
    yield _counter("loraplex_passes", "Training passes run (forward and forward_backward, packed).", t.passes)
    yield _counter("loraplex_pass_tokens", "Datum tokens of the requests packed into passes.", t.pass_tokens)
    yield _counter("loraplex_pass_requests", "Requests packed into passes.", t.pass_requests)
    yield _counter("loraplex_pass_runs", "Runs packed into passes, summed over passes.", t.pass_runs)
    yield _counter("loraplex_pass_tenants", "Tenants packed into passes, summed over passes.", t.pass_tenants)
    yield _histogram("loraplex_pass_duration_seconds", "Duration of one training pass.", s.pass_duration)
    yield _counter("loraplex_optim_steps", "Fused optimizer steps run.", t.optim_steps)
    yield _counter("loraplex_optim_step_runs", "Runs stepped, summed over fused steps.", t.optim_step_runs)
    yield _histogram(
        "loraplex_optim_step_duration_seconds", "Duration of one fused optimizer step.", s.optim_step_duration
    )
    yield _counter(
        "loraplex_sampler_steps", "Sampler steps run (admission, prefill, one decode step).", t.sampler_steps
    )
    yield _counter("loraplex_decode_tokens", "Tokens the sampler generated.", t.decode_tokens)
    yield _counter("loraplex_prefill_tokens", "Prompt tokens the sampler prefilled.", t.prefill_tokens)
    yield _histogram(
        "loraplex_sampler_step_duration_seconds",
        "Duration of one sampler step (admissions' prefill and one decode step of every active sequence).",
        s.sampler_step_duration,
    )
    busy = s.engine_thread_s.get("engine", 0.0)
    yield _counter(
        "loraplex_engine_busy_seconds",
        "Wall seconds the engine thread spent inside engine calls; its duty cycle is this over "
        "loraplex_engine_thread_seconds_total of the states engine, durable and other.",
        busy,
    )
    thread = CounterMetricFamily(
        "loraplex_engine_thread_seconds",
        "Wall seconds of the engine thread by state: engine (inside engine calls), durable (waiting for an "
        "earlier outcome to be written), held (work the scheduler holds back), idle, other (planning, "
        "bookkeeping).",
        labels=("state",),
    )
    for state in ENGINE_THREAD_STATES:
        thread.add_metric((state,), s.engine_thread_s.get(state, 0.0))
    yield thread
    db = HistogramMetricFamily(
        "loraplex_db_call_duration_seconds", "Duration of one database call, by Store method.", labels=["op"]
    )
    for op, h in sorted(s.db_call_duration.items()):
        db.add_metric([op], _buckets(h), h.sum)
    yield db


# Exported on CUDA only (docs/METRICS.md).
DEVICE_MEMORY_METRICS = (
    "loraplex_device_memory_allocated_bytes",
    "loraplex_device_memory_reserved_bytes",
    "loraplex_device_memory_total_bytes",
)


def _memory(s: ServerSnapshot) -> Iterator[Metric]:
    yield _gauge("loraplex_kv_cache_bytes", "KV cache storage the sampler holds.", s.kv_cache.bytes)
    yield _gauge(
        "loraplex_kv_cache_tokens", "Tokens cached in the KV cache's rows in use.", s.kv_cache.tokens
    )
    yield _gauge(
        "loraplex_sampling_sequences", "Sequences decoding (KV cache rows in use).", s.kv_cache.sequences
    )
    memory = s.memory
    values = (memory.device_allocated_bytes, memory.device_reserved_bytes, memory.device_total_bytes)
    docs = (
        "Device memory held by tensors (CUDA).",
        "Device memory the caching allocator holds (CUDA).",
        "Device memory in all (CUDA).",
    )
    for name, doc, value in zip(DEVICE_MEMORY_METRICS, docs, values, strict=True):
        if value is not None:
            yield _gauge(name, doc, value)


async def _authorize(request: Request) -> None:
    """Any tenant's key (X-API-Key, or Authorization: Bearer as Prometheus sends it), unless the server
    runs with --metrics-public."""
    if request.app.state.metrics_public:
        return
    key, authorization = request.headers.get("x-api-key"), request.headers.get("authorization")
    if authorization is not None and authorization[: len(_BEARER)].lower() == _BEARER:
        key = authorization[len(_BEARER) :].strip()
    if not key:
        raise AuthenticationError(
            "/metrics needs an API key (X-API-Key or Authorization: Bearer), unless the server runs with "
            "--metrics-public"
        )
    tenants: TenantResolver = request.app.state.tenants
    if tenants.cached(key) is None:
        await run_in_threadpool(tenants.tenant_for, key)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The Prometheus exposition; rendered on a worker thread (it takes the service lock briefly)."""
    await _authorize(request)
    body = await run_in_threadpool(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
