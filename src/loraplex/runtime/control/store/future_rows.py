"""The futures table's queries, and the writer's batch: futures added as requests are accepted, their
outcomes written with the facts beside them (control/writer.py), looked up, listed and pruned. The request
path's statements are built once. No tensors, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, bindparam, case, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from loraplex.errors import NotFoundError
from loraplex.runtime.control.store.connection import StoreBase
from loraplex.runtime.control.store.schema import CheckpointRow, FutureRow, MetricRow, RunRow, SamplerRow
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


class FutureQueries(StoreBase):
    """Futures: added, finished in the writer's batches, looked up, listed and pruned."""

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
                s.execute(delete(CheckpointRow).where(*checkpoint_at(row.run_id, row.kind, row.name)))
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

    def recent_futures(
        self,
        tenants: Sequence[str],
        limit: int,
        run_id: str | None = None,
        request_type: str | None = None,
        status: str | None = None,
    ) -> list[FutureRow]:
        """The newest futures of the given tenants, newest first, of one run (or sampler), request type and
        status where given: each tenant's newest, merged. A run's are read by seq_id through the (run_id,
        seq_id) index (its seq_ids are claimed in submission order), the others through (tenant,
        created_at) newest first; schema.py FutureRow says why type and status have no index."""
        where = [
            column == value
            for column, value in (
                (FutureRow.run_id, run_id),
                (FutureRow.request_type, request_type),
                (FutureRow.status, status),
            )
            if value is not None
        ]
        newest = FutureRow.seq_id.desc() if run_id is not None else FutureRow.created_at.desc()
        rows: list[FutureRow] = []
        with self._session() as s:
            for tenant in dict.fromkeys(tenants):
                query = select(FutureRow).where(FutureRow.tenant == tenant, *where)
                rows += s.scalars(query.order_by(newest).limit(limit))
        return sorted(rows, key=lambda row: as_utc(row.created_at), reverse=True)[:limit]

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


def checkpoint_at(run_id: str, kind: str, name: str) -> tuple[Any, ...]:
    """The where-clauses of the checkpoint at path (run_id, kind, name)."""
    return (CheckpointRow.run_id == run_id, CheckpointRow.kind == kind, CheckpointRow.name == name)
