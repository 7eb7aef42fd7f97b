"""Each run's metric history: every forward_backward's and forward's metrics (loss:sum, ...) and every
optim_step's (grad_norm, learning_rate), for the web console's charts.

The engine worker records each finished request here (an append under a small lock) and writes what it
recorded to the store in one transaction at most every `flush_s`, outside the service lock, so a pass
costs no extra database round trip. A crash loses at most that last moment of history. The console
reads a run's history back thinned to a bounded number of points per kind. Retention bounds the table
(runtime/control/retention.py). No tensors, no HTTP.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loraplex.runtime.control.store import Store, utcnow

log = logging.getLogger(__name__)

FORWARD_BACKWARD, FORWARD, OPTIM_STEP = "forward_backward", "forward", "optim_step"
_KIND_ORDER = (FORWARD_BACKWARD, FORWARD, OPTIM_STEP)


@dataclass(frozen=True)
class MetricSeries:
    """One metric of one kind of request over a run's steps, oldest first."""

    kind: str  # forward_backward | forward | optim_step
    name: str  # e.g. loss:sum, grad_norm
    points: tuple[tuple[int, float], ...]  # (step, value); thinned when the run has more than asked for
    total: int  # records of this kind the run's history holds


class MetricHistory:
    """Buffers metric records on the engine worker and writes them to the store in batches."""

    def __init__(
        self,
        store: Store,
        flush_s: float = 0.5,
        max_buffered: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store, self._flush_s, self._max_buffered, self._clock = store, flush_s, max_buffered, clock
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one write at a time, in order, so last steps never go back
        self._rows: list[dict[str, object]] = []
        self._last_steps: dict[str, int] = {}  # run -> optimizer steps taken, as of the buffered records
        self._next_flush = clock() + flush_s
        self.dropped = 0  # records lost to a full buffer (the database refusing for long)

    def record(self, run_id: str, seq_id: int, step: int, kind: str, metrics: Mapping[str, float]) -> None:
        """Remember one request's metrics (non-finite values left out, as the SDK's results leave them)."""
        row = {
            "run_id": run_id,
            "seq_id": seq_id,
            "step": step,
            "kind": kind,
            "metrics": json.dumps({k: v for k, v in metrics.items() if math.isfinite(v)}),
            "recorded_at": utcnow(),
        }
        with self._lock:
            if len(self._rows) >= self._max_buffered:  # bounded: the oldest go first
                del self._rows[0]
                self.dropped += 1
            self._rows.append(row)
            if kind == OPTIM_STEP:
                self._last_steps[run_id] = step

    def flush_if_due(self) -> None:
        """Write the buffered records if `flush_s` has passed since the last write (the engine loop's
        housekeeping, every cycle)."""
        if self._clock() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        """Write every buffered record now; on a database error they stay buffered for the next try."""
        self._next_flush = self._clock() + self._flush_s
        with self._writing:
            with self._lock:
                rows, self._rows = self._rows, []
                last_steps, self._last_steps = self._last_steps, {}
            if not rows:
                return
            try:
                self._store.add_metrics(rows, last_steps)
            except Exception:
                log.exception("could not record %d metric records; will retry", len(rows))
                with self._lock:
                    self._rows[:0] = rows[-self._max_buffered :]
                    self._last_steps = last_steps | self._last_steps

    def series(self, run_id: str, max_points: int = 1000) -> list[MetricSeries]:
        """A run's recorded metrics, one series per (kind, metric name), losses first; each kind thinned
        to about `max_points` records (store.run_metrics)."""
        rows, totals = self._store.run_metrics(run_id, max_points)
        points: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for row in rows:
            for name, value in json.loads(row.metrics).items():
                points.setdefault((row.kind, name), []).append((row.step, float(value)))
        order = sorted(points, key=lambda key: (_rank(key[0]), not key[1].startswith("loss"), key[1]))
        return [MetricSeries(kind, name, tuple(points[kind, name]), totals[kind]) for kind, name in order]


def _rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
