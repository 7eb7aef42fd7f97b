"""The engine worker: the one thread that calls the Engine, cycle after cycle, and keeps going.

Each cycle takes one plan from the scheduler (residency moves, then at most one packed pass or one fused
step with the barriers), hands newly queued sampling requests to the engine and runs one sampler step, so
decoding and training interleave and neither starves; sampling reads immutable snapshots, so it never
waits for a training barrier. About once a second it also fails requests stuck behind a seq_id that will
never come and parks the runs of sessions whose lease lapsed; and every
`retention_sweep_s` it deletes what retention says is due (retention.py), sparing what queued or running
requests read.

Supervised: a failure anywhere in a cycle fails the requests it concerns (execution.py), is logged, and
the loop goes on after a short pause. Only an engine that reports it cannot go on (a dead data-parallel
rank) ends the process, through its own failure callback. No tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from loraplex.engine.interface import Engine
from loraplex.errors import UserError
from loraplex.os_threads import ENGINE, name_os_thread
from loraplex.runtime.control.futures import FutureTable
from loraplex.runtime.control.retention import Retention
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.control.store import utcnow
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.commands import CreateRunFromCheckpoint, LoadState
from loraplex.runtime.core.duty import HELD, IDLE, DutyMeter
from loraplex.runtime.core.executor import Executor
from loraplex.runtime.core.run_queue import LOST, RunState
from loraplex.runtime.core.sampling import SampleJob, SampleQueue, SampleResult
from loraplex.runtime.core.scheduler import Plan, Scheduler, work_items
from loraplex.runtime.observability.telemetry import Telemetry

log = logging.getLogger(__name__)

_LEASE_CHECK_S = 1.0
# Pause after a cycle that failed outside any request, or whose residency moves failed, so a persistent
# fault (a full disk, a database down) is retried without spinning.
_FAULT_PAUSE_S = 0.5


class EngineLoop:
    """Runs plans on the engine; shares `runs` and `active` with the service under `cond`'s lock."""

    def __init__(
        self,
        engine: Engine,
        executor: Executor,
        futures: FutureTable,
        sessions: SessionTable,
        layout: DiskLayout,
        scheduler: Scheduler,
        active: dict[str, RunState],
        samples: SampleQueue,
        retention: Retention,
        retention_sweep_s: float,
        seq_gap_timeout_s: float,
        max_prefill_tokens: int,
        cond: threading.Condition,
        telemetry: Telemetry | None = None,
        meter: DutyMeter | None = None,
    ) -> None:
        self.engine, self.executor, self.futures, self.sessions = engine, executor, futures, sessions
        self.layout, self.scheduler, self.active, self.cond = layout, scheduler, active, cond
        self.samples, self.max_prefill_tokens = samples, max_prefill_tokens
        self.retention, self.retention_sweep_s = retention, retention_sweep_s
        self.seq_gap_timeout_s = seq_gap_timeout_s
        self.telemetry = telemetry or Telemetry()
        self.meter = meter or DutyMeter(self.telemetry)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_lease_check = 0.0
        self._next_sweep = time.monotonic() + retention_sweep_s

    def run(self, keep_running: Callable[[], bool] = lambda: True) -> None:
        """Run the loop on the calling thread until stopped, or until `keep_running()` turns false.

        `loraplex serve` runs it on the process's main thread: the same pass measured 25-35% slower
        on a second thread than on the main one (torch 2.13 CPU, libgomp; ~330 vs ~250 ms for 8 x 32
        tokens on the bench model), with its elementwise and batched-matmul kernels 2-3x slower;
        bench/second_thread.py reproduces it in plain torch.
        """
        while True:
            with self.cond:
                if self._stopping or not keep_running():
                    return
                now = time.monotonic()
                plan = self.scheduler.plan(list(self.active.values()), now)
                arrivals = self.samples.take_waiting()
                if not plan and not arrivals and not self.engine.has_sampling_work():
                    wake_at = self.scheduler.wake_at
                    with self.meter.state(IDLE if wake_at is None else HELD):
                        self.cond.wait(timeout=_LEASE_CHECK_S if wake_at is None else max(0.0, wake_at - now))
            try:
                healthy = self._cycle(plan, arrivals)
            except Exception:
                log.exception("engine worker cycle failed; the worker goes on")
                healthy = False
            if not healthy:
                time.sleep(_FAULT_PAUSE_S)
            self.meter.end_cycle()

    def _cycle(self, plan: Plan, arrivals: list[SampleJob]) -> bool:
        """Carry out one plan and one sampler step; False if a residency move failed."""
        start = time.perf_counter()
        healthy = all([self.executor.park(run) for run in plan.parks])
        for run in plan.admits:
            self.executor.admit(run)
        for work in plan.work:
            self.executor.execute(work)
        planned = time.perf_counter()
        for job in arrivals:
            self._admit_sample(job)
        if self.engine.has_sampling_work():
            self._step_sampler()
        if log.isEnabledFor(logging.DEBUG) and (plan or arrivals):
            log.debug(
                "cycle: parked %d, admitted %d, work %s, %d new samples; plan %.1f ms, sampling %.1f ms",
                len(plan.parks),
                len(plan.admits),
                ", ".join(f"{type(w).__name__} of {len(work_items(w))}" for w in plan.work) or "none",
                len(arrivals),
                (planned - start) * 1000,
                (time.perf_counter() - planned) * 1000,
            )
        if time.monotonic() >= self._next_lease_check:
            self._next_lease_check = time.monotonic() + _LEASE_CHECK_S
            self._expire_leases()
            self.telemetry.record_usage(self.engine.usage())
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self.retention_sweep_s
            self._sweep()
        self.executor.history.flush_if_due()
        self._forget_quiet_runs()
        return healthy

    def start(self) -> None:
        """Run the loop on a thread of its own (tests, and apps that own their main thread)."""
        self._thread = threading.Thread(target=self._run_named, name="loraplex-engine", daemon=True)
        self._thread.start()

    def _run_named(self) -> None:
        name_os_thread(ENGINE)
        self.run()

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

    # --- leases and the plan set
    def _expire_leases(self) -> None:
        """Fail requests stuck behind a seq_id gap that will never fill: their session's lease lapsed, or
        the gap is older than `seq_gap_timeout_s` (a request refused before its seq_id could be read, such
        as a body over the size limit). Then park the lapsed sessions' runs that have nothing left to do,
        like any idle run."""
        now = time.monotonic()
        with self.cond:
            lapsed = [r for r in self.active.values() if not self.sessions.is_live(r.session_id)]
            stale = [
                r
                for r in self.active.values()
                if r.queue.pending() and now - r.queue.pending()[0].arrived_at >= self.seq_gap_timeout_s
            ]
            stuck = {run.run_id: (run.queue.next_seq_id, run.queue.abandon_gap()) for run in lapsed + stale}
        for run_id, (missing, entries) in stuck.items():
            if entries:
                gap = UserError(
                    f"training run {run_id} never received seq_id {missing} (its session expired, or it was "
                    "refused before its seq_id could be read); this request waited behind it and is dropped"
                )
                self.futures.finish(dict.fromkeys((e.future_id for e in entries), gap))
        for run in lapsed:
            if run.slot is not None and run.queue.is_idle():
                self.executor.park(run)

    def park_all(self) -> None:
        """Park every resident run (gradients included), so a restart finds them on disk: called once the
        loop has stopped."""
        with self.cond:
            resident = [run for run in self.active.values() if run.slot is not None]
        for run in resident:
            self.executor.park(run)
        if resident:
            log.info("parked %d resident runs before stopping", len(resident))

    def _sweep(self) -> None:
        """Delete what retention says is due, except what a queued or running request reads."""
        with self.cond:
            in_use = frozenset(self._directories_in_use())
        self.retention.sweep(utcnow(), in_use)

    def _directories_in_use(self) -> Iterator[Path]:
        """Checkpoint and snapshot directories that queued commands or unfinished samples will read."""
        for run in self.active.values():
            for entry in run.queue.pending():
                if isinstance(entry.command, LoadState | CreateRunFromCheckpoint):
                    yield self.layout.checkpoint_dir(entry.command.source)
        for job in self.samples.jobs():
            if job.request.snapshot is not None:
                yield job.request.snapshot
            if job.export_from is not None:
                yield self.layout.checkpoint_dir(job.export_from)

    def _forget_quiet_runs(self) -> None:
        """Keep the per-cycle plan set to runs that hold a slot or have commands: idle parked and lost runs
        leave it, so thousands of old runs cost a plan nothing (the service adds a run back on its next
        request)."""
        with self.cond:
            quiet = [
                run_id
                for run_id, run in self.active.items()
                if (run.slot is None or run.status == LOST) and run.queue.is_idle()
            ]
            for run_id in quiet:
                del self.active[run_id]

    # --- sampling
    def _admit_sample(self, job: SampleJob) -> None:
        """Hand one request to the engine, exporting its training checkpoint first if it needs one."""
        try:
            snapshot = job.request.snapshot
            if job.export_from is not None and snapshot is not None and not snapshot.exists():
                source = self.layout.checkpoint_dir(job.export_from)
                owner = self.executor.source_owner(job.export_from)
                track = self.executor.progress.track
                with track(
                    "export for sampler", job.tenant, str(job.export_from), reads=source, writes=snapshot
                ):
                    self.engine.export_snapshot(source, snapshot, owner)
            self.engine.add_sample(job.future_id, job.request)
        except Exception as exc:
            self._finish_samples({job.future_id: exc})

    def _step_sampler(self) -> None:
        start = time.perf_counter()
        try:
            finished = self.engine.step_sampler(self.max_prefill_tokens)
        except Exception as exc:  # the engine dropped every request it held: fail them all
            log.exception("sampler step failed")
            with self.cond:
                dropped = self.samples.active_ids()
            self._finish_samples(dict.fromkeys(dropped, exc))
            return
        elapsed_s = time.perf_counter() - start
        self._finish_samples(dict(finished))
        self.telemetry.record_sampler_step(elapsed_s, self.engine.usage())

    def _finish_samples(self, outcomes: dict[str, SampleResult | Exception]) -> None:
        with self.cond:
            for future_id in outcomes:
                self.samples.finish(future_id)
        self.futures.finish(outcomes)
