"""Session search (RestClient.search_sessions): a tenant's sessions, newest first, filtered by id or display
name, user_metadata, owner and status, one page at a time behind a keyset cursor.

A tenant lists only its own sessions: this server has no organisations, so "every owner's sessions" are the
caller's, and an owner other than the caller has none. No HTTP, no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import SessionRow
from loraplex.timestamps import as_utc

# Sessions read per query while a page fills: filters the database cannot apply (status, display name,
# user_metadata) may skip many.
_BATCH = 256


@dataclass(frozen=True)
class SessionStatus:
    """`active` (its lease is current) or `client_finished` with the client's reason."""

    kind: str
    reason: str | None = None


@dataclass(frozen=True)
class StatusFilter:
    """One status a session may have to match; `reasons` narrows client_finished (None: any reason)."""

    kind: str  # active | cancelled | failed | client_finished
    reasons: frozenset[str] | None = None

    def matches(self, status: SessionStatus | None) -> bool:
        """Whether a session with `status` has this one."""
        if status is None or status.kind != self.kind:
            return False
        return self.reasons is None or status.reason in self.reasons


@dataclass(frozen=True)
class SessionQuery:
    """What to search for. A session matches `session_id` or `display_name` (either, when both are given),
    every `user_metadata` pair, one of `owners` and one of `statuses` (None: any)."""

    session_id: str | None = None
    display_name: str | None = None  # words that must all appear in the name, case-insensitively
    user_metadata: dict[str, str] | None = None
    owners: frozenset[str] | None = None
    statuses: tuple[StatusFilter, ...] | None = None
    limit: int = 50
    after: tuple[datetime, str] | None = None  # the previous page's last (created_at, session id)


@dataclass(frozen=True)
class SessionSummary:
    """A session as the search lists it."""

    session_id: str
    created_at: datetime
    owner: str
    status: SessionStatus | None  # None: neither finished nor known to be running (e.g. after a restart)
    display_name: str | None
    user_metadata: dict[str, str]
    checkpoints_count: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class SessionPage:
    """One page of results and where the next starts (None once the results are exhausted)."""

    sessions: list[SessionSummary]
    next_after: tuple[datetime, str] | None


class SessionSearch:
    """Searches a tenant's sessions; `is_live` tells which leases are current (SessionTable.is_live)."""

    def __init__(self, store: Store, is_live: Callable[[str], bool]) -> None:
        self._store, self._is_live = store, is_live

    def search(self, tenant: str, query: SessionQuery) -> SessionPage:
        """One page of the tenant's sessions that match `query`, newest first."""
        if query.owners is not None and tenant not in query.owners:
            return SessionPage([], None)
        found: list[tuple[SessionRow, SessionStatus | None]] = []
        for row in self._newest_first(tenant, query):
            status = self._status(row)
            if _matches(row, status, query):
                found.append((row, status))
                if len(found) > query.limit:  # one more than the page: the results go on
                    break
        page = found[: query.limit]
        usage = self._store.session_checkpoint_usage([row.id for row, _ in page])
        summaries = [_summary(row, status, *usage.get(row.id, (0, 0))) for row, status in page]
        more = len(found) > query.limit
        return SessionPage(summaries, (summaries[-1].created_at, summaries[-1].session_id) if more else None)

    def _newest_first(self, tenant: str, query: SessionQuery) -> Iterator[SessionRow]:
        """The tenant's sessions after the query's cursor, newest first, read a batch at a time."""
        after = None if query.after is None else (query.after[0].astimezone(UTC), query.after[1])
        by_id = query.session_id if query.display_name is None else None  # the database can match it alone
        while True:
            rows = self._store.tenant_sessions(tenant, after, _BATCH, session_id=by_id)
            yield from rows
            if len(rows) < _BATCH:
                return
            after = (rows[-1].created_at, rows[-1].id)

    def _status(self, row: SessionRow) -> SessionStatus | None:
        if row.finished_reason is not None:
            return SessionStatus("client_finished", row.finished_reason)
        return SessionStatus("active") if self._is_live(row.id) else None


def _summary(row: SessionRow, status: SessionStatus | None, checkpoints: int, size: int) -> SessionSummary:
    return SessionSummary(
        session_id=row.id,
        created_at=as_utc(row.created_at),
        owner=row.tenant,
        status=status,
        display_name=row.display_name,
        user_metadata=_text(row.user_metadata),
        checkpoints_count=checkpoints,
        checkpoint_bytes=size,
    )


def _matches(row: SessionRow, status: SessionStatus | None, query: SessionQuery) -> bool:
    named = (query.session_id, query.display_name) != (None, None)
    if named and row.id != query.session_id and not _name_matches(row.display_name, query.display_name):
        return False
    metadata = _text(row.user_metadata)
    if any(metadata.get(key) != value for key, value in (query.user_metadata or {}).items()):
        return False
    return query.statuses is None or any(wanted.matches(status) for wanted in query.statuses)


def _name_matches(name: str | None, words: str | None) -> bool:
    """Every word of `words` appears in `name`, ignoring case."""
    if name is None or words is None:
        return False
    return all(word in name.casefold() for word in words.casefold().split())


def _text(metadata: dict | None) -> dict[str, str]:
    """Stored user_metadata as text, as Tinker keeps it."""
    return {str(key): str(value) for key, value in (metadata or {}).items()}
