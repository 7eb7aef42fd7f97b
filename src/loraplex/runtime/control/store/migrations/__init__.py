"""The database schema's history as Alembic revisions (versions/), and `upgrade`, which the Store runs as it
opens a database: a new one is created by the revisions, one made by an earlier release is brought up to
date in place.

Alembic is configured here in code (no alembic.ini); env.py runs the revisions on the connection
`upgrade` hands it. Knows nothing of the Store's queries.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from sqlalchemy.engine import Engine

# Alembic's own INFO lines (plugins set up as it is imported, the dialect on every open) say nothing an
# operator needs; env.py logs the revisions applied instead.
logging.getLogger("alembic").setLevel(logging.WARNING)

from alembic import command  # noqa: E402 (imported once its logger is quiet)
from alembic.config import Config  # noqa: E402
from alembic.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402

_SCRIPTS = Path(__file__).parent
# Concurrent upgrades of one PostgreSQL database wait for each other on this transaction-level lock key
# (an arbitrary constant: "lpx" as an integer); SQLite's BEGIN IMMEDIATE does the same for a file.
_PG_LOCK_KEY = 0x6C7078


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest revision in one transaction: all of it or, if a step fails, none.
    A database with loraplex's tables but no alembic_version table (made before migrations) is completed
    and stamped with revision 0001 on the way."""
    with engine.connect() as connection, connection.begin():
        if engine.dialect.name == "sqlite":
            # pysqlite would begin the transaction only at the first INSERT or UPDATE, leaving the DDL before
            # it outside; beginning it here makes the whole upgrade atomic and takes the write lock first.
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        elif engine.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")
        current, scripts = MigrationContext.configure(connection).get_current_revision(), _scripts()
        if current == scripts.get_current_head():
            return  # the usual case, without loading env.py and the revisions
        if current is not None and current not in {script.revision for script in scripts.walk_revisions()}:
            raise RuntimeError(
                f"the database is at schema revision {current!r}, which this release does not have (its "
                f"newest is {scripts.get_current_head()!r}): a newer release upgraded it; run that release, "
                "or restore the backup taken before the upgrade"
            )
        config = _config()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    """The revisions, read once per process: they are part of the installed package."""
    return ScriptDirectory.from_config(_config())
