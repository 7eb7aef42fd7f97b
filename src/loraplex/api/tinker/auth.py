"""Authentication: the X-API-Key header (the SDK sends no Bearer token) resolved to a tenant per request.

Knows no key storage; the runtime's TenantResolver does. No tensors.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from loraplex.api.request_log import note_request
from loraplex.runtime.control.keys import TenantResolver


# `async def` though it rarely awaits: FastAPI runs a plain `def` dependency in its thread pool, two thread
# hops on every request for a lookup that takes microseconds.
async def current_tenant(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The caller's tenant (AuthenticationError, hence 401, for a missing or unknown key); a key not
    resolved recently is looked up on a worker thread, never on the event loop."""
    tenants: TenantResolver = request.app.state.tenants
    tenant = tenants.cached(x_api_key) or await run_in_threadpool(tenants.tenant_for, x_api_key)
    note_request(tenant=tenant)
    return tenant


Tenant = Annotated[str, Depends(current_tenant)]
