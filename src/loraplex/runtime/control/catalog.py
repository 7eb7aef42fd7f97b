"""The catalog: read views of runs, checkpoints and samplers, each behind its owner check.

Another tenant's object answers exactly like a missing one (NotFoundError), so ids leak nothing.
Views are plain dataclasses so the API never sees database rows. No tensors, no HTTP.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from loraplex.engine.types import LoraConfig
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import CheckpointRow, RunRow, SamplerRow
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from loraplex.runtime.core.encrypted_exports import is_encrypted
from loraplex.timestamps import as_utc, utcnow


@dataclass(frozen=True)
class CheckpointView:
    """A named checkpoint."""

    path: CheckpointPath
    created_at: datetime
    size_bytes: int
    expires_at: datetime | None
    user_metadata: dict[str, str]
    public: bool = False
    owner: str = ""  # the tenant that saved it


@dataclass(frozen=True)
class RunView:
    """A training run with its latest checkpoints."""

    run_id: str
    tenant: str
    base_model: str
    lora_config: LoraConfig
    status: str
    last_request_at: datetime
    user_metadata: dict[str, Any]
    last_checkpoint: CheckpointView | None
    last_sampler_checkpoint: CheckpointView | None


@dataclass(frozen=True)
class SessionView:
    """A client session and what was made in it."""

    session_id: str
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, Any]


@dataclass(frozen=True)
class SamplerView:
    """A sampling session and where its weights live."""

    sampler_id: str
    base_model: str
    model_path: str | None
    snapshot: Path | None  # the PEFT snapshot directory it samples; None = the base model alone
    export_from: CheckpointPath | None  # a training checkpoint that is exported into `snapshot` on first use


class Catalog:
    """Owner-checked reads (and checkpoint deletion) over the store."""

    def __init__(self, store: Store, layout: DiskLayout) -> None:
        self._store, self._layout = store, layout

    def run(self, tenant: str, run_id: str) -> RunView:
        """One of the tenant's runs."""
        return self._run_view(self._run_row(tenant, run_id))

    def runs(self, tenant: str, limit: int, offset: int) -> tuple[list[RunView], int]:
        """A page of the tenant's runs, newest first, and the total."""
        rows, total = self._store.list_runs(tenant, limit, offset)
        return [self._run_view(row) for row in rows], total

    def checkpoints(self, tenant: str, run_id: str) -> list[CheckpointView]:
        """A run's checkpoints, oldest first."""
        self._run_row(tenant, run_id)
        return [_checkpoint_view(row) for row in self._store.run_checkpoints(run_id)]

    def tenant_checkpoints(self, tenant: str, limit: int, offset: int) -> tuple[list[CheckpointView], int]:
        """A page of all the tenant's checkpoints, newest first, and the total."""
        rows, total = self._store.tenant_checkpoints(tenant, limit, offset)
        return [_checkpoint_view(row) for row in rows], total

    def checkpoint_usage(self, tenant: str) -> tuple[int, int]:
        """How many checkpoints the tenant holds, and their bytes on disk (each checkpoint's files measured
        when they were written; a checkpoint's directory never changes after that)."""
        return self._store.tenant_checkpoint_usage(tenant)

    def published_checkpoints(self, tenant: str) -> list[CheckpointView]:
        """The checkpoints other tenants published (readable by `tenant`), newest first."""
        return [_checkpoint_view(row) for row in self._store.published_checkpoints(tenant)]

    def checkpoint(self, tenant: str, path: CheckpointPath) -> CheckpointView:
        """One of the tenant's checkpoints."""
        row = self._store.get_checkpoint(path.run_id, path.kind, path.name)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"checkpoint {path} not found")
        return _checkpoint_view(row)

    def readable_checkpoint(self, tenant: str, path: CheckpointPath) -> CheckpointView:
        """A checkpoint the tenant may read: its own, or one another tenant published."""
        row = self._store.get_checkpoint(path.run_id, path.kind, path.name)
        if row is None or (row.tenant != tenant and not row.public):
            raise NotFoundError(f"checkpoint {path} not found")
        return _checkpoint_view(row)

    def loadable_checkpoint(self, tenant: str, path: CheckpointPath) -> CheckpointView:
        """A checkpoint the tenant may read whose weights the server can read too, to load or sample them:
        not an export encrypted to age recipients (the server holds no identity)."""
        view = self.readable_checkpoint(tenant, path)
        if is_encrypted(self._layout.checkpoint_dir(path)):
            raise UserError(
                f"{path} is encrypted to its age recipients, so this server cannot read its weights; load "
                "or sample the training checkpoint (weights/) or a sampler checkpoint it was made from"
            )
        return view

    def readable_run(self, tenant: str, path: CheckpointPath) -> RunView:
        """The run behind a checkpoint the tenant may read (weights_info of a published checkpoint)."""
        self.readable_checkpoint(tenant, path)
        row = self._store.get_run(path.run_id)
        if row is None:
            raise NotFoundError(f"training run {path.run_id!r} not found")
        return self._run_view(row)

    def set_public(self, tenant: str, path: CheckpointPath, public: bool) -> None:
        """Publish (or unpublish) one of the tenant's checkpoints to every tenant of this server."""
        self.checkpoint(tenant, path)
        self._store.update_checkpoint(path.run_id, path.kind, path.name, public=public)

    def set_ttl(self, tenant: str, path: CheckpointPath, ttl_seconds: int | None) -> None:
        """Make one of the tenant's checkpoints expire `ttl_seconds` from now (None: never)."""
        self.checkpoint(tenant, path)
        expires = None if ttl_seconds is None else utcnow() + timedelta(seconds=ttl_seconds)
        self._store.update_checkpoint(path.run_id, path.kind, path.name, expires_at=expires)

    def session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        """A page of the tenant's session ids, newest first."""
        return self._store.tenant_session_ids(tenant, limit, offset)

    def session(self, tenant: str, session_id: str) -> SessionView:
        """One of the tenant's sessions, with its runs and samplers."""
        row = self._store.get_session(session_id)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"session {session_id!r} not found")
        runs, samplers = self._store.session_members(session_id)
        return SessionView(session_id, runs, samplers, row.user_metadata or {})

    def delete_checkpoint(self, tenant: str, path: CheckpointPath) -> None:
        """Forget one of the tenant's checkpoints and delete its files."""
        self.checkpoint(tenant, path)
        self._store.delete_checkpoint(path.run_id, path.kind, path.name)
        shutil.rmtree(self._layout.checkpoint_dir(path), ignore_errors=True)

    def sampler(self, tenant: str, sampler_id: str) -> SamplerView:
        """One of the tenant's sampling sessions."""
        row = self._store.get_sampler(sampler_id)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"sampler {sampler_id!r} not found")
        return SamplerView(row.id, row.base_model, row.model_path, *self._weights_of(row))

    def _weights_of(self, row: SamplerRow) -> tuple[Path | None, CheckpointPath | None]:
        """A sampler's snapshot directory and, for a training checkpoint, the source to export into it."""
        if row.snapshot_dir is not None:  # an unnamed save_weights_for_sampler
            return Path(row.snapshot_dir), None
        if row.model_path is None:
            return None, None
        source = CheckpointPath.parse(row.model_path)
        if source.kind in ("sampler_weights", "external_weights"):  # already PEFT snapshots
            return self._layout.checkpoint_dir(source), None
        # A training checkpoint holds weights + optimizer state, not a PEFT snapshot: the sampler gets
        # its own export, made once on first use (immutable, like every snapshot).
        return self._layout.snapshot_dir(row.id), source

    def _run_row(self, tenant: str, run_id: str) -> RunRow:
        row = self._store.get_run(run_id)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"training run {run_id!r} not found")
        return row

    def _run_view(self, row: RunRow) -> RunView:
        checkpoints = self._store.run_checkpoints(row.id)
        latest = {
            kind: next((c for c in reversed(checkpoints) if c.kind == kind), None)
            for kind in ("weights", "sampler_weights")
        }
        return RunView(
            run_id=row.id,
            tenant=row.tenant,
            base_model=row.base_model,
            lora_config=LoraConfig(**row.lora_config),
            status=row.status,
            last_request_at=as_utc(row.last_request_at),
            user_metadata=row.user_metadata or {},
            last_checkpoint=_maybe_view(latest["weights"]),
            last_sampler_checkpoint=_maybe_view(latest["sampler_weights"]),
        )


def _checkpoint_view(row: CheckpointRow) -> CheckpointView:
    return CheckpointView(
        path=CheckpointPath(row.run_id, row.kind, row.name),
        created_at=as_utc(row.created_at),
        size_bytes=row.size_bytes,
        expires_at=as_utc(row.expires_at) if row.expires_at else None,
        user_metadata=row.user_metadata or {},
        public=bool(row.public),
        owner=row.tenant,
    )


def _maybe_view(row: CheckpointRow | None) -> CheckpointView | None:
    return _checkpoint_view(row) if row is not None else None
