"""Sampling routes: sampling sessions (create, describe) and asample, answered at once with a future that
promises one sequence id per sample; the SampleResponse comes from retrieve_future.

Handlers that read or write the database are plain `def`: FastAPI runs them on its worker threads, never
on the event loop."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from loraplex.api.request_log import note_request
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Runs, Samplers
from loraplex.api.tinker.wire import AsampleRequest, CreateSamplingSessionRequest
from loraplex.runtime.core.sampling import sample_sequence_ids

router = APIRouter()


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


@router.post("/asample")
def asample(body: AsampleRequest, samplers: Samplers, tenant: Tenant) -> dict[str, Any]:
    note_request(sampler_id=body.sampling_session_id, seq_id=body.seq_id)
    record = samplers.sample(tenant, body.sampling_session_id, body.seq_id, body.to_request())
    note_request(future_id=record.id)
    return {"request_id": record.id, "sample_sequence_ids": sample_sequence_ids(record.id, body.num_samples)}
