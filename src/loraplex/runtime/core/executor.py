"""Executing a plan on the engine: passes, fused steps, barriers, residency moves and the sampler's work.

Called by the engine loop on its one thread. Each engine call's outcome goes to the journal as one
`Record` (journal.py), which another thread makes durable; the executor never waits for the database
except where the ordering rule says so:
- before a call that may change a slot it settles the last record it may have to take back (`settle`): a
  pass whose outcomes could not be written is undone (`Engine.undo_last`), a created run's slot freed;
- an optimizer step is prepared (its metrics known, nothing changed), its record written, and only then
  are its kernels applied, or the step aborted if the record could not be written.
Every method either hands on the outcomes of the commands it ran or their errors, so no future is left
pending by a failure here. Run state the control plane also reads (queues, status) changes under the
shared lock; slot ids and gradient flags are the loop's alone. No SQL, no tensors.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from loraplex.engine.interface import Engine
from loraplex.engine.types import PassRequest, PassResult, SampleResult
from loraplex.errors import CapacityError, ServerError, UserError
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
from loraplex.runtime.core.disk_space import DiskSpace, tree_bytes
from loraplex.runtime.core.duty import DURABLE, DutyMeter
from loraplex.runtime.core.encrypted_exports import parse_recipients, write_encrypted
from loraplex.runtime.core.journal import (
    FORWARD,
    FORWARD_BACKWARD,
    OPTIM_STEP,
    SAMPLE,
    CheckpointSaved,
    Journal,
    MetricsRecorded,
    Outcome,
    Receipt,
    Record,
    RunCreated,
    RunStatusChanged,
    SamplerCreated,
)
from loraplex.runtime.core.run_queue import LIVE, LOST, PARKED, Entry, RunState
from loraplex.runtime.core.sample_history import SnapshotRuns, SnapshotWeights, sample_metrics
from loraplex.runtime.core.sampler_backend import SamplerBackend
from loraplex.runtime.core.sampling import SampleCancelledError, SampleJob, SampleProgress
from loraplex.runtime.core.scheduler import OptimWork, PassWork, Work, work_items
from loraplex.runtime.core.state import SharedState
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
    """Runs plan items on the engine and hands their outcomes to the journal."""

    def __init__(
        self,
        engine: Engine,
        journal: Journal,
        layout: DiskLayout,
        state: SharedState,
        meter: DutyMeter,
        telemetry: Telemetry,
        progress: ProgressBoard,
        max_prefill_tokens: int,
        host_slots: int,
        disk: DiskSpace,
        sampler: SamplerBackend,
    ) -> None:
        self.engine, self.journal, self.layout, self.state = engine, journal, layout, state
        self.sampler = sampler  # where sampling requests are decoded (--sampler)
        self.meter, self.telemetry, self.progress = meter, telemetry, progress
        self.max_prefill_tokens = max_prefill_tokens
        self.host_slots = host_slots  # runs the host tier holds at most (--host-slots)
        self._on_host: set[str] = set()  # ids of the runs it holds
        self._streams: dict[str, Callable[[SampleProgress], None]] = {}  # streaming samples: future -> sink
        self.disk = disk
        # Bytes each run's last write of each kind took: what its next one is expected to need.
        self._write_sizes: dict[tuple[str, str], int] = {}
        # The last record whose call the engine may have to take back, and how.
        self._open: tuple[Receipt, Callable[[], None]] | None = None
        self._snapshot_runs = SnapshotRuns()  # whose history a request sampling a snapshot goes to

    # --- the journal
    def hand_over(self, record: Record, undo: Callable[[], None] | None = None) -> None:
        """Queue a record; with `undo`, keep it open until the next `settle` (one at most: callers settle
        before every call that could open another)."""
        if not record:
            return
        receipt = self.journal.append(record)
        if undo is not None:
            assert self._open is None, "a record was opened before the previous one was settled"
            self._open = (receipt, undo)

    def settle(self, block: bool = True) -> None:
        """Learn whether the open record was written, and take its call back if it was not. Called before
        every call that may change a slot (blocking), and by the loop each cycle (not blocking), so a
        failed write is undone at once even when nothing else comes."""
        if self._open is None:
            return
        receipt, undo = self._open
        if not block and not receipt.is_settled:
            return
        self._open = None
        with self.meter.state(DURABLE):
            durable = receipt.wait()
        if not durable:
            undo()

    # --- work
    def execute(self, work: Work) -> None:
        """One work item; an unexpected failure fails its requests (as server errors), never the loop."""
        try:
            if isinstance(work, PassWork):
                self._run_pass(work.items)
            elif isinstance(work, OptimWork):
                self._run_optim(work.items)
            else:
                self._run_barrier(work.run, work.entry)
        except Exception as exc:
            log.exception("engine work failed: %s of %d requests", type(work).__name__, len(work_items(work)))
            # Requests that already have an outcome keep it: the writer records only a future's first.
            self.hand_over(Record({entry.future_id: exc for _, entry in work_items(work)}))

    def _run_pass(self, items: list[tuple[RunState, Entry]]) -> None:
        self.settle()
        items = self._with_slots(items)
        if not items:
            return
        requests = []
        for run, entry in items:
            cmd = entry.command
            assert isinstance(cmd, ForwardBackward)
            requests.append(
                PassRequest(run.slot, cmd.loss_fn, cmd.loss_fn_config, cmd.datums, cmd.forward_only)
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
        record = Record(is_undone_if_unwritten=True)
        had_gradients = [(run, run.pending_gradients) for run, _ in items]
        for (run, entry), result in zip(items, results, strict=True):
            record.outcomes[entry.future_id] = result
            cmd = entry.command
            if isinstance(result, PassResult) and isinstance(cmd, ForwardBackward):
                record.facts.append(_pass_metrics(run, entry, result))
                if not cmd.forward_only:
                    run.pending_gradients = True
                    self.telemetry.health.record_training(cmd.loss_fn, result.health)

        def undo() -> None:
            self.engine.undo_last()
            for run, pending in had_gradients:
                run.pending_gradients = pending
            log.warning("took back a pass of %d requests whose outcomes could not be recorded", len(items))

        self.hand_over(record, undo)

    def _with_slots(self, items: list[tuple[RunState, Entry]]) -> list[tuple[RunState, Entry]]:
        """The items whose runs hold their slot. A run loses it between planning and execution only when the
        write of its creation failed and the creation was taken back: its requests fail with a server
        error, never run on the base model."""
        kept = [(run, entry) for run, entry in items if run.slot is not None]
        if dropped := [entry for run, entry in items if run.slot is None]:
            error = ServerError("this training run was not created (its creation could not be recorded)")
            self.hand_over(Record(dict.fromkeys((entry.future_id for entry in dropped), error)))
        return kept

    def _run_optim(self, items: list[tuple[RunState, Entry]]) -> None:
        self.settle()
        items = self._with_slots(items)
        if not items:
            return
        steps = {run.slot: entry.command.params for run, entry in items}  # type: ignore[union-attr]
        start = time.perf_counter()
        prepared = self.engine.prepare_step(steps)  # type: ignore[arg-type]
        prepare_s = time.perf_counter() - start
        record = Record(is_undone_if_unwritten=True, is_held_until_applied=True)
        for run, entry in items:
            metrics = prepared.metrics[run.slot]  # type: ignore[index]
            # A skipped step's grad_norm is NaN or inf, which JSON cannot carry and the SDK's float metrics
            # refuse: it is left out; skipped_nonfinite says why.
            finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
            record.outcomes[entry.future_id] = {"metrics": finite}
            record.facts.append(
                MetricsRecorded(run.run_id, entry.seq_id, run.optim_steps + 1, OPTIM_STEP, metrics)
            )
        receipt = self.journal.append(record)
        with self.meter.state(DURABLE):
            durable = receipt.wait()
        if not durable:
            self.engine.abort_step(prepared)
            log.warning("aborted a step of %d runs whose outcomes could not be recorded", len(items))
            return
        start = time.perf_counter()
        try:
            self.engine.apply_step(prepared)
        except Exception as exc:  # its outcome is recorded, but the slots are not usable any more
            log.exception("an optimizer step failed after it was recorded; its runs are lost")
            for run, _ in items:
                self.lose(run, exc, f"training run {run.run_id} lost its state in a failed optimizer step")
                self._free_lost_slot(run)
            receipt.publish()
            return
        self.telemetry.record_optim_step(len(steps), prepare_s + time.perf_counter() - start)
        for run, _ in items:
            run.pending_gradients = False
            run.optim_steps += 1
        receipt.publish()  # its waiters wake now that the kernels ran

    def _run_barrier(self, run: RunState, entry: Entry) -> None:
        self.settle()
        try:
            record = self._barrier(run, entry)
        except UserError as exc:
            record = Record({entry.future_id: exc})
        self.hand_over(record)

    def _barrier(self, run: RunState, entry: Entry) -> Record:
        cmd, future_id = entry.command, entry.future_id
        slot = _slot_of(run)
        if isinstance(cmd, LoadState):
            source = self.layout.checkpoint_dir(cmd.source)
            with self.progress.track("load checkpoint", run.tenant, str(cmd.source), reads=source):
                self.engine.load_state(source, cmd.source_owner, cmd.with_optimizer, slot=slot)
            run.pending_gradients = False
            return Record(
                {future_id: {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}}
            )
        if isinstance(cmd, SaveState):
            path = CheckpointPath(run.run_id, "weights", cmd.name)
            owner = owner_digest(run.tenant)
            return self._save(run, path, cmd, future_id, lambda d: self.engine.save_state(slot, d, owner))
        if isinstance(cmd, SaveExternal | SaveSnapshot) and cmd.name is not None:
            kind = "external_weights" if isinstance(cmd, SaveExternal) else "sampler_weights"
            path = CheckpointPath(run.run_id, kind, cmd.name)
            record = self._save(run, path, cmd, future_id, self._snapshot_writer(slot, cmd))
            self._note_snapshot(self.layout.checkpoint_dir(path), run)
            if isinstance(cmd, SaveSnapshot):
                self.sampler.offer_snapshot(self.layout.checkpoint_dir(path))
            return record
        if isinstance(cmd, SaveSnapshot) and cmd.sampler_id is not None:
            directory = self.layout.snapshot_dir(cmd.sampler_id)
            if directory.exists():  # the control plane checked the sampler id; this catches a copy in flight
                raise UserError(f"sampling session {cmd.sampler_id} already exists")
            with self.progress.track("save sampler snapshot", run.tenant, cmd.sampler_id, writes=directory):
                self._write(
                    run,
                    "snapshot",
                    "save a sampler snapshot",
                    lambda: self.engine.save_snapshot(slot, directory),
                )
            sampler = SamplerCreated(cmd.sampler_id, run.session_id, run.tenant, run.base_model, directory)
            self._note_snapshot(directory, run)
            self.sampler.offer_snapshot(directory)
            result = {"sampling_session_id": cmd.sampler_id, "type": "save_weights_for_sampler"}
            return Record({future_id: result}, [sampler], written=directory)
        raise ServerError(f"no executor for command {type(cmd).__name__}")

    def _note_snapshot(self, directory: Path, run: RunState) -> None:
        """`directory` holds the run's weights as of now: requests sampling it go to its history."""
        self._snapshot_runs.note(directory, SnapshotWeights(run.run_id, run.tenant, run.optim_steps))

    def _save(
        self,
        run: RunState,
        path: CheckpointPath,
        cmd: SaveState | SaveSnapshot | SaveExternal,
        future_id: str,
        write: Callable[[Path], int],
    ) -> Record:
        """Write a named checkpoint's files; its row goes in the record. The control plane refused a name
        already saved when the request came; a directory present now is a copy saved since (only this
        thread writes checkpoints), refused unless the request overwrites."""
        directory = self.layout.checkpoint_dir(path)
        existed = directory.exists()
        if existed and not getattr(cmd, "overwrite", False):
            raise UserError(
                f"checkpoint {path} already exists; pick another name or save with overwrite=True"
            )
        with self.progress.track(_SAVE_KINDS[path.kind], run.tenant, str(path), writes=directory):
            size = self._write(run, path.kind, f"save checkpoint {path}", lambda: write(directory))
        saved = CheckpointSaved(path, run.tenant, size, cmd.ttl_seconds, cmd.user_metadata)
        result: dict[str, object] = {"path": str(path), "type": _RESULT_TYPES[path.kind]}
        if path.kind == "external_weights":
            result["size_bytes"] = size
        return Record({future_id: result}, [saved], written=None if existed else directory)

    def _snapshot_writer(self, slot: int, cmd: SaveSnapshot | SaveExternal) -> Callable[[Path], int]:
        """How a named snapshot reaches its directory: written by the engine, or, for an export encrypted to
        age recipients, serialised in memory and only its ciphertext written (the plaintext never touches
        the disk)."""
        if isinstance(cmd, SaveExternal) and cmd.age_recipients:
            # Checked when the request came (api/tinker/wire.py); a UserError here would still come before
            # anything is written.
            recipients = parse_recipients(cmd.age_recipients)
            return lambda d: write_encrypted(d, self.engine.snapshot_files(slot), recipients)
        return lambda d: self.engine.save_snapshot(slot, d)

    def _write(self, run: RunState, kind: str, what: str, write: Callable[[], int]) -> int:
        """`write` (returning the bytes it wrote), refused before it starts if the run's last write of this
        kind would not fit above the data dir's reserve; running out of space during it is the same user
        error, its partial files already removed."""
        with self.disk.writing(what, self._write_sizes.get((run.run_id, kind), 0)):
            size = write()
        self._write_sizes[run.run_id, kind] = size
        return size

    # --- residency: a run's state leaves its slot for the host tier while it has room, else for disk
    def park(self, run: RunState, to_disk: bool = False) -> bool:
        """Free a resident run's slot, its whole state (gradients included) kept exactly: in host memory
        while the host tier has room and `to_disk` is not asked, else saved to disk; False (logged, the run
        stays resident) if that failed."""
        self.settle()
        slot = _slot_of(run)
        if not to_disk and len(self._on_host) < self.host_slots:
            try:
                key = self.engine.offload_slot(slot)
            except Exception:
                log.exception("could not move run %s to host memory; it stays resident", run.run_id)
                return False
            self._on_host.add(run.run_id)
            self.telemetry.record_park("host")
            with self.state.cond:
                run.slot, run.host_key = None, key
                run.waiting_since = time.monotonic() if run.queue.ready() else None
            log.debug("moved run %s to host memory", run.run_id)
            return True
        directory = self.layout.parked_dir(run.run_id)
        try:
            with self.progress.track("park run", run.tenant, run.run_id, writes=directory):
                owner = owner_digest(run.tenant)
                save = functools.partial(self.engine.save_state, slot, directory, owner, with_gradients=True)
                self._write(run, "parked", f"park run {run.run_id}", save)
            self.engine.free_slot(slot)
        except Exception:
            log.exception("could not park run %s; it stays resident", run.run_id)
            return False
        self._parked(run, directory)
        return True

    def spill(self, run: RunState) -> bool:
        """Park a run of the host tier to disk (its session ended, or the server stops), in the format of
        `park`; False (logged, the run stays in host memory) if that failed."""
        self.settle()
        assert run.host_key is not None
        directory = self.layout.parked_dir(run.run_id)
        try:
            with self.progress.track("park run", run.tenant, run.run_id, writes=directory):
                owner = owner_digest(run.tenant)
                spill = functools.partial(self.engine.spill_offloaded, run.host_key, directory, owner)
                self._write(run, "parked", f"park run {run.run_id}", spill)
        except Exception:
            log.exception("could not park run %s from host memory; it stays there", run.run_id)
            return False
        self._on_host.discard(run.run_id)
        self._parked(run, directory)
        return True

    def _parked(self, run: RunState, directory: Path) -> None:
        """The run's state is on disk in `directory` now, and nowhere else (one change under the lock, so
        the control plane never sees a run held nowhere that is not parked either)."""
        self.telemetry.record_park("disk")
        with self.state.cond:
            run.slot, run.host_key, run.status, run.parked_dir = None, None, PARKED, directory
            run.waiting_since = time.monotonic() if run.queue.ready() else None
        self.hand_over(Record(facts=[RunStatusChanged(run.run_id, PARKED)]))
        log.info("parked run %s to %s", run.run_id, directory)

    def admit(self, run: RunState) -> None:
        """Give a waiting run a slot: create its adapter (its first command) or bring it back from host
        memory or disk. No free slot (a park before it failed): it keeps waiting. A failure of the run's own
        making fails its request; a state that cannot be brought back loses the run, failing what it had
        queued."""
        self.settle()
        try:
            if run.host_key is not None:
                self._restore(run)
            elif run.status == PARKED:
                self._unpark(run)
            else:
                self._create(run)
        except CapacityError:
            log.warning("no free slot for run %s; it keeps waiting", run.run_id)
            return
        with self.state.cond:
            run.waiting_since = None

    def _create(self, run: RunState) -> None:
        with self.state.cond:
            (entry,) = run.queue.ready()[:1]
        cmd = entry.command
        try:
            if isinstance(cmd, CreateRun):
                slot, config = self.engine.create_slot(cmd.lora_config), cmd.lora_config
                result: dict[str, object] = {"model_id": run.run_id, "type": "create_model"}
            elif isinstance(cmd, CreateRunFromCheckpoint):
                source = self.layout.checkpoint_dir(cmd.source)
                with self.progress.track("load checkpoint", run.tenant, str(cmd.source), reads=source):
                    slot, config = self.engine.load_state(source, cmd.source_owner, cmd.with_optimizer)
                result = {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}
            else:
                raise ServerError(f"run {run.run_id} has no slot and starts with {type(cmd).__name__}")
        except CapacityError:
            raise
        except Exception as exc:
            self._forget(run, {entry.future_id: exc}, f"training run {run.run_id} was not created: {exc}")
            return
        with self.state.cond:
            run.slot, run.lora_config = slot, config
            run.queue.pop(1)
        created = RunCreated(
            run.run_id, run.session_id, run.tenant, run.base_model, config, run.user_metadata
        )

        def undo() -> None:
            self.engine.free_slot(slot)
            with self.state.cond:
                run.slot = None
            self._forget(run, {}, f"training run {run.run_id} was not created (it could not be recorded)")

        self.hand_over(Record({entry.future_id: result}, [created], is_undone_if_unwritten=True), undo)

    def _forget(self, run: RunState, outcomes: dict[str, Outcome], why: str) -> None:
        """Drop a run that was never created, failing what it had queued after its creation with `why`."""
        with self.state.cond:
            if outcomes:
                run.queue.pop(1)
            later = run.queue.abandon_all()
            self.state.runs.pop(run.run_id, None)
            self.state.active.pop(run.run_id, None)
        after = UserError(why)
        self.hand_over(Record(outcomes | {e.future_id: after for e in later}))

    def _restore(self, run: RunState) -> None:
        assert run.host_key is not None
        try:
            slot = self.engine.restore_slot(run.host_key)
        except CapacityError:
            raise
        except Exception as exc:
            log.exception("could not bring back run %s from host memory; it is lost", run.run_id)
            self._on_host.discard(run.run_id)
            with self.state.cond:
                run.host_key = None
            self.lose(run, exc, f"training run {run.run_id} could not be restored (the server log says why)")
            return
        self._on_host.discard(run.run_id)
        with self.state.cond:
            run.slot, run.host_key = slot, None
        log.debug("brought back run %s from host memory", run.run_id)

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
            why = f"training run {run.run_id} could not be restored from disk (the server log says why)"
            self.lose(run, exc, why)
            return
        with self.state.cond:
            run.status, run.parked_dir = LIVE, None
        self.hand_over(Record(facts=[RunStatusChanged(run.run_id, LIVE)], obsolete=[directory]))
        log.info("resumed parked run %s", run.run_id)

    def lose(self, run: RunState, cause: Exception, why: str) -> None:
        """Mark a run lost and fail every command it has queued with `why`."""
        with self.state.cond:
            run.status = LOST
            dropped = run.queue.abandon_all()
        log.error("run %s is lost: %r", run.run_id, cause)
        error = ServerError(why)
        outcomes: dict[str, Outcome] = {entry.future_id: error for entry in dropped}
        self.hand_over(Record(outcomes, [RunStatusChanged(run.run_id, LOST)]))

    def _free_lost_slot(self, run: RunState) -> None:
        """Give back the slot of a run whose state was lost (the engine frees even a poisoned slot)."""
        if run.slot is None:
            return
        try:
            self.engine.free_slot(run.slot)
        except Exception:
            log.exception("could not free the slot of lost run %s", run.run_id)
            return
        with self.state.cond:
            run.slot = None

    # --- sampling (reads immutable snapshots: changes no slot, so nothing to settle)
    def admit_sample(self, job: SampleJob) -> None:
        """Hand one request to the engine, exporting its training checkpoint first if it needs one."""
        try:
            snapshot = job.request.snapshot
            if job.export_from is not None and snapshot is not None and not snapshot.exists():
                source = self.layout.checkpoint_dir(job.export_from)
                # The export holds the checkpoint's weights: less than the whole checkpoint, a safe bound.
                with (
                    self.disk.writing(f"export {job.export_from} for sampling", tree_bytes(source)),
                    self.progress.track(
                        "export for sampler", job.tenant, str(job.export_from), reads=source, writes=snapshot
                    ),
                ):
                    self.engine.export_snapshot(source, snapshot, job.export_owner)
            self.sampler.add_sample(job.future_id, job.request)
            if job.on_progress is not None:
                self._streams[job.future_id] = job.on_progress
        except Exception as exc:
            self._finish_samples({job.future_id: exc})

    def cancel_samples(self, reasons: dict[str, str]) -> None:
        """Drop cancelled requests from the engine (those it holds; others never reached it) and fail their
        futures, each with why it was cancelled."""
        for future_id in reasons:
            self.sampler.cancel_sample(future_id)
        self._finish_samples({future_id: SampleCancelledError(why) for future_id, why in reasons.items()})

    def step_sampler(self) -> None:
        """One sampler step; the requests it finished go to the journal."""
        start = time.perf_counter()
        try:
            finished = self.sampler.step_sampler(self.max_prefill_tokens)
        except Exception as exc:  # the engine dropped every request it held: fail them all
            log.exception("sampler step failed")
            with self.state.cond:
                dropped = self.state.samples.active_ids()
            self._finish_samples(dict.fromkeys(dropped, exc))
            return
        elapsed_s = time.perf_counter() - start
        self._finish_samples(dict(finished))
        for future_id, progress in self.sampler.take_sample_progress().items():
            if (on_progress := self._streams.get(future_id)) is not None:  # None: cancelled meanwhile
                on_progress(progress)
        self.telemetry.record_sampler_step(elapsed_s, self.engine.usage())

    def _finish_samples(self, outcomes: dict[str, Outcome]) -> None:
        with self.state.cond:
            jobs = [self.state.samples.finish(future_id) for future_id in outcomes]
            for future_id in outcomes:
                self._streams.pop(future_id, None)
        record = Record(outcomes)
        # One history row per snapshot for the requests that finished together (usually one request).
        finished: dict[SnapshotWeights | None, list[tuple[int, SampleResult]]] = {}
        for job in jobs:
            result = outcomes[job.future_id]
            if isinstance(result, SampleResult):
                weights = self._snapshot_runs.get(job.request.snapshot, job.tenant)
                finished.setdefault(weights, []).append((job.seq_id, result))
        for weights, done in finished.items():
            metrics = sample_metrics([result for _, result in done])
            self.telemetry.health.record_samples(metrics)
            if weights is not None:
                first = min(seq_id for seq_id, _ in done)
                record.facts.append(MetricsRecorded(weights.run_id, first, weights.step, SAMPLE, metrics))
        self.hand_over(record)


def _pass_metrics(run: RunState, entry: Entry, result: PassResult) -> MetricsRecorded:
    """A forward_backward's metrics belong to the step it feeds; a forward's to the steps taken. The history
    keeps the client's metrics and the server's health statistics of the request together."""
    assert isinstance(entry.command, ForwardBackward)
    metrics = {**result.metrics, **result.health}
    if entry.command.forward_only:
        return MetricsRecorded(run.run_id, entry.seq_id, run.optim_steps, FORWARD, metrics)
    return MetricsRecorded(run.run_id, entry.seq_id, run.optim_steps + 1, FORWARD_BACKWARD, metrics)


# What saving each kind of checkpoint is called where work in progress is shown (progress.py), and the
# `type` of its result.
_SAVE_KINDS = {
    "weights": "save checkpoint",
    "sampler_weights": "save sampler weights",
    "external_weights": "export weights",
}
_RESULT_TYPES = {
    "weights": "save_weights",
    "sampler_weights": "save_weights_for_sampler",
    "external_weights": "save_weights_external",
}


def _slot_of(run: RunState) -> int:
    """The run's slot; ServerError (a scheduling bug, never a silent base-model pass) if it has none."""
    if run.slot is None:
        raise ServerError(f"training run {run.run_id} reached the engine without its adapter slot")
    return run.slot
