"""retrieve_future: the long-poll every submission's result comes back through (docs/PROTOCOL.md §5).

A large result is encoded on the codec pool (codec_pool.py), never on the event loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.request_log import note_request
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.codec_pool import INLINE_JSON_RESULT_BYTES, INLINE_PROTOBUF_RESULT_BYTES
from loraplex.api.tinker.codecs import (
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_output_json,
    json_safe,
    sample_response_json,
)
from loraplex.api.tinker.deps import Codecs, Futures
from loraplex.api.tinker.json_render import render_json
from loraplex.api.tinker.wire import RetrieveFutureRequest
from loraplex.runtime.control.futures import RETRYABLE
from loraplex.runtime.core.commands import PassResult
from loraplex.runtime.core.sampling import SampleResult

router = APIRouter(route_class=PooledJsonRoute)

PROTOBUF = "application/x-protobuf"

# Results the 0.38.0 SDK reads as protobuf (it asks with Accept); other clients get their JSON form.
_ENCODINGS: dict[type, tuple[Callable[[Any], bytes], Callable[..., dict[str, Any]]]] = {
    PassResult: (encode_forward_backward_output, forward_backward_output_json),
    SampleResult: (encode_sample_response, sample_response_json),
}


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, futures: Futures, codecs: Codecs, tenant: Tenant
) -> Response:
    note_request(future_id=body.request_id)
    record = await futures.retrieve(tenant, body.request_id)
    if not record.is_done:
        return JSONResponse({"type": "try_again", "request_id": record.id, "queue_state": "active"})
    if record.status == "failed":
        if record.category == RETRYABLE:  # 410: the SDK sends the sample again (docs/PROTOCOL.md §1.4)
            return JSONResponse({"error": record.error, "category": "server"}, status_code=410)
        return JSONResponse({"error": record.error, "category": record.category})
    if (encodings := _ENCODINGS.get(type(record.result))) is None:
        return JSONResponse(json_safe(record.result))
    to_proto, to_json = encodings
    size = _array_bytes(record.result)
    if PROTOBUF in request.headers.get("accept", ""):
        encoded = await codecs.run(size < INLINE_PROTOBUF_RESULT_BYTES, to_proto, record.result)
        return Response(encoded, media_type=PROTOBUF)
    rendered = await codecs.run(size < INLINE_JSON_RESULT_BYTES, _render, to_json, record.result)
    return Response(rendered, media_type="application/json")


def _render(to_json: Callable[..., dict[str, Any]], result: Any) -> bytes:
    return render_json(to_json(result, is_lazy=True))


def _array_bytes(value: Any) -> int:
    """The bytes of the arrays a result holds (what its encoding costs in proportion to)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if dataclasses.is_dataclass(value):
        value = vars(value)
    if isinstance(value, dict):
        return sum(_array_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_array_bytes(item) for item in value)
    return 0
