"""The metric history table's queries (observability/history.py reads them; the writer's batch adds the
rows, future_rows.py): a run's history thinned for charts, and its pruning. No tensors, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import case, delete, func, or_, select, union_all

from loraplex.runtime.control.store.connection import StoreBase
from loraplex.runtime.control.store.schema import MetricRow, RunRow


class MetricQueries(StoreBase):
    """Metric history: read thinned, counted and pruned."""

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

    def latest_metrics(self, run_ids: Sequence[str], kinds: Sequence[str]) -> list[MetricRow]:
        """Each run's newest metric record of each kind, in one statement: per run and kind, a subquery
        walks the (run_id, id) index back from the run's newest record to the first of that kind."""
        if not run_ids or not kinds:
            return []
        newest = [
            select(
                select(MetricRow.id)
                .where(MetricRow.run_id == RunRow.id, MetricRow.kind == kind)
                .order_by(MetricRow.id.desc())
                .limit(1)
                .scalar_subquery()
            ).where(RunRow.id.in_(run_ids))
            for kind in kinds
        ]
        columns = (MetricRow.run_id, MetricRow.step, MetricRow.kind, MetricRow.metrics)
        query = select(*columns).where(MetricRow.id.in_(union_all(*newest).scalar_subquery()))
        with self._session() as s:
            found: Sequence[Any] = s.execute(query.order_by(MetricRow.id)).all()
        return [MetricRow(run_id=r.run_id, step=r.step, kind=r.kind, metrics=r.metrics) for r in found]

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


def _idle_runs(before: datetime) -> Any:
    """The ids of runs last used before `before`."""
    return select(RunRow.id).where(RunRow.last_request_at < before)


def _over_cap(keep_per_run: int) -> Any:
    """(run_id, count) of the runs with more than `keep_per_run` metric records."""
    return (
        select(MetricRow.run_id, func.count()).group_by(MetricRow.run_id).having(func.count() > keep_per_run)
    )
