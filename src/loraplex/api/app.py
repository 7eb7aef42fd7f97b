"""The FastAPI application: the Tinker routes under /api/v1 and their error bodies, and the
OpenAI-compatible app mounted at /v1 (api/openai/), /metrics (metrics.py), the web console at /console
(api/console/), and around them all the request log (request_log.py). Status codes come from errors.py.

Knows nothing of tensors or the database; it hands each route the runtime collaborators it uses.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.routing import Mount

from loraplex.api.console.routes import router as console_router
from loraplex.api.errors import status_of
from loraplex.api.limits import BodyLimit, RequestLimits
from loraplex.api.metrics import Metrics
from loraplex.api.metrics import router as metrics_router
from loraplex.api.openai.app import create_openai_app
from loraplex.api.openai.tokenization import ROOT_PATHS as TOKENIZER_PATHS
from loraplex.api.request_log import RequestObserver
from loraplex.api.tinker import (
    downloads,
    futures,
    rest,
    sampling,
    server,
    sessions,
    sharing,
    training,
    unsupported,
)
from loraplex.api.tinker.codec_pool import CodecPool
from loraplex.api.tinker.submissions import SubmissionThread
from loraplex.api.tinker.wire import describe_errors
from loraplex.errors import CapacityError, LoraplexError, UserError
from loraplex.runtime.assembly import Runtime

log = logging.getLogger(__name__)


# x-should-retry tells the SDK's HTTP layer not to retry a permanent (user) error.
_PERMANENT = {"x-should-retry": "false"}


async def _loraplex_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, LoraplexError)
    status = status_of(error)
    if status >= 500 and not isinstance(error, CapacityError):  # capacity says what to wait for
        return _server_error(error)
    headers = _PERMANENT if isinstance(error, UserError) else {}
    if (retry_after_s := getattr(error, "retry_after_s", None)) is not None:
        headers = {**headers, "Retry-After": str(retry_after_s)}
    return JSONResponse({"detail": str(error)}, status_code=status, headers=headers)


async def _invalid_body(_request: Request, error: Exception) -> JSONResponse:
    """A body or parameter that fits no field: 422 naming the fields, not echoing their values."""
    assert isinstance(error, RequestValidationError)
    return JSONResponse({"detail": describe_errors(error.errors())}, status_code=422, headers=_PERMANENT)


async def _unexpected_error(_request: Request, error: Exception) -> JSONResponse:
    return _server_error(error)


def _server_error(error: Exception) -> JSONResponse:
    """A 500 whose body names an error id, never the error itself (it may hold filesystem paths); the log
    has the details under that id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("server error %s: %r", error_id, error, exc_info=error)
    detail = f"internal server error (error id {error_id}; the server log has the details)"
    return JSONResponse({"detail": detail}, status_code=500)


def create_app(runtime: Runtime, run_service: bool = True) -> FastAPI:
    """The app over a (not yet started) runtime. Its lifespan starts and stops the runtime, unless
    `run_service` is False: then whoever serves the app runs the runtime itself."""

    submissions = SubmissionThread(runtime.training)
    codecs = CodecPool()
    serving = [0]  # lifespans running: one app may be served by two servers at once (a test and a fuzzer)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        serving[0] += 1
        if run_service and serving[0] == 1:
            runtime.start()
        try:
            yield
        finally:
            serving[0] -= 1
            if serving[0] == 0:
                if run_service:
                    await run_in_threadpool(runtime.stop)  # it parks runs: database writes
                submissions.close()
                codecs.close()

    app = FastAPI(title="loraplex", lifespan=lifespan)
    # Each route takes the collaborators it uses from here (api/tinker/deps.py), never the whole runtime.
    state = app.state
    state.training, state.samplers, state.futures = runtime.training, runtime.samplers, runtime.futures
    state.sessions, state.catalog, state.downloads = runtime.sessions, runtime.catalog, runtime.downloads
    state.session_search, state.session_traces = runtime.session_search, runtime.session_traces
    state.info, state.layout, state.submissions = runtime.info, runtime.layout, submissions
    state.codecs, state.database, state.disk = codecs, runtime.store.reachability, runtime.disk
    state.sampler = runtime.sampler
    state.tenants, state.logins, state.console = runtime.tenants, runtime.logins, runtime.console
    state.metrics_public = runtime.config.metrics_public
    app.add_exception_handler(LoraplexError, _loraplex_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(Exception, _unexpected_error)
    limits = RequestLimits.from_config(runtime.config)
    app.add_middleware(BodyLimit, limits=limits, release_memory=runtime.release_freed_memory)
    # Added last, so outermost: its log line and metrics see BodyLimit's refusals too.
    state.metrics = Metrics(runtime.telemetry)
    app.add_middleware(RequestObserver, metrics=state.metrics)
    # FastAPI tries routes in the order they were added, a regex each, twice per request: the routes of
    # every training step (retrieve_future, then forward_backward and optim_step) come first.
    # Unsupported SDK routes before REST's, whose checkpoint path parameter would swallow them.
    for module in (futures, training, server, sampling, downloads, sharing, sessions, unsupported, rest):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(unsupported.fallback, prefix="/api/v1")
    app.include_router(metrics_router)
    app.include_router(console_router)
    openai_app = create_openai_app(runtime.inference, runtime.tenants, codecs)
    app.mount("/v1", openai_app)
    # vLLM serves its tokenizer routes at the root, where lm-evaluation-harness looks for them: each path
    # goes to the /v1 app as is, which answers it with OpenAI's error bodies.
    for path in TOKENIZER_PATHS:
        app.router.add_route(path, openai_app, include_in_schema=False)
    build_route_tables(app)
    return app


def build_route_tables(app: FastAPI) -> None:
    """Build every route table of `app` and the apps mounted in it now, before it serves. FastAPI 0.165
    builds an included router's table (each route's dependencies and validators) the first time a
    request looks through it, on the event loop: the first request to /v1 built some 70 routes and held
    the loop 90-130 ms. Looking for a path no route serves looks through every table."""
    nowhere = {"type": "http", "method": "GET", "path": "/\0", "root_path": "", "headers": []}
    for route in app.router.routes:
        route.matches(nowhere)
        if isinstance(route, Mount) and isinstance(route.app, FastAPI):
            build_route_tables(route.app)
