"""API keys and tenants: keys are shown once, stored as digests, and resolved to a tenant per request;
and the web console's sign-ins, which trade a key for a token once. Both read key digests through
`KeyLookups`: remembered either way, and read from the database at a bounded rate, so a client sending
made-up keys costs a bounded number of reads.

With auth "none" every key belongs to one local tenant (a loopback convenience). An admin key (`keys create
--admin`) is its tenant's key for the API like any other; only the console lets it see every tenant. No HTTP.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from loraplex.errors import AuthenticationError, CapacityError, UserError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import ApiKeyRow
from loraplex.timestamps import as_utc, utcnow

LOCAL_TENANT = "local"
KEY_PREFIX = "tml-"  # the Tinker SDK refuses keys without it
UNKNOWN_KEY = "unknown or revoked API key"

T = TypeVar("T")
V = TypeVar("V")


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


class KeyReadLimitError(CapacityError):
    """Too many keys not remembered were presented at once: their database reads wait (503, retried)."""


@dataclass(frozen=True)
class KeyReadLimits:
    """How long KeyLookups remembers key digests, and how fast it reads those it does not (it says why)."""

    known_s: float = 10.0  # a key found: a revoked key keeps working this long at worst
    unknown_s: float = 5.0  # a key not found: one made after it was presented works this long later at worst
    reads_per_s: float = 100.0  # database reads of keys remembered neither way, on average
    burst: int = 100  # and at once


class KeyLookups(Generic[T]):
    """What key digests stand for, read with `read` (None: no such unrevoked key) and remembered.

    A digest found is remembered for `known_s`, one not found for `unknown_s`, so a key sent again and
    again costs one read per period either way. A key is never presented before `loraplex keys create`
    makes it, so remembering unknown ones delays no new key (one presented before it existed works
    `unknown_s` after its creation at worst). Reads of digests remembered neither way are limited to
    `reads_per_s` on average, `burst` at once (a token bucket): past that, KeyReadLimitError (503) rather
    than 401, as a valid key not yet remembered may be among them, and the SDK and the openai client retry
    a 503 with backoff where they give up on a 401. So a client sending made-up keys costs the database at
    most `reads_per_s` reads a second, and both memories stay bounded by what that many reads can fill.
    """

    def __init__(
        self,
        read: Callable[[str], T | None],
        limits: KeyReadLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read, self._limits, self._clock = read, limits or KeyReadLimits(), clock
        self._lock = threading.Lock()
        # digest -> (what it stands for, monotonic expiry). In insertion order, which is expiry order (one
        # lifetime per dict), so expired entries are dropped from the front.
        self._known: dict[str, tuple[T, float]] = {}
        self._unknown: dict[str, tuple[None, float]] = {}
        self._reads_left = float(self._limits.burst)
        self._refilled_at = clock()

    def cached(self, digest: str) -> T | None:
        """What `digest` stands for if that is remembered, else None."""
        with self._lock:
            known = self._known.get(digest)
        return known[0] if known is not None and known[1] > self._clock() else None

    def resolve(self, digest: str) -> T:
        """What `digest` stands for; AuthenticationError if nothing (401), KeyReadLimitError if it must be
        read and the read budget is spent. May read the database."""
        with self._lock:
            now = self._clock()
            known, unknown = self._known.get(digest), self._unknown.get(digest)
            if known is not None and known[1] > now:
                return known[0]
            if unknown is not None and unknown[1] > now:
                raise AuthenticationError(UNKNOWN_KEY)
            self._take_read(now)
        value = self._read(digest)
        with self._lock:
            now = self._clock()
            if value is None:
                _remember(self._unknown, digest, None, now + self._limits.unknown_s, now)
            else:
                _remember(self._known, digest, value, now + self._limits.known_s, now)
        if value is None:
            raise AuthenticationError(UNKNOWN_KEY)
        return value

    def _take_read(self, now: float) -> None:
        """Take one read from the bucket, refilled at reads_per_s up to burst; KeyReadLimitError if empty."""
        limits = self._limits
        refilled = self._reads_left + (now - self._refilled_at) * limits.reads_per_s
        self._reads_left, self._refilled_at = min(float(limits.burst), refilled), now
        if self._reads_left < 1:
            raise KeyReadLimitError(
                f"this server is checking too many API keys it does not know yet (more than "
                f"{limits.reads_per_s:g} a second); try again in a moment"
            )
        self._reads_left -= 1


def _remember(entries: dict[str, tuple[V, float]], digest: str, value: V, until: float, now: float) -> None:
    """Remember `value` for `digest` until `until`, and forget the entries expired by `now`."""
    entries.pop(digest, None)  # re-inserted at the end, so the order stays the expiry order
    entries[digest] = (value, until)
    while entries:
        oldest, (_, expiry) = next(iter(entries.items()))
        if expiry > now:
            break
        del entries[oldest]


class TenantResolver:
    """Maps the X-API-Key of a request to its tenant, through KeyLookups: most requests need no database
    read (and the API's event loop none at all), and a key revoked with `loraplex keys revoke` stops
    working within `limits.known_s`."""

    def __init__(self, store: Store, auth: str, limits: KeyReadLimits | None = None) -> None:
        self._auth = auth
        self._tenants = KeyLookups(store.tenant_for_digest, limits)

    def cached(self, key: str | None) -> str | None:
        """The tenant of `key` if it is known without the database (auth none, or resolved recently)."""
        if key and self._auth == "none":
            return LOCAL_TENANT
        return self._tenants.cached(key_digest(key)) if key else None

    def tenant_for(self, key: str | None) -> str:
        """The tenant of `key`; AuthenticationError (401) for a missing or unknown one, KeyReadLimitError
        (503) when it must be read and too many unknown keys are being read; may read the database."""
        if not key:
            raise AuthenticationError("missing X-API-Key header")
        return self.cached(key) or self._tenants.resolve(key_digest(key))


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

    A token holds only its key's digest and lasts `lifetime_s`; signing in and each use check the key
    through KeyLookups, as TenantResolver does (remembered either way, reads bounded), so revoking a key
    ends its console sign-ins within `limits.known_s` too. Tokens live in memory (a restart signs everyone
    out), at most `max_tokens` of them.
    """

    def __init__(
        self,
        store: Store,
        auth: str,
        lifetime_s: float = 12 * 3600.0,
        limits: KeyReadLimits | None = None,
        max_tokens: int = 10_000,
    ) -> None:
        self._store, self._auth = store, auth
        self._lifetime_s, self._max_tokens = lifetime_s, max_tokens
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (key digest, monotonic expiry)
        self._viewers = KeyLookups(self._read_viewer, limits)

    def sign_in(self, key: str) -> tuple[str, Viewer]:
        """A new token for `key` and who it is (AuthenticationError for a missing or unknown key,
        KeyReadLimitError when too many unknown keys are being read); may read the database."""
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
        return Viewer(LOCAL_TENANT) if self._auth == "none" else self._viewers.cached(digest)

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
        return Viewer(LOCAL_TENANT) if self._auth == "none" else self._viewers.resolve(digest)

    def _read_viewer(self, digest: str) -> Viewer | None:
        row = self._store.get_key(digest)
        return None if row is None else Viewer(row.tenant, bool(row.admin))
