"""What a finished sampling request adds to the metric history of the run whose weights it sampled.

A sampler made by an unnamed save_weights_for_sampler (the SDK's save_weights_and_get_sampling_client,
which tinker-cookbook's RL loops call every step) samples one run's weights as of one step; the executor
notes that when it saves the snapshot (`SamplerRuns.note`) and, as each of the sampler's requests
finishes, records the request's lengths and stop reasons in that run's history at that step
(`sample_metrics`; docs/METRICS.md defines them). The note lives in memory only: a sampler made before a
restart, or over a named checkpoint, is in no run's history (its requests still count on /metrics).
No tensors, no SQL, no HTTP.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loraplex.engine.types import SampleResult

SEQUENCES, TOKENS, LENGTH_MEAN = "sample/sequences", "sample/tokens", "sample/length_mean"
STOP_REASONS = ("stop", "length")  # SampledSequence.stop_reason: EOS / stop token / stop string, max_tokens
STOP_NAMES = {reason: f"sample/stop_reason_{reason}" for reason in STOP_REASONS}
# Samplers remembered at most, the oldest forgotten first: a step's sampler is used for that step, so a
# few thousand cover every run a server trains at once, in bounded memory over a long life.
MAX_SAMPLERS = 4096


@dataclass(frozen=True)
class SampledWeights:
    """The run a sampler samples, and the optimizer steps it had taken when its snapshot was saved."""

    run_id: str
    step: int


class SamplerRuns:
    """Sampler id -> the run and step its snapshot holds, for the most recent `MAX_SAMPLERS` samplers.
    Used by the engine thread only."""

    def __init__(self, max_samplers: int = MAX_SAMPLERS) -> None:
        self._max = max_samplers
        self._weights: OrderedDict[str, SampledWeights] = OrderedDict()

    def note(self, sampler_id: str, run_id: str, step: int) -> None:
        """A snapshot of `run_id` after `step` optimizer steps was saved for `sampler_id`."""
        self._weights[sampler_id] = SampledWeights(run_id, step)
        self._weights.move_to_end(sampler_id)
        while len(self._weights) > self._max:
            self._weights.popitem(last=False)

    def get(self, sampler_id: str | None) -> SampledWeights | None:
        """The weights a sampler samples, if it is one noted here."""
        return None if sampler_id is None else self._weights.get(sampler_id)


def sample_metrics(result: SampleResult) -> dict[str, float]:
    """One request's samples: how many, their tokens (stop tokens included), mean length, and how many
    ended on each stop reason."""
    lengths = [len(sequence.tokens) for sequence in result.sequences]
    metrics = {SEQUENCES: float(len(lengths)), TOKENS: float(sum(lengths))}
    if lengths:
        metrics[LENGTH_MEAN] = sum(lengths) / len(lengths)
    for reason, name in STOP_NAMES.items():
        metrics[name] = float(sum(sequence.stop_reason == reason for sequence in result.sequences))
    return metrics
