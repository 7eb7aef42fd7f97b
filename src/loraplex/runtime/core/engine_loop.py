"""The engine loop: the one thread that calls the Engine, cycle after cycle, and does nothing else.

Each cycle takes one plan from the scheduler (residency moves, then at most one packed pass or one fused
step with the barriers), drops the sampling requests cancelled since the last cycle, hands newly queued
ones to the engine and runs one sampler step, so decoding and training interleave and neither starves;
sampling reads immutable snapshots, so it never waits for a training barrier. About once a second it
also fails requests stuck behind a seq_id that will never come and parks the runs of sessions whose lease
lapsed. Outcomes go to the journal (journal.py); the database, retention and every other chore run on
other threads (runtime/control/), so on a GPU the thread spends its time launching work (duty.py
measures it).

Supervised: a failure anywhere in a cycle fails the requests it concerns (executor.py), is logged, and
the loop goes on after a short pause. Only an engine that reports it cannot go on (a dead data-parallel
rank) ends the process, through its own failure callback. No SQL, no tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from loraplex.errors import UserError
from loraplex.os_threads import ENGINE, name_os_thread
from loraplex.runtime.core.duty import HELD, IDLE, DutyMeter
from loraplex.runtime.core.executor import Executor
from loraplex.runtime.core.journal import Record
from loraplex.runtime.core.run_queue import LOST, Entry
from loraplex.runtime.core.sampling import SampleJob
from loraplex.runtime.core.scheduler import Plan, Scheduler, work_items
from loraplex.runtime.core.state import SharedState
from loraplex.runtime.observability.telemetry import Telemetry

log = logging.getLogger(__name__)

_LEASE_CHECK_S = 1.0
# Pause after a cycle that failed outside any request, or whose residency moves failed, so a persistent
# fault (a full disk, a database down) is retried without spinning.
_FAULT_PAUSE_S = 0.5


class EngineLoop:
    """Runs plans on the engine through the executor; shares runs and queues with the control plane."""

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        state: SharedState,
        is_live: Callable[[str], bool],
        seq_gap_timeout_s: float,
        telemetry: Telemetry,
        meter: DutyMeter,
    ) -> None:
        self.executor, self.engine, self.scheduler, self.state = executor, executor.engine, scheduler, state
        self.sampler = executor.sampler
        self.cond = state.cond
        self.is_live, self.seq_gap_timeout_s = is_live, seq_gap_timeout_s
        self.telemetry, self.meter = telemetry, meter
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_lease_check = 0.0

    def run(self, keep_running: Callable[[], bool] = lambda: True) -> None:
        """Run the loop on the calling thread until stopped, or until `keep_running()` turns false.

        `loraplex serve` runs it on the process's main thread: the same pass measured 25-35% slower
        on a second thread than on the main one (torch 2.13 CPU, libgomp; ~330 vs ~250 ms for 8 x 32
        tokens on the bench model), with its elementwise and batched-matmul kernels 2-3x slower;
        bench/second_thread.py reproduces it in plain torch.
        """
        while True:
            self.executor.settle(block=False)
            with self.cond:
                if self._stopping or not keep_running():
                    return
                now = time.monotonic()
                plan = self.scheduler.plan(list(self.state.active.values()), now)
                cancels = self.state.samples.take_cancels()  # first: cancelled arrivals skip the engine
                arrivals = self.state.samples.take_waiting(self.sampler.sampling_rows())
                if not plan and not cancels and not arrivals and not self.sampler.has_sampling_work():
                    wake_at = self.scheduler.wake_at
                    with self.meter.state(IDLE if wake_at is None else HELD):
                        self.cond.wait(timeout=_LEASE_CHECK_S if wake_at is None else max(0.0, wake_at - now))
            try:
                healthy = self._cycle(plan, cancels, arrivals)
            except Exception:
                log.exception("engine loop cycle failed; the loop goes on")
                healthy = False
            if not healthy:
                time.sleep(_FAULT_PAUSE_S)
            self.meter.end_cycle()

    def _cycle(self, plan: Plan, cancels: dict[str, str], arrivals: list[SampleJob]) -> bool:
        """Carry out one plan, the sampling cancellations and one sampler step; False if a residency move
        failed."""
        start = time.perf_counter()
        if cancels:
            self.executor.cancel_samples(cancels)
        healthy = all([self.executor.park(run) for run in plan.parks])
        for run in plan.admits:
            self.executor.admit(run)
        for work in plan.work:
            self.executor.execute(work)
        planned = time.perf_counter()
        for job in arrivals:
            self.executor.admit_sample(job)
        if self.sampler.has_sampling_work():
            self.executor.step_sampler()
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
        """Finish the current plan, then stop (and wait for the loop's thread, if it has one)."""
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
        stuck: dict[str, tuple[int, list[Entry]]] = {}
        with self.cond:
            lapsed = [r for r in self.state.active.values() if not self.is_live(r.session_id)]
            stale = [
                r
                for r in self.state.active.values()
                if r.queue.pending() and now - r.queue.pending()[0].arrived_at >= self.seq_gap_timeout_s
            ]
            for run in lapsed + stale:  # a run both lapsed and stale gives up its gap once
                if run.run_id not in stuck:
                    stuck[run.run_id] = (run.queue.next_seq_id, run.queue.abandon_gap())
        for run_id, (missing, entries) in stuck.items():
            if entries:
                gap = UserError(
                    f"training run {run_id} never received seq_id {missing} (its session expired, or it was "
                    "refused before its seq_id could be read); this request waited behind it and is dropped"
                )
                self.executor.hand_over(Record(dict.fromkeys((e.future_id for e in entries), gap)))
        for run in lapsed:  # straight to disk: the host tier is for runs still training
            if run.slot is not None and run.queue.is_idle():
                self.executor.park(run, to_disk=True)
            elif run.host_key is not None and run.queue.is_idle():
                self.executor.spill(run)

    def park_all(self) -> None:
        """Park every run the engine holds (gradients included), in a slot or in host memory, so a restart
        finds them on disk: called once the loop has stopped."""
        with self.cond:
            resident = [run for run in self.state.active.values() if run.slot is not None]
            on_host = [run for run in self.state.active.values() if run.host_key is not None]
        for run in resident:
            self.executor.park(run, to_disk=True)
        for run in on_host:
            self.executor.spill(run)
        self.executor.settle()
        if resident or on_host:
            log.info(
                "parked %d resident runs and %d from host memory before stopping", len(resident), len(on_host)
            )

    def _forget_quiet_runs(self) -> None:
        """Keep the per-cycle plan set to runs the engine holds or that have commands: idle parked and lost
        runs leave it, so thousands of old runs cost a plan nothing (a run is added back on its next
        request); runs in the host tier stay, so their sessions' leases are watched."""
        with self.cond:
            quiet = [
                run_id
                for run_id, run in self.state.active.items()
                if (not run.is_held() or run.status == LOST) and run.queue.is_idle()
            ]
            for run_id in quiet:
                del self.state.active[run_id]
