"""Tenants take turns for the sampler (runtime/core/sampling.py SampleQueue): a backlog stays in its
tenant's queue, another tenant's request goes into the next batch with room, turns are weighted by tokens,
a quiet tenant saves up no credit, and each tenant's share of the queue is capped (429, Retry-After)."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.runtime.core.sampling import (
    SampleJob,
    SampleQueue,
    SampleRequest,
    SamplingBackpressureError,
    SamplingParams,
)

ROWS = 4  # the engine's decode batch in these tests


def _job(queue: SampleQueue, tenant: str, name: str, tokens: int = 10, samples: int = 1) -> SampleJob:
    request = SampleRequest(
        np.zeros(tokens // 2, np.int64), SamplingParams(max_tokens=tokens - tokens // 2), samples
    )
    job = SampleJob(name, tenant, request)
    queue.add(job, queue.reserve_room(samples, tenant))
    return job


def _run_batches(queue: SampleQueue, batches: int) -> list[list[str]]:
    """Hand the engine a batch, finish it, `batches` times: which requests each batch held."""
    handed = []
    for _ in range(batches):
        taken = queue.take_waiting(ROWS)
        handed.append([job.future_id for job in taken])
        for job in taken:
            queue.finish(job.future_id)
    return handed


def test_a_backlog_does_not_delay_another_tenants_request_past_the_next_batch() -> None:
    queue = SampleQueue(10_000)
    for i in range(100):
        _job(queue, "flood", f"f{i}")
    first = queue.take_waiting(ROWS)
    assert [job.future_id for job in first] == ["f0", "f1", "f2", "f3"]  # the batch holds ROWS rows
    _job(queue, "quiet", "q0")
    assert queue.take_waiting(ROWS) == []  # the batch is full: everything else waits here, not in it
    queue.finish("f0")
    assert [job.future_id for job in queue.take_waiting(ROWS)] == ["q0"]  # first into the room that opened


def test_turns_are_weighted_by_tokens() -> None:
    queue = SampleQueue(10_000)
    for i in range(20):
        _job(queue, "long", f"l{i}", tokens=40)
        _job(queue, "short", f"s{i}", tokens=10)
    handed = [name[0] for batch in _run_batches(queue, 5) for name in batch]
    # Four short requests cost one long one: per five turns "long" takes one and "short" four.
    assert handed == list("lssss" * 4)


def test_a_tenant_back_from_quiet_time_starts_level_with_the_others() -> None:
    queue = SampleQueue(10_000)
    _job(queue, "early", "e0")
    _run_batches(queue, 1)  # "early" is served, then has nothing queued
    for i in range(40):
        _job(queue, "busy", f"b{i}")
    _run_batches(queue, 5)  # "busy" has been served 20 requests' worth
    _job(queue, "early", "e1")
    _job(queue, "early", "e2")
    batch = queue.take_waiting(ROWS)
    # "early" is not owed 19 requests of catch-up: it takes its turn with "busy" from here.
    assert {job.tenant for job in batch} == {"early", "busy"}


def test_a_request_larger_than_the_batch_still_goes_in_alone() -> None:
    queue = SampleQueue(10_000)
    _job(queue, "wide", "w0", samples=ROWS + 3)
    _job(queue, "wide", "w1")
    assert [job.future_id for job in queue.take_waiting(ROWS)] == ["w0"]


def test_a_tenant_past_its_share_is_backpressured_and_others_are_not() -> None:
    queue = SampleQueue(100, max_queued_samples_per_tenant=3)
    for i in range(3):
        _job(queue, "greedy", f"g{i}")
    with pytest.raises(
        SamplingBackpressureError, match=r"3 of your samples are queued.*at most 3 per tenant"
    ):
        queue.reserve_room(1, "greedy")
    assert SamplingBackpressureError.status_code == 429 and SamplingBackpressureError.retry_after_s == 1
    _job(queue, "other", "o0")  # another tenant still gets in
    queue.take_waiting(ROWS)
    queue.finish("g0")
    _job(queue, "greedy", "g3")  # room again once one of its own finished
    assert queue.queued_samples == 4


def test_cancelled_requests_leave_their_tenants_queue() -> None:
    queue = SampleQueue(100)
    for name in ("a0", "a1"):
        _job(queue, "a", name)
    _job(queue, "b", "b0")
    queue.cancel("a1", "client gone")
    queue.cancel("b0", "client gone")
    assert queue.take_cancels() == {"a1": "client gone", "b0": "client gone"}
    assert [job.future_id for job in queue.take_waiting(ROWS)] == ["a0"]
