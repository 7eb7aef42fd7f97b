"""RunQueue: commands run in seq_id order; gaps hold later commands; rejected entries never block."""

from __future__ import annotations

import pytest

from loraplex.engine.types import AdamParams
from loraplex.errors import UserError
from loraplex.runtime.commands import OptimStep
from loraplex.runtime.run_queue import Entry, RunQueue

STEP = OptimStep(AdamParams())


def test_out_of_order_commands_wait_until_the_gap_is_filled() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(3, "f3", STEP))
    queue.add(Entry(2, "f2", STEP))
    assert queue.ready() == []
    queue.add(Entry(1, "f1", STEP))
    assert [e.future_id for e in queue.ready()] == ["f1", "f2", "f3"]


def test_popped_commands_advance_the_log_and_cannot_be_resubmitted() -> None:
    queue = RunQueue(next_seq_id=1)
    queue.add(Entry(1, "f1", STEP))
    assert [e.seq_id for e in queue.pop(1)] == [1]
    assert queue.next_seq_id == 2
    with pytest.raises(UserError, match="already executed"):
        queue.add(Entry(1, "again", STEP))


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
