"""One log line and one set of metric updates per HTTP request, and its request id.

`RequestObserver` is an ASGI middleware around every route (the /v1 app included): it gives each request
an id (the client's `X-Request-ID` if it is a short token, else a new one) and returns it as the
`x-request-id` response header, times the request until its last byte is sent, and then logs one line
on the `loraplex.requests` logger (INFO) with the request fields of log_format.py and updates the
request metrics (api/metrics.py). Handlers add what only they know (tenant, run id, seq_id, future id)
with `note_request(...)`. No tensors, no SQL.
"""

from __future__ import annotations

import logging
import re
import time
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.api.metrics import Metrics
from loraplex.ids import random_hex

log = logging.getLogger("loraplex.requests")

_current: ContextVar[dict[str, Any] | None] = ContextVar("loraplex_request", default=None)
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
UNMATCHED = "unmatched"  # the route label of a path no route matched (bounded: never the raw path)


def note_request(**fields: Any) -> None:
    """Add fields (tenant, run_id, seq_id, sampler_id, future_id) to the current request's log line; a
    no-op outside a request (and on worker threads it reaches through the copied context)."""
    entry = _current.get()
    if entry is not None:
        entry.update(fields)


def route_template(scope: Scope) -> str:
    """The matched route's path template (`/api/v1/samplers/{sampler_id}`), with the mount's prefix for
    the /v1 app's routes; UNMATCHED when no route matched."""
    route = scope.get("route")
    if route is None or hasattr(route, "routes"):  # none, or only the /v1 Mount matched
        return UNMATCHED
    # FastAPI 0.165 keeps an included router's routes without its prefix and records the route as
    # served (prefix included) in its own scope entry; older versions prefix the route itself.
    served = getattr(scope.get("fastapi", {}).get("effective_route_context"), "path_format", None)
    return scope.get("root_path", "") + (served or route.path)


class RequestObserver:
    """ASGI middleware: request id, one log line and the request metrics per HTTP request."""

    def __init__(self, app: ASGIApp, metrics: Metrics | None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = _request_id(scope)
        entry: dict[str, Any] = {"request_id": request_id}
        token = _current.set(entry)
        status = 500  # what the client gets if the app raises before answering
        header = (b"x-request-id", request_id.encode())

        async def tagged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        finally:
            _current.reset(token)
            latency_s = time.perf_counter() - start
            route = route_template(scope)
            if self.metrics is not None:
                self.metrics.observe_request(scope["method"], route, status, latency_s)
            if log.isEnabledFor(logging.INFO):
                path = _loggable_path(scope)
                entry.update(
                    method=scope["method"],
                    route=route,
                    path=path,
                    status=status,
                    latency_ms=round(latency_s * 1000, 2),
                )
                log.info("%s %s %d %.1f ms", scope["method"], path, status, latency_s * 1000, extra=entry)


def _loggable_path(scope: Scope) -> str:
    """The request path with a signed download token (a credential for its lifetime) masked."""
    path: str = scope["path"]
    token = scope.get("path_params", {}).get("token")
    return path.replace(token, "<token>") if isinstance(token, str) and token else path


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID when it is a short plain token (so its logs and ours join), else new."""
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _CLIENT_ID.fullmatch(value):
            return value.decode()
    return random_hex(8)
