"""The Store: every database read and write of loraplex, one short transaction per call.

SQLite (WAL) by default, PostgreSQL by URL; opening one brings its schema to the newest revision
(migrations/). Thread-safe: each call opens its own session. Returned rows are detached snapshots;
changing them changes nothing. No tensors, no HTTP.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import NotFoundError
from loraplex.runtime.control.store import migrations
from loraplex.runtime.control.store.schema import (
    AliasRow,
    ApiKeyRow,
    Base,
    CheckpointRow,
    FutureRow,
    MetricRow,
    RunRow,
    SamplerRow,
    SessionRow,
)
from loraplex.timestamps import as_utc, utcnow


@dataclass(frozen=True)
class FutureOutcome:
    """What finishing one future writes: its status and its encoded result (results.py) or error."""

    id: str
    status: str
    result: bytes | None
    error: str | None
    category: str | None


@dataclass
class Batch:
    """Rows the writer commits together: futures' outcomes, metric history, and the facts beside them."""

    outcomes: list[FutureOutcome] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # MetricRow columns but id
    last_steps: dict[str, int] = field(default_factory=dict)  # run -> optimizer steps taken
    runs: list[RunRow] = field(default_factory=list)  # runs created
    statuses: dict[str, str] = field(default_factory=dict)  # run -> its new status
    checkpoints: list[CheckpointRow] = field(default_factory=list)  # saved (replacing one of the same path)
    samplers: list[SamplerRow] = field(default_factory=list)  # created by unnamed sampler saves


class SeqIdTakenError(Exception):
    """A (run or sampler, seq_id) already has a future: a copy of the request got there first."""


class SamplerGoneError(NotFoundError):
    """The sampler a request names was deleted (by retention, after it went unused)."""


@dataclass(frozen=True)
class RequestSpan:
    """A future's kind, outcome and times, without its result (which may be large)."""

    id: str
    request_type: str
    seq_id: int | None
    status: str
    category: str | None
    error: str | None
    created_at: datetime
    completed_at: datetime | None


def _connect(url: str) -> SqlEngine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        # WAL lets the API read while the engine worker writes results; NORMAL sync is durable
        # across a process kill (only an OS crash may lose the last transactions).
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


class Store:
    """Repository over the loraplex tables. Each public method reports its duration to `observe` (method
    name, seconds) when set: the one place database latency is measured
    (runtime/observability/telemetry.py)."""

    observe: Callable[[str, float], None] | None = None

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine = _connect(url)
        migrations.upgrade(self._engine)
        self._session = sessionmaker(self._engine, expire_on_commit=False)
        # SQLite lets one connection write at a time and makes the others poll for the lock, sleeping 1,
        # 2, 5, 10 ... ms between tries; writers queue on a lock of ours instead and wake the moment it is
        # free. PostgreSQL locks rows, so its writers go in parallel.
        self._writer: AbstractContextManager[Any] = (
            threading.Lock() if self._engine.dialect.name == "sqlite" else nullcontext()
        )

    @property
    def display_url(self) -> str:
        """The database URL with any password hidden, for logs."""
        return self._engine.url.render_as_string(hide_password=True)

    def close(self) -> None:
        """Release pooled connections."""
        self._engine.dispose()

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """An ORM session in a write transaction, committed on exit."""
        with self._writer, self._session.begin() as s:
            yield s

    @contextmanager
    def _writing_core(self) -> Iterator[Connection]:
        """A Core connection in a write transaction (the request path's prebuilt statements)."""
        with self._writer, self._engine.begin() as connection:
            yield connection

    def _add(self, row: Base) -> None:
        with self._writing() as s:
            s.add(row)

    def _get(self, cls: type, key: Any) -> Any:
        with self._session() as s:
            return s.get(cls, key)

    def _all(self, query: Any) -> list[Any]:
        with self._session() as s:
            return list(s.scalars(query))

    def _page(self, query: Any, limit: int, offset: int) -> tuple[list[Any], int]:
        with self._session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            return list(s.scalars(query.limit(limit).offset(offset))), total

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
        rows = self._all(select(CheckpointRow).where(*_same_path(run_id, kind, name)))
        return rows[0] if rows else None

    def delete_checkpoint(self, run_id: str, kind: str, name: str) -> None:
        """Forget a checkpoint."""
        with self._writing() as s:
            s.execute(delete(CheckpointRow).where(*_same_path(run_id, kind, name)))

    def update_checkpoint(self, run_id: str, kind: str, name: str, **values: object) -> None:
        """Change fields of a checkpoint (public, expires_at)."""
        with self._writing() as s:
            s.execute(update(CheckpointRow).where(*_same_path(run_id, kind, name)).values(**values))

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

    # --- futures
    # add_futures and write_batch run on every request: prebuilt Core statements on a connection, not the
    # ORM's unit of work, which costs several times more Python per row.
    def add_futures(self, rows: Sequence[FutureRow]) -> None:
        """Store new futures of training runs (or none) in one transaction; a run's future also stamps the
        run's last request time and highest seq_id."""
        if not rows:
            return
        values = [_future_values(row) for row in rows]
        stamps = [
            {"stamped_id": row.run_id, "stamped_at": row.created_at, "stamped_seq": row.seq_id}
            for row in rows
            if row.run_id is not None
        ]
        with self._writing_core() as connection:
            connection.execute(_INSERT_FUTURE, values)
            if stamps:
                connection.execute(_STAMP_RUN, stamps)

    def add_sample_future(self, row: FutureRow) -> None:
        """Store a sampling request's future and stamp its sampler's last use, in one transaction.
        SamplerGoneError if the sampler's row is gone (retention deleted it: the stamp, which a sweep checks
        before it deletes, matched nothing); SeqIdTakenError if the (sampler, seq_id) already has a future
        (a copy of the request wrote it first)."""
        stamp = {"stamped_id": row.run_id, "stamped_at": row.created_at}
        with self._writing_core() as connection:
            if connection.execute(_STAMP_SAMPLER, stamp).rowcount == 0:
                raise SamplerGoneError(f"sampler {row.run_id!r} not found")
            try:
                connection.execute(_INSERT_FUTURE, [_future_values(row)])
            except IntegrityError as exc:
                raise SeqIdTakenError(f"{row.run_id} seq_id {row.seq_id} has a future already") from exc

    def write_batch(self, batch: Batch) -> None:
        """Write what the writer gathered (control/writer.py) in one transaction. A future's outcome is
        written only while the future is pending: its first outcome stands."""
        with self._writing() as s:
            if batch.runs:
                s.add_all(batch.runs)
                s.flush()
            for run_id, status in batch.statuses.items():
                s.execute(update(RunRow).where(RunRow.id == run_id).values(status=status))
            for row in {(r.run_id, r.kind, r.name): r for r in batch.checkpoints}.values():  # the last wins
                s.execute(delete(CheckpointRow).where(*_same_path(row.run_id, row.kind, row.name)))
                s.add(row)
            s.add_all(batch.samplers)
            s.flush()
            if batch.metrics:
                s.execute(_INSERT_METRICS, batch.metrics)
            if batch.last_steps:
                steps = [{"stamped_id": run, "new_step": step} for run, step in batch.last_steps.items()]
                s.execute(_SET_LAST_STEP, steps)
            if batch.outcomes:
                now = utcnow()
                s.execute(_FINISH_FUTURE, [_outcome_values(outcome, now) for outcome in batch.outcomes])

    def get_future(self, future_id: str) -> FutureRow | None:
        """A future by id."""
        return self._get(FutureRow, future_id)

    def future_id_for(self, run_id: str, seq_id: int) -> str | None:
        """The future of a run's (or a sampler's) seq_id, if one was ever submitted."""
        rows = self._all(select(FutureRow.id).where(FutureRow.run_id == run_id, FutureRow.seq_id == seq_id))
        return rows[0] if rows else None

    def request_spans(self, tenant: str, run_id: str) -> list[RequestSpan]:
        """The tenant's futures of one run (or sampler) that the database still holds, oldest first."""
        columns = [getattr(FutureRow, field.name) for field in fields(RequestSpan)]
        query = select(*columns).where(FutureRow.tenant == tenant, FutureRow.run_id == run_id)
        with self._session() as s:
            rows = s.execute(query.order_by(FutureRow.created_at, FutureRow.id)).all()
        return [
            RequestSpan(*values, as_utc(created), as_utc(completed) if completed else None)
            for *values, created, completed in rows
        ]

    def recent_futures(self, tenants: Sequence[str], limit: int) -> list[FutureRow]:
        """The newest futures of the given tenants, newest first: each tenant's newest through the
        (tenant, created_at) index, merged."""
        rows: list[FutureRow] = []
        with self._session() as s:
            for tenant in dict.fromkeys(tenants):
                query = select(FutureRow).where(FutureRow.tenant == tenant)
                rows += s.scalars(query.order_by(FutureRow.created_at.desc()).limit(limit))
        return sorted(rows, key=lambda row: as_utc(row.created_at), reverse=True)[:limit]

    def key_tenants(self) -> list[str]:
        """Every tenant that has (or had) an API key."""
        with self._session() as s:
            return list(s.scalars(select(ApiKeyRow.tenant).distinct()))

    def fail_pending_futures(self, error: str) -> int:
        """Fail every unfinished future (start-up after a crash) with a server error; return how many."""
        values = {"status": "failed", "error": error, "category": "server", "completed_at": utcnow()}
        with self._writing() as s:
            return s.execute(update(FutureRow).where(FutureRow.status == "pending").values(**values)).rowcount

    def last_seq_ids(self) -> dict[str, int]:
        """Per run, the highest seq_id it accepted (so a recovered run continues after it): the run's own
        record, or its futures for a database written before that record existed."""
        query = select(FutureRow.run_id, func.max(FutureRow.seq_id)).where(FutureRow.run_id.is_not(None))
        with self._session() as s:
            rows: Sequence[Any] = s.execute(query.group_by(FutureRow.run_id)).all()
            recorded: Sequence[Any] = s.execute(select(RunRow.id, RunRow.last_seq_id)).all()
        last = {run_id: seq for run_id, seq in rows if seq is not None}
        for run_id, seq in recorded:
            if seq is not None:
                last[run_id] = max(seq, last.get(run_id, seq))
        return last

    # --- metric history (runtime/observability/history.py; written by write_batch)
    def run_metrics(self, run_id: str, per_kind: int) -> tuple[list[MetricRow], dict[str, int]]:
        """A run's metric records, oldest first, and how many each kind has. A kind with more than
        `per_kind` is thinned in the database to every k-th record (k = ceil(count / per_kind)) and its
        last one, so a long run costs a chart at most that many points."""
        rn = func.row_number().over(partition_by=MetricRow.kind, order_by=MetricRow.id).label("rn")
        n = func.count().over(partition_by=MetricRow.kind).label("n")
        columns = (MetricRow.id, MetricRow.seq_id, MetricRow.step, MetricRow.kind, MetricRow.metrics)
        inner = select(*columns, MetricRow.recorded_at, rn, n).where(MetricRow.run_id == run_id).subquery()
        stride = case((inner.c.n > per_kind, (inner.c.n + per_kind - 1) // per_kind), else_=1)
        query = (
            select(inner)
            .where(or_((inner.c.rn - 1) % stride == 0, inner.c.rn == inner.c.n))
            .order_by(inner.c.id)
        )
        with self._session() as s:
            found: Sequence[Any] = s.execute(query).all()
        rows = [
            MetricRow(
                id=r.id,
                run_id=run_id,
                seq_id=r.seq_id,
                step=r.step,
                kind=r.kind,
                metrics=r.metrics,
                recorded_at=r.recorded_at,
            )
            for r in found
        ]
        return rows, {r.kind: r.n for r in found}

    def prune_metrics(self, idle_before: datetime, keep_per_run: int) -> int:
        """Delete the metric history of runs last used before `idle_before`, and every run's records beyond
        its newest `keep_per_run`; return how many."""
        deleted = 0
        with self._writing() as s:
            deleted += s.execute(
                delete(MetricRow).where(MetricRow.run_id.in_(_idle_runs(idle_before)))
            ).rowcount
            for run_id, _count in s.execute(_over_cap(keep_per_run)).all():
                newest_dropped = (
                    select(MetricRow.id)
                    .where(MetricRow.run_id == run_id)
                    .order_by(MetricRow.id.desc())
                    .limit(1)
                    .offset(keep_per_run)
                    .scalar_subquery()
                )
                query = delete(MetricRow).where(MetricRow.run_id == run_id, MetricRow.id <= newest_dropped)
                deleted += s.execute(query).rowcount
        return deleted

    def count_prunable_metrics(self, idle_before: datetime, keep_per_run: int) -> int:
        """How many records `prune_metrics` would delete."""
        idle = select(func.count()).where(MetricRow.run_id.in_(_idle_runs(idle_before)))
        cap = _over_cap(keep_per_run).where(MetricRow.run_id.not_in(_idle_runs(idle_before)))
        with self._session() as s:
            over = sum(count - keep_per_run for _, count in s.execute(cap).all())
            return (s.scalar(idle) or 0) + over

    def count_metrics(self) -> int:
        """How many metric records the database holds."""
        with self._session() as s:
            return s.scalar(select(func.count()).select_from(MetricRow)) or 0

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

    # --- retention (runtime/control/retention.py decides; these only select and delete)
    def prune_futures(self, finished_before: datetime) -> int:
        """Delete futures that finished before the given time; return how many."""
        with self._writing() as s:
            query = delete(FutureRow).where(
                FutureRow.status != "pending", FutureRow.completed_at < finished_before
            )
            return s.execute(query).rowcount

    def count_prunable_futures(self, finished_before: datetime) -> int:
        """How many futures `prune_futures` would delete."""
        query = select(func.count()).where(
            FutureRow.status != "pending", FutureRow.completed_at < finished_before
        )
        with self._session() as s:
            return s.scalar(query) or 0

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

    def count_futures(self) -> int:
        """How many futures the database holds."""
        with self._session() as s:
            return s.scalar(select(func.count()).select_from(FutureRow)) or 0


# The request path's statements, built once (building one cost about as much as running it on SQLite). Bound
# parameters are named unlike any column: one named like a column would also be SET by an UPDATE.
_FUTURES, _RUNS = FutureRow.__table__, RunRow.__table__
_INSERT_FUTURE = insert(_FUTURES)
_SAMPLERS = SamplerRow.__table__
_STAMPED_SEQ = bindparam("stamped_seq", type_=BigInteger)  # typed: PostgreSQL cannot infer it inside CASE
_STAMP_RUN = (
    update(_RUNS)
    .where(_RUNS.c.id == bindparam("stamped_id"))
    .values(
        last_request_at=bindparam("stamped_at"),
        last_seq_id=case((_RUNS.c.last_seq_id >= _STAMPED_SEQ, _RUNS.c.last_seq_id), else_=_STAMPED_SEQ),
    )
)
_STAMP_SAMPLER = (
    update(_SAMPLERS)
    .where(_SAMPLERS.c.id == bindparam("stamped_id"))
    .values(last_used_at=bindparam("stamped_at"))
)
_FINISH_FUTURE = (
    update(_FUTURES)
    .where(_FUTURES.c.id == bindparam("future_id"), _FUTURES.c.status == "pending")
    .values(
        status=bindparam("new_status"),
        result=bindparam("new_result"),
        error=bindparam("new_error"),
        category=bindparam("new_category"),
        completed_at=bindparam("done_at"),
    )
)


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, reporting how long each call took to its store's `observe`, if set."""

    @functools.wraps(method)
    def timed(self: Store, *args: Any, **kwargs: Any) -> Any:
        observe = self.observe
        if observe is None:
            return method(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            observe(name, time.perf_counter() - start)

    return timed


for _name, _method in list(vars(Store).items()):
    if not _name.startswith("_") and _name != "close" and callable(_method):
        setattr(Store, _name, _timed(_name, _method))


_INSERT_METRICS = insert(MetricRow.__table__)
_SET_LAST_STEP = (
    update(_RUNS).where(_RUNS.c.id == bindparam("stamped_id")).values(last_step=bindparam("new_step"))
)


def _future_values(row: FutureRow) -> dict[str, Any]:
    return {column.key: getattr(row, column.key) for column in _FUTURES.columns}


def _outcome_values(outcome: FutureOutcome, now: datetime) -> dict[str, Any]:
    return {
        "future_id": outcome.id,
        "new_status": outcome.status,
        "new_result": outcome.result,
        "new_error": outcome.error,
        "new_category": outcome.category,
        "done_at": now,
    }


def _idle_runs(before: datetime) -> Any:
    """The ids of runs last used before `before`."""
    return select(RunRow.id).where(RunRow.last_request_at < before)


def _over_cap(keep_per_run: int) -> Any:
    """(run_id, count) of the runs with more than `keep_per_run` metric records."""
    return (
        select(MetricRow.run_id, func.count()).group_by(MetricRow.run_id).having(func.count() > keep_per_run)
    )


def _same_path(run_id: str, kind: str, name: str) -> tuple[Any, ...]:
    return (CheckpointRow.run_id == run_id, CheckpointRow.kind == kind, CheckpointRow.name == name)
