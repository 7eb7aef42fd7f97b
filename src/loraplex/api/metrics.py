"""`GET /metrics`: the server's metrics in the Prometheus text format (docs/METRICS.md lists them).

Each app has its own CollectorRegistry (several apps may live in one process, as in the tests). It holds the
request metrics, updated per request by the request observer (request_log.py), the process collector, and
the runtime's `Telemetry.registry` itself: the counters, histograms and gauges the runtime records into,
rendered as they are at scrape time. No label names a tenant, run or sampler: one tenant's key may read
/metrics (unless `--metrics-public`, which needs none), and sees only server-wide figures. No tensors, no
SQL.
"""

from __future__ import annotations

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
from prometheus_client.process_collector import ProcessCollector
from starlette.concurrency import run_in_threadpool

from loraplex.errors import AuthenticationError
from loraplex.runtime.control.keys import TenantResolver
from loraplex.runtime.observability.telemetry import Telemetry

router = APIRouter()

HTTP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BEARER = "bearer "


def error_category(status: int) -> str | None:
    """The error category of an HTTP status: capacity (429, 503: the client retries), server (other 5xx),
    user (other 4xx); None for success."""
    if status in (429, 503):
        return "capacity"
    if status >= 500:
        return "server"
    return "user" if status >= 400 else None


class Metrics:
    """The registry of one app: request instruments, the runtime's telemetry registry and the process."""

    def __init__(self, telemetry: Telemetry) -> None:
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
        self._telemetry = telemetry
        self.registry.register(telemetry.registry)  # collected as it is, each scrape
        ProcessCollector(registry=self.registry)

    def observe_request(self, method: str, route: str, status: int, latency_s: float) -> None:
        """One answered request (the request observer calls this); an error response counts in
        loraplex_errors_total, which telemetry holds beside the futures' errors."""
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            children = self.requests.labels(method, route, str(status)), self.latency.labels(method, route)
            self._children[key] = children
        children[0].inc()
        children[1].observe(latency_s)
        if status >= 400 and (category := error_category(status)) is not None:
            self._telemetry.record_response_error(category)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


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
