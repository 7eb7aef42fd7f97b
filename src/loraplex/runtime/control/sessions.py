"""Sessions and their heartbeat leases.

A session lives while heartbeats arrive; once silent for `timeout_s` (or finished) its runs may be
parked by the engine worker, and any later request brings them back. No tensors, no HTTP.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import SessionRow
from loraplex.timestamps import utcnow


class SessionGoneError(UserError):
    """The session was finished or is unknown; heartbeats must stop (HTTP 410 stops the SDK's loop)."""

    status_code = 410


class SessionTable:
    """Who owns which session, and when each last showed signs of life (monotonic clock)."""

    def __init__(self, store: Store, timeout_s: float) -> None:
        self._store = store
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}  # live sessions only

    def create(self, tenant: str, user_metadata: dict[str, Any], display_name: str | None = None) -> str:
        """Start a session and its lease; return its id (no '/' or ':', as run ids embed it)."""
        session_id = f"s{uuid.uuid4().hex[:16]}"
        now = utcnow()
        self._store.add_session(
            SessionRow(
                id=session_id,
                tenant=tenant,
                created_at=now,
                last_heartbeat_at=now,
                user_metadata=user_metadata,
                display_name=display_name,
            )
        )
        with self._lock:
            self._last_seen[session_id] = time.monotonic()
        return session_id

    def owned(self, session_id: str, tenant: str) -> SessionRow:
        """The session row if `tenant` owns it (NotFoundError otherwise)."""
        row = self._store.get_session(session_id)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"session {session_id!r} not found")
        return row

    def heartbeat(self, session_id: str, tenant: str) -> None:
        """Renew the lease; SessionGoneError (410, which stops the SDK's heartbeat loop) once the session
        is finished, or for a session this tenant does not have (a 404 would be retried forever)."""
        row = self._store.get_session(session_id)
        if row is None or row.tenant != tenant:
            raise SessionGoneError(f"session {session_id!r} not found")
        if row.finished_reason is not None:
            raise SessionGoneError(f"session {session_id!r} is finished ({row.finished_reason})")
        with self._lock:
            self._last_seen[session_id] = time.monotonic()
        self._store.update_session(session_id, last_heartbeat_at=utcnow())

    def touch(self, session_id: str) -> None:
        """Any request of the session also counts as a sign of life."""
        with self._lock:
            self._last_seen[session_id] = time.monotonic()

    def finish(self, session_id: str, tenant: str, reason: str) -> None:
        """End a session (the first reason recorded wins); its runs may be parked at once."""
        row = self.owned(session_id, tenant)
        if row.finished_reason is None:
            self._store.update_session(session_id, finished_reason=reason)
        with self._lock:
            self._last_seen.pop(session_id, None)

    def forget_lapsed(self) -> int:
        """Drop the lease of every session silent past the timeout (is_live says no either way), so the map
        holds live sessions only; return how many were dropped."""
        deadline = time.monotonic() - self.timeout_s
        with self._lock:
            lapsed = [session for session, seen in self._last_seen.items() if seen <= deadline]
            for session in lapsed:
                del self._last_seen[session]
        return len(lapsed)

    def is_live(self, session_id: str) -> bool:
        """Whether the session's lease is current (unknown sessions, e.g. after a restart, are not)."""
        with self._lock:
            seen = self._last_seen.get(session_id)
        return seen is not None and time.monotonic() - seen < self.timeout_s
