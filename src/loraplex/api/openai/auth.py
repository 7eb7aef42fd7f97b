"""Who calls a /v1 route: the API key as OpenAI clients send it (`Authorization: Bearer tml-...`), or in
the Tinker SDK's X-API-Key header, resolved by the same TenantResolver as the Tinker routes. No tensors.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, Header, Request

from loraplex.api.request_log import note_request
from loraplex.errors import AuthenticationError
from loraplex.runtime.control.keys import TenantResolver
from loraplex.runtime.serving.inference import InferenceService

_BEARER = "bearer "


async def inference_of(request: Request) -> InferenceService:
    """The InferenceService of this app."""
    return request.app.state.inference


async def bearer_tenant(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> str:
    """The caller's tenant (AuthenticationError, hence 401, for a missing or unknown key)."""
    key = x_api_key
    if authorization is not None and authorization[: len(_BEARER)].lower() == _BEARER:
        key = authorization[len(_BEARER) :].strip()
    if not key:
        raise AuthenticationError("missing API key: send it as the header Authorization: Bearer tml-...")
    tenants: TenantResolver = request.app.state.tenants
    # A key is looked up in the database: on a worker thread, not the event loop every request shares.
    tenant = tenants.cached(key) or await asyncio.to_thread(tenants.tenant_for, key)
    note_request(tenant=tenant)
    return tenant


Inference = Annotated[InferenceService, Depends(inference_of)]
Tenant = Annotated[str, Depends(bearer_tenant)]
