"""Sampling routes: sampling sessions exist and resolve; asample answers a clear user error until the
engine has a sampler (the sampler records, ids and owner checks are already in place)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from loraplex.api.auth import Service, Tenant
from loraplex.api.wire import CreateSamplingSessionRequest, SampleRequest

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, service: Service, tenant: Tenant
) -> dict[str, Any]:
    sampler_id = service.create_sampler(
        tenant, body.session_id, body.sampling_session_seq_id, body.model_path, body.base_model
    )
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, service: Service, tenant: Tenant) -> dict[str, Any]:
    view = service.catalog.sampler(tenant, sampler_id)
    return {"sampler_id": view.sampler_id, "base_model": view.base_model, "model_path": view.model_path}


@router.post("/asample")
async def asample(body: SampleRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    record = service.sample(tenant, body.sampling_session_id)
    return {"request_id": record.id}
