"""A sampling request's row in its run's history (runtime/core/sample_history.py): what it counts, whose
history it enters, and how many snapshots the server remembers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loraplex.engine.types import SampledSequence, SampleResult
from loraplex.runtime.core.sample_history import SnapshotRuns, SnapshotWeights, sample_metrics


def _sequence(length: int, stop_reason: str) -> SampledSequence:
    return SampledSequence(np.zeros(length, np.int32), np.zeros(length, np.float32), stop_reason)


def test_a_row_counts_its_requests_samples_tokens_and_each_stop_reason() -> None:
    first = SampleResult([_sequence(3, "stop"), _sequence(8, "length")])
    second = SampleResult([_sequence(1, "stop")])
    assert sample_metrics([first, second]) == {
        "sample/sequences": 3.0,
        "sample/tokens": 12.0,
        "sample/length_mean": 4.0,
        "sample/stop_reason_stop": 2.0,
        "sample/stop_reason_length": 1.0,
    }


def test_a_snapshot_belongs_to_its_runs_history_for_its_owners_requests_only() -> None:
    runs = SnapshotRuns()
    snapshot = Path("/data/snapshots/s:sample:1")
    runs.note(snapshot, SnapshotWeights("s:train:0", "alice", 4))
    assert runs.get(snapshot, "alice") == SnapshotWeights("s:train:0", "alice", 4)
    assert runs.get(snapshot, "bob") is None  # another tenant sampling a shared checkpoint
    assert runs.get(Path("/data/snapshots/other"), "alice") is None
    assert runs.get(None, "alice") is None  # the base model
    runs.note(snapshot, SnapshotWeights("s:train:0", "alice", 6))  # saved again under the same name
    assert runs.get(snapshot, "alice") == SnapshotWeights("s:train:0", "alice", 6)


def test_the_oldest_snapshot_saved_is_forgotten_past_the_bound() -> None:
    runs = SnapshotRuns(max_snapshots=2)
    first, second, third = (Path(f"/snap/{i}") for i in range(3))
    for step, path in enumerate((first, second)):
        runs.note(path, SnapshotWeights("r", "t", step))
    runs.note(first, SnapshotWeights("r", "t", 5))  # saved again: now the newest
    runs.note(third, SnapshotWeights("r", "t", 6))
    assert runs.get(second, "t") is None
    assert [runs.get(p, "t").step for p in (first, third)] == [5, 6]  # type: ignore[union-attr]
