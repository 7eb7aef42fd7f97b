"""Service and session routes: client config, health, capabilities, telemetry, sessions and heartbeats.

Handlers that read or write the database are plain `def`: FastAPI runs them on its worker threads, never
on the event loop."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio.to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Database, Disk, Info, Sampler, Sessions
from loraplex.api.tinker.wire import CreateSessionRequest, FinishRequest, SessionRequest
from loraplex.runtime.control.store.outage import DatabaseUnavailableError

router = APIRouter(route_class=PooledJsonRoute)

# Feature flags for the SDK (docs/PROTOCOL.md §6.1). Chunks are submitted in parallel (the run
# queue reorders them); every optional flag stays off.
CLIENT_CONFIG: dict[str, Any] = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/healthz", response_model=None)
async def healthz(database: Database, disk: Disk, sampler: Sampler) -> dict[str, Any] | JSONResponse:
    """200 while the server can do its work; 503 with the reason while it cannot (the database does not
    answer), so a load balancer or supervisor notices. Reads a flag: no database call on the loop. Both
    answers give the data dir's free space and the reserve saves keep (a full disk refuses saves, not
    training: still 200); read on a worker thread, as a stalled network filesystem would stall it. With
    `--sampler vllm` they name the sampler and each of its servers: up or not, and why it last went down
    (a server down fails only sampling, which the SDK retries: still 200)."""
    space: dict[str, Any] = {"data_dir_free_bytes": await anyio.to_thread.run_sync(disk.free_bytes)}
    space["data_dir_reserve_bytes"] = disk.reserve_bytes
    if servers := sampler.servers():
        space["sampler"] = {"backend": sampler.name, "servers": [dataclasses.asdict(s) for s in servers]}
    if (reason := database.down_report()) is not None:
        headers = {"Retry-After": str(DatabaseUnavailableError.retry_after_s)}
        body = {"status": "unavailable", "reason": reason, **space}
        return JSONResponse(body, status_code=503, headers=headers)
    return {"status": "ok", **space}


@router.get("/get_server_capabilities")
async def capabilities(info: Info) -> dict[str, Any]:
    model = {
        "model_name": info.model_name,
        "max_context_length": info.max_context_length,
        "trainable": True,
        "sampleable": True,
    }
    return {"supported_models": [model]}


@router.post("/telemetry")
async def telemetry(_tenant: Tenant) -> dict[str, str]:
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(body: CreateSessionRequest, sessions: Sessions, tenant: Tenant) -> dict[str, Any]:
    session_id = sessions.create(tenant, body.user_metadata, body.display_name)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
def heartbeat(body: SessionRequest, sessions: Sessions, tenant: Tenant) -> dict[str, str]:
    sessions.heartbeat(body.session_id, tenant)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish(session_id: str, body: FinishRequest, sessions: Sessions, tenant: Tenant) -> dict[str, str]:
    sessions.finish(session_id, tenant, body.reason.type)
    return {"status": "finished"}
