"""Alembic's entry point: runs the revisions on the connection, already in a transaction, that
migrations.upgrade put in the config's attributes, and logs each one it applies. Compares against the
tables schema.py declares."""

import logging
from typing import Any

from alembic import context

from loraplex.runtime.control.store.schema import Base

log = logging.getLogger("loraplex.runtime.control.store.migrations")  # alembic loads this file by path


def _applied(*, step: Any, **_: Any) -> None:
    log.info("database upgraded to revision %s: %s", step.up_revision_id, step.up_revision.doc)


# transactional_ddl: the connection's transaction holds every statement, DDL included, SQLite's too
# (migrations.upgrade begins it).
context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=Base.metadata,
    transactional_ddl=True,
    on_version_apply=_applied,
)
with context.begin_transaction():
    context.run_migrations()
