"""The submission thread: work runs off the event loop, in arrival order; the submissions that wait while
it is busy are handed to the service together (one transaction, `Runtime.submit_many`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from loraplex.api.tinker.submissions import SubmissionThread
from loraplex.errors import ServerError, UserError
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.control.service import Submission


class _Service:
    """Records what the thread hands over; seq_id 0 is refused, seq_id -1 breaks the whole group."""

    def __init__(self) -> None:
        self.log: list[object] = []

    def submit_many(self, submissions: Sequence[Submission]) -> list[FutureRecord | Exception]:
        self.log.append([s.seq_id for s in submissions])
        if any(s.seq_id == -1 for s in submissions):
            raise OSError("database gone")
        return [
            FutureRecord(f"f{s.seq_id}", s.tenant, s.request_type) if s.seq_id else UserError("seq_id 0")
            for s in submissions
        ]


def _submission(seq_id: int) -> Submission:
    return Submission("t", "s:train:0", seq_id, "ForwardBackward")


async def _while_busy(thread: SubmissionThread, service: _Service, work: list) -> list:
    """Hold the thread in a call, hand over `work` (Submissions or calls), then let it go; the outcomes."""
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait()

    held = asyncio.ensure_future(thread.call(hold))
    await asyncio.to_thread(entered.wait)
    tasks = [
        asyncio.ensure_future(thread.submit(w) if isinstance(w, Submission) else thread.call(w)) for w in work
    ]
    await asyncio.sleep(0.05)  # every task has handed its work over
    gate.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_submissions_that_wait_go_together_and_a_call_between_them_keeps_its_place() -> None:
    service = _Service()
    thread = SubmissionThread(service)  # type: ignore[arg-type]
    between = lambda: service.log.append("call") or "called"  # noqa: E731
    work = [_submission(1), _submission(2), _submission(0), between, _submission(3)]
    try:
        outcomes = asyncio.run(_while_busy(thread, service, work))
    finally:
        thread.close()
    assert service.log == [[1, 2, 0], "call", [3]]
    assert [o.id if isinstance(o, FutureRecord) else o for o in outcomes[:2]] == ["f1", "f2"]
    assert isinstance(outcomes[2], UserError) and outcomes[3] == "called" and outcomes[4].id == "f3"
    assert threading.current_thread() is not thread._thread and not thread._thread.is_alive()


def test_a_group_that_fails_fails_each_of_its_requests_and_the_thread_goes_on() -> None:
    service = _Service()
    thread = SubmissionThread(service)  # type: ignore[arg-type]
    try:
        outcomes = asyncio.run(_while_busy(thread, service, [_submission(1), _submission(-1)]))
        after = asyncio.run(thread.submit(_submission(5)))
    finally:
        thread.close()
    assert [type(o) for o in outcomes] == [OSError, OSError]
    assert after.id == "f5"


def test_closing_finishes_what_was_handed_over_and_an_unused_thread_never_starts() -> None:
    service = _Service()
    unused = SubmissionThread(service)  # type: ignore[arg-type]
    unused.close()
    assert unused._thread.ident is None
    thread = SubmissionThread(service)  # type: ignore[arg-type]

    async def hand_over_then_close() -> list:
        tasks = [asyncio.ensure_future(thread.submit(_submission(seq))) for seq in (1, 2, 3)]
        await asyncio.sleep(0)
        await asyncio.to_thread(thread.close)
        return await asyncio.gather(*tasks)

    records = asyncio.run(hand_over_then_close())
    assert [r.id for r in records] == ["f1", "f2", "f3"]
    assert not thread._thread.is_alive()
    with pytest.raises(ServerError, match="shutting down"):  # not a wait for a thread that is gone
        asyncio.run(thread.submit(_submission(4)))


def test_work_handed_over_while_the_thread_closes_is_done_or_refused_never_left_waiting() -> None:
    service = _Service()
    thread = SubmissionThread(service)  # type: ignore[arg-type]
    asyncio.run(thread.submit(_submission(1)))  # the thread runs
    jobs, closer = thread._jobs, threading.Thread(target=thread.close)

    class CloseMeanwhile:
        """The thread's queue, with a close coming between the shutdown check and the hand-over."""

        def put(self, job) -> None:
            if job is not None and not closer.is_alive():
                closer.start()
                closer.join(timeout=0.5)  # a close that waits for this hand-over is still running
            jobs.put(job)

        def get(self):
            return jobs.get()

        def get_nowait(self):
            return jobs.get_nowait()

    thread._jobs = CloseMeanwhile()  # type: ignore[assignment]

    async def hand_over() -> str:
        try:
            return (await asyncio.wait_for(thread.submit(_submission(2)), timeout=5)).id
        except ServerError as error:
            return str(error)

    outcome = asyncio.run(hand_over())
    closer.join(timeout=5)
    assert outcome == "f2" or "shutting down" in outcome
    assert not thread._thread.is_alive()
