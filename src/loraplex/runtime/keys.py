"""API keys and tenants: keys are shown once, stored as digests, and resolved to a tenant per request.

With auth "none" every key belongs to one local tenant (a loopback convenience). No HTTP.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
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
    """Maps the X-API-Key of a request to its tenant.

    Resolved keys are remembered for `cache_s`, so most requests need no database read (and the API's
    event loop none at all): a key revoked with `loraplex keys revoke` stops working within that time.
    """

    def __init__(self, store: Store, auth: str, cache_s: float = 10.0) -> None:
        self._store, self._auth, self._cache_s = store, auth, cache_s
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str, float]] = {}  # key digest -> (tenant, monotonic expiry)

    def cached(self, key: str | None) -> str | None:
        """The tenant of `key` if it is known without the database (auth none, or resolved recently)."""
        if key and self._auth == "none":
            return LOCAL_TENANT
        if not key:
            return None
        with self._lock:
            known = self._known.get(key_digest(key))
        return known[0] if known is not None and known[1] > time.monotonic() else None

    def tenant_for(self, key: str | None) -> str:
        """The tenant of `key`, or AuthenticationError (401); may read the database."""
        if not key:
            raise AuthenticationError("missing X-API-Key header")
        if (tenant := self.cached(key)) is not None:
            return tenant
        digest = key_digest(key)
        tenant = self._store.tenant_for_digest(digest)
        if tenant is None:
            raise AuthenticationError("unknown or revoked API key")
        with self._lock:
            if len(self._known) > 10_000:  # bounded: forget everything rather than grow
                self._known.clear()
            self._known[digest] = (tenant, time.monotonic() + self._cache_s)
        return tenant
