"""REST routes of RestClient: training runs, checkpoints (list, delete, storage usage), weights_info. All
owner-checked.

Handlers that read or write the database are plain `def`: FastAPI runs them on its worker threads, never
on the event loop."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from loraplex.api.pooled_json import PooledJsonRoute
from loraplex.api.tinker.auth import Tenant
from loraplex.api.tinker.deps import Runs
from loraplex.api.tinker.unsupported import unsupported
from loraplex.api.tinker.wire import WeightsInfoRequest, checkpoint_json, lora_info_json, training_run_json
from loraplex.runtime.core.checkpoints import CheckpointPath

router = APIRouter(route_class=PooledJsonRoute)

# The database takes a 64-bit OFFSET; a larger one is a 422 here.
Offset = Annotated[int, Query(ge=0, lt=2**63)]


@router.get("/training_runs")
def list_runs(
    catalog: Runs, tenant: Tenant, limit: int = Query(20, ge=1, le=1000), offset: Offset = 0
) -> dict[str, Any]:
    runs, total = catalog.runs(tenant, limit, offset)
    cursor = {"offset": offset, "limit": limit, "total_count": total}
    return {"training_runs": [training_run_json(r) for r in runs], "cursor": cursor}


@router.get("/training_runs/{run_id}")
def get_run(run_id: str, catalog: Runs, tenant: Tenant) -> dict[str, Any]:
    return training_run_json(catalog.run(tenant, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, catalog: Runs, tenant: Tenant) -> dict[str, Any]:
    return {
        "checkpoints": [checkpoint_json(c) for c in catalog.checkpoints(tenant, run_id)],
        "cursor": None,
    }


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, catalog: Runs, tenant: Tenant) -> dict[str, str]:
    catalog.delete_checkpoint(tenant, CheckpointPath.parse(f"tinker://{run_id}/{checkpoint_id}"))
    return {"status": "deleted"}


@router.get("/checkpoints")
def list_checkpoints(
    catalog: Runs, tenant: Tenant, limit: int = Query(100, ge=1, le=1000), offset: Offset = 0
) -> dict[str, Any]:
    views, total = catalog.tenant_checkpoints(tenant, limit, offset)
    cursor = {"offset": offset, "limit": limit, "total_count": total}
    return {"checkpoints": [checkpoint_json(c) for c in views], "cursor": cursor}


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage(catalog: Runs, tenant: Tenant, project_id: str | None = None) -> dict[str, Any]:
    """The caller's checkpoint count and bytes (AdminClient.get_current_checkpoint_storage_usage, `tinker
    billing checkpoint-storage`): one row, or none without checkpoints; no rates or costs."""
    if project_id is not None:
        raise unsupported("projects", "project_id of GET /api/v1/billing/usage/checkpoints/current")
    count, size = catalog.checkpoint_usage(tenant)
    row = {
        "project_id": None,
        "org_user_urn": None,
        "user_email": None,
        "user_name": tenant,
        "checkpoint_count": count,
        "size_bytes": size,
        "size_gigabytes": size / 1e9,
        "estimated_monthly_cost_usd": None,
    }
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [row] if count else []}


@router.post("/weights_info")
def weights_info(body: WeightsInfoRequest, catalog: Runs, tenant: Tenant) -> dict[str, Any]:
    run = catalog.readable_run(tenant, CheckpointPath.parse(body.tinker_path))
    return {"base_model": run.base_model, **lora_info_json(run.lora_config)}
