"""FutureTable and the writer: outcomes of a fused pass are written in one transaction, wake their waiters,
and read back the same from the database after a restart; a run's future stamps the run's last request
time."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event

from loraplex.errors import UserError
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.store import Batch, Store
from loraplex.runtime.control.store.schema import RunRow
from loraplex.runtime.control.writer import JournalWriter
from loraplex.runtime.core.journal import Record


def test_finish_writes_every_outcome_at_once_and_wakes_the_waiters(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    store = Store(url)
    futures = FutureTable(store, 3600.0)
    writer = JournalWriter(store, futures)
    writer.start()
    ok, user, server = (futures.create("alice", "forward_backward", "r", seq) for seq in (1, 2, 3))

    async def wait_for_all() -> list[str]:
        waits = [asyncio.create_task(futures.wait(f.id, "alice", timeout_s=5)) for f in (ok, user, server)]
        await asyncio.sleep(0.01)  # every waiter registered before the outcomes land
        outcomes = {
            ok.id: {"metrics": {"loss:sum": 1.5}},
            user.id: UserError("bad datum 3"),
            server.id: RuntimeError(),
        }
        writer.append(Record(outcomes))  # type: ignore[arg-type]
        return [record.status for record in await asyncio.gather(*waits)]

    assert asyncio.run(wait_for_all()) == ["complete", "failed", "failed"]
    writer.close()
    reread = FutureTable(Store(url), 3600.0)  # a restart: the records come from the database
    outcomes = [reread.get(f.id, "alice") for f in (ok, user, server)]
    assert outcomes[0].result == {"metrics": {"loss:sum": 1.5}}
    assert (outcomes[1].error, outcomes[1].category) == ("bad datum 3", "user")
    # An unexpected error's text may name server paths: the client gets a pointer to the log instead.
    assert outcomes[2].category == "server"
    assert outcomes[2].error == f"internal server error (request {server.id}; the server log has the details)"


def test_a_runs_future_stamps_the_runs_last_request_time(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    created = datetime(2026, 1, 1, tzinfo=UTC)
    row = RunRow(
        id="s:train:0",
        tenant="alice",
        session_id="s",
        base_model="m",
        lora_config={},
        status="live",
        created_at=created,
        last_request_at=created,
    )
    store.write_batch(Batch(runs=[row]))
    record = FutureTable(store, 3600.0).create("alice", "optim_step", "s:train:0", 1)
    row = store.get_run("s:train:0")
    assert row is not None and row.last_request_at.replace(tzinfo=UTC) > created
    assert store.get_future(record.id) is not None


def test_concurrent_writers_queue_on_the_store_never_on_sqlites_lock(tmp_path: Path) -> None:
    """SQLite makes a writer that finds the database locked sleep and poll (1, 2, 5 ... ms); the store
    queues its writers on a lock of its own instead. With SQLite's wait switched off, a writer that ever
    met another's lock would fail at once with "database is locked": none does."""
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")

    @event.listens_for(store._engine, "connect")
    def _fail_instead_of_waiting(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    store._engine.dispose()  # every connection from now on is made with the listener above
    futures = FutureTable(store, 3600.0)
    journal = JournalWriter(store, futures)
    journal.start()

    def submit_and_finish(writer: int) -> None:
        for seq in range(40):
            record = futures.create("alice", "forward_backward", f"run-{writer}", seq)
            journal.append(Record({record.id: {"metrics": {"loss:sum": float(seq)}}}))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(submit_and_finish, range(8)))
    journal.close()  # everything appended is written
    assert store.count_futures() == 8 * 40
    assert futures.pending_count() == 0


def test_an_outcome_the_database_refused_never_reads_as_pending_again_and_is_written_once_it_answers(
    tmp_path: Path,
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    futures = FutureTable(store, 3600.0, retained=2)  # two finished futures kept in memory
    writer = JournalWriter(store, futures, retry_pauses_s=())
    writer.start()
    refused = futures.create("alice", "OptimStep", "r", 1)
    real_write = store.write_batch
    store.write_batch = lambda *_: (_ for _ in ()).throw(OSError("disk full (injected)"))  # type: ignore[method-assign]
    assert not writer.append(Record({refused.id: {"metrics": {}}})).wait()  # not durable: failed in memory
    store.write_batch = real_write  # type: ignore[method-assign]
    for seq in range(2, 6):  # more finished futures than memory keeps: the refused one is not evicted
        record = futures.create("alice", "OptimStep", "r", seq)
        assert writer.append(Record({record.id: {"metrics": {}}})).wait()
    failed = futures.get(refused.id, "alice")
    assert (failed.status, failed.category) == ("failed", "server")
    assert "could not record this request's outcome (OSError" in (failed.error or "")
    writer.close()  # the database answers again: the failure is written before the writer stops
    row = store.get_future(refused.id)
    assert row is not None and (row.status, row.error) == ("failed", failed.error)
