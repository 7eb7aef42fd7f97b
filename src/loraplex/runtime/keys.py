"""API keys and tenants: keys are shown once, stored as digests, and resolved to a tenant per request.

With auth "none" every key belongs to one local tenant (a loopback convenience). No HTTP.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from loraplex.errors import AuthenticationError, UserError
from loraplex.runtime.store import Store, as_utc, utcnow
from loraplex.runtime.store.schema import ApiKeyRow

LOCAL_TENANT = "local"
KEY_PREFIX = "tml-"  # the Tinker SDK refuses keys without it


@dataclass(frozen=True)
class KeyInfo:
    """What `loraplex keys list` shows: never the key itself."""

    key_id: str
    tenant: str
    created_at: datetime
    revoked: bool


def key_digest(key: str) -> str:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(store: Store, tenant: str) -> str:
    """Make a new key for `tenant`; return it (the only time it is visible)."""
    if not tenant or len(tenant) > 128:
        raise UserError("tenant name must be 1-128 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = key_digest(key)
    store.add_key(ApiKeyRow(digest=digest, key_id=f"key-{digest[:12]}", tenant=tenant, created_at=utcnow()))
    return key


def list_keys(store: Store) -> list[KeyInfo]:
    """Every key's public id, tenant and state."""
    return [
        KeyInfo(r.key_id, r.tenant, as_utc(r.created_at), r.revoked_at is not None) for r in store.list_keys()
    ]


def revoke_key(store: Store, key_id: str) -> None:
    """Revoke a key by its public id."""
    if not store.revoke_key(key_id):
        raise UserError(f"no active key with id {key_id!r}")


class TenantResolver:
    """Maps the X-API-Key of a request to its tenant."""

    def __init__(self, store: Store, auth: str) -> None:
        self._store, self._auth = store, auth

    def tenant_for(self, key: str | None) -> str:
        """The tenant of `key`, or AuthenticationError (401)."""
        if not key:
            raise AuthenticationError("missing X-API-Key header")
        if self._auth == "none":
            return LOCAL_TENANT
        tenant = self._store.tenant_for_digest(key_digest(key))
        if tenant is None:
            raise AuthenticationError("unknown or revoked API key")
        return tenant
