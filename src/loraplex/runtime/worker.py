"""The engine worker: the one thread that calls the Engine, executing the scheduler's plans and sampling.

Each cycle runs one training plan (at most one packed pass and one fused step), hands newly queued
sampling requests to the engine and runs one sampler step, so decoding and training interleave and
neither starves; sampling reads immutable snapshots, so it never waits for a training barrier.
It also parks runs whose session lease expired (state to disk, slot freed) and brings parked runs
back before their next command. Every engine call happens here, never on the event loop.
No tensors: it moves numpy-level dataclasses between commands and the Engine interface.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from loraplex.engine.interface import Engine
from loraplex.engine.types import PassRequest
from loraplex.errors import CapacityError, ServerError, UserError
from loraplex.runtime.checkpoints import CheckpointPath, DiskLayout, owner_digest
from loraplex.runtime.commands import (
    CreateRun,
    CreateRunFromCheckpoint,
    LoadState,
    Pass,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.futures import FutureTable
from loraplex.runtime.run_queue import LIVE, LOST, PARKED, Entry, RunState
from loraplex.runtime.sampling import SampleJob, SampleQueue, SampleResult
from loraplex.runtime.scheduler import BarrierWork, OptimWork, PassWork, Scheduler, Work
from loraplex.runtime.sessions import SessionTable
from loraplex.runtime.store import Store, utcnow
from loraplex.runtime.store.schema import CheckpointRow, RunRow, SamplerRow

log = logging.getLogger(__name__)

_LEASE_CHECK_S = 1.0


def lost_run_error(run_id: str) -> ServerError:
    """The error for any command on a run whose live state a restart destroyed."""
    return ServerError(
        f"training run {run_id} lost its live state when the server restarted; resume it from a checkpoint "
        "with ServiceClient.create_training_client_from_state_with_optimizer(tinker_path)"
    )


class EngineWorker:
    """Runs plans on the engine; shares `runs` with the service under `cond`'s lock."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        futures: FutureTable,
        sessions: SessionTable,
        layout: DiskLayout,
        scheduler: Scheduler,
        runs: dict[str, RunState],
        samples: SampleQueue,
        max_prefill_tokens: int,
        cond: threading.Condition,
    ) -> None:
        self.engine, self.store, self.futures, self.sessions = engine, store, futures, sessions
        self.layout, self.scheduler, self.runs, self.cond = layout, scheduler, runs, cond
        self.samples, self.max_prefill_tokens = samples, max_prefill_tokens
        self._stopping = False
        self._thread: threading.Thread | None = None

    def run(self, keep_running: Callable[[], bool] = lambda: True) -> None:
        """Run the loop on the calling thread until stopped, or until `keep_running()` turns false.

        `loraplex serve` runs it on the process's main thread: the same pass measured 25-35% slower
        on a second thread than on the main one (torch 2.13 CPU, libgomp; ~330 vs ~250 ms for 8 x 32
        tokens on the bench model), with its elementwise and batched-matmul kernels 2-3x slower;
        bench/second_thread.py reproduces it in plain torch.
        """
        next_lease_check = 0.0
        while True:
            with self.cond:
                if self._stopping or not keep_running():
                    return
                now = time.monotonic()
                plan = self.scheduler.plan(list(self.runs.values()), now)
                arrivals = self.samples.take_waiting()
                if not plan and not arrivals and not self.engine.has_sampling_work():
                    wake_at = self.scheduler.wake_at
                    self.cond.wait(timeout=_LEASE_CHECK_S if wake_at is None else max(0.0, wake_at - now))
            for work in plan:
                self._execute(work)
            for job in arrivals:
                self._admit(job)
            if self.engine.has_sampling_work():
                self._step_sampler()
            if time.monotonic() >= next_lease_check:
                next_lease_check = time.monotonic() + _LEASE_CHECK_S
                self._park_expired()

    def start(self) -> None:
        """Run the loop on a thread of its own (tests, and apps that own their main thread)."""
        self._thread = threading.Thread(target=self.run, name="loraplex-engine", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after its current plan; takes no lock, so a signal handler may call it
        (the loop sees it within a second)."""
        self._stopping = True

    def stop(self) -> None:
        """Finish the current plan, then stop (and wait for the worker thread, if it has one)."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _execute(self, work: Work) -> None:
        try:
            if isinstance(work, PassWork):
                self._run_pass(work.items)
            elif isinstance(work, OptimWork):
                self._run_optim(work.items)
            else:
                self._run_barrier(work.run, work.entry)
        except Exception as exc:  # a bug must fail its requests, never the worker thread
            log.exception("engine work failed")
            for _, entry in _items(work):
                self.futures.fail_if_pending(entry.future_id, exc)

    # --- work kinds
    def _run_pass(self, items: list[tuple[RunState, Entry]]) -> None:
        items = self._with_slots(items)
        requests = []
        for run, entry in items:
            cmd = entry.command
            assert isinstance(cmd, Pass)
            requests.append(
                PassRequest(run.slot, cmd.loss_fn, cmd.loss_fn_config, cmd.datums, cmd.forward_only)
            )
        results = self.engine.run_pass(requests) if requests else []
        self.futures.finish(
            {entry.future_id: result for (_, entry), result in zip(items, results, strict=True)}
        )

    def _run_optim(self, items: list[tuple[RunState, Entry]]) -> None:
        items = self._with_slots(items)
        steps = {run.slot: entry.command.params for run, entry in items}  # type: ignore[union-attr]
        metrics = self.engine.optim_step(steps) if steps else {}  # type: ignore[arg-type]
        self.futures.finish({entry.future_id: {"metrics": metrics.get(run.slot, {})} for run, entry in items})  # type: ignore[arg-type]

    def _run_barrier(self, run: RunState, entry: Entry) -> None:
        cmd = entry.command
        if not isinstance(cmd, CreateRun | CreateRunFromCheckpoint) and not self._with_slots([(run, entry)]):
            return
        try:
            result = self._barrier_result(run, cmd)
        except Exception as exc:
            if isinstance(cmd, CreateRun | CreateRunFromCheckpoint):
                with self.cond:
                    self.runs.pop(run.run_id, None)
            self.futures.fail(entry.future_id, exc)
            return
        self.futures.complete(entry.future_id, result)

    def _barrier_result(self, run: RunState, cmd: object) -> dict[str, object]:
        owner = owner_digest(run.tenant)
        if isinstance(cmd, CreateRun):
            run.slot = self._with_capacity(lambda: self.engine.create_slot(cmd.lora_config))
            run.lora_config = cmd.lora_config
            self._record_run(run)
            return {"model_id": run.run_id, "type": "create_model"}
        if isinstance(cmd, CreateRunFromCheckpoint):
            source = self.layout.checkpoint_dir(cmd.source)
            run.slot, run.lora_config = self._with_capacity(
                lambda: self.engine.load_state(source, owner, cmd.with_optimizer)
            )
            self._record_run(run)
            return {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}
        if isinstance(cmd, LoadState):
            self.engine.load_state(
                self.layout.checkpoint_dir(cmd.source), owner, cmd.with_optimizer, slot=run.slot
            )
            return {"model_id": run.run_id, "path": str(cmd.source), "type": "load_weights"}
        if isinstance(cmd, SaveState):
            path = CheckpointPath(run.run_id, "weights", cmd.name)
            self._save_checkpoint(run, path, cmd, lambda d: self.engine.save_state(run.slot, d, owner))  # type: ignore[arg-type]
            return {"path": str(path), "type": "save_weights"}
        if isinstance(cmd, SaveSnapshot) and cmd.name is not None:
            path = CheckpointPath(run.run_id, "sampler_weights", cmd.name)
            self._save_checkpoint(run, path, cmd, lambda d: self.engine.save_snapshot(run.slot, d))  # type: ignore[arg-type]
            return {"path": str(path), "type": "save_weights_for_sampler"}
        if isinstance(cmd, SaveSnapshot) and cmd.sampler_id is not None:
            directory = self.layout.snapshot_dir(cmd.sampler_id)
            _write_replacing(directory, lambda d: self.engine.save_snapshot(run.slot, d))  # type: ignore[arg-type]
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

    # --- sampling
    def _admit(self, job: SampleJob) -> None:
        """Hand one request to the engine, exporting its training checkpoint first if it needs one."""
        try:
            snapshot = job.request.snapshot
            if job.export_from is not None and snapshot is not None and not snapshot.exists():
                self._export_snapshot(job.export_from, snapshot, job.tenant)
            self.engine.add_sample(job.future_id, job.request)
        except Exception as exc:
            self._finish_samples({job.future_id: exc})

    def _export_snapshot(self, source: CheckpointPath, target: Path, tenant: str) -> None:
        """A PEFT snapshot of a training checkpoint: load it into a spare slot, snapshot it, free the slot."""
        slot, _ = self._with_capacity(  # type: ignore[misc]
            lambda: self.engine.load_state(self.layout.checkpoint_dir(source), owner_digest(tenant), False)
        )
        try:
            _write_replacing(target, lambda d: self.engine.save_snapshot(slot, d))
        finally:
            self.engine.free_slot(slot)

    def _step_sampler(self) -> None:
        try:
            finished = self.engine.step_sampler(self.max_prefill_tokens)
        except Exception as exc:  # the engine dropped every request it held: fail them all
            log.exception("sampler step failed")
            with self.cond:
                dropped = self.samples.active_ids()
            self._finish_samples(dict.fromkeys(dropped, exc))
            return
        self._finish_samples(dict(finished))

    def _finish_samples(self, outcomes: dict[str, SampleResult | Exception]) -> None:
        with self.cond:
            for future_id in outcomes:
                self.samples.finish(future_id)
        self.futures.finish(outcomes)

    # --- checkpoints
    def _save_checkpoint(
        self, run: RunState, path: CheckpointPath, cmd: SaveState | SaveSnapshot, write: Callable[[Path], int]
    ) -> None:
        if not getattr(cmd, "overwrite", False) and self.store.get_checkpoint(
            run.run_id, path.kind, path.name
        ):
            raise UserError(
                f"checkpoint {path} already exists; pick another name or save with overwrite=True"
            )
        size = _write_replacing(self.layout.checkpoint_dir(path), write)
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

    # --- slots, parking, leases
    def _with_slots(self, items: list[tuple[RunState, Entry]]) -> list[tuple[RunState, Entry]]:
        """The items whose run has (or now got back) its slot; the others' futures fail."""
        ready = []
        for run, entry in items:
            try:
                if run.status == LOST:
                    raise lost_run_error(run.run_id)
                if run.status == PARKED:
                    self._unpark(run)
                ready.append((run, entry))
            except Exception as exc:
                self.futures.fail(entry.future_id, exc)
        return ready

    def _with_capacity(self, allocate: Callable[[], object]) -> object:
        """Allocate a slot; when all are taken, park an idle run (one of a lapsed session first)."""
        try:
            return allocate()
        except CapacityError:
            if not self._park_one_idle():
                raise
            return allocate()

    def _park_one_idle(self) -> bool:
        with self.cond:
            idle = [r for r in self.runs.values() if r.status == LIVE and r.has_slot() and r.queue.is_idle()]
        if not idle:
            return False
        idle.sort(key=lambda r: self.sessions.is_live(r.session_id))
        self._park(idle[0])
        return True

    def _park_expired(self) -> None:
        with self.cond:
            expired = [
                r
                for r in self.runs.values()
                if r.status == LIVE
                and r.has_slot()
                and r.queue.is_idle()
                and not self.sessions.is_live(r.session_id)
            ]
        for run in expired:
            try:
                self._park(run)
            except Exception:
                log.exception("could not park run %s; it stays resident", run.run_id)

    def _park(self, run: RunState) -> None:
        assert run.slot is not None
        directory = self.layout.parked_dir(run.run_id)
        _write_replacing(directory, lambda d: self.engine.save_state(run.slot, d, owner_digest(run.tenant)))  # type: ignore[arg-type]
        self.engine.free_slot(run.slot)
        run.slot, run.status, run.parked_dir = None, PARKED, directory
        self.store.update_run(run.run_id, status=PARKED)
        log.info(
            "parked run %s to %s (its session's lease lapsed or a slot was needed)", run.run_id, directory
        )

    def _unpark(self, run: RunState) -> None:
        assert run.parked_dir is not None
        directory = run.parked_dir
        run.slot, _ = self._with_capacity(  # type: ignore[misc]
            lambda: self.engine.load_state(directory, owner_digest(run.tenant), True)
        )
        run.status, run.parked_dir = LIVE, None
        self.store.update_run(run.run_id, status=LIVE)
        shutil.rmtree(directory, ignore_errors=True)
        log.info("resumed parked run %s", run.run_id)


def _write_replacing(target: Path, write: Callable[[Path], int]) -> int:
    """Write into a staging directory beside `target`, then swap it in, so a crash never leaves half a dir."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging-{uuid.uuid4().hex[:8]}")
    size = write(staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return size


def _items(work: Work) -> list[tuple[RunState, Entry]]:
    return [(work.run, work.entry)] if isinstance(work, BarrierWork) else work.items
