"""The sampling requests one /v1 request queues, on queue room reserved for all of them at once, so that
they can be called off together: when the client goes away, or when one of them fails.

Requests are queued on worker threads (each writes its future to the database) while the generation waits
on the event loop, and a cancelled coroutine does not stop the thread that was queueing for it. So
`close`, on the event loop, never waits: it cancels what is already queued, and a request whose queueing
was in flight is cancelled by its own thread as soon as it is queued; the room's rest goes back to the
queue when the last of them is in. No tensors, no HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.samplers import SamplerService
from loraplex.runtime.core.sampling import SampleCancelledError, SampleRoom

# Why a /v1 request's unfinished sampling is cancelled.
CLIENT_GONE = "the client went away"
PART_FAILED = "another part of the same request failed"


class QueuedRequests:
    """One generation's queued sampling requests and the room they take from."""

    def __init__(self, samplers: SamplerService, room: SampleRoom) -> None:
        self._samplers, self._room = samplers, room
        self._lock = threading.Lock()
        self._future_ids: list[str] = []
        self._in_flight = 0  # requests being queued right now
        self._is_closed = False
        self._cancel_reason: str | None = None

    def queue(self, submit: Callable[[SampleRoom], FutureRecord]) -> FutureRecord:
        """Queue one request with `submit`, which takes its samples from the room (on a worker thread)."""
        with self._lock:
            if self._is_closed:  # its generation was called off before this thread started
                raise SampleCancelledError(self._cancel_reason or "its request already finished")
            self._in_flight += 1
        record: FutureRecord | None = None
        try:
            record = submit(self._room)
            return record
        finally:
            with self._lock:
                self._in_flight -= 1
                if record is not None:
                    self._future_ids.append(record.id)
                reason = self._cancel_reason
                is_last = self._is_closed and self._in_flight == 0
            if record is not None and reason is not None:  # called off while this one was being queued
                self._samplers.cancel([record.id], reason)
            if is_last:
                self._samplers.release(self._room)

    def close(self, cancel_reason: str | None = None) -> None:
        """Queue nothing more; with a reason, cancel every request still unfinished (never waits)."""
        with self._lock:
            self._is_closed, self._cancel_reason = True, cancel_reason
            future_ids, is_last = list(self._future_ids), self._in_flight == 0
        if cancel_reason is not None:
            self._samplers.cancel(future_ids, cancel_reason)
        if is_last:
            self._samplers.release(self._room)
