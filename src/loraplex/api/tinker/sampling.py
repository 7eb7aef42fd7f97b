"""Sampling routes: sampling sessions (create, describe) and asample, answered at once with a future that
promises one sequence id per sample; the SampleResponse comes from retrieve_future.

Handlers that read or write the database are plain `def`, or hand the call to a worker thread: FastAPI
runs them on its worker threads, never on the event loop. asample reads its own body, so that a long
prompt is validated on the codec pool (codec_pool.py) rather than by FastAPI on the event loop."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.request_log import note_request
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.codec_pool import INLINE_JSON_BODY_BYTES, body_chunks, body_size
from loraplex.api.tinker.deps import Codecs, Runs, Samplers
from loraplex.api.tinker.json_body import json_body_route, validate_json_body
from loraplex.api.tinker.wire import AsampleRequest, CreateSamplingSessionRequest
from loraplex.runtime.core.sampling import SampleRequest, sample_sequence_ids

router = APIRouter(route_class=PooledJsonRoute)


@router.post("/create_sampling_session")
def create_sampling_session(
    body: CreateSamplingSessionRequest, samplers: Samplers, tenant: Tenant
) -> dict[str, Any]:
    sampler_id = samplers.create_sampler(
        tenant, body.session_id, body.sampling_session_seq_id, body.model_path, body.base_model
    )
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, catalog: Runs, tenant: Tenant) -> dict[str, Any]:
    view = catalog.sampler(tenant, sampler_id)
    return {"sampler_id": view.sampler_id, "base_model": view.base_model, "model_path": view.model_path}


@router.post("/asample", **json_body_route(AsampleRequest))
async def asample(request: Request, samplers: Samplers, codecs: Codecs, tenant: Tenant) -> dict[str, Any]:
    chunks = await body_chunks(request)
    is_small = body_size(chunks) < INLINE_JSON_BODY_BYTES
    body, sample = await codecs.run(is_small, _asample_body, chunks, request.headers.get("content-type"))
    record = await run_in_threadpool(samplers.sample, tenant, body.sampling_session_id, body.seq_id, sample)
    note_request(future_id=record.id)
    return {"request_id": record.id, "sample_sequence_ids": sample_sequence_ids(record.id, body.num_samples)}


def _asample_body(chunks: list[bytes], content_type: str | None) -> tuple[AsampleRequest, SampleRequest]:
    """The validated body and the request it asks for."""
    body = validate_json_body(AsampleRequest, b"".join(chunks), content_type)
    note_request(sampler_id=body.sampling_session_id, seq_id=body.seq_id)
    return body, body.to_request()
