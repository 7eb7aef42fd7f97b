"""Each run's metric history: every forward_backward's and forward's metrics (loss:sum, ... and the server's
own health statistics: train/tokens, rl/...), every optim_step's (grad_norm, learning_rate) and every
request's of a sampler of the run's weights (sample/...), for the web console's charts; docs/METRICS.md
defines them.

The engine loop puts each finished request's metrics in the record of its engine call (core/journal.py:
MetricsRecorded), and the writer stores them in the same transaction as the requests' outcomes
(control/writer.py: metric_row): a request's metrics are in its run's history by the time its outcome is
visible, and a crash loses neither one without the other. The console reads a run's history back thinned
to a bounded number of points per kind. Retention bounds the table (control/retention.py). No tensors, no
HTTP.
"""

from __future__ import annotations

import json
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
        order = sorted(points, key=lambda key: (_rank(key[0]), not key[1].startswith("loss"), key[1]))
        return [MetricSeries(kind, name, tuple(points[kind, name]), totals[kind]) for kind, name in order]


def _rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
