"""Long work in progress on the engine worker: checkpoint saves and exports, loads into a slot, parking
and unparking, so the web console can show what is under way, for whom and for how long.

The worker opens an entry around each such engine call (`track`) and closes it when the call returns;
readers take copies from any thread. The bytes a write has put down so far are read, when asked, from
the hidden staging directory every directory write goes through (durable.py), and a load's total from
its source directory: no engine call needs a callback, and the worker pays for a dict entry only. The
last few finished entries are kept. No tensors, no HTTP, no SQL.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from loraplex.timestamps import utcnow

RUNNING, DONE, FAILED = "running", "done", "failed"
_KEPT = 32


@dataclass(frozen=True)
class Progress:
    """One long piece of work, under way or finished."""

    kind: str  # what it is, in words: "save checkpoint", "load parked run", ...
    tenant: str
    subject: str  # the run, checkpoint path or sampler it concerns
    started_at: datetime
    elapsed_s: float  # so far, or in all once finished
    outcome: str  # running | done | failed
    reads: Path | None = None  # a load's source directory
    writes: Path | None = None  # a write's target directory

    def read_total_bytes(self) -> int | None:
        """The size of what a load reads (None for a write)."""
        return _size(self.reads) if self.reads is not None else None

    def written_bytes(self) -> int | None:
        """What a running write has put in its staging directory so far (None if not a running write)."""
        if self.writes is None or self.outcome != RUNNING:
            return None
        return sum(_size(tmp) for tmp in self.writes.parent.glob(f".{self.writes.name}.tmp-*"))


class ProgressBoard:
    """The work under way and the last `keep` finished."""

    def __init__(self, keep: int = _KEPT, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running: dict[int, tuple[Progress, float]] = {}  # id -> (entry, monotonic start)
        self._finished: deque[Progress] = deque(maxlen=keep)

    @contextmanager
    def track(
        self, kind: str, tenant: str, subject: str, reads: Path | None = None, writes: Path | None = None
    ) -> Iterator[None]:
        """An entry for the work the `with` block does."""
        entry = Progress(kind, tenant, subject, utcnow(), 0.0, RUNNING, reads, writes)
        start = self._clock()
        with self._lock:
            key = next(self._ids)
            self._running[key] = (entry, start)
        outcome = FAILED
        try:
            yield
            outcome = DONE
        finally:
            with self._lock:
                del self._running[key]
                self._finished.append(replace(entry, elapsed_s=self._clock() - start, outcome=outcome))

    def running(self) -> list[Progress]:
        """Work under way, oldest first, with its elapsed time now."""
        now = self._clock()
        with self._lock:
            entries = list(self._running.values())
        return [replace(entry, elapsed_s=now - start) for entry, start in entries]

    def finished(self) -> list[Progress]:
        """The last finished work, newest first."""
        with self._lock:
            return list(reversed(self._finished))


def _size(directory: Path) -> int:
    """Bytes of the files under a directory (0 if it is gone: a write renamed into place meanwhile)."""
    try:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    except OSError:
        return 0
