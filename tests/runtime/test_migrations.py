"""The database schema is made and changed by the migrations: a new database of SQLite or PostgreSQL comes out
equal to the declared tables, and a database made by release 31f5bb0 (before migrations; legacy_store/)
upgrades in place with every row and result kept, its integer columns 64-bit and its results bytes."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.dialects import postgresql

from loraplex.engine.types import PassResult, SampleResult
from loraplex.runtime.control.store import Batch, Store
from loraplex.runtime.control.store.results import decode_result
from loraplex.runtime.control.store.schema import Base, CheckpointRow
from loraplex.timestamps import as_utc
from tests.e2e.postgres import create_database
from tests.runtime.legacy_store import rows

HEAD = "0002"  # the newest revision in migrations/versions/
FIXTURES = Path(__file__).parent / "legacy_store"
# Every integer column of the schema; all BIGINT on PostgreSQL once upgraded.
INTEGER_COLUMNS = {
    ("checkpoints", "id"),
    ("checkpoints", "size_bytes"),
    ("futures", "seq_id"),
    ("run_metrics", "id"),
    ("run_metrics", "seq_id"),
    ("run_metrics", "step"),
    ("training_runs", "last_seq_id"),
    ("training_runs", "last_step"),
}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'new.db'}"
    prefix = request.getfixturevalue("postgres_url_prefix")
    return create_database(prefix, f"new_{tmp_path.name.lower().replace('-', '_')}")


@pytest.fixture
def legacy_sqlite(tmp_path: Path) -> Path:
    """A copy of the SQLite file release 31f5bb0 made."""
    path = tmp_path / "legacy.db"
    shutil.copyfile(FIXTURES / rows.SQLITE_FILE, path)
    return path


@pytest.fixture
def legacy_postgres(postgres_url_prefix: str, tmp_path: Path) -> str:
    """The URL of a new PostgreSQL database loaded with the dump of the one release 31f5bb0 made."""
    url = create_database(postgres_url_prefix, f"legacy_{tmp_path.name.lower().replace('-', '_')}")
    with psycopg.connect(_libpq(url)) as connection:
        connection.execute((FIXTURES / rows.POSTGRES_DUMP).read_text())  # type: ignore[arg-type]
    return url


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


@contextmanager
def _connection(url: str) -> Iterator[sa.Connection]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


def _differences(url: str) -> list[Any]:
    """What alembic's autogenerate finds between the database and the declared tables."""
    with _connection(url) as connection:
        return compare_metadata(MigrationContext.configure(connection), Base.metadata)


def _revision(url: str) -> str | None:
    with _connection(url) as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _column_types(url: str) -> dict[tuple[str, str], str]:
    """(table, column) -> the type the database declares."""
    with _connection(url) as connection:
        inspector = sa.inspect(connection)
        return {
            (table, column["name"]): str(column["type"].compile(dialect=connection.dialect))
            for table in inspector.get_table_names()
            for column in inspector.get_columns(table)
        }


# --- a new database
def test_every_integer_column_declared_is_64_bit() -> None:
    declared = {
        (table.name, column.name): column.type.compile(dialect=postgresql.dialect())
        for table in Base.metadata.sorted_tables
        for column in table.columns
        if isinstance(column.type, sa.Integer)
    }
    assert declared == dict.fromkeys(INTEGER_COLUMNS, "BIGINT")


def test_a_new_database_is_made_by_the_migrations_equal_to_the_declared_tables(
    empty_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the tables must come from the migrations, not from create_all")

    monkeypatch.setattr(Base.metadata, "create_all", refuse)
    Store(empty_url).close()
    assert _differences(empty_url) == []
    assert _revision(empty_url) == HEAD


def test_stores_opening_a_new_database_at_once_make_its_tables_once(empty_url: str) -> None:
    url, opened, errors = empty_url, [], []
    start = threading.Barrier(4)

    def open_store() -> None:
        start.wait()
        try:
            opened.append(Store(url))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(opened) == 4
    assert _revision(url) == HEAD
    for store in opened:
        store.close()


# --- a database of release 31f5bb0
def _assert_row(row: Any, expected: dict[str, Any]) -> None:
    got = {name: getattr(row, name) for name in expected}
    got = {k: as_utc(v) if isinstance(v, datetime) else v for k, v in got.items()}
    assert got == expected


def _assert_same_result(got: Any, expected: Any) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, PassResult):
        assert got.metrics == expected.metrics and len(got.outputs) == len(expected.outputs)
        for out, want in zip(got.outputs, expected.outputs, strict=True):
            assert out.keys() == want.keys()
            for name in want:
                _assert_same_array(out[name], want[name])
    elif isinstance(expected, SampleResult):
        assert len(got.sequences) == len(expected.sequences)
        for seq, want in zip(got.sequences, expected.sequences, strict=True):
            assert seq.stop_reason == want.stop_reason
            for name in ("tokens", "logprobs", "topk_ids", "topk_logprobs"):
                _assert_same_array(getattr(seq, name), getattr(want, name))
        for name in ("prompt_logprobs", "topk_prompt_ids", "topk_prompt_logprobs", "target_prompt_logprobs"):
            _assert_same_array(getattr(got, name), getattr(expected, name))
        assert got.target_prompt_is_sparse == expected.target_prompt_is_sparse
    else:
        assert got == expected


def _assert_same_array(got: np.ndarray | None, expected: np.ndarray | None) -> None:
    if expected is None:
        assert got is None
        return
    assert got is not None and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)  # NaNs where expected has them


def _assert_every_row_kept(store: Store) -> None:
    _assert_row(store.get_key(rows.KEY["digest"]), rows.KEY)
    _assert_row(store.get_session(rows.SESSION_ID), rows.SESSION)
    _assert_row(store.get_run(rows.RUN_ID), rows.RUN)
    checkpoint = store.get_checkpoint(rows.RUN_ID, "sampler_weights", "final")
    _assert_row(checkpoint, {"id": 1, **rows.CHECKPOINT})
    _assert_row(store.get_sampler(rows.SAMPLER_ID), rows.SAMPLER)
    for columns, result in rows.FUTURES:
        row = store.get_future(columns["id"])
        _assert_row(row, columns)
        assert (row.result is None) == (result is None)
        if result is not None:
            assert isinstance(row.result, bytes)
            _assert_same_result(decode_result(row.result), result)
    metrics, counts = store.run_metrics(rows.RUN_ID, per_kind=100)
    assert [m.id for m in metrics] == [1, 2, 3]
    for metric, expected in zip(metrics, rows.METRICS, strict=True):
        _assert_row(metric, expected)
    assert counts == {"forward_backward": 1, "optim_step": 2}


def test_a_sqlite_database_of_release_31f5bb0_upgrades_in_place_keeping_every_row(
    legacy_sqlite: Path,
) -> None:
    url = f"sqlite:///{legacy_sqlite}"
    before = _column_types(url)
    assert _revision(url) is None and ("aliases", "tenant") not in before
    assert (before[("checkpoints", "size_bytes")], before[("futures", "result")]) == ("INTEGER", "TEXT")
    store = Store(url)
    _assert_every_row_kept(store)
    store.close()
    after = _column_types(url)
    assert {after[column] for column in INTEGER_COLUMNS - {("checkpoints", "id"), ("run_metrics", "id")}} == {
        "BIGINT"
    }
    assert after[("futures", "result")] == "BLOB"
    assert _revision(url) == HEAD
    assert _differences(url) == []


def test_a_postgresql_database_of_release_31f5bb0_upgrades_in_place_and_holds_2_gib_checkpoints(
    legacy_postgres: str,
) -> None:
    huge = CheckpointRow(**{**rows.CHECKPOINT, "name": "huge", "size_bytes": 2**31 + 5})
    with _connection(legacy_postgres) as connection:  # that release's column: 32 bits, the save fails
        assert _integer_types(connection)[("checkpoints", "size_bytes")] == "integer"
        with pytest.raises(sa.exc.DataError, match="integer out of range"):
            connection.execute(sa.insert(CheckpointRow.__table__).values(_columns(huge)))
    store = Store(legacy_postgres)
    _assert_every_row_kept(store)
    store.write_batch(Batch(checkpoints=[huge]))
    assert store.get_checkpoint(rows.RUN_ID, "sampler_weights", "huge").size_bytes == 2**31 + 5
    assert store.tenant_checkpoint_usage(rows.TENANT) == (2, 2**31 - 1 + 2**31 + 5)
    store.close()
    with _connection(legacy_postgres) as connection:
        assert _integer_types(connection) == dict.fromkeys(INTEGER_COLUMNS, "bigint")
        sequences = connection.execute(sa.text("SELECT sequencename, data_type FROM pg_sequences")).all()
        assert sorted(map(tuple, sequences)) == [
            ("checkpoints_id_seq", "bigint"),
            ("run_metrics_id_seq", "bigint"),
        ]
    assert _revision(legacy_postgres) == HEAD
    assert _differences(legacy_postgres) == []


def _integer_types(connection: sa.Connection) -> dict[tuple[str, str], str]:
    query = sa.text(
        "SELECT table_name, column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = 'public' AND data_type IN ('smallint', 'integer', 'bigint')"
    )
    return {(table, column): kind for table, column, kind in connection.execute(query)}


def _columns(row: CheckpointRow) -> dict[str, Any]:
    return {c.key: getattr(row, c.key) for c in CheckpointRow.__table__.columns if c.key != "id"}


def test_a_database_from_before_the_added_columns_gains_them_and_keeps_its_rows(legacy_sqlite: Path) -> None:
    added = {
        "training_runs": ("last_seq_id", "last_step"),
        "samplers": ("last_used_at",),
        "checkpoints": ("public",),
        "sessions": ("display_name",),
        "api_keys": ("admin",),
    }
    with sqlite3.connect(legacy_sqlite) as old:  # as the first release left it
        for table, columns in added.items():
            for column in columns:
                old.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    url = f"sqlite:///{legacy_sqlite}"
    store = Store(url)
    assert (store.get_run(rows.RUN_ID).last_step, store.get_session(rows.SESSION_ID).display_name) == (
        None,
        None,
    )
    assert store.get_checkpoint(rows.RUN_ID, "sampler_weights", "final").size_bytes == 2**31 - 1
    _assert_same_result(decode_result(store.get_future("req-pass").result), rows.pass_result())
    store.close()
    assert _differences(url) == []


def test_a_result_stored_before_the_newer_sample_outputs_converts_without_them(legacy_sqlite: Path) -> None:
    with sqlite3.connect(legacy_sqlite) as old:
        (text,) = old.execute("SELECT result FROM futures WHERE id = 'req-sample'").fetchone()
        stored = json.loads(text)
        body = stored["sample_result"]
        for name in (
            "target_prompt_logprobs",
            "target_prompt_is_sparse",
            "prompt_alt_ids",
            "prompt_alt_logprobs",
        ):
            del body[name]
        for name in ("topk_ids", "topk_logprobs"):
            del body["sequences"][0][name]
        old.execute("UPDATE futures SET result = ? WHERE id = 'req-sample'", (json.dumps(stored),))
    store = Store(f"sqlite:///{legacy_sqlite}")
    decoded = decode_result(store.get_future("req-sample").result)
    assert isinstance(decoded, SampleResult) and decoded.sequences[0].tokens.tolist() == [4, 5]
    assert decoded.target_prompt_logprobs is None and not decoded.target_prompt_is_sparse
    assert decoded.prompt_alt_ids is None and decoded.sequences[0].topk_ids is None
    store.close()


def test_results_convert_in_batches_of_500_rows(legacy_sqlite: Path) -> None:
    text = json.dumps({"path": "tinker://r/sampler_weights/x"})
    with sqlite3.connect(legacy_sqlite) as old:
        old.executemany(
            "INSERT INTO futures (id, tenant, request_type, status, result, created_at) "
            "VALUES (?, 'alice', 'SaveWeights', 'complete', ?, '2026-11-02 10:00:00')",
            [(f"req-bulk-{i:05d}", text) for i in range(1201)],
        )
    pages: list[str] = []

    def count_pages(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("SELECT futures.id, futures.result"):
            pages.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", count_pages)
    try:
        store = Store(f"sqlite:///{legacy_sqlite}")
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", count_pages)
    assert len(pages) == 4  # 1204 results: 500, 500, 204, then none
    assert all("LIMIT" in page for page in pages)
    assert decode_result(store.get_future("req-bulk-01200").result) == {
        "path": "tinker://r/sampler_weights/x"
    }
    assert store.count_futures() == 1201 + len(rows.FUTURES)
    store.close()


def test_an_upgrade_that_fails_changes_nothing(legacy_sqlite: Path) -> None:
    url = f"sqlite:///{legacy_sqlite}"
    with sqlite3.connect(legacy_sqlite) as old:
        old.execute("UPDATE futures SET result = 'not json' WHERE id = 'req-save'")
    before = _column_types(url)
    with pytest.raises(RuntimeError, match="future 'req-save': its stored result is not the base64 JSON"):
        Store(url)
    assert _column_types(url) == before and _revision(url) is None
    with sqlite3.connect(legacy_sqlite) as old:  # fixed by hand, it upgrades
        old.execute("UPDATE futures SET result = '{}' WHERE id = 'req-save'")
    Store(url).close()
    assert _revision(url) == HEAD


def test_a_database_a_newer_release_upgraded_is_refused_unchanged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    Store(url).close()
    with sqlite3.connect(tmp_path / "new.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")
    with pytest.raises(RuntimeError, match="at schema revision '0099', which this release does not have"):
        Store(url)
    assert _revision(url) == "0099"
