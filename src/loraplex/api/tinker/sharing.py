"""REST routes of RestClient over what a tenant owns: publish/unpublish and the TTL of a checkpoint. All
owner-checked; a published checkpoint is readable (loadable, sampleable) by every tenant of this server, and
stays writable (TTL, publish, delete) by its owner alone.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Runs
from loraplex.api.tinker.wire import TtlSeconds, WireModel
from loraplex.runtime.core.checkpoints import CheckpointPath

router = APIRouter(route_class=PooledJsonRoute)

_CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"


class SetTtlRequest(WireModel):
    ttl_seconds: TtlSeconds | None


def _path(run_id: str, kind: str, name: str) -> CheckpointPath:
    return CheckpointPath.parse(f"tinker://{run_id}/{kind}/{name}")


@router.post(f"{_CHECKPOINT}/publish")
async def publish(run_id: str, kind: str, name: str, catalog: Runs, tenant: Tenant) -> None:
    await run_in_threadpool(catalog.set_public, tenant, _path(run_id, kind, name), True)


@router.delete(f"{_CHECKPOINT}/publish")
async def unpublish(run_id: str, kind: str, name: str, catalog: Runs, tenant: Tenant) -> None:
    await run_in_threadpool(catalog.set_public, tenant, _path(run_id, kind, name), False)


@router.put(f"{_CHECKPOINT}/ttl")
async def set_ttl(
    run_id: str, kind: str, name: str, body: SetTtlRequest, catalog: Runs, tenant: Tenant
) -> None:
    await run_in_threadpool(catalog.set_ttl, tenant, _path(run_id, kind, name), body.ttl_seconds)
