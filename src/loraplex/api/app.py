"""The FastAPI application: routes, and the one place exception classes become HTTP status codes.

Knows nothing of tensors or the database; it talks only to the runtime's TrainingService.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex.api.routes import futures, rest, sampling, service, training, unsupported
from loraplex.errors import CapacityError, LoraplexError, UserError
from loraplex.runtime.service import TrainingService

log = logging.getLogger(__name__)


def status_of(error: LoraplexError) -> int:
    """HTTP status of an error: its own status_code if it has one (a UserError's 4xx, sampling
    backpressure's 429, the only 429); else 503 for capacity (retried) and 500 for the rest."""
    return getattr(error, "status_code", 503 if isinstance(error, CapacityError) else 500)


async def _loraplex_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, LoraplexError)
    status = status_of(error)
    if status >= 500:
        log.error("server error: %r", error)
    # x-should-retry tells the SDK's HTTP layer not to retry a permanent (user) error.
    headers = {"x-should-retry": "false"} if isinstance(error, UserError) else {}
    return JSONResponse({"detail": str(error)}, status_code=status, headers=headers)


def create_app(training_service: TrainingService, run_service: bool = True) -> FastAPI:
    """The app over a (not yet started) service. Its lifespan starts and stops the service, unless
    `run_service` is False: then whoever serves the app runs the service's engine worker itself."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not run_service:
            yield
            return
        training_service.start()
        try:
            yield
        finally:
            training_service.stop()

    app = FastAPI(title="loraplex", lifespan=lifespan)
    app.state.service = training_service
    app.add_exception_handler(LoraplexError, _loraplex_error)
    # Unsupported SDK routes before REST's, whose checkpoint path parameter would swallow them.
    for module in (service, training, futures, sampling, unsupported, rest):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(unsupported.fallback, prefix="/api/v1")
    return app
