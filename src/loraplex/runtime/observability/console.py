"""The web console's read side: what each page shows, for the viewer who asks.

A viewer (keys.Viewer) sees its own tenant's runs, checkpoints, samplers, requests and work in progress;
an admin sees every tenant's. Another tenant's run answers exactly like a missing one (NotFoundError), as
in the API, so ids leak nothing. The server's totals (telemetry) are shown to every viewer: they name no
run. Views are plain dataclasses that the API layer renders (api/console/). Every method reads the
database or the data directory: call it from a worker thread. No tensors, no HTTP.
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from loraplex.engine.interface import EngineInfo
from loraplex.engine.types import LoraConfig
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.catalog import Catalog, CheckpointView
from loraplex.runtime.control.downloads import URL_LIFETIME_S, DownloadSigner
from loraplex.runtime.control.keys import LOCAL_TENANT, Viewer
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import FutureRow, RunRow, SamplerRow
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout
from loraplex.runtime.core.commands import Command
from loraplex.runtime.observability.history import LatestValue, MetricHistory, MetricSeries, series_order
from loraplex.runtime.observability.progress import Progress, ProgressBoard
from loraplex.runtime.observability.server_snapshot import ServerSnapshot
from loraplex.runtime.observability.telemetry import Telemetry
from loraplex.timestamps import as_utc

# Most rows a list page shows; most points a chart draws per kind of request; most runs one comparison
# overlays (each gets its own colour, and a chart of more curves is hard to read).
PAGE_ROWS = 100
CHART_POINTS = 1000
MAX_COMPARED = 8
# What the requests page filters by: the request types futures are recorded under, and their statuses.
REQUEST_TYPES = tuple(sorted({kind.request_type for kind in typing.get_args(Command)} | {"Sample"}))
REQUEST_STATUSES = ("pending", "complete", "failed")
_MAX_ID_CHARS = 200  # as wide as the run_id column


@dataclass(frozen=True)
class RunSummary:
    """A training run as the runs page lists it."""

    run_id: str
    tenant: str
    base_model: str
    lora_config: LoraConfig
    status: str  # live | parked | lost
    created_at: datetime
    last_request_at: datetime
    last_step: int | None  # optimizer steps taken; None before the first
    latest: tuple[LatestValue, ...] = ()  # its newest metric values (the runs page); () elsewhere


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint and the signed token that downloads it (runtime/control/downloads.py)."""

    relpath: str
    size_bytes: int
    token: str


@dataclass(frozen=True)
class CheckpointEntry:
    """A checkpoint and its files."""

    checkpoint: CheckpointView
    files: tuple[CheckpointFile, ...]


@dataclass(frozen=True)
class SamplerSummary:
    """A sampling session and the weights it samples."""

    sampler_id: str
    tenant: str
    base_model: str
    source: str  # the checkpoint path it samples, "unnamed snapshot", or "base model"
    snapshot_bytes: int | None  # the size of its weights on disk, if any
    created_at: datetime
    last_used_at: datetime | None


@dataclass(frozen=True)
class RequestSummary:
    """A submitted request: what it was, how it ended and how long it took."""

    request_id: str
    tenant: str
    request_type: str
    target: str | None  # the training run or sampler it named
    seq_id: int | None
    status: str  # pending | complete | failed
    created_at: datetime
    latency_s: float | None  # submission to outcome; None while pending
    error: str | None


@dataclass(frozen=True)
class RunDetail:
    """Everything the page of one run shows."""

    run: RunSummary
    series: list[MetricSeries]
    checkpoints: list[CheckpointEntry]
    samplers: list[SamplerSummary]
    work: list[Progress]  # its work under way and recently finished


@dataclass(frozen=True)
class ComparedMetric:
    """One metric across the compared runs: each run's series of it, None for a run without it."""

    kind: str
    name: str
    series: tuple[MetricSeries | None, ...]  # in the order of Comparison.runs


@dataclass(frozen=True)
class Comparison:
    """The compare page: runs, and every metric any of them has."""

    runs: list[RunSummary]
    metrics: list[ComparedMetric]


@dataclass(frozen=True)
class RequestFilter:
    """Which requests the requests page lists: of one run (or sampler), request type and status, where
    given."""

    run: str | None = None
    request_type: str | None = None
    status: str | None = None

    def check(self) -> None:
        """Raise UserError naming the field, the value and what is allowed, if a filter is unknown."""
        if self.run is not None and not 0 < len(self.run) <= _MAX_ID_CHARS:
            raise UserError(f"run: an id of 1 to {_MAX_ID_CHARS} characters, got {len(self.run)}")
        if self.request_type is not None and self.request_type not in REQUEST_TYPES:
            raise UserError(f"request type {self.request_type!r} is not one of {', '.join(REQUEST_TYPES)}")
        if self.status is not None and self.status not in REQUEST_STATUSES:
            raise UserError(f"status {self.status!r} is not one of {', '.join(REQUEST_STATUSES)}")


@dataclass(frozen=True)
class ServerStatus:
    """The server page: telemetry, and the viewer's long work under way and recently finished."""

    snapshot: ServerSnapshot
    running: list[Progress]
    finished: list[Progress]


class Console:
    """Viewer-checked reads for the console's pages."""

    def __init__(
        self,
        store: Store,
        layout: DiskLayout,
        catalog: Catalog,
        history: MetricHistory,
        progress: ProgressBoard,
        telemetry: Telemetry,
        downloads: DownloadSigner,
        info: EngineInfo,
    ) -> None:
        self._store, self._layout, self._catalog = store, layout, catalog
        self._history, self._progress, self._telemetry = history, progress, telemetry
        self._downloads = downloads
        self.info = info  # what the server page names: the model and the device

    def runs(self, viewer: Viewer, limit: int = PAGE_ROWS, offset: int = 0) -> tuple[list[RunSummary], int]:
        """A page of the runs the viewer may see, newest first, with their newest metric values, and
        their total."""
        rows, total = self._store.list_runs(viewer.scope, limit, offset)
        latest = self._history.latest([row.id for row in rows])
        return [replace(_run_summary(row), latest=tuple(latest.get(row.id, ()))) for row in rows], total

    def run(self, viewer: Viewer, run_id: str) -> RunDetail:
        """One run the viewer may see, with its metric history, checkpoints, samplers and work."""
        row = self._visible_run(viewer, run_id)
        checkpoints = [self._with_files(c) for c in self._catalog.checkpoints(row.tenant, run_id)]
        prefix = f"tinker://{run_id}/"
        over_run = self._store.list_samplers(row.tenant, PAGE_ROWS, prefix)
        samplers = [self._sampler_summary(s) for s in over_run]
        work = [
            p
            for p in self._progress.running() + self._progress.finished()
            if p.subject == run_id or p.subject.startswith(prefix)
        ]
        return RunDetail(
            _run_summary(row), self._history.series(run_id, CHART_POINTS), checkpoints, samplers, work
        )

    def compare(self, viewer: Viewer, run_ids: list[str]) -> Comparison:
        """Runs the viewer may see (each once, in the order given) and their metric histories, metric by
        metric; an id it may not see answers like a missing one, before any history is read."""
        run_ids = list(dict.fromkeys(run_ids))
        if not run_ids:
            raise UserError("no run to compare: tick runs on the runs page, or name them as ?run=ID&run=ID")
        if len(run_ids) > MAX_COMPARED:
            raise UserError(f"{len(run_ids)} runs asked for: compare at most {MAX_COMPARED} at a time")
        rows = [self._visible_run(viewer, run_id) for run_id in run_ids]
        histories = [{(s.kind, s.name): s for s in self._history.series(r.id, CHART_POINTS)} for r in rows]
        keys = dict.fromkeys(key for history in histories for key in history)
        metrics = [
            ComparedMetric(kind, name, tuple(history.get((kind, name)) for history in histories))
            for kind, name in sorted(keys, key=series_order)
        ]
        return Comparison([_run_summary(row) for row in rows], metrics)

    def samplers(self, viewer: Viewer, limit: int = PAGE_ROWS) -> list[SamplerSummary]:
        """The newest sampling sessions the viewer may see."""
        return [self._sampler_summary(row) for row in self._store.list_samplers(viewer.scope, limit)]

    def requests(
        self, viewer: Viewer, chosen: RequestFilter = RequestFilter(), limit: int = PAGE_ROWS
    ) -> list[RequestSummary]:
        """The newest requests the viewer may see that match `chosen` (finished ones while retention keeps
        them); an admin's are those of every tenant that has a key, and of the local tenant of --auth
        none."""
        chosen.check()
        tenants = [viewer.tenant] if not viewer.is_admin else [LOCAL_TENANT, *self._store.key_tenants()]
        rows = self._store.recent_futures(tenants, limit, chosen.run, chosen.request_type, chosen.status)
        return [_request_summary(row) for row in rows]

    def server(self, viewer: Viewer) -> ServerStatus:
        """Telemetry now, and the long work of the viewer's runs under way and recently finished."""
        return ServerStatus(
            self._telemetry.snapshot(),
            [p for p in self._progress.running() if viewer.may_see(p.tenant)],
            [p for p in self._progress.finished() if viewer.may_see(p.tenant)],
        )

    def _visible_run(self, viewer: Viewer, run_id: str) -> RunRow:
        """The run, if the viewer may see it; else NotFoundError, whether it exists or not."""
        row = self._store.get_run(run_id)
        if row is None or not viewer.may_see(row.tenant):
            raise NotFoundError(f"training run {run_id!r} not found")
        return row

    def _with_files(self, checkpoint: CheckpointView) -> CheckpointEntry:
        """A checkpoint with a download token for each of its files, signed for its owner."""
        root = self._layout.checkpoint_dir(checkpoint.path)
        expires = int(time.time()) + URL_LIFETIME_S
        files = tuple(
            CheckpointFile(
                relpath, size, self._downloads.sign(checkpoint.owner, checkpoint.path, relpath, expires)
            )
            for relpath, size in _files(root)
        )
        return CheckpointEntry(checkpoint, files)

    def _sampler_summary(self, row: SamplerRow) -> SamplerSummary:
        if row.snapshot_dir is not None:
            source, weights = "unnamed snapshot", Path(row.snapshot_dir)
        elif row.model_path is not None:
            source = row.model_path
            path = CheckpointPath.parse(row.model_path)
            own_export = path.kind == "weights"  # a training checkpoint: the sampler's export of it
            weights = self._layout.snapshot_dir(row.id) if own_export else self._layout.checkpoint_dir(path)
        else:
            source, weights = "base model", None
        size = sum(size for _, size in _files(weights)) if weights is not None and weights.is_dir() else None
        return SamplerSummary(
            row.id,
            row.tenant,
            row.base_model,
            source,
            size,
            as_utc(row.created_at),
            as_utc(row.last_used_at) if row.last_used_at else None,
        )


def _run_summary(row: RunRow) -> RunSummary:
    return RunSummary(
        run_id=row.id,
        tenant=row.tenant,
        base_model=row.base_model,
        lora_config=LoraConfig(**row.lora_config),
        status=row.status,
        created_at=as_utc(row.created_at),
        last_request_at=as_utc(row.last_request_at),
        last_step=row.last_step,
    )


def _request_summary(row: FutureRow) -> RequestSummary:
    created = as_utc(row.created_at)
    latency = (as_utc(row.completed_at) - created).total_seconds() if row.completed_at else None
    return RequestSummary(
        row.id, row.tenant, row.request_type, row.run_id, row.seq_id, row.status, created, latency, row.error
    )


def _files(root: Path) -> list[tuple[str, int]]:
    """The regular files under a directory, as sorted (relative POSIX path, size) pairs."""
    if not root.is_dir():
        return []
    found = [
        (p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    ]
    return [(relpath, p.stat().st_size) for relpath, p in sorted(found)]
