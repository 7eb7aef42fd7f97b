"""RunQueue: commands run in seq_id order; gaps hold later commands; rejected entries never block."""

from __future__ import annotations

import pytest

from loraplex.engine.types import AdamParams
from loraplex.errors import UserError
from loraplex.runtime.core.commands import OptimStep
from loraplex.runtime.core.run_queue import Entry, RunQueue, RunQueueFullError

STEP = OptimStep(AdamParams())


def test_out_of_order_commands_wait_until_the_gap_is_filled() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(3, "f3", STEP))
    queue.add(Entry(2, "f2", STEP))
    assert queue.ready() == []
    queue.add(Entry(1, "f1", STEP))
    assert [e.future_id for e in queue.ready()] == ["f1", "f2", "f3"]


def test_popped_commands_advance_the_log_cannot_be_claimed_again_and_are_forgotten() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(1, "f1", STEP))
    assert [e.seq_id for e in queue.pop(1)] == [1]
    assert queue.next_seq_id == 2
    with pytest.raises(UserError, match="already executed"):
        queue.reserve(1, "again")
    assert queue.future_for(1) is None  # the log keeps no executed ids: the database answers for them


def test_seq_ids_beyond_the_window_are_refused_and_nothing_is_held() -> None:
    queue = RunQueue(next_seq_id=5, window=10)
    queue.reserve(14, "last-in-window")
    with pytest.raises(UserError, match=r"seq_id 15 is too far ahead: this run expects seq_id 5 next"):
        queue.reserve(15, "too-far")
    assert queue.future_for(14) == "last-in-window" and queue.future_for(15) is None


def test_a_reservation_is_found_before_its_entry_arrives_and_can_be_released() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.reserve(1, "claimed")
    assert queue.future_for(1) == "claimed" and not queue.is_idle()
    queue.release(1)
    assert queue.future_for(1) is None and queue.is_idle()


def test_abandoning_a_gap_drops_what_waits_behind_it_and_moves_past() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(3, "f3", STEP))
    queue.add(Entry(4, "rejected", None))
    queue.add(Entry(5, "f5", STEP))
    assert [e.future_id for e in queue.abandon_gap()] == ["f3", "f5"]  # the rejected one failed already
    assert queue.next_seq_id == 6 and queue.is_idle()
    queue.add(Entry(6, "f6", STEP))
    assert queue.abandon_gap() == []  # no gap: nothing is dropped
    assert [e.future_id for e in queue.ready()] == ["f6"]


def test_resubmission_finds_the_first_future() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(1, "first", STEP))
    assert queue.future_for(1) == "first"
    assert queue.future_for(2) is None


def test_an_entry_rejected_at_submission_is_skipped_not_waited_for() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(2, "f2", STEP))
    queue.add(Entry(1, "rejected", None))
    assert [e.future_id for e in queue.ready()] == ["f2"]
    assert queue.next_seq_id == 2


def _held(queue: RunQueue, seq_id: int, nbytes: int) -> None:
    queue.reserve(seq_id, f"f{seq_id}", nbytes)
    queue.add(Entry(seq_id, f"f{seq_id}", STEP))


def test_requests_past_the_bytes_a_run_may_hold_are_told_to_come_again_and_nothing_is_held() -> None:
    queue = RunQueue(next_seq_id=1, max_bytes=100)
    _held(queue, 3, 60)  # waiting for seq_ids 1 and 2
    queue.reserve(4, "f4", 40)  # exactly at the bound
    with pytest.raises(
        RunQueueFullError, match=r"holds 100 bytes .* this one's 1 would pass the 100"
    ) as refused:
        queue.reserve(5, "f5", 1)
    assert refused.value.status_code == 429 and refused.value.retry_after_s == 1
    assert queue.future_for(5) is None and queue.held_bytes == 100
    queue.release(4)  # a reservation whose record could not be written frees its bytes
    assert queue.held_bytes == 60
    _held(queue, 1, 500)  # the next expected seq_id is always taken: without it the run could not go on
    assert queue.held_bytes == 560


def test_held_bytes_are_freed_as_requests_run_fail_or_are_abandoned() -> None:
    queue = RunQueue(next_seq_id=1, max_bytes=1000)
    for seq_id in (1, 2, 4):
        _held(queue, seq_id, 100)
    queue.reserve(3, "f3", 0)
    queue.add(Entry(3, "f3", None))  # refused at submission: holds nothing, skipped when its turn comes
    queue.pop(1)
    assert queue.held_bytes == 200
    queue.pop(1)  # seq 2; seq 3 is skipped over
    assert queue.held_bytes == 100 and queue.next_seq_id == 4
    queue.pop(1)
    assert queue.held_bytes == 0 and queue.next_seq_id == 5
    _held(queue, 7, 300)
    assert [e.seq_id for e in queue.abandon_all()] == [7] and queue.held_bytes == 0
