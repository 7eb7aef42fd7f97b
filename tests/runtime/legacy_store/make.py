"""Make the legacy store fixtures with the code of release 31f5bb0 (before migrations): a SQLite file and a
PostgreSQL dump holding the rows of rows.py, and that release's aliases.json. Not run by the suite; run
it again only to remake the fixtures, from the repository root:

    git worktree add --detach /tmp/old31f 31f5bb0
    PYTHONPATH=/tmp/old31f/src:$PWD .venv/bin/python -m tests.runtime.legacy_store.make
    git worktree remove /tmp/old31f

It writes store_31f5bb0.db, store_31f5bb0.sql and aliases.json beside itself. The PostgreSQL dump comes
from a throwaway cluster (tests/e2e/postgres.py) through `pg_dump --inserts`, less psql's own commands,
so that it loads as plain SQL.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import tempfile
from pathlib import Path

from loraplex.runtime.aliases import AliasTable  # the release's modules: runtime/ before its rooms
from loraplex.runtime.store import Store
from loraplex.runtime.store.results import encode_result
from loraplex.runtime.store.schema import ApiKeyRow, CheckpointRow, FutureRow, RunRow, SamplerRow, SessionRow

from tests.e2e.postgres import create_database, postgres_cluster
from tests.runtime.legacy_store import rows

HERE = Path(__file__).parent


def fill(url: str) -> None:
    """Write the rows through the release's Store."""
    store = Store(url)
    store.add_key(ApiKeyRow(**rows.KEY))
    store.add_session(SessionRow(**rows.SESSION))
    store.add_run(RunRow(**rows.RUN))
    store.put_checkpoint(CheckpointRow(**rows.CHECKPOINT))
    store.add_sampler(SamplerRow(**rows.SAMPLER))
    for columns, result in sorted(rows.FUTURES, key=lambda future: future[0]["created_at"]):
        encoded = encode_result(result) if result is not None else None
        store.add_futures([FutureRow(**columns, result=encoded)])
    store.add_metrics(rows.METRICS, {rows.RUN_ID: rows.RUN["last_step"]})
    store.close()


def make_sqlite(path: Path) -> None:
    path.unlink(missing_ok=True)
    fill(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:  # small pages and no free ones: a fixture of a few KB
        db.execute("PRAGMA journal_mode=DELETE")
        db.execute("PRAGMA page_size=512")
        db.execute("VACUUM")


def make_postgres_dump(path: Path) -> None:
    with postgres_cluster() as prefix:
        url = create_database(prefix, "legacy")
        fill(url)
        plain = url.replace("postgresql+psycopg", "postgresql")
        dump = subprocess.run(
            ["pg_dump", "--inserts", "--no-owner", "--no-privileges", plain],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    lines = [line for line in dump.splitlines() if not line.startswith("\\")]  # \restrict, \unrestrict
    path.write_text("\n".join(lines) + "\n")


def make_alias_file(path: Path) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        table = AliasTable(Path(data_dir))
        for tenant, names in rows.ALIASES.items():
            for alias, model in names.items():
                table.set(tenant, alias, model)
        path.write_text((Path(data_dir) / "aliases.json").read_text())
    assert json.loads(path.read_text()) == rows.ALIASES


if __name__ == "__main__":
    make_sqlite(HERE / rows.SQLITE_FILE)
    make_postgres_dump(HERE / rows.POSTGRES_DUMP)
    make_alias_file(HERE / "aliases.json")
