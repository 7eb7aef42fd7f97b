"""What the control plane and the engine loop share: every run this server knows, the runs the scheduler
looks at, and the sampling queue, under one lock.

The lock is a Condition: submissions notify it when they queue work, and the engine loop waits on it when
it has none. It is held for moments only (to claim a seq_id, queue a command, plan, move a result), and
nobody touches the database or the engine while holding it (tests/api/test_no_sql_on_the_loop.py).
No SQL, no tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.commands import CreateRunFromCheckpoint, LoadState
from loraplex.runtime.core.run_queue import PARKED, RunState
from loraplex.runtime.core.sampling import SampleQueue
from loraplex.runtime.observability.telemetry import Occupancy, queue_kind


class SharedState:
    """Runs and sampling work, shared under `cond`'s lock."""

    def __init__(self, max_queued_samples: int, max_queued_samples_per_tenant: int | None = None) -> None:
        self.cond = threading.Condition()
        self.runs: dict[str, RunState] = {}  # every run this server knows
        self.active: dict[str, RunState] = {}  # the runs the scheduler looks at: resident or with commands
        self.samples = SampleQueue(max_queued_samples, max_queued_samples_per_tenant)

    def wake(self) -> None:
        """Wake the engine loop if it waits for work (another thread has something for it)."""
        with self.cond:
            self.cond.notify_all()

    def run(self, run_id: str) -> RunState | None:
        """A known run, or None."""
        with self.cond:
            return self.runs.get(run_id)

    def release_idle_runs(self, run_ids: list[str]) -> list[str]:
        """Forget the named runs that are idle (no slot or host copy, nothing queued or being submitted), so
        that retention may delete their state; return those forgotten. A run the server does not hold counts
        as released. A request for a forgotten run is answered from the database (control/service.py)."""
        released = []
        with self.cond:
            for run_id in run_ids:
                run = self.runs.get(run_id)
                if run is not None and (run.is_held() or not run.queue.is_idle()):
                    continue
                self.runs.pop(run_id, None)
                self.active.pop(run_id, None)
                released.append(run_id)
        return released

    def directories_in_use(self, layout: DiskLayout) -> frozenset[Path]:
        """Checkpoint and snapshot directories that queued commands or unfinished samples will read:
        retention must leave them be."""
        with self.cond:
            return frozenset(self._directories_in_use(layout))

    def _directories_in_use(self, layout: DiskLayout) -> Iterator[Path]:
        for run in self.active.values():
            for entry in run.queue.pending():
                if isinstance(entry.command, LoadState | CreateRunFromCheckpoint):
                    yield layout.checkpoint_dir(entry.command.source)
        for job in self.samples.jobs():
            if job.request.snapshot is not None:
                yield job.request.snapshot
            if job.export_from is not None:
                yield layout.checkpoint_dir(job.export_from)

    def occupancy(self, slots_total: int) -> Occupancy:
        """Slots, runs and queues now, for telemetry (under the lock: O(runs + queued)); the futures
        pending are the control plane's to add."""
        depth: dict[str, int] = {}
        with self.cond:
            resident = sum(run.slot is not None for run in self.active.values())
            parked = sum(run.status == PARKED for run in self.runs.values())
            on_host = sum(run.host_key is not None for run in self.active.values())
            waiting = 0
            for run in self.active.values():
                pending = run.queue.pending()
                waiting += run.slot is None and bool(pending)
                for entry in pending:
                    if entry.command is not None:
                        kind = queue_kind(entry.command)
                        depth[kind] = depth.get(kind, 0) + 1
            depth["sample"] = len(self.samples.jobs())
        return Occupancy(
            slots_used=resident,
            slots_total=slots_total,
            runs_parked=parked,
            runs_on_host=on_host,
            runs_waiting=waiting,
            queue_depth=depth,
        )
