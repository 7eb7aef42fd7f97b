"""Each run's metric history: every forward_backward's and forward's metrics (loss:sum, ... and the server's
own health statistics: train/tokens, rl/...), every optim_step's (grad_norm, learning_rate) and every
request's of a sampler of the run's weights (sample/...), for the web console's charts; docs/METRICS.md
defines them.

The engine loop puts each finished request's metrics in the record of its engine call (core/journal.py:
MetricsRecorded), and the writer stores them in the same transaction as the requests' outcomes
(control/writer.py: metric_row): a request's metrics are in its run's history by the time its outcome is
visible, and a crash loses neither one without the other. The console reads a run's history back thinned
to a bounded number of points per kind, and the newest values of a page of runs in one query. Retention
bounds the table (control/retention.py). No tensors, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.runtime.control.store import Store
from loraplex.runtime.core.journal import FORWARD, FORWARD_BACKWARD, OPTIM_STEP, SAMPLE

_KIND_ORDER = (FORWARD_BACKWARD, FORWARD, OPTIM_STEP, SAMPLE)


@dataclass(frozen=True)
class MetricSeries:
    """One metric of one kind of request over a run's steps, oldest first."""

    kind: str  # forward_backward | forward | optim_step | sample
    name: str  # e.g. loss:sum, grad_norm
    points: tuple[tuple[int, float], ...]  # (step, value); thinned when the run has more than asked for
    total: int  # records of this kind the run's history holds


@dataclass(frozen=True)
class LatestValue:
    """A metric's value in its run's newest record of its kind, and that record's step."""

    kind: str
    name: str
    step: int
    value: float


class MetricHistory:
    """Reads runs' metric histories from the store."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def series(self, run_id: str, max_points: int = 1000) -> list[MetricSeries]:
        """A run's recorded metrics, one series per (kind, metric name), losses first; each kind thinned
        to about `max_points` records (store.run_metrics)."""
        rows, totals = self._store.run_metrics(run_id, max_points)
        points: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for row in rows:
            for name, value in json.loads(row.metrics).items():
                points.setdefault((row.kind, name), []).append((row.step, float(value)))
        order = sorted(points, key=series_order)
        return [MetricSeries(kind, name, tuple(points[kind, name]), totals[kind]) for kind, name in order]

    def latest(self, run_ids: Sequence[str]) -> dict[str, list[LatestValue]]:
        """Per run, the metrics of its newest record of each kind (one query for them all), in the order
        of `series`; a run with no history is absent."""
        found: dict[str, list[LatestValue]] = {}
        for row in self._store.latest_metrics(run_ids, _KIND_ORDER):
            values = found.setdefault(row.run_id, [])
            values += [
                LatestValue(row.kind, k, row.step, float(v)) for k, v in json.loads(row.metrics).items()
            ]
        return {
            run: sorted(values, key=lambda v: series_order((v.kind, v.name))) for run, values in found.items()
        }


def series_order(key: tuple[str, str]) -> tuple[int, bool, str]:
    """Series order: by kind, losses first, then by name."""
    kind, name = key
    return _rank(kind), not name.startswith("loss"), name


def _rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
