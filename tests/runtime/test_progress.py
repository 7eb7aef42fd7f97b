"""Long work in progress: saves, exports and loads are visible while they run, with what they have written
so far, and kept a while once finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.runtime.core.commands import SaveState
from loraplex.runtime.observability.progress import DONE, FAILED, RUNNING, ProgressBoard
from tests.runtime.conftest import create_run, result_of, train_steps


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_running_work_shows_its_elapsed_time_and_the_bytes_its_staging_directory_holds(
    tmp_path: Path,
) -> None:
    clock = Clock()
    board = ProgressBoard(clock=clock)
    target = tmp_path / "checkpoints" / "run" / "weights" / "step-3"
    staging = target.parent / ".step-3.tmp-abc123"  # where durable.write_directory_atomically writes
    staging.mkdir(parents=True)
    with board.track("save checkpoint", "alice", "tinker://run/weights/step-3", writes=target):
        (staging / "weights.safetensors").write_bytes(b"x" * 1000)
        clock.now += 2.5
        (entry,) = board.running()
        assert (entry.kind, entry.tenant, entry.outcome, entry.elapsed_s) == (
            "save checkpoint",
            "alice",
            RUNNING,
            2.5,
        )
        assert entry.written_bytes() == 1000
    assert board.running() == []
    (finished,) = board.finished()
    assert (finished.outcome, finished.elapsed_s, finished.written_bytes()) == (DONE, 2.5, None)


def test_a_load_shows_the_size_it_reads_and_a_failure_is_kept_as_failed(tmp_path: Path) -> None:
    board = ProgressBoard(clock=Clock())
    source = tmp_path / "parked" / "run"
    source.mkdir(parents=True)
    (source / "weights.safetensors").write_bytes(b"y" * 300)
    with pytest.raises(OSError), board.track("load parked run", "bob", "run", reads=source):
        assert board.running()[0].read_total_bytes() == 300
        raise OSError("unreadable")
    assert [p.outcome for p in board.finished()] == [FAILED]


def test_only_the_last_finished_work_is_kept_newest_first() -> None:
    board = ProgressBoard(keep=3, clock=Clock())
    for n in range(5):
        with board.track("park run", "alice", f"run-{n}"):
            pass
    assert [p.subject for p in board.finished()] == ["run-4", "run-3", "run-2"]


def test_the_service_reports_a_checkpoint_save_for_its_run(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 1)
    assert (
        result_of(service, service.training.submit("local", run, 3, SaveState("kept"))).status == "complete"
    )
    saves = [p for p in service.progress.finished() if p.kind == "save checkpoint"]
    assert [(p.subject, p.tenant, p.outcome) for p in saves] == [
        (f"tinker://{run}/weights/kept", "local", DONE)
    ]
