"""Sampling work between the API and the engine worker: the hand-over queue and its backpressure.

Sampling reads immutable snapshots, so it has no per-run ordering and never waits for training
barriers: a request goes from `SampleQueue.add` (the API thread) to the worker's next cycle, into the
engine's continuous batch, and leaves when its last sample finishes, or when it is cancelled: the worker
takes the cancellations asked for at the start of each cycle (`take_cancels`), before it hands new
requests to the engine. Not thread-safe: the service and the worker hold the service lock around every
call. No tensors, no HTTP.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loraplex.engine.types import SampledSequence, SampleRequest, SampleResult, SamplingParams
from loraplex.errors import CapacityError, UserError
from loraplex.runtime.core.checkpoints import CheckpointPath

# The engine value types sampling carries, re-exported so the API builds requests without the engine.
__all__ = [
    "SampleCancelledError",
    "SampleJob",
    "SampleQueue",
    "SampleRequest",
    "SampleResult",
    "SampleRoom",
    "SampledSequence",
    "SamplingBackpressureError",
    "SamplingParams",
    "sample_sequence_ids",
]


class SamplingBackpressureError(CapacityError):
    """Too much sampling is queued; the SDK backs off about a second and resends (HTTP 429)."""

    status_code = 429


class SampleCancelledError(UserError):
    """What a cancelled request's future fails with."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cancelled: {reason}")


@dataclass
class SampleRoom:
    """Room in the queue reserved at once for requests added one by one (the prompts of one /v1 request
    and then their scoring), so none of them meets a full queue: each added request takes its samples
    from it, and what is left is released once they are all in. Changed under the service lock."""

    samples: int  # reserved and not yet taken


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
        self._cancels: dict[str, str] = {}  # future id -> why, for the worker's next cycle

    def reserve_room(self, num_samples: int) -> SampleRoom:
        """Count samples against the limit before their requests are added; refuse them all (429, the SDK
        resends) if they would push the queue past the limit (the limit's worth fits an empty queue)."""
        if self.queued_samples and self.queued_samples + num_samples > self.max_queued_samples:
            raise SamplingBackpressureError(
                f"{self.queued_samples} samples are queued; this server queues at most "
                f"{self.max_queued_samples} (try again shortly)"
            )
        self.queued_samples += num_samples
        return SampleRoom(num_samples)

    def release_room(self, room: SampleRoom) -> None:
        """Give back what no added request took of a reservation."""
        self.queued_samples -= room.samples
        room.samples = 0

    def add(self, job: SampleJob, room: SampleRoom) -> None:
        """Queue an accepted request for the worker, its samples taken from `room`."""
        assert job.num_samples <= room.samples, "a request was added without room reserved for it"
        room.samples -= job.num_samples
        self._waiting.append(job)

    def cancel(self, future_id: str, reason: str) -> None:
        """Ask the worker to drop a request at its next cycle and fail it with `reason` (one that has
        finished by then is left as it is)."""
        self._cancels.setdefault(future_id, reason)

    def take_cancels(self) -> dict[str, str]:
        """Hand the worker the requests asked to be cancelled and still unfinished, with why: those still
        waiting leave the queue here and never reach the engine. They count as active until finished."""
        if not self._cancels:
            return {}
        cancelled = [job for job in self._waiting if job.future_id in self._cancels]
        if cancelled:
            self._active.update((job.future_id, job) for job in cancelled)
            self._waiting = deque(job for job in self._waiting if job.future_id not in self._cancels)
        taken = {future_id: why for future_id, why in self._cancels.items() if future_id in self._active}
        self._cancels.clear()
        return taken

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
