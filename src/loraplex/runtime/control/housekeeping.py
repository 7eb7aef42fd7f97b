"""Housekeeping: the thread that deletes what retention says is due, every `--retention-sweep-s`.

Off the engine thread (a sweep may delete gigabytes of snapshots, which must not hold up a pass) and off
the writer's (whose commits the engine loop waits on). What queued or running requests read is spared:
the engine loop's shared state names those directories at the moment of the sweep, and gives up only the
runs it does not hold. No tensors, no HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from loraplex.os_threads import name_os_thread
from loraplex.runtime.control.retention import Removal, Retention
from loraplex.runtime.control.sessions import SessionTable
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.state import SharedState
from loraplex.timestamps import utcnow

log = logging.getLogger(__name__)

HOUSEKEEPING = "lpx-housekeep"


class Housekeeping:
    """Runs retention sweeps on a thread of its own."""

    def __init__(
        self,
        retention: Retention,
        state: SharedState,
        sessions: SessionTable,
        layout: DiskLayout,
        sweep_s: float,
        on_removed: Callable[[Path], None] = lambda _directory: None,
    ) -> None:
        self.retention, self.state, self.sessions = retention, state, sessions
        self.layout, self.sweep_s = layout, sweep_s
        self.on_removed = on_removed  # told each directory a sweep deleted (the vLLM sampler unloads it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loraplex-housekeeping", daemon=True)

    def start(self) -> None:
        """Start sweeping."""
        self._thread.start()

    def close(self) -> None:
        """Stop after the sweep under way, if any."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sweep(self) -> Removal:
        """One sweep now: delete what is due, except what queued or running requests read and the runs the
        engine loop holds; forget lapsed sessions' leases."""
        self.sessions.forget_lapsed()
        in_use = self.state.directories_in_use(self.layout)
        removal = self.retention.sweep(utcnow(), in_use, release=self.state.release_idle_runs)
        for directory in removal.directories:
            self.on_removed(directory)
        return removal

    def _serve(self) -> None:
        name_os_thread(HOUSEKEEPING)
        while not self._stop.wait(self.sweep_s):
            try:
                self.sweep()
            except Exception:  # a database or disk fault: the next sweep tries again
                log.exception("retention sweep failed")
