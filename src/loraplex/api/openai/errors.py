"""OpenAI's error body for every /v1 failure: `{"error": {"message", "type", "param", "code"}}`.

Statuses are the Tinker routes' (api/errors.py); only the body differs, so OpenAI clients (which read
`error.message` and retry 429 and 5xx themselves) report what went wrong. As on the Tinker routes, a
server error's body names an error id that the log has the details under, never the error itself (it may
hold filesystem paths). No tensors.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loraplex.api.errors import status_of
from loraplex.errors import AuthenticationError, CapacityError, FieldError, LoraplexError, UserError
from loraplex.runtime.serving.inference import ModelNotFoundError

log = logging.getLogger(__name__)


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An OpenAI error body with the error type OpenAI gives that status."""
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's `{"error": ...}` for a failure of that status."""
    if status == 429:
        kind = "requests"
        code = code or "rate_limit_exceeded"
    else:
        kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stream_error_body(error: Exception) -> dict:
    """The error event of a stream that fails once started (its status has been sent): a user error says
    what was wrong; anything else, like a 500, only the error id the log has it under."""
    if isinstance(error, LoraplexError):
        status = status_of(error)
        if status < 500 or isinstance(error, CapacityError):  # capacity says what to wait for
            return error_body(status, str(error))
    return error_body(500, _logged(error))


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape."""
    app.add_exception_handler(LoraplexError, _loraplex_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _loraplex_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, LoraplexError)
    status = status_of(error)
    if status >= 500 and not isinstance(error, CapacityError):  # capacity says what to wait for
        return _server_error(error)
    if isinstance(error, ModelNotFoundError):
        response = error_response(status, str(error), "model", "model_not_found")
    elif isinstance(error, AuthenticationError):
        response = error_response(status, str(error), None, "invalid_api_key")
    elif isinstance(error, FieldError):
        response = error_response(status, str(error), error.field)
    else:
        response = error_response(status, str(error))
    if isinstance(error, UserError):  # the openai client honours it: retrying a bad request fails again
        response.headers["x-should-retry"] = "false"
    if (retry_after_s := getattr(error, "retry_after_s", None)) is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


async def _invalid_body(_request: Request, error: Exception) -> JSONResponse:
    """A body that does not parse or fits no field: 400 naming the first bad parameter."""
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0]
    if first["type"] == "json_invalid":  # its loc is a character offset, not a parameter
        return error_response(400, f"the body is not valid JSON: {first['ctx']['error']}")
    # A union's form tags (<text>, schemas.py) are pydantic's, not fields of the request.
    param = ".".join(str(part) for part in first["loc"] if part != "body" and not _is_form_tag(part)) or None
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix to our validators' messages
    if first["type"] == "extra_forbidden":
        message = "this server does not support this parameter"
    return error_response(400, f"{param}: {message}" if param else message, param)


def _is_form_tag(part: str | int) -> bool:
    return isinstance(part, str) and part.startswith("<") and part.endswith(">")


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}"
        return error_response(404, message, None, "unknown_url")
    return error_response(error.status_code, str(error.detail))


async def _unexpected_error(_request: Request, error: Exception) -> JSONResponse:
    return _server_error(error)


def _server_error(error: Exception) -> JSONResponse:
    return error_response(500, _logged(error))


def _logged(error: Exception) -> str:
    """Log a server error under a new id; the message that names it."""
    error_id = uuid.uuid4().hex[:12]
    log.error("server error %s: %r", error_id, error, exc_info=error)
    return f"internal server error (error id {error_id}; the server log has the details)"
