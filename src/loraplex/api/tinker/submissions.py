"""The one thread that carries training submissions from the event loop to the runtime.

A submission writes its future's row before it is answered, so it must not run on the event loop. It
runs on one thread of its own rather than on FastAPI's worker pool (anyio, up to 40 threads):
- the pool's hop costs more Python than the submission's own write, and spreads the submissions of one
  burst (the SDK sends a step's forward_backwards back to back) over as many threads, each woken on
  cores the engine's compute threads are using (docs/BENCHMARKS.md, sixth session);
- SQLite takes one writer at a time anyway, and on PostgreSQL a submission's two statements take about a
  millisecond: one thread carries far more submissions than the engine can execute.
Group commit: the submissions that arrive while the thread is busy wait for it; it then takes them all
and writes their futures in one transaction (`TrainingService.submit_many`), at a third to a quarter of
the CPU per row of one transaction each (docs/BENCHMARKS.md, seventh session). Work runs in arrival
order, and a slow database holds submissions back no more than it would anyway: each is answered only
once its row is written. No tensors, no SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from loraplex.errors import ServerError
from loraplex.os_threads import SUBMIT, name_os_thread
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.service import Submission, TrainingService

T = TypeVar("T")

# The most submissions written in one transaction: bounds how long a long burst's requests wait for theirs.
_MAX_GROUP = 64


@dataclass(frozen=True)
class _Job:
    """Work handed to the thread and where its outcome goes: a Submission (grouped with its neighbours)
    or a call made alone."""

    work: Submission | Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def settle(self, outcome: Any, failed: bool) -> None:
        """Hand the outcome to the awaiting coroutine (nothing if it was cancelled or its loop closed)."""
        with contextlib.suppress(RuntimeError):  # raised if the loop closed meanwhile: nobody is waiting
            self.loop.call_soon_threadsafe(_resolve, self.future, outcome, failed)


def _resolve(future: asyncio.Future[Any], outcome: Any, failed: bool) -> None:
    if future.cancelled():  # the request went away; its submission stands, like a resent copy's would
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class SubmissionThread:
    """Runs training submissions, and blocking runtime calls, one batch at a time on a thread of its own,
    for the event loop to await."""

    def __init__(self, service: TrainingService) -> None:
        self._service = service
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="loraplex-submit", daemon=True)
        # Taken to hand work over, to start the thread (with the first work: an app may never serve) and to
        # close: work is either queued before the close's end marker, and done, or refused.
        self._lock = threading.Lock()
        self._closed = False

    async def submit(self, submission: Submission) -> FutureRecord:
        """Submit a request of a run (its future, or the error that refused it), its row written in one
        transaction with the submissions waiting beside it."""
        return await self._hand_over(submission)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, alone, in the caller's context (the request log's fields)."""
        return await self._hand_over(partial(contextvars.copy_context().run, fn, *args))

    def close(self) -> None:
        """Finish what was handed over, then stop the thread; work handed over later is refused."""
        with self._lock:
            self._closed = True
            if self._thread.is_alive():
                self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join()

    async def _hand_over(self, work: Submission | Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise ServerError("the server is shutting down; submit the request again once it is back")
            self._jobs.put(_Job(work, loop, future))
            if self._thread.ident is None:
                self._thread.start()
        return await future

    def _serve(self) -> None:
        name_os_thread(SUBMIT)
        stopping = False
        while not stopping:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < _MAX_GROUP:  # what arrived meanwhile goes in the same transaction
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                jobs.append(job)
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        """Each run of consecutive submissions as one `submit_many`, each call alone, in order."""
        start = 0
        while start < len(jobs):
            end = start + 1
            if isinstance(jobs[start].work, Submission):
                while end < len(jobs) and isinstance(jobs[end].work, Submission):
                    end += 1
            self._run_group(jobs[start:end])
            start = end

    def _run_group(self, jobs: list[_Job]) -> None:
        first = jobs[0].work
        try:
            if isinstance(first, Submission):
                outcomes = self._service.submit_many([job.work for job in jobs])  # type: ignore[misc]
            else:
                outcomes = [first()]
        except BaseException as error:  # the thread must go on: the requests get the error (a 500)
            for job in jobs:
                job.settle(error, failed=True)
            return
        for job, outcome in zip(jobs, outcomes, strict=True):
            failed = isinstance(first, Submission) and isinstance(outcome, Exception)
            job.settle(outcome, failed)
