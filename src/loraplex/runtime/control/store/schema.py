"""Database tables (SQLAlchemy 2 ORM): tenants' keys, sessions, training runs, checkpoints, samplers, futures,
each run's metric history, and the tenants' model aliases.

Rows hold identities, ownership and encoded results; never request bodies, tensors or weights (those
live in memory or under the data directory). Times are UTC. Every count, size, step and numeric id is
64-bit. These classes declare the schema the code expects; the migrations (migrations/versions/) are
what creates and changes it, and a test holds the two equal.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """Declarative base of every loraplex table."""


# A 64-bit integer that may also be an autoincrementing primary key: SQLite's autoincrement needs INTEGER
# (its rowid, 64-bit anyway); elsewhere BIGINT, as ids are never reused and a busy server writes billions.
_BIG_ID = BigInteger().with_variant(Integer, "sqlite")


class ApiKeyRow(Base):
    """An API key, stored only as its digest; the key itself is shown once at creation."""

    __tablename__ = "api_keys"

    # The digest is the primary key because authentication looks keys up by digest on every request.
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), unique=True)  # short public handle for list/revoke
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # An admin key sees every tenant's objects in the web console (`keys create --admin`); NULL: no.
    admin: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=False)


class SessionRow(Base):
    """A client session: the heartbeat lease its training runs live under."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    # ServiceClient(display_name=...): shown and searched (search_sessions), never unique. Text: its
    # bound is the operator's --max-name-bytes, which a fixed column width could fall short of.
    display_name: Mapped[str | None] = mapped_column(Text, nullable=True)


class RunRow(Base):
    """A training run (model id `{session}:train:{n}`) and the LoRA config it was created with."""

    __tablename__ = "training_runs"
    # Listing a tenant's runs newest first is the REST list query.
    __table_args__ = (Index("ix_runs_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(String(300))
    lora_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16))  # live | parked | lost | expired (run_queue.py)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The highest seq_id the run ever accepted: where its log resumes after a restart, even once the
    # futures that carried those seq_ids are pruned.
    last_seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Optimizer steps the run has taken on this server, as of its last recorded metrics (the console's
    # "last step"; a restarted run counts on from it). NULL: none recorded.
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class CheckpointRow(Base):
    """A named checkpoint: `tinker://{run_id}/{kind}/{name}`, its size and expiry."""

    __tablename__ = "checkpoints"
    # One name per (run, kind): it is the checkpoint's path, and overwrite=false must see duplicates.
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "name", name="uq_checkpoint_path"),
        # The caller-wide checkpoint list (GET /checkpoints) filters by tenant, newest first.
        Index("ix_checkpoints_tenant_created", "tenant", "created_at"),
    )

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128))
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # a checkpoint may pass 2 GiB
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    # Published: readable (loadable, sampleable) by every tenant of this server. NULL (older rows): no.
    public: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=False)


class SamplerRow(Base):
    """A sampling session: base model alone, a sampler checkpoint path, or an unnamed snapshot directory."""

    __tablename__ = "samplers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(String(300))
    model_path: Mapped[str | None] = mapped_column(String(500), nullable=True)
    snapshot_dir: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Stamped by every asample: an unnamed snapshot unused for the retention window is deleted.
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class FutureRow(Base):
    """A submitted request's future: status and its encoded result, retrievable after a restart."""

    __tablename__ = "futures"
    # Dedup under concurrent retries: a (run, seq_id) may own at most one future, even across a
    # restart, so a resent request finds the first future instead of running twice. Sampling requests
    # use the sampler id as run_id (sampler and run ids never collide: ":sample:" vs ":train:"), so the
    # same constraint dedups (sampler, seq_id). NULLs (session-level requests) are not constrained.
    __table_args__ = (
        UniqueConstraint("run_id", "seq_id", name="uq_future_run_seq"),
        # Retention prunes finished futures by completion time.
        Index("ix_futures_completed", "completed_at"),
        # The console lists a tenant's newest requests (an admin's: each tenant's, merged). One index, as
        # every index costs each request's insert. Its filters by request type and status read this one
        # newest first and stop at a page of matches: retention bounds how far back a tenant's rows go,
        # while an index on status would also cost every outcome's update. Its filter by run reads the
        # (run_id, seq_id) index of the constraint above.
        Index("ix_futures_tenant_created", "tenant", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    request_type: Mapped[str] = mapped_column(String(64))
    run_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # training run or sampler
    # 64-bit: a cloned SamplingClient numbers its requests from clone_id * 1e9.
    seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    status: Mapped[str] = mapped_column(String(16))  # pending | complete | failed
    # Bytes in the format of results.py, not JSON: results are written once and only ever read back whole,
    # and their arrays go in and out as raw bytes.
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class MetricRow(Base):
    """One training request's metrics in its run's history: a forward_backward's or forward's (loss:sum, ...)
    or an optim_step's (grad_norm, learning_rate). Written in batches by runtime/observability/history.py;
    bounded by retention (runtime/control/retention.py): per run, and by how long ago the run was used."""

    __tablename__ = "run_metrics"
    # A run's history in order (the console's charts, the per-run bound) and by run (deleting a run's
    # history) are both this index.
    __table_args__ = (Index("ix_run_metrics_run", "run_id", "id"),)

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(200))
    seq_id: Mapped[int] = mapped_column(BigInteger)
    # The optimizer step the request belongs to: a forward_backward's is the step it feeds (the run's steps
    # so far + 1), an optim_step's the step it took, a forward's the steps taken before it.
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))  # forward_backward | forward | optim_step | sample
    # Text, not the JSON type: written once, read back whole.
    metrics: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AliasRow(Base):
    """A tenant's name for one of its models (runtime/control/aliases.py): alias -> a tinker:// path."""

    __tablename__ = "aliases"

    # Each tenant has its own names, so (tenant, alias) is the key; resolving a name and listing a
    # tenant's names (a prefix of the key) both use it.
    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    alias: Mapped[str] = mapped_column(String(128), primary_key=True)  # aliases.py allows 128 characters
    model: Mapped[str] = mapped_column(String(500))  # as wide as SamplerRow.model_path, the same paths
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # when it last moved
