"""Executing a plan on the engine: passes, fused steps, barriers, and the residency moves that precede them.

Called by the engine worker (worker.py) on its one thread; every method either finishes the futures of
the commands it ran or fails them, so no future is left pending by a failure here. Run state the HTTP
side also reads (queues, status) changes under the service lock; slot ids and gradient flags are the
worker's alone. No tensors: numpy-level dataclasses in, numpy-level results out.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from loraplex.engine.interface import Engine
from loraplex.engine.types import PassRequest, PassResult
from loraplex.errors import CapacityError, ServerError, UserError
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.store import Store, utcnow
from loraplex.runtime.control.store.results import Result
from loraplex.runtime.control.store.schema import CheckpointRow, RunRow, SamplerRow
from loraplex.runtime.core.checkpoints import CheckpointPath, DiskLayout, owner_digest
from loraplex.runtime.core.commands import (
    CreateRun,
    CreateRunFromCheckpoint,
    ForwardBackward,
    LoadState,
    SaveExternal,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.core.run_queue import LIVE, LOST, PARKED, Entry, RunState
from loraplex.runtime.core.scheduler import OptimWork, PassWork, Work, work_items
from loraplex.runtime.observability.history import FORWARD, FORWARD_BACKWARD, OPTIM_STEP, MetricHistory
from loraplex.runtime.observability.progress import ProgressBoard
from loraplex.runtime.observability.telemetry import Telemetry

log = logging.getLogger(__name__)


def lost_run_error(run_id: str) -> ServerError:
    """The error for any command on a run whose live state a restart destroyed."""
    return ServerError(
        f"training run {run_id} lost its live state when the server restarted; resume it from a checkpoint "
        "with ServiceClient.create_training_client_from_state_with_optimizer(tinker_path)"
    )


class Executor:
    """Runs plan items on the engine and reports them through the futures."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        futures: FutureTable,
        layout: DiskLayout,
        runs: dict[str, RunState],
        cond: threading.Condition,
        telemetry: Telemetry | None = None,
        history: MetricHistory | None = None,
        progress: ProgressBoard | None = None,
    ) -> None:
        self.engine, self.store, self.futures, self.layout = engine, store, futures, layout
        self.runs, self.cond = runs, cond
        self.telemetry = telemetry or Telemetry()
        self.history = history or MetricHistory(store)
        self.progress = progress or ProgressBoard()

    def execute(self, work: Work) -> None:
        """One work item; an unexpected failure fails its requests (as server errors), never the worker."""
        try:
            if isinstance(work, PassWork):
                self._run_pass(work.items)
            elif isinstance(work, OptimWork):
                self._run_optim(work.items)
            else:
                self._run_barrier(work.run, work.entry)
        except Exception as exc:
            log.exception("engine work failed: %s of %d requests", type(work).__name__, len(work_items(work)))
            for _, entry in work_items(work):
                self.futures.fail_if_pending(entry.future_id, exc)

    # --- work kinds
    def _run_pass(self, items: list[tuple[RunState, Entry]]) -> None:
        requests = []
        for run, entry in items:
            cmd = entry.command
            assert isinstance(cmd, ForwardBackward)
            requests.append(
                PassRequest(_slot_of(run), cmd.loss_fn, cmd.loss_fn_config, cmd.datums, cmd.forward_only)
            )
        start = time.perf_counter()
        results = self.engine.run_pass(requests, keep_undo=True)
        self.telemetry.record_pass(
            tokens=sum(entry.command.num_tokens for _, entry in items),  # type: ignore[union-attr]
            requests=len(items),
            runs=len({run.run_id for run, _ in items}),
            tenants=len({run.tenant for run, _ in items}),
            duration_s=time.perf_counter() - start,
        )
        had_gradients = [run.pending_gradients for run, _ in items]
        for (run, entry), result in zip(items, results, strict=True):
            if not isinstance(result, Exception) and not entry.command.forward_only:  # type: ignore[union-attr]
                run.pending_gradients = True
        outcomes = {entry.future_id: result for (_, entry), result in zip(items, results, strict=True)}
        if not self._finish_or_undo(outcomes, items, had_gradients):
            return
        for (run, entry), result in zip(items, results, strict=True):
            if isinstance(result, PassResult):
                self._record_pass_metrics(run, entry, result)

    def _record_pass_metrics(self, run: RunState, entry: Entry, result: PassResult) -> None:
        """A forward_backward's metrics belong to the step it feeds; a forward's to the steps taken."""
        assert isinstance(entry.command, ForwardBackward)
        if entry.command.forward_only:
            self.history.record(run.run_id, entry.seq_id, run.optim_steps, FORWARD, result.metrics)
        else:
            step = run.optim_steps + 1
            self.history.record(run.run_id, entry.seq_id, step, FORWARD_BACKWARD, result.metrics)

    def _run_optim(self, items: list[tuple[RunState, Entry]]) -> None:
        steps = {_slot_of(run): entry.command.params for run, entry in items}  # type: ignore[union-attr]
        start = time.perf_counter()
        metrics = self.engine.optim_step(steps, keep_undo=True)
        self.telemetry.record_optim_step(len(steps), time.perf_counter() - start)
        had_gradients = [run.pending_gradients for run, _ in items]
        for run, _ in items:
            run.pending_gradients = False
        # A skipped step's grad_norm is NaN or inf, which JSON cannot carry and the SDK's float metrics
        # refuse: it is left out; skipped_nonfinite says why.
        finite = {slot: {k: v for k, v in m.items() if math.isfinite(v)} for slot, m in metrics.items()}
        outcomes = {entry.future_id: {"metrics": finite[run.slot]} for run, entry in items}  # type: ignore[index]
        if not self._finish_or_undo(outcomes, items, had_gradients):
            return
        for run, entry in items:
            run.optim_steps += 1
            self.history.record(run.run_id, entry.seq_id, run.optim_steps, OPTIM_STEP, metrics[run.slot])  # type: ignore[index]

    def _finish_or_undo(
        self, outcomes: dict[str, Result], items: list[tuple[RunState, Entry]], had_gradients: list[bool]
    ) -> bool:
        """Record a pass's or step's outcomes; True if recorded. If they cannot be recorded, its requests
        fail: take the work back, so that their retry counts once (the engine keeps what it needs until its
        next call)."""
        if self.futures.finish(outcomes, undone_if_unrecorded=True):
            return True
        self.engine.undo_last()
        for (run, _), pending in zip(items, had_gradients, strict=True):
            run.pending_gradients = pending
        log.warning("took back the work of %d requests whose outcomes could not be recorded", len(items))
        return False

    def _run_barrier(self, run: RunState, entry: Entry) -> None:
        try:
            result = self._barrier_result(run, entry.command)
        except UserError as exc:
            self.futures.fail(entry.future_id, exc)
            return
        self.futures.complete(entry.future_id, result)

    def _barrier_result(self, run: RunState, cmd: object) -> dict[str, object]:
        owner = owner_digest(run.tenant)
        slot = _slot_of(run)
        if isinstance(cmd, LoadState):
            source = self.layout.checkpoint_dir(cmd.source)
            with self.progress.track("load checkpoint", run.tenant, str(cmd.source), reads=source):
                self.engine.load_state(source, self.source_owner(cmd.source), cmd.with_optimizer, slot=slot)
            run.pending_gradients = False
            return {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}
        if isinstance(cmd, SaveState):
            path = CheckpointPath(run.run_id, "weights", cmd.name)
            self._save_checkpoint(run, path, cmd, lambda d: self.engine.save_state(slot, d, owner))
            return {"path": str(path), "type": "save_weights"}
        if isinstance(cmd, SaveExternal):
            path = CheckpointPath(run.run_id, "external_weights", cmd.name)
            size = self._save_checkpoint(run, path, cmd, lambda d: self.engine.save_snapshot(slot, d))
            return {"path": str(path), "size_bytes": size, "type": "save_weights_external"}
        if isinstance(cmd, SaveSnapshot) and cmd.name is not None:
            path = CheckpointPath(run.run_id, "sampler_weights", cmd.name)
            self._save_checkpoint(run, path, cmd, lambda d: self.engine.save_snapshot(slot, d))
            return {"path": str(path), "type": "save_weights_for_sampler"}
        if isinstance(cmd, SaveSnapshot) and cmd.sampler_id is not None:
            if self.store.get_sampler(cmd.sampler_id) is not None:
                raise UserError(
                    f"sampling session {cmd.sampler_id} already exists; each sampling_session_seq_id of a "
                    "session names one sampler"
                )
            directory = self.layout.snapshot_dir(cmd.sampler_id)
            with self.progress.track("save sampler snapshot", run.tenant, cmd.sampler_id, writes=directory):
                self.engine.save_snapshot(slot, directory)
            self.store.add_sampler(
                SamplerRow(
                    id=cmd.sampler_id,
                    session_id=run.session_id,
                    tenant=run.tenant,
                    base_model=run.base_model,
                    model_path=None,
                    snapshot_dir=str(directory),
                    created_at=utcnow(),
                )
            )
            return {"sampling_session_id": cmd.sampler_id, "type": "save_weights_for_sampler"}
        raise ServerError(f"no executor for command {type(cmd).__name__}")

    def _save_checkpoint(
        self,
        run: RunState,
        path: CheckpointPath,
        cmd: SaveState | SaveSnapshot | SaveExternal,
        write: Callable[[Path], int],
    ) -> int:
        if not getattr(cmd, "overwrite", False) and self.store.get_checkpoint(
            run.run_id, path.kind, path.name
        ):
            raise UserError(
                f"checkpoint {path} already exists; pick another name or save with overwrite=True"
            )
        directory = self.layout.checkpoint_dir(path)
        with self.progress.track(_SAVE_KINDS[path.kind], run.tenant, str(path), writes=directory):
            size = write(directory)
        now = utcnow()
        expires = None if cmd.ttl_seconds is None else now + timedelta(seconds=cmd.ttl_seconds)
        self.store.put_checkpoint(
            CheckpointRow(
                run_id=run.run_id,
                kind=path.kind,
                name=path.name,
                tenant=run.tenant,
                size_bytes=size,
                created_at=now,
                expires_at=expires,
                user_metadata=cmd.user_metadata,
            )
        )
        return size

    def source_owner(self, path: CheckpointPath) -> str:
        """The owner digest stamped into a checkpoint: its saver's (a published one may be another
        tenant's; the service checked the reader may read it)."""
        row = self.store.get_checkpoint(path.run_id, path.kind, path.name)
        if row is None:
            raise UserError(f"checkpoint {path} not found")
        return owner_digest(row.tenant)

    # --- residency
    def park(self, run: RunState) -> bool:
        """Save a resident run's whole state (gradients included) to disk and free its slot; False (logged,
        the run stays resident) if that failed."""
        slot = _slot_of(run)
        directory = self.layout.parked_dir(run.run_id)
        try:
            with self.progress.track("park run", run.tenant, run.run_id, writes=directory):
                self.engine.save_state(slot, directory, owner_digest(run.tenant), with_gradients=True)
            self.engine.free_slot(slot)
        except Exception:
            log.exception("could not park run %s; it stays resident", run.run_id)
            return False
        with self.cond:
            run.slot, run.status, run.parked_dir = None, PARKED, directory
            run.waiting_since = time.monotonic() if run.queue.ready() else None
        self._record_status(run)
        log.info("parked run %s to %s", run.run_id, directory)
        return True

    def admit(self, run: RunState) -> None:
        """Give a waiting run a slot: create its adapter (its first command) or bring it back from disk. No
        free slot (a park before it failed): it keeps waiting. A failure of the run's own making fails its
        request; a parked state that cannot be read loses the run, failing what it had queued."""
        try:
            if run.status == PARKED:
                self._unpark(run)
            else:
                self._create(run)
        except CapacityError:
            log.warning("no free slot for run %s; it keeps waiting", run.run_id)
            return
        with self.cond:
            run.waiting_since = None

    def _create(self, run: RunState) -> None:
        with self.cond:
            (entry,) = run.queue.ready()[:1]
        cmd = entry.command
        try:
            if isinstance(cmd, CreateRun):
                run.slot = self.engine.create_slot(cmd.lora_config)
                run.lora_config = cmd.lora_config
                result: dict[str, object] = {"model_id": run.run_id, "type": "create_model"}
            elif isinstance(cmd, CreateRunFromCheckpoint):
                source = self.layout.checkpoint_dir(cmd.source)
                with self.progress.track("load checkpoint", run.tenant, str(cmd.source), reads=source):
                    run.slot, run.lora_config = self.engine.load_state(
                        source, self.source_owner(cmd.source), cmd.with_optimizer
                    )
                result = {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}
            else:
                raise ServerError(f"run {run.run_id} has no slot and starts with {type(cmd).__name__}")
            self._record_run(run)
        except CapacityError:
            raise
        except Exception as exc:
            if run.slot is not None:
                self.engine.free_slot(run.slot)
                run.slot = None
            with self.cond:
                run.queue.pop(1)
                later = run.queue.abandon_all()
                self.runs.pop(run.run_id, None)
            after = UserError(f"training run {run.run_id} was not created: {exc}")
            self.futures.finish({entry.future_id: exc} | {e.future_id: after for e in later})
            return
        with self.cond:
            run.queue.pop(1)
        self.futures.complete(entry.future_id, result)

    def _unpark(self, run: RunState) -> None:
        assert run.parked_dir is not None
        directory = run.parked_dir
        try:
            with self.progress.track("load parked run", run.tenant, run.run_id, reads=directory):
                run.slot, _ = self.engine.load_state(directory, owner_digest(run.tenant), True)
        except CapacityError:
            raise
        except Exception as exc:
            log.exception("could not bring back parked run %s; it is lost", run.run_id)
            self.lose(run, exc)
            return
        with self.cond:
            run.status, run.parked_dir = LIVE, None
        self._record_status(run)
        shutil.rmtree(directory, ignore_errors=True)
        log.info("resumed parked run %s", run.run_id)

    def lose(self, run: RunState, cause: Exception) -> None:
        """Mark a run lost and fail every command it has queued."""
        with self.cond:
            run.status = LOST
            dropped = run.queue.abandon_all()
        self._record_status(run)
        log.error("run %s is lost: %r", run.run_id, cause)
        error = ServerError(
            f"training run {run.run_id} could not be restored from disk (the server log says why)"
        )
        self.futures.finish({entry.future_id: error for entry in dropped})

    def _record_status(self, run: RunState) -> None:
        try:
            self.store.update_run(run.run_id, status=run.status)
        except Exception:  # the in-memory state is the truth; a restart re-derives status from the data dir
            log.exception("could not record run %s as %s", run.run_id, run.status)

    def _record_run(self, run: RunState) -> None:
        assert run.lora_config is not None
        now = utcnow()
        self.store.add_run(
            RunRow(
                id=run.run_id,
                session_id=run.session_id,
                tenant=run.tenant,
                base_model=run.base_model,
                lora_config=vars(run.lora_config),
                user_metadata=run.user_metadata,
                status=LIVE,
                created_at=now,
                last_request_at=now,
            )
        )


# What saving each kind of checkpoint is called where work in progress is shown (progress.py).
_SAVE_KINDS = {
    "weights": "save checkpoint",
    "sampler_weights": "save sampler weights",
    "external_weights": "export weights",
}


def _slot_of(run: RunState) -> int:
    """The run's slot; ServerError (a scheduling bug, never a silent base-model pass) if it has none."""
    if run.slot is None:
        raise ServerError(f"training run {run.run_id} reached the engine without its adapter slot")
    return run.slot
