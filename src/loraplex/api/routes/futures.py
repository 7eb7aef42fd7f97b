"""retrieve_future: the long-poll every submission's result comes back through (tinker-protocol.md §3)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from loraplex.api.auth import Service, Tenant
from loraplex.api.codecs import encode_forward_backward_output, forward_backward_output_json
from loraplex.api.wire import RetrieveFutureRequest
from loraplex.runtime.commands import PassResult

router = APIRouter()

PROTOBUF = "application/x-protobuf"


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, service: Service, tenant: Tenant
) -> Response:
    record = await service.retrieve(tenant, body.request_id)
    if not record.is_done:
        return JSONResponse({"type": "try_again", "request_id": record.id, "queue_state": "active"})
    if record.status == "failed":
        return JSONResponse({"error": record.error, "category": record.category})
    if isinstance(record.result, PassResult):
        if PROTOBUF in request.headers.get("accept", ""):
            return Response(encode_forward_backward_output(record.result), media_type=PROTOBUF)
        return JSONResponse(forward_backward_output_json(record.result))
    return JSONResponse(record.result)
