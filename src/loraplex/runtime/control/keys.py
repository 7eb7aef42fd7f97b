"""API keys and tenants: keys are shown once, stored as digests, and resolved to a tenant per request;
and the web console's sign-ins, which trade a key for a token once.

With auth "none" every key belongs to one local tenant (a loopback convenience). An admin key (`keys create
--admin`) is its tenant's key for the API like any other; only the console lets it see every tenant. No HTTP.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from loraplex.errors import AuthenticationError, UserError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import ApiKeyRow
from loraplex.timestamps import as_utc, utcnow

LOCAL_TENANT = "local"
KEY_PREFIX = "tml-"  # the Tinker SDK refuses keys without it


@dataclass(frozen=True)
class KeyInfo:
    """What `loraplex keys list` shows: never the key itself."""

    key_id: str
    tenant: str
    created_at: datetime
    revoked: bool
    admin: bool = False


def key_digest(key: str) -> str:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(store: Store, tenant: str, admin: bool = False) -> str:
    """Make a new key for `tenant` (an admin's: its console sees every tenant); return it (the only time it
    is visible)."""
    if not tenant or len(tenant) > 128:
        raise UserError("tenant name must be 1-128 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = key_digest(key)
    store.add_key(
        ApiKeyRow(digest=digest, key_id=f"key-{digest[:12]}", tenant=tenant, created_at=utcnow(), admin=admin)
    )
    return key


def list_keys(store: Store) -> list[KeyInfo]:
    """Every key's public id, tenant and state."""
    return [
        KeyInfo(r.key_id, r.tenant, as_utc(r.created_at), r.revoked_at is not None, bool(r.admin))
        for r in store.list_keys()
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


@dataclass(frozen=True)
class Viewer:
    """Who looks at the web console: a tenant, and whether it signed in with an admin key."""

    tenant: str
    is_admin: bool = False

    @property
    def scope(self) -> str | None:
        """The tenant whose objects this viewer lists; None: every tenant's (an admin)."""
        return None if self.is_admin else self.tenant

    def may_see(self, owner: str) -> bool:
        """Whether an object of tenant `owner` is visible to this viewer."""
        return self.is_admin or owner == self.tenant


class ConsoleLogins:
    """The console's sign-ins: a key is exchanged once for a random token that the browser keeps in an
    HttpOnly cookie, so the key is neither stored by the browser nor sent again.

    A token holds only its key's digest and lasts `lifetime_s`; each use re-checks the key (remembered for
    `cache_s`, as TenantResolver does), so revoking a key ends its console sign-ins within that time too.
    Tokens live in memory (a restart signs everyone out), at most `max_tokens` of them.
    """

    def __init__(
        self,
        store: Store,
        auth: str,
        lifetime_s: float = 12 * 3600.0,
        cache_s: float = 10.0,
        max_tokens: int = 10_000,
    ) -> None:
        self._store, self._auth = store, auth
        self._lifetime_s, self._cache_s, self._max_tokens = lifetime_s, cache_s, max_tokens
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (key digest, monotonic expiry)
        self._known: dict[str, tuple[Viewer, float]] = {}  # key digest -> (viewer, monotonic expiry)

    def sign_in(self, key: str) -> tuple[str, Viewer]:
        """A new token for `key` and who it is (AuthenticationError for a missing or unknown key); may read
        the database."""
        if not key:
            raise AuthenticationError("enter an API key")
        digest = key_digest(key)
        viewer = self._resolve(digest)
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            if len(self._tokens) >= self._max_tokens:  # bounded: drop expired ones, else the oldest
                self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
                while len(self._tokens) >= self._max_tokens:
                    del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = (digest, now + self._lifetime_s)
        return token, viewer

    def cached(self, token: str | None) -> Viewer | None:
        """The viewer of a valid token if known without the database, else None."""
        digest = self._digest_of(token)
        if digest is None:
            return None
        with self._lock:
            known = self._known.get(digest)
        return known[0] if known is not None and known[1] > time.monotonic() else None

    def viewer(self, token: str | None) -> Viewer:
        """The viewer of a token (AuthenticationError if it is unknown, expired or its key revoked); may
        read the database."""
        digest = self._digest_of(token)
        if digest is None:
            raise AuthenticationError("not signed in, or the sign-in expired")
        return self.cached(token) or self._resolve(digest)

    def sign_out(self, token: str | None) -> None:
        """Forget a token."""
        with self._lock:
            self._tokens.pop(token or "", None)

    def _digest_of(self, token: str | None) -> str | None:
        if not token:
            return None
        with self._lock:
            entry = self._tokens.get(token)
            if entry is not None and entry[1] <= time.monotonic():
                del self._tokens[token]
                entry = None
        return entry[0] if entry is not None else None

    def _resolve(self, digest: str) -> Viewer:
        if self._auth == "none":
            viewer = Viewer(LOCAL_TENANT)
        else:
            row = self._store.get_key(digest)
            if row is None:
                raise AuthenticationError("unknown or revoked API key")
            viewer = Viewer(row.tenant, bool(row.admin))
        with self._lock:
            if len(self._known) > 10_000:  # bounded, as TenantResolver
                self._known.clear()
            self._known[digest] = (viewer, time.monotonic() + self._cache_s)
        return viewer
