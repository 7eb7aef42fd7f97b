"""The console's request list filtered in the database: by run (or sampler), request type and status,
combined, each tenant's newest first, on SQLite and on PostgreSQL. Another tenant's requests never match."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from loraplex.runtime.control.store import Batch, FutureOutcome, Store
from loraplex.runtime.control.store.schema import FutureRow
from loraplex.timestamps import utcnow

# (id, tenant, request_type, run_id, status), oldest first.
FUTURES = [
    ("req-1", "alice", "ForwardBackward", "a:train:0", "complete"),
    ("req-2", "alice", "OptimStep", "a:train:0", "complete"),
    ("req-3", "alice", "ForwardBackward", "a:train:0", "failed"),
    ("req-4", "alice", "ForwardBackward", "a:train:1", "complete"),
    ("req-5", "alice", "Sample", "a:sample:0", "pending"),
    ("req-6", "alice", "OptimStep", "a:train:1", "failed"),
    ("req-7", "bob", "ForwardBackward", "a:train:0", "failed"),  # bob's, naming alice's run id
    ("req-8", "alice", "CreateModel", None, "complete"),
]


@pytest.fixture
def filled(store: Store) -> Store:
    start = utcnow()
    rows = [
        FutureRow(
            id=fid,
            tenant=tenant,
            request_type=kind,
            run_id=run,
            seq_id=n if run else None,
            status="pending",
            created_at=start + timedelta(seconds=n),
        )
        for n, (fid, tenant, kind, run, _) in enumerate(FUTURES)
    ]
    store.add_futures(rows)
    outcomes = [
        FutureOutcome(fid, status, None, "boom" if status == "failed" else None, None)
        for fid, _, _, _, status in FUTURES
        if status != "pending"
    ]
    store.write_batch(Batch(outcomes=outcomes))
    return store


# (run, request type, status) -> the ids expected, newest first.
CASES = {
    (None, None, None): ["req-8", "req-6", "req-5", "req-4", "req-3", "req-2", "req-1"],
    ("a:train:0", None, None): ["req-3", "req-2", "req-1"],
    (None, "ForwardBackward", None): ["req-4", "req-3", "req-1"],
    (None, None, "failed"): ["req-6", "req-3"],
    (None, None, "pending"): ["req-5"],
    ("a:train:0", "ForwardBackward", None): ["req-3", "req-1"],
    ("a:train:0", "ForwardBackward", "complete"): ["req-1"],
    ("a:train:1", "OptimStep", "failed"): ["req-6"],
    ("a:train:1", "OptimStep", "complete"): [],
    ("nobody:train:0", None, None): [],
}


def test_the_filters_combine_and_return_exactly_the_tenants_matching_requests_newest_first(
    filled: Store,
) -> None:
    for (run, kind, status), expected in CASES.items():
        found = filled.recent_futures(["alice"], 100, run_id=run, request_type=kind, status=status)
        assert [row.id for row in found] == expected, (run, kind, status)


def test_an_admins_filtered_list_merges_each_tenants_matches(filled: Store) -> None:
    found = filled.recent_futures(["alice", "bob"], 100, run_id="a:train:0", status="failed")
    assert [row.id for row in found] == ["req-7", "req-3"]


def test_the_limit_keeps_the_newest_matches(filled: Store) -> None:
    found = filled.recent_futures(["alice"], 2, request_type="ForwardBackward")
    assert [row.id for row in found] == ["req-4", "req-3"]


def test_every_filter_reads_an_index_newest_first_without_scanning_or_sorting_the_table(
    tmp_path: Path,
) -> None:
    """SQLite's plan of each query the store runs: a run's requests through the (run_id, seq_id) index,
    the rest through (tenant, created_at); never a scan of the table or a sort of its rows."""
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    statements: list[tuple[str, Any]] = []

    def keep(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().startswith("SELECT futures."):
            statements.append((statement, parameters))

    for run, kind, status in CASES:
        statements.clear()
        sa.event.listen(sa.Engine, "before_cursor_execute", keep)
        try:
            store.recent_futures(["alice"], 100, run_id=run, request_type=kind, status=status)
        finally:
            sa.event.remove(sa.Engine, "before_cursor_execute", keep)
        ((statement, parameters),) = statements  # one query per tenant
        with store._engine.connect() as connection:
            plan = [
                row[-1] for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            ]
        # sqlite_autoindex_futures_2: the index of the (run_id, seq_id) unique constraint
        index = "sqlite_autoindex_futures_2 (run_id=?)" if run else "ix_futures_tenant_created (tenant=?)"
        assert plan == [f"SEARCH futures USING INDEX {index}"], (run, kind, status)
    store.close()
