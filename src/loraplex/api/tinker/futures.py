"""retrieve_future: the long-poll every submission's result comes back through (docs/PROTOCOL.md §5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from loraplex.api.request_log import note_request
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.codecs import (
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_output_json,
    json_safe,
    sample_response_json,
)
from loraplex.api.tinker.deps import Futures
from loraplex.api.tinker.wire import RetrieveFutureRequest
from loraplex.runtime.core.commands import PassResult
from loraplex.runtime.core.sampling import SampleResult

router = APIRouter()

PROTOBUF = "application/x-protobuf"

# Results the 0.38.0 SDK reads as protobuf (it asks with Accept); other clients get their JSON form.
_ENCODINGS: dict[type, tuple[Callable[[Any], bytes], Callable[[Any], dict[str, Any]]]] = {
    PassResult: (encode_forward_backward_output, forward_backward_output_json),
    SampleResult: (encode_sample_response, sample_response_json),
}


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, futures: Futures, tenant: Tenant
) -> Response:
    note_request(future_id=body.request_id)
    record = await futures.retrieve(tenant, body.request_id)
    if not record.is_done:
        return JSONResponse({"type": "try_again", "request_id": record.id, "queue_state": "active"})
    if record.status == "failed":
        return JSONResponse({"error": record.error, "category": record.category})
    if (encodings := _ENCODINGS.get(type(record.result))) is None:
        return JSONResponse(json_safe(record.result))
    to_proto, to_json = encodings
    if PROTOBUF in request.headers.get("accept", ""):
        return Response(to_proto(record.result), media_type=PROTOBUF)
    return JSONResponse(to_json(record.result))
