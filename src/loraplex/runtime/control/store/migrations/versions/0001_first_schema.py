"""The schema of the releases before migrations, as their code created it (schema.py up to 31f5bb0).

On an empty database this creates the tables. A database those releases made has the tables but no
alembic_version table; on it this completes what is missing, as their start-up did: tables, the columns
added after a table first shipped, and indexes. Its data stays as it is. Frozen: later schema changes
are later revisions, never edits here.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

log = logging.getLogger("loraplex.runtime.control.store.migrations")  # alembic loads this by path

_TABLES = sa.MetaData()
sa.Table(
    "api_keys",
    _TABLES,
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Column("key_id", sa.String(32), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("admin", sa.Boolean, nullable=True),
)
sa.Table(
    "sessions",
    _TABLES,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_reason", sa.String(32), nullable=True),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    sa.Column("display_name", sa.Text, nullable=True),
)
sa.Table(
    "training_runs",
    _TABLES,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("base_model", sa.String(300), nullable=False),
    sa.Column("lora_config", sa.JSON, nullable=False),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_seq_id", sa.BigInteger, nullable=True),
    sa.Column("last_step", sa.Integer, nullable=True),
    sa.Index("ix_runs_tenant_created", "tenant", "created_at"),
)
sa.Table(
    "checkpoints",
    _TABLES,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(200), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("size_bytes", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("user_metadata", sa.JSON, nullable=False),
    sa.Column("public", sa.Boolean, nullable=True),
    sa.UniqueConstraint("run_id", "kind", "name", name="uq_checkpoint_path"),
    sa.Index("ix_checkpoints_tenant_created", "tenant", "created_at"),
)
sa.Table(
    "samplers",
    _TABLES,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("base_model", sa.String(300), nullable=False),
    sa.Column("model_path", sa.String(500), nullable=True),
    sa.Column("snapshot_dir", sa.String(1000), nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
)
sa.Table(
    "futures",
    _TABLES,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("request_type", sa.String(64), nullable=False),
    sa.Column("run_id", sa.String(200), nullable=True),
    sa.Column("seq_id", sa.BigInteger, nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("result", sa.Text, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("category", sa.String(16), nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    sa.UniqueConstraint("run_id", "seq_id", name="uq_future_run_seq"),
    sa.Index("ix_futures_completed", "completed_at"),
    sa.Index("ix_futures_tenant_created", "tenant", "created_at"),
)
sa.Table(
    "run_metrics",
    _TABLES,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(200), nullable=False),
    sa.Column("seq_id", sa.BigInteger, nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_run_metrics_run", "run_id", "id"),
)

# The columns those releases added to a table after it first shipped (nullable, so rows already there
# stay valid), in the order they were added: a database made before one of them lacks it.
COLUMNS_ADDED = (
    ("training_runs", "last_seq_id"),
    ("samplers", "last_used_at"),
    ("checkpoints", "public"),
    ("sessions", "display_name"),
    ("api_keys", "admin"),
    ("training_runs", "last_step"),
)


def upgrade() -> None:
    bind = op.get_bind()
    existing = set(sa.inspect(bind).get_table_names())
    for table in _TABLES.sorted_tables:
        if table.name in existing:
            _complete(bind, table)
        else:
            table.create(bind)


def _complete(bind: sa.Connection, table: sa.Table) -> None:
    """Bring a table an earlier release made to this revision's shape: add the columns it lacks (only those
    of COLUMNS_ADDED: any other gap means the table is not loraplex's) and the indexes."""
    present = {column["name"] for column in sa.inspect(bind).get_columns(table.name)}
    for column in table.columns:
        if column.name in present:
            continue
        if (table.name, column.name) not in COLUMNS_ADDED:
            raise RuntimeError(
                f"table {table.name!r} lacks column {column.name!r}, which every release of loraplex "
                "created: this database was not made by loraplex"
            )
        log.info("adding column %s, which the release that made this database lacked", column)
        op.add_column(table.name, sa.Column(column.name, column.type, nullable=True))
    for index in table.indexes:
        index.create(bind, checkfirst=True)
