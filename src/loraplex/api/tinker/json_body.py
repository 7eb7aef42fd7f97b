"""JSON bodies read by their route rather than by FastAPI: the OpenAPI entry that still documents them, and
FastAPI's reading of a body parameter, done where the route chooses (a large one on the codec pool:
FastAPI parses and validates a body on the event loop, and an 8 MiB asample prompt held it ~1 s).

`validate_json_body` answers every body as FastAPI 0.165 does (fastapi/routing.py, get_request_handler,
and dependencies/utils.py, request_body_to_args), so a client sees the same 400s and 422s; one difference
remains: FastAPI decodes the JSON before it authenticates, this route after. No tensors, no SQL.
"""

from __future__ import annotations

import email.message
import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

Wire = TypeVar("Wire", bound=BaseModel)


def json_body_route(wire: type[BaseModel]) -> dict[str, Any]:
    """Route options that document a body the handler reads itself."""
    schema = wire.model_json_schema(ref_template="#/components/schemas/{model}")
    return {
        "openapi_extra": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}
        }
    }


def validate_json_body(wire: type[Wire], raw: bytes, content_type: str | None) -> Wire:
    """The body as `wire`, or the RequestValidationError (422) / HTTPException (400) FastAPI raises for it:
    JSON only under a JSON Content-Type (FastAPI's strict default), errors located under `body`."""
    if not raw:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing], body=None)
    body: Any = raw  # validated as bytes, hence refused, unless it is JSON
    if content_type and _is_json(content_type):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as error:
            problem = {
                "type": "json_invalid",
                "loc": ("body", error.pos),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": error.msg},
            }
            raise RequestValidationError([problem], body=error.doc) from error
        except Exception as error:  # bytes that are not text, nesting too deep
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from error
    try:
        return wire.model_validate(body, from_attributes=True)
    except ValidationError as error:
        problems = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise RequestValidationError(problems, body=body) from error


def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")
