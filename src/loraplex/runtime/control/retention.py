"""Retention: what the server keeps, and for how long, so that nothing it stores grows without bound.

- Finished futures are kept `future_retention_s` after they finished, then deleted; retrieving one
  afterwards is a 404 that says results are kept that long.
- A sampler goes once no client can reach it: its session finished, or its session stopped heartbeating
  and the sampler has not been used for `session_timeout_s`. A sampler with weights of its own (the
  unnamed snapshot behind save_weights_and_get_sampling_client, one per RL step, or the export made for
  a sampler over a training checkpoint) also goes, with those weights, once unused for
  `snapshot_idle_s`. Samplers over named checkpoints or the base model cost a row and stay while their
  session lives.
- Named checkpoints saved with a TTL (or given one later) are deleted once it runs out.
- A run's metric history (runtime/observability/history.py: one record per forward_backward, forward or
  optim_step) keeps its newest `max_metrics_per_run` records, and goes whole once the run has not been
  used for `metric_retention_s`.
- A run whose session finished or went silent, unused for `parked_retention_s`, loses its parked state
  (weights, both AdamW moments, gradients: gigabytes for a large model) and its status becomes expired: it
  can be resumed from its named checkpoints, which this never deletes. A run with no checkpoint left goes
  whole (row and metric history). A run the engine loop holds (resident, or with requests queued) is
  never touched: the caller's `release` takes idle runs out of the server's memory first.
- A session's row goes once it is finished or silent for `parked_retention_s` and holds no run and no
  sampler any more.
- Nothing that a queued or running request reads is deleted: the caller passes those directories as
  `in_use` (the housekeeping thread reads them from the engine loop's queues), and a sampler is deleted
  only if no request stamped it since the sweep looked (store: delete_unused_sampler), so a request
  accepted while the sweep runs keeps its sampler.

`Retention.due` says what would go (loraplex doctor prints it); `sweep` removes it. No tensors, no HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from loraplex.config import ServerConfig
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import SamplerRow, SessionRow
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from loraplex.timestamps import as_utc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long things are kept (seconds)."""

    future_retention_s: float
    snapshot_idle_s: float
    session_timeout_s: float
    metric_retention_s: float = 2_592_000.0
    max_metrics_per_run: int = 100_000
    parked_retention_s: float = 604_800.0

    @classmethod
    def of(cls, config: ServerConfig) -> RetentionPolicy:
        """The policy a server's configuration sets (each field means what its ServerConfig field says)."""
        return cls(
            config.future_retention_s,
            config.snapshot_idle_s,
            config.session_timeout_s,
            config.metric_retention_s,
            config.max_metrics_per_run,
            config.parked_retention_s,
        )


@dataclass
class Removal:
    """What one sweep removes (or, from `due`, would remove)."""

    futures: int = 0
    metrics: int = 0  # metric history records
    checkpoints: list[CheckpointPath] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)  # sampler ids; their own weight directories go too
    expired_runs: list[str] = field(default_factory=list)  # runs whose parked state goes
    parked_bytes: int = 0  # the size of that parked state
    runs: list[str] = field(default_factory=list)  # of those, runs whose rows go too (no checkpoint left)
    sessions: list[str] = field(default_factory=list)  # session rows that go
    directories: list[Path] = field(default_factory=list)  # every directory deleted, checkpoints included
    bytes: int = 0  # the size of those directories
    kept_in_use: int = 0  # due, but read by a request in flight: kept for a later sweep
    # Per sampler due: its last use when the sweep looked, and the weights directory of its own (if any).
    sampler_state: dict[str, tuple[datetime | None, Path | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.futures
            or self.metrics
            or self.checkpoints
            or self.samplers
            or self.expired_runs
            or self.sessions
        )


class Retention:
    """Applies a RetentionPolicy to the store and the data directory."""

    def __init__(self, store: Store, layout: DiskLayout, policy: RetentionPolicy) -> None:
        self.store, self.layout, self.policy = store, layout, policy

    def due(self, now: datetime, in_use: frozenset[Path] = frozenset()) -> Removal:
        """What a sweep at `now` would remove, leaving alone what `in_use` names."""
        removal = Removal()
        removal.futures = self.store.count_prunable_futures(now - _seconds(self.policy.future_retention_s))
        removal.metrics = self.store.count_prunable_metrics(*self._metric_bounds(now))
        for row in self.store.expired_checkpoints(now):
            path = CheckpointPath(row.run_id, row.kind, row.name)
            directory = self.layout.checkpoint_dir(path)
            if directory in in_use:
                removal.kept_in_use += 1
                continue
            removal.checkpoints.append(path)
            removal.directories.append(directory)
        samplers = self.store.all_samplers()
        sessions = self.store.sessions_by_id(sorted({row.session_id for row in samplers}))
        for row in samplers:
            if not self._unreachable(row, sessions.get(row.session_id), now):
                continue
            own = self._own_weights(row)
            if own is not None and own in in_use:
                removal.kept_in_use += 1
                continue
            removal.samplers.append(row.id)
            has_weights = own is not None and own.exists()
            removal.sampler_state[row.id] = (row.last_used_at, own if has_weights else None)
            if has_weights:
                removal.directories.append(own)
        unused_before = now - _seconds(self.policy.parked_retention_s)
        silent_before = now - _seconds(self.policy.session_timeout_s)
        expirable = self.store.expirable_runs(unused_before, silent_before)
        removal.expired_runs = [row.id for row in expirable]
        kept = self.store.runs_with_checkpoints(removal.expired_runs)
        removal.runs = [run_id for run_id in removal.expired_runs if run_id not in kept]
        for run_id in removal.expired_runs:
            parked = self.layout.parked_dir(run_id)
            if parked.is_dir():
                removal.directories.append(parked)
                removal.parked_bytes += _size(parked)
        removal.sessions = self.store.reclaimable_sessions(unused_before)
        removal.bytes = sum(_size(directory) for directory in removal.directories)
        return removal

    def sweep(
        self,
        now: datetime,
        in_use: frozenset[Path] = frozenset(),
        release: Callable[[list[str]], list[str]] = list,
    ) -> Removal:
        """Remove what is due; rows go before their files, so nothing can reference a half-deleted one.
        `release` gets the runs due to expire and returns those it took out of the server's memory (the
        others are busy: kept for a later sweep); a stopped server's data dir needs none (`loraplex gc`)."""
        removal = self.due(now, in_use)
        if removal.expired_runs:
            released = set(release(removal.expired_runs))
            for run_id in [r for r in removal.expired_runs if r not in released]:
                removal.expired_runs.remove(run_id)
                if run_id in removal.runs:
                    removal.runs.remove(run_id)
                parked = self.layout.parked_dir(run_id)
                if parked in removal.directories:
                    removal.directories.remove(parked)
            expired = [run_id for run_id in removal.expired_runs if run_id not in removal.runs]
            self.store.expire_runs(expired, removal.runs)
        if removal.sessions:
            removal.sessions = self.store.delete_empty_sessions(removal.sessions)
        if removal.futures:
            self.store.prune_futures(now - _seconds(self.policy.future_retention_s))
        if removal.metrics:
            self.store.prune_metrics(*self._metric_bounds(now))
        for path in removal.checkpoints:
            self.store.delete_checkpoint(path.run_id, path.kind, path.name)
        for sampler_id in list(removal.samplers):
            last_used, weights = removal.sampler_state[sampler_id]
            if not self.store.delete_unused_sampler(sampler_id, last_used):  # a request came meanwhile
                removal.samplers.remove(sampler_id)
                if weights is not None:
                    removal.directories.remove(weights)
        for directory in removal.directories:
            shutil.rmtree(directory, ignore_errors=True)
        if removal:
            log.info(
                "retention removed %d futures, %d metric records, %d expired checkpoints, %d unreachable "
                "samplers, the parked state of %d runs unused for %g s (%d run rows with it), %d session "
                "rows",
                removal.futures,
                removal.metrics,
                len(removal.checkpoints),
                len(removal.samplers),
                len(removal.expired_runs),
                self.policy.parked_retention_s,
                len(removal.runs),
                len(removal.sessions),
            )
        return removal

    def _metric_bounds(self, now: datetime) -> tuple[datetime, int]:
        """Runs unused since this time lose their metric history; every run keeps at most this many."""
        return now - _seconds(self.policy.metric_retention_s), self.policy.max_metrics_per_run

    def _unreachable(self, row: SamplerRow, session: SessionRow | None, now: datetime) -> bool:
        """Whether the sampler goes (module docstring): its session is gone, or silent and the sampler
        unused; or it holds weights of its own that nobody used for snapshot_idle_s."""
        last_used = as_utc(row.last_used_at or row.created_at)
        if session is None or session.finished_reason is not None:
            return True
        timeout = _seconds(self.policy.session_timeout_s)
        if now - as_utc(session.last_heartbeat_at) >= timeout and now - last_used >= timeout:
            return True
        idle = _seconds(self.policy.snapshot_idle_s)
        return self._own_weights(row) is not None and now - last_used >= idle

    def _own_weights(self, row: SamplerRow) -> Path | None:
        """The weights directory that belongs to the sampler alone (never a named checkpoint)."""
        if row.snapshot_dir is not None:
            return Path(row.snapshot_dir)
        if row.model_path is not None and CheckpointPath.parse(row.model_path).kind == "weights":
            return self.layout.snapshot_dir(row.id)  # the export made for it on first use
        return None


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


def _size(directory: Path) -> int:
    """Bytes of the files under a directory (what is gone meanwhile counts 0)."""
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total
