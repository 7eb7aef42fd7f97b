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
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.types import (
    SampledSequence,
    SampleProgress,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from loraplex.errors import CapacityError, UserError
from loraplex.runtime.core.checkpoints import CheckpointPath

# The engine value types sampling carries, re-exported so the API builds requests without the engine.
__all__ = [
    "SampleCancelledError",
    "SampleJob",
    "SampleProgress",
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
    """Too much sampling is queued, or too much of one tenant's; the SDK backs off about a second and
    resends (HTTP 429 with Retry-After)."""

    status_code = 429
    retry_after_s = 1


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
    tenant: str  # whose: the per-tenant limit counts it, its requests join that tenant's queue


@dataclass
class SampleJob:
    """One accepted asample request on its way through the engine."""

    future_id: str  # also the request's key inside the engine
    tenant: str
    request: SampleRequest  # request.snapshot is set: the snapshot directory, or None for the base model
    export_from: CheckpointPath | None = None  # a training checkpoint to export into request.snapshot first
    export_owner: str = ""  # the owner digest stamped into export_from (the engine checks it)
    seq_id: int = 0  # its seq_id on its sampler (a run's history names it)
    # Called on the engine thread with each step's new tokens when request.streams (a /v1 stream): it must
    # only hand them on, never block.
    on_progress: Callable[[SampleProgress], None] | None = None

    @property
    def num_samples(self) -> int:
        """What the backpressure limit counts."""
        return self.request.num_samples


def sample_sequence_ids(future_id: str, num_samples: int) -> list[str]:
    """The ids asample promises, one per sample; derived from the future so a resend gets the same ones."""
    return [f"{future_id}:{i}" for i in range(num_samples)]


class SampleQueue:
    """Sampling requests not yet finished: waiting for the worker, or inside the engine.

    Tenants take turns (start-time fair queuing by tokens): the worker is handed waiting requests only
    while the engine has rows free in its decode batch, and each time from the tenant that has been served
    the fewest tokens (prompt plus max_tokens, times samples) since it last had work waiting. So one
    tenant's backlog stays here, in its own queue, and another tenant's first request goes into the next
    batch with room, not behind the backlog; inside the engine, first come is first served, but it holds
    at most about one batch. A tenant whose queue empties and refills starts level with the others, with
    no credit saved up from its quiet time.
    """

    def __init__(self, max_queued_samples: int, max_queued_samples_per_tenant: int | None = None) -> None:
        self.max_queued_samples = max_queued_samples
        self.max_queued_samples_per_tenant = max_queued_samples_per_tenant or max_queued_samples
        self.queued_samples = 0  # samples of every unfinished request, waiting or active
        self._queued_by_tenant: dict[str, int] = {}
        self._waiting: dict[str, deque[SampleJob]] = {}  # tenant -> its waiting requests, in arrival order
        self._served: dict[str, float] = {}  # tenant -> tokens handed to the engine (its virtual time)
        self._virtual_time = 0.0  # the served tokens of the last tenant picked, when it was picked
        self._active: dict[str, SampleJob] = {}
        self._cancels: dict[str, str] = {}  # future id -> why, for the worker's next cycle

    def reserve_room(self, num_samples: int, tenant: str) -> SampleRoom:
        """Count a tenant's samples against the limits before their requests are added; refuse them all
        (429 with Retry-After, the SDK resends) if they would push the queue, or the tenant's share of it,
        past its limit (the limit's worth fits an empty queue)."""
        if self.queued_samples and self.queued_samples + num_samples > self.max_queued_samples:
            raise SamplingBackpressureError(
                f"{self.queued_samples} samples are queued; this server queues at most "
                f"{self.max_queued_samples} (try again shortly)"
            )
        queued = self._queued_by_tenant.get(tenant, 0)
        if queued and queued + num_samples > self.max_queued_samples_per_tenant:
            raise SamplingBackpressureError(
                f"{queued} of your samples are queued; this server queues at most "
                f"{self.max_queued_samples_per_tenant} per tenant (try again shortly)"
            )
        self.queued_samples += num_samples
        self._queued_by_tenant[tenant] = queued + num_samples
        return SampleRoom(num_samples, tenant)

    def release_room(self, room: SampleRoom) -> None:
        """Give back what no added request took of a reservation."""
        self._uncount(room.tenant, room.samples)
        room.samples = 0

    def add(self, job: SampleJob, room: SampleRoom) -> None:
        """Queue an accepted request for the worker, its samples taken from `room`."""
        assert job.num_samples <= room.samples, "a request was added without room reserved for it"
        assert job.tenant == room.tenant, "a request was added to another tenant's room"
        room.samples -= job.num_samples
        waiting = self._waiting.get(job.tenant)
        if waiting is None:  # the tenant starts level with the others, no credit from its quiet time
            waiting = self._waiting[job.tenant] = deque()
            self._served[job.tenant] = max(self._served.get(job.tenant, 0.0), self._virtual_time)
        waiting.append(job)

    def cancel(self, future_id: str, reason: str) -> None:
        """Ask the worker to drop a request at its next cycle and fail it with `reason` (one that has
        finished by then is left as it is)."""
        self._cancels.setdefault(future_id, reason)

    def take_cancels(self) -> dict[str, str]:
        """Hand the worker the requests asked to be cancelled and still unfinished, with why: those still
        waiting leave the queue here and never reach the engine. They count as active until finished."""
        if not self._cancels:
            return {}
        for tenant, waiting in list(self._waiting.items()):
            cancelled = [job for job in waiting if job.future_id in self._cancels]
            if not cancelled:
                continue
            self._active.update((job.future_id, job) for job in cancelled)
            kept = deque(job for job in waiting if job.future_id not in self._cancels)
            if kept:
                self._waiting[tenant] = kept
            else:
                del self._waiting[tenant]
        taken = {future_id: why for future_id, why in self._cancels.items() if future_id in self._active}
        self._cancels.clear()
        return taken

    def take_waiting(self, engine_rows: int) -> list[SampleJob]:
        """Hand the worker waiting requests, tenants in turn, while the engine's `engine_rows` decode rows
        have room for them (at least one request when the engine holds none); they count as active until
        finished."""
        taken: list[SampleJob] = []
        rows = sum(job.num_samples for job in self._active.values())
        while self._waiting:
            tenant = min(self._waiting, key=self._served.__getitem__)
            job = self._waiting[tenant][0]
            if rows and rows + job.num_samples > engine_rows:
                break
            self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            self._virtual_time = self._served[tenant]
            self._served[tenant] += job.num_samples * _tokens(job.request)
            self._active[job.future_id] = job
            taken.append(job)
            rows += job.num_samples
        return taken

    def finish(self, future_id: str) -> SampleJob:
        """Forget a request that finished or failed."""
        job = self._active.pop(future_id)
        self._uncount(job.tenant, job.num_samples)
        return job

    def jobs(self) -> list[SampleJob]:
        """Every unfinished request: waiting for the worker, or inside the engine."""
        return [*(job for waiting in self._waiting.values() for job in waiting), *self._active.values()]

    def active_ids(self) -> list[str]:
        """Future ids of every request handed to the worker and not finished."""
        return list(self._active)

    def _uncount(self, tenant: str, num_samples: int) -> None:
        if not num_samples:
            return
        self.queued_samples -= num_samples
        left = self._queued_by_tenant[tenant] - num_samples
        if left:
            self._queued_by_tenant[tenant] = left
        else:
            del self._queued_by_tenant[tenant]
            if tenant not in self._waiting:
                self._served.pop(tenant, None)  # nothing of it left here: no turn to remember


def _tokens(request: SampleRequest) -> int:
    """What one sample of a request costs its tenant's turn: its prompt and the tokens it may draw."""
    return len(request.prompt) + (request.params.max_tokens or 0)
