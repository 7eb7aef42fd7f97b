"""What a finished sampling request adds to the metric history of the run whose weights it sampled.

A snapshot saved by save_weights_for_sampler (unnamed: the SDK's save_weights_and_get_sampling_client,
which tinker-cookbook's RL loops call every step; or named, which the cookbook samples from on its
checkpoint steps) holds one run's weights as of one step. The executor notes that when it saves the
snapshot (`SnapshotRuns.note`) and, as requests sampling that snapshot directory finish, records their
lengths and stop reasons in that run's history at that step (`sample_metrics`: one row for the requests
of one sampler step; docs/METRICS.md defines them), when the requests are the run owner's own. The notes
live in memory only: a snapshot saved before a restart is in no run's history (its requests still count
on /metrics). No tensors, no SQL, no HTTP.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loraplex.engine.types import SampleResult

SEQUENCES, TOKENS, LENGTH_MEAN = "sample/sequences", "sample/tokens", "sample/length_mean"
STOP_REASONS = ("stop", "length")  # SampledSequence.stop_reason: EOS / stop token / stop string, max_tokens
STOP_NAMES = {reason: f"sample/stop_reason_{reason}" for reason in STOP_REASONS}
# Snapshots remembered at most, the oldest saved forgotten first: an RL loop samples each step's snapshot
# during that step, so a few thousand cover every run a server trains at once, in bounded memory.
MAX_SNAPSHOTS = 4096


@dataclass(frozen=True)
class SnapshotWeights:
    """Whose run a snapshot holds, and the optimizer steps the run had taken when it was saved."""

    run_id: str
    tenant: str
    step: int


class SnapshotRuns:
    """Snapshot directory -> the run and step it holds, for the last `max_snapshots` saved. Used by the
    engine thread only."""

    def __init__(self, max_snapshots: int = MAX_SNAPSHOTS) -> None:
        self._max = max_snapshots
        self._weights: OrderedDict[Path, SnapshotWeights] = OrderedDict()

    def note(self, directory: Path, weights: SnapshotWeights) -> None:
        """`directory` now holds `weights` (a snapshot saved again under the same name: the latest)."""
        self._weights[directory] = weights
        self._weights.move_to_end(directory)
        while len(self._weights) > self._max:
            self._weights.popitem(last=False)

    def get(self, directory: Path | None, tenant: str) -> SnapshotWeights | None:
        """The run and step a tenant's request sampling `directory` belongs to: a snapshot noted here of
        one of the tenant's own runs (another tenant's sampling never enters a run's history)."""
        weights = None if directory is None else self._weights.get(directory)
        return weights if weights is not None and weights.tenant == tenant else None


def sample_metrics(results: Sequence[SampleResult]) -> dict[str, float]:
    """The samples of some requests together: how many, their tokens (stop tokens included), mean length,
    and how many ended on each stop reason."""
    sequences = [sequence for result in results for sequence in result.sequences]
    lengths = [len(sequence.tokens) for sequence in sequences]
    metrics = {SEQUENCES: float(len(lengths)), TOKENS: float(sum(lengths))}
    if lengths:
        metrics[LENGTH_MEAN] = sum(lengths) / len(lengths)
    for reason, name in STOP_NAMES.items():
        metrics[name] = float(sum(sequence.stop_reason == reason for sequence in sequences))
    return metrics
