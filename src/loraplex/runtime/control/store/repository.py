"""The Store: every database read and write of loraplex, one short transaction per call.

SQLite (WAL) by default, PostgreSQL by URL; opening one brings its schema to the newest revision
(migrations/). Thread-safe: each call opens its own session. Returned rows are detached snapshots;
changing them changes nothing. No tensors, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from loraplex.runtime.control.store.connection import time_calls
from loraplex.runtime.control.store.future_rows import FutureQueries, checkpoint_at
from loraplex.runtime.control.store.metric_rows import MetricQueries
from loraplex.runtime.control.store.schema import (
    AliasRow,
    ApiKeyRow,
    Base,
    CheckpointRow,
    MetricRow,
    RunRow,
    SamplerRow,
    SessionRow,
)
from loraplex.runtime.core.run_queue import EXPIRED, LOST, PARKED
from loraplex.timestamps import utcnow


class Store(FutureQueries, MetricQueries):
    """Repository over the loraplex tables: keys, sessions, runs, checkpoints, samplers and aliases here;
    futures (future_rows.py) and metric history (metric_rows.py) in the query classes it joins."""

    # --- API keys
    def add_key(self, row: ApiKeyRow) -> None:
        """Store a new key digest."""
        self._add(row)

    def tenant_for_digest(self, digest: str) -> str | None:
        """The tenant of an unrevoked key, or None."""
        row = self._get(ApiKeyRow, digest)
        return row.tenant if row is not None and row.revoked_at is None else None

    def get_key(self, digest: str) -> ApiKeyRow | None:
        """An unrevoked key by digest, or None."""
        row = self._get(ApiKeyRow, digest)
        return row if row is not None and row.revoked_at is None else None

    def list_keys(self) -> list[ApiKeyRow]:
        """Every key, oldest first."""
        return self._all(select(ApiKeyRow).order_by(ApiKeyRow.created_at))

    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key by its public id; False if there is no such unrevoked key."""
        with self._writing() as s:
            query = update(ApiKeyRow).where(ApiKeyRow.key_id == key_id, ApiKeyRow.revoked_at.is_(None))
            return s.execute(query.values(revoked_at=utcnow())).rowcount > 0

    # --- sessions
    def add_session(self, row: SessionRow) -> None:
        """Store a new session."""
        self._add(row)

    def get_session(self, session_id: str) -> SessionRow | None:
        """A session by id."""
        return self._get(SessionRow, session_id)

    def tenant_session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        """A page of a tenant's session ids, newest first."""
        query = select(SessionRow.id).where(SessionRow.tenant == tenant)
        query = query.order_by(SessionRow.created_at.desc(), SessionRow.id).limit(limit).offset(offset)
        with self._session() as s:
            return list(s.execute(query).scalars())

    def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """The ids of a session's training runs and samplers, oldest first."""
        runs = select(RunRow.id).where(RunRow.session_id == session_id).order_by(RunRow.created_at)
        samplers = select(SamplerRow.id).where(SamplerRow.session_id == session_id)
        with self._session() as s:
            run_ids = list(s.execute(runs).scalars())
            return run_ids, list(s.execute(samplers.order_by(SamplerRow.created_at)).scalars())

    def tenant_sessions(
        self, tenant: str, after: tuple[datetime, str] | None, limit: int, session_id: str | None = None
    ) -> list[SessionRow]:
        """Up to `limit` of a tenant's sessions (only `session_id`, if given), newest first with ties by
        id, starting after the keyset `after` (created_at, id) of the previous page's last."""
        query = select(SessionRow).where(SessionRow.tenant == tenant)
        if session_id is not None:
            query = query.where(SessionRow.id == session_id)
        if after is not None:
            query = query.where(tuple_(SessionRow.created_at, SessionRow.id) < tuple_(*after))
        return self._all(query.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()).limit(limit))

    def session_checkpoint_usage(self, session_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per session (of those named that have any): how many checkpoints its runs hold, and their bytes."""
        query = (
            select(RunRow.session_id, func.count(CheckpointRow.id), func.sum(CheckpointRow.size_bytes))
            .join(RunRow, RunRow.id == CheckpointRow.run_id)
            .where(RunRow.session_id.in_(list(session_ids)))
            .group_by(RunRow.session_id)
        )
        with self._session() as s:
            return {session: (int(count), int(size)) for session, count, size in s.execute(query).all()}

    def update_session(self, session_id: str, **values: Any) -> None:
        """Set columns of one session (heartbeat time, finish reason)."""
        with self._writing() as s:
            s.execute(update(SessionRow).where(SessionRow.id == session_id).values(**values))

    # --- training runs
    def update_run(self, run_id: str, **values: Any) -> None:
        """Set columns of one run (status, last request time)."""
        with self._writing() as s:
            s.execute(update(RunRow).where(RunRow.id == run_id).values(**values))

    def get_run(self, run_id: str) -> RunRow | None:
        """A run by id."""
        return self._get(RunRow, run_id)

    def all_runs(self) -> list[RunRow]:
        """Every run (start-up recovery)."""
        return self._all(select(RunRow))

    def list_runs(self, tenant: str | None, limit: int, offset: int) -> tuple[list[RunRow], int]:
        """A page of a tenant's runs (None: every tenant's), newest first, and their total count."""
        query = select(RunRow) if tenant is None else select(RunRow).where(RunRow.tenant == tenant)
        return self._page(query.order_by(RunRow.created_at.desc(), RunRow.id), limit, offset)

    # --- checkpoints
    def get_checkpoint(self, run_id: str, kind: str, name: str) -> CheckpointRow | None:
        """A checkpoint by path parts."""
        rows = self._all(select(CheckpointRow).where(*checkpoint_at(run_id, kind, name)))
        return rows[0] if rows else None

    def delete_checkpoint(self, run_id: str, kind: str, name: str) -> None:
        """Forget a checkpoint."""
        with self._writing() as s:
            s.execute(delete(CheckpointRow).where(*checkpoint_at(run_id, kind, name)))

    def update_checkpoint(self, run_id: str, kind: str, name: str, **values: object) -> None:
        """Change fields of a checkpoint (public, expires_at)."""
        with self._writing() as s:
            s.execute(update(CheckpointRow).where(*checkpoint_at(run_id, kind, name)).values(**values))

    def run_checkpoints(self, run_id: str) -> list[CheckpointRow]:
        """A run's checkpoints, oldest first."""
        query = select(CheckpointRow).where(CheckpointRow.run_id == run_id)
        return self._all(query.order_by(CheckpointRow.created_at, CheckpointRow.id))

    def tenant_checkpoints(self, tenant: str, limit: int, offset: int) -> tuple[list[CheckpointRow], int]:
        """A page of a tenant's checkpoints, newest first, and their total count."""
        query = select(CheckpointRow).where(CheckpointRow.tenant == tenant)
        return self._page(
            query.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()), limit, offset
        )

    def tenant_checkpoint_usage(self, tenant: str) -> tuple[int, int]:
        """How many checkpoints a tenant holds, and their bytes."""
        query = select(func.count(CheckpointRow.id), func.sum(CheckpointRow.size_bytes))
        with self._session() as s:
            count, size = s.execute(query.where(CheckpointRow.tenant == tenant)).one()
        return int(count), int(size or 0)

    def published_checkpoints(self, not_of_tenant: str) -> list[CheckpointRow]:
        """Other tenants' published checkpoints, newest first."""
        query = select(CheckpointRow).where(
            CheckpointRow.public.is_(True), CheckpointRow.tenant != not_of_tenant
        )
        return self._all(query.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()))

    # --- samplers
    def add_sampler(self, row: SamplerRow) -> None:
        """Store a new sampling session."""
        self._add(row)

    def get_sampler(self, sampler_id: str) -> SamplerRow | None:
        """A sampling session by id."""
        return self._get(SamplerRow, sampler_id)

    def list_samplers(
        self, tenant: str | None, limit: int, path_prefix: str | None = None
    ) -> list[SamplerRow]:
        """A tenant's (None: every tenant's) newest sampling sessions; with `path_prefix`, only those over
        a checkpoint path that starts with it."""
        query = select(SamplerRow)
        if tenant is not None:
            query = query.where(SamplerRow.tenant == tenant)
        if path_prefix is not None:
            query = query.where(SamplerRow.model_path.startswith(path_prefix, autoescape=True))
        return self._all(query.order_by(SamplerRow.created_at.desc(), SamplerRow.id).limit(limit))

    def key_tenants(self) -> list[str]:
        """Every tenant that has (or had) an API key."""
        with self._session() as s:
            return list(s.scalars(select(ApiKeyRow.tenant).distinct()))

    # --- model aliases (runtime/control/aliases.py validates them)
    def alias_target(self, tenant: str, alias: str) -> str | None:
        """What the tenant's alias names, or None if it has no such alias."""
        row = self._get(AliasRow, (tenant, alias))
        return row.model if row is not None else None

    def tenant_aliases(self, tenant: str) -> dict[str, str]:
        """The tenant's aliases and what each names, in code point order of the alias (sorted here: the
        database's collation may order punctuation and case otherwise)."""
        query = select(AliasRow.alias, AliasRow.model).where(AliasRow.tenant == tenant)
        with self._session() as s:
            return dict(sorted(s.execute(query).tuples()))

    def set_alias(self, tenant: str, alias: str, model: str) -> None:
        """Point the tenant's alias at `model`: a new alias, or an existing one moved."""
        now = utcnow()
        row = {"tenant": tenant, "alias": alias, "model": model, "created_at": now, "updated_at": now}
        query = self._insert_or(AliasRow).values(row)
        keys = [AliasRow.tenant.key, AliasRow.alias.key]
        with self._writing_core() as connection:
            connection.execute(
                query.on_conflict_do_update(index_elements=keys, set_={"model": model, "updated_at": now})
            )

    def add_aliases(self, rows: Sequence[AliasRow]) -> int:
        """Store aliases their tenants do not have yet, in one transaction; an alias a tenant has keeps its
        target. Return how many were added."""
        values = [{c.key: getattr(row, c.key) for c in AliasRow.__table__.columns} for row in rows]
        added = 0
        with self._writing_core() as connection:
            for start in range(0, len(values), 1000):  # SQLite binds at most 32766 values per statement
                query = self._insert_or(AliasRow).values(values[start : start + 1000])
                # Counted by RETURNING: PostgreSQL reports no rowcount for a multi-row INSERT.
                added += len(
                    connection.execute(query.on_conflict_do_nothing().returning(AliasRow.alias)).all()
                )
        return added

    def delete_alias(self, tenant: str, alias: str) -> bool:
        """Forget one of the tenant's aliases; False if it had no such alias."""
        query = delete(AliasRow).where(AliasRow.tenant == tenant, AliasRow.alias == alias)
        with self._writing() as s:
            return s.execute(query).rowcount > 0

    def _insert_or(self, row_class: type[Base]) -> Any:
        """An INSERT with ON CONFLICT clauses, in this database's dialect."""
        dialects = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
        return dialects[self._engine.dialect.name](row_class.__table__)

    def expired_checkpoints(self, now: datetime) -> list[CheckpointRow]:
        """Checkpoints whose TTL has run out."""
        return self._all(select(CheckpointRow).where(CheckpointRow.expires_at < now))

    def all_samplers(self) -> list[SamplerRow]:
        """Every sampling session (retention looks for the unreachable ones)."""
        return self._all(select(SamplerRow))

    def delete_unused_sampler(self, sampler_id: str, last_used_at: datetime | None) -> bool:
        """Forget a sampling session if nobody used it since it was read (its last use is still
        `last_used_at`): a request stamps the sampler as it is accepted (add_sample_future), so retention
        never deletes a sampler from under one. True if it was deleted."""
        unused = (
            SamplerRow.last_used_at.is_(None)
            if last_used_at is None
            else (SamplerRow.last_used_at == last_used_at)
        )
        with self._writing() as s:
            return s.execute(delete(SamplerRow).where(SamplerRow.id == sampler_id, unused)).rowcount > 0

    def sessions_by_id(self, session_ids: Sequence[str]) -> dict[str, SessionRow]:
        """The named sessions that exist."""
        rows = self._all(select(SessionRow).where(SessionRow.id.in_(list(session_ids))))
        return {row.id: row for row in rows}

    def expirable_runs(self, unused_before: datetime, silent_before: datetime) -> list[RunRow]:
        """Runs parked or lost, unused since `unused_before`, whose session finished, went silent (no
        heartbeat since `silent_before`) or is gone: their live state may go (retention.py)."""
        session = select(SessionRow.id).where(
            SessionRow.finished_reason.is_(None), SessionRow.last_heartbeat_at >= silent_before
        )
        query = select(RunRow).where(
            RunRow.status.in_((PARKED, LOST)),
            RunRow.last_request_at < unused_before,
            RunRow.session_id.not_in(session),
        )
        return self._all(query.order_by(RunRow.last_request_at, RunRow.id))

    def runs_with_checkpoints(self, run_ids: Sequence[str]) -> set[str]:
        """Those of the runs that still have a named checkpoint (their rows stay: checkpoints name them)."""
        query = select(CheckpointRow.run_id).where(CheckpointRow.run_id.in_(list(run_ids))).distinct()
        with self._session() as s:
            return set(s.scalars(query))

    def expire_runs(self, expired: Sequence[str], deleted: Sequence[str]) -> None:
        """Mark runs expired (their parked state is being deleted) and delete the rows, and metric history,
        of runs that have nothing left, in one transaction."""
        with self._writing() as s:
            if expired:
                s.execute(update(RunRow).where(RunRow.id.in_(list(expired))).values(status=EXPIRED))
            if deleted:
                s.execute(delete(MetricRow).where(MetricRow.run_id.in_(list(deleted))))
                s.execute(delete(RunRow).where(RunRow.id.in_(list(deleted))))

    def reclaimable_sessions(self, silent_before: datetime) -> list[str]:
        """Sessions finished or silent since `silent_before` that hold no run and no sampler any more."""
        runs = select(RunRow.session_id)
        samplers = select(SamplerRow.session_id)
        query = select(SessionRow.id).where(
            SessionRow.last_heartbeat_at < silent_before,
            SessionRow.id.not_in(runs),
            SessionRow.id.not_in(samplers),
        )
        with self._session() as s:
            return list(s.scalars(query.order_by(SessionRow.id)))

    def delete_empty_sessions(self, session_ids: Sequence[str]) -> list[str]:
        """Delete those of the sessions that still hold no run and no sampler (a new run may have come);
        return the ones deleted."""
        empty = (
            SessionRow.id.in_(list(session_ids)),
            SessionRow.id.not_in(select(RunRow.session_id)),
            SessionRow.id.not_in(select(SamplerRow.session_id)),
        )
        with self._writing() as s:
            gone = list(s.scalars(select(SessionRow.id).where(*empty)))
            s.execute(delete(SessionRow).where(SessionRow.id.in_(gone)))
        return gone


time_calls(Store)
