"""Training routes: create_model, load_weights, get_info, forward(_backward), optim_step, the saves.

Each submission answers at once with an UntypedAPIFuture; the result comes from retrieve_future.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from loraplex.api.auth import Service, Tenant
from loraplex.api.codecs import MAX_BODY_BYTES, PayloadTooLargeError, decode_forward_backward, decompress
from loraplex.api.wire import (
    CreateModelRequest,
    LoadWeightsRequest,
    ModelRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    lora_info_json,
)
from loraplex.errors import UserError
from loraplex.runtime.futures import FutureRecord

router = APIRouter()


def _future(record: FutureRecord, model_id: str) -> dict[str, Any]:
    return {"request_id": record.id, "model_id": model_id}


@router.post("/create_model")
async def create_model(body: CreateModelRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    record = service.create_run(tenant, body.session_id, body.model_seq_id, body.to_command())
    return _future(record, f"{body.session_id}:train:{body.model_seq_id}")


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    command = body.to_command()
    if body.session_id is not None and body.model_seq_id is not None:
        record = service.create_run(tenant, body.session_id, body.model_seq_id, command)
        return _future(record, f"{body.session_id}:train:{body.model_seq_id}")
    if body.model_id is None or body.seq_id is None:
        raise UserError(
            "load_weights needs session_id + model_seq_id (new run) or model_id + seq_id (in place)"
        )
    return _future(service.submit(tenant, body.model_id, body.seq_id, command), body.model_id)


@router.post("/get_info")
async def get_info(body: ModelRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    run, info = service.run_state(tenant, body.model_id), service.info
    model_data = {
        "arch": info.arch,
        "model_name": info.model_name,
        "tokenizer_id": info.tokenizer_dir or None,
    }
    assert run.lora_config is not None
    return {
        "type": "get_info",
        "model_id": run.run_id,
        "model_data": model_data,
        "model_name": info.model_name,
        **lora_info_json(run.lora_config),
    }


@router.post("/forward_backward")
@router.post("/forward")
async def forward_backward(request: Request, service: Service, tenant: Tenant) -> dict[str, Any]:
    """forward and forward_backward share this handler: the proto's forward_only says which."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"body exceeds {MAX_BODY_BYTES} bytes")
    body = decompress(await request.body(), request.headers.get("content-encoding"))
    model_id, seq_id, command = decode_forward_backward(body)
    return _future(service.submit(tenant, model_id, seq_id, command), model_id)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    return _future(service.submit(tenant, body.model_id, body.seq_id, body.to_command()), body.model_id)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, service: Service, tenant: Tenant) -> dict[str, Any]:
    return _future(service.submit(tenant, body.model_id, body.seq_id, body.to_command()), body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, service: Service, tenant: Tenant
) -> dict[str, Any]:
    session_id = service.run_state(tenant, body.model_id).session_id
    command = body.to_command(session_id)
    return _future(service.submit(tenant, body.model_id, body.seq_id, command), body.model_id)
