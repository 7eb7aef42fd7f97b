"""Sampling work between the API and the engine worker: the hand-over queue and its backpressure.

Sampling reads immutable snapshots, so it has no per-run ordering and never waits for training
barriers: a request goes from `SampleQueue.add` (the API thread) to the worker's next cycle, into the
engine's continuous batch, and leaves when its last sample finishes. Not thread-safe: the service and
the worker hold the service lock around every call. No tensors, no HTTP.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loraplex.engine.types import SampledSequence, SampleRequest, SampleResult, SamplingParams
from loraplex.errors import CapacityError
from loraplex.runtime.core.checkpoints import CheckpointPath

# The engine value types sampling carries, re-exported so the API builds requests without the engine.
__all__ = [
    "SampleJob",
    "SampleQueue",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingBackpressureError",
    "SamplingParams",
    "sample_sequence_ids",
]


class SamplingBackpressureError(CapacityError):
    """Too much sampling is queued; the SDK backs off about a second and resends (HTTP 429)."""

    status_code = 429


@dataclass
class SampleJob:
    """One accepted asample request on its way through the engine."""

    future_id: str  # also the request's key inside the engine
    tenant: str
    request: SampleRequest  # request.snapshot is set: the snapshot directory, or None for the base model
    export_from: CheckpointPath | None = None  # a training checkpoint to export into request.snapshot first
    export_owner: str = ""  # the owner digest stamped into export_from (the engine checks it)

    @property
    def num_samples(self) -> int:
        """What the backpressure limit counts."""
        return self.request.num_samples


def sample_sequence_ids(future_id: str, num_samples: int) -> list[str]:
    """The ids asample promises, one per sample; derived from the future so a resend gets the same ones."""
    return [f"{future_id}:{i}" for i in range(num_samples)]


class SampleQueue:
    """Sampling requests not yet finished: waiting for the worker, or inside the engine."""

    def __init__(self, max_queued_samples: int) -> None:
        self.max_queued_samples = max_queued_samples
        self.queued_samples = 0  # samples of every unfinished request, waiting or active
        self._waiting: deque[SampleJob] = deque()
        self._active: dict[str, SampleJob] = {}

    def reserve_room(self, num_samples: int) -> None:
        """Count a request's samples against the limit before it is added; refuse it (429, the SDK resends)
        if it would push the queue past the limit (one request always fits an empty queue)."""
        if self.queued_samples and self.queued_samples + num_samples > self.max_queued_samples:
            raise SamplingBackpressureError(
                f"{self.queued_samples} samples are queued; this server queues at most "
                f"{self.max_queued_samples} (try again shortly)"
            )
        self.queued_samples += num_samples

    def release_room(self, num_samples: int) -> None:
        """Give back a reservation whose request was never added."""
        self.queued_samples -= num_samples

    def add(self, job: SampleJob) -> None:
        """Queue an accepted request, whose room was reserved, for the worker."""
        self._waiting.append(job)

    def take_waiting(self) -> list[SampleJob]:
        """Hand every waiting request to the worker; they count as active until finished."""
        taken = list(self._waiting)
        self._waiting.clear()
        self._active.update((job.future_id, job) for job in taken)
        return taken

    def finish(self, future_id: str) -> SampleJob:
        """Forget a request that finished or failed."""
        job = self._active.pop(future_id)
        self.queued_samples -= job.num_samples
        return job

    def jobs(self) -> list[SampleJob]:
        """Every unfinished request: waiting for the worker, or inside the engine."""
        return [*self._waiting, *self._active.values()]

    def active_ids(self) -> list[str]:
        """Future ids of every request handed to the worker and not finished."""
        return list(self._active)
