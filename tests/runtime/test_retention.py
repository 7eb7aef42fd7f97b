"""Retention: results, unnamed snapshots and expired checkpoints are deleted on schedule, nothing a request
still reads is deleted under it, and what a server keeps stays bounded however long it runs."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from loraplex.cli import main
from loraplex.engine.types import AdamParams, SampleRequest, SamplingParams
from loraplex.errors import NotFoundError
from loraplex.runtime.control.store.schema import RunRow
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import (
    CreateRunFromCheckpoint,
    LoadState,
    OptimStep,
    SaveSnapshot,
    SaveState,
)
from loraplex.timestamps import utcnow
from tests.runtime.conftest import PHRASE, create_run, held, result_of, sft_pass, train_steps

SHORT = {"future_retention_s": 0.3, "snapshot_idle_s": 0.2, "retention_sweep_s": 0.05}


# A deadline for what housekeeping does eventually, not a timing: in the whole suite on the CI machine
# (twice, December 5) two runs were not both parked 5 s after their sessions ended, though here they are
# within 1.6 s alone, in tests/runtime and beside tests/engine and tests/model; the cause is not found yet.
def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _dir_size(root: Path) -> int:
    """Bytes under `root`; housekeeping may delete files while they are counted (os.walk skips what
    vanished)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += (Path(directory) / name).stat().st_size
    return total


def test_a_result_is_pruned_after_the_window_with_a_clear_error_and_the_run_resumes_past_it(
    service_factory, tmp_path
) -> None:
    service = service_factory(session_timeout_s=0.3, **SHORT)
    run = create_run(service)
    first = service.training.submit("local", run, 1, sft_pass())
    assert result_of(service, first).status == "complete"
    train_steps(service, run, 2, first_seq=2)  # seq 2..5
    _wait_until(lambda: service.store.count_futures() == 0)  # every finished result aged out
    service.futures._done.clear()  # as after a restart: only the database answers
    with pytest.raises(NotFoundError, match=r"finished more than 0.3 s ago \(this server keeps results"):
        service.futures.get(first.id, "local")
    _wait_until(lambda: service.catalog.run("local", run).status == "parked")  # its lease lapsed
    service.stop()

    after = service_factory(subdir="data", **SHORT)  # a restart on the same data dir
    # The log resumes after seq 5 although no future of the run is left: seq 6 runs at once.
    assert train_steps(after, run, 1, first_seq=6)[0] > 0


def test_a_150_step_rl_loop_keeps_snapshots_results_and_the_data_dir_bounded(
    service_factory, tmp_path
) -> None:
    service = service_factory(**SHORT)
    run = create_run(service)
    counts: list[tuple[int, int, int]] = []
    for step in range(150):
        seq = 1 + 3 * step
        service.training.submit("local", run, seq, sft_pass())
        service.training.submit("local", run, seq + 1, OptimStep(AdamParams(learning_rate=0.01)))
        session = service.training.run_state("local", run).session_id
        sampler = f"{session}:sample:{step}"
        saved = service.training.submit("local", run, seq + 2, SaveSnapshot(None, sampler))
        assert result_of(service, saved).status == "complete"
        request = SampleRequest(PHRASE, SamplingParams(max_tokens=4, seed=step), 2)
        assert result_of(service, service.samplers.sample("local", sampler, 0, request)).status == "complete"
        if step % 10 == 9:
            snapshots = len(list((tmp_path / "data" / "snapshots").iterdir()))
            counts.append((snapshots, service.store.count_futures(), _dir_size(tmp_path / "data")))
            time.sleep(0.3)  # a slower stretch of the loop: everything older than the windows goes
    worst = tuple(max(c[i] for c in counts) for i in range(3))
    # Without retention: 150 snapshot dirs and 600 results, growing with every step.
    assert worst[0] <= 40 and worst[1] <= 160, counts
    assert counts[-1][2] <= 2 * counts[1][2], counts  # the data dir does not grow with the step count
    _wait_until(lambda: not list((tmp_path / "data" / "snapshots").iterdir()))
    _wait_until(lambda: service.store.count_futures() == 0)
    assert service.store.all_samplers() == []


def test_a_checkpoint_past_its_ttl_is_deleted_unless_a_queued_load_reads_it(
    service_factory, tmp_path
) -> None:
    service = service_factory(retention_sweep_s=0.05)
    run = create_run(service)
    short = result_of(service, service.training.submit("local", run, 1, SaveState("short", ttl_seconds=1)))
    kept = result_of(service, service.training.submit("local", run, 2, SaveState("kept", ttl_seconds=1)))
    assert short.status == kept.status == "complete"
    kept_path = CheckpointPath.parse(kept.result["path"])
    # A load of `kept` waits behind seq 3, which has not arrived: it reads the checkpoint later.
    load = service.training.submit("local", run, 4, LoadState(kept_path, with_optimizer=True))
    checkpoints = tmp_path / "data" / "checkpoints" / run / "weights"
    _wait_until(lambda: not (checkpoints / "short").exists())
    assert [v.path.name for v in service.catalog.checkpoints("local", run)] == ["kept"]
    time.sleep(0.2)  # several more sweeps
    assert (checkpoints / "kept").is_dir()
    assert result_of(service, service.training.submit("local", run, 3, sft_pass())).status == "complete"
    assert result_of(service, load).status == "complete"  # loaded whole, then free to go
    _wait_until(lambda: not (checkpoints / "kept").exists())


def test_start_up_removes_what_a_crash_during_a_save_left_and_restores_a_set_aside_checkpoint(
    service_factory, tmp_path
) -> None:
    service = service_factory()
    run = create_run(service)
    assert (
        result_of(service, service.training.submit("local", run, 1, SaveState("ckpt"))).status == "complete"
    )
    service.stop()
    weights = tmp_path / "data" / "checkpoints" / run / "weights"
    (weights / ".half.tmp-abc123").mkdir()  # a save that died while writing
    (weights / ".old.staging-1a2b3c4d").mkdir()  # loraplex 0.1's staging directory
    (weights / "ckpt").rename(weights / ".ckpt.old-zz9")  # died between the two renames of an overwrite

    after = service_factory(subdir="data")
    assert sorted(p.name for p in weights.iterdir()) == ["ckpt"]
    assert after.catalog.checkpoints("local", run)[0].path.name == "ckpt"


def test_ten_thousand_idle_runs_are_not_planned_over(service_factory, tmp_path, monkeypatch) -> None:
    first = service_factory()
    now = utcnow()
    rows = [
        RunRow(
            id=f"old{i}:train:0",
            session_id=f"old{i}",
            tenant="local",
            base_model="fake/bigram",
            lora_config={"rank": 4},
            user_metadata={},
            status="parked",
            created_at=now,
            last_request_at=now,
        )
        for i in range(10_000)
    ]
    with first.store._session.begin() as session:  # one transaction: the Store has no bulk insert
        session.add_all(rows)
    first.stop()

    service = service_factory(subdir="data")
    assert len(service.state.runs) == 10_000  # all known (lost: their parked state is not on disk)
    planned: list[int] = []
    plan = service.engine_loop.scheduler.plan

    def counting(runs, now):
        runs = list(runs)
        planned.append(len(runs))
        return plan(runs, now)

    monkeypatch.setattr(service.engine_loop.scheduler, "plan", counting)
    run = create_run(service)
    train_steps(service, run, 2)
    assert planned and max(planned) == 1  # the one run with work; the idle ones cost nothing


def test_doctor_reports_usage_by_kind_and_what_retention_would_remove(
    service_factory, tmp_path, capsys
) -> None:
    service = service_factory()
    run = create_run(service)
    assert (
        result_of(service, service.training.submit("local", run, 1, SaveState("gone", ttl_seconds=1))).status
        == "complete"
    )
    train_steps(service, run, 1, first_seq=2)
    service.stop()
    time.sleep(1.1)
    data = str(tmp_path / "data")
    assert main(["doctor", "--data-dir", data, "--future-retention-s", "0.001"]) == 0
    report = capsys.readouterr().out
    assert "checkpoints (training)" in report and "database" in report
    assert "retention would remove:" in report and "4 request results finished over 0.001 s ago" in report
    assert f"1 expired checkpoints: tinker://{run}/weights/gone" in report
    assert (tmp_path / "data" / "checkpoints" / run / "weights" / "gone").is_dir()  # doctor changes nothing

    assert main(["gc", "--data-dir", data, "--future-retention-s", "0.001"]) == 0
    assert "removed:" in capsys.readouterr().out
    assert not (tmp_path / "data" / "checkpoints" / run / "weights" / "gone").exists()
    assert main(["doctor", "--data-dir", data]) == 0


def test_a_sweep_never_deletes_a_sampler_that_a_request_took_meanwhile(
    service_factory, tmp_path, monkeypatch
) -> None:
    service = service_factory(snapshot_idle_s=0.2, retention_sweep_s=3600.0)  # swept by hand below
    run = create_run(service)
    sampler = run.replace(":train:0", ":sample:0")
    saved = service.training.submit("local", run, 1, SaveSnapshot(None, sampler_id=sampler))
    assert result_of(service, saved).status == "complete"
    time.sleep(0.3)  # unused past snapshot_idle_s: the sweep finds it due
    snapshot = tmp_path / "data" / "snapshots" / sampler
    request = SampleRequest(PHRASE, SamplingParams(max_tokens=3, seed=1))
    taken: list[str] = []
    delete = service.store.delete_unused_sampler

    def request_first(sampler_id, last_used_at):  # a request is accepted between the look and the delete
        taken.append(service.samplers.sample("local", sampler, 0, request).id)
        return delete(sampler_id, last_used_at)

    monkeypatch.setattr(service.store, "delete_unused_sampler", request_first)
    removal = service.housekeeping.sweep()
    assert removal.samplers == [] and snapshot.is_dir()
    assert result_of(service, service.futures.get(taken[0], "local")).status == "complete"


def test_an_ended_sessions_runs_lose_their_parked_state_after_parked_retention_s_but_never_a_checkpoint(
    service_factory, tmp_path
) -> None:
    service = service_factory(session_timeout_s=0.2, parked_retention_s=0.5, retention_sweep_s=0.1)
    kept, dropped = create_run(service, seed=1), create_run(service, seed=2)
    train_steps(service, kept, 1)
    train_steps(service, dropped, 1)
    saved = service.training.submit("local", kept, 3, SaveState("keep"))
    assert result_of(service, saved).status == "complete"
    sessions = {run: service.training.run_state("local", run).session_id for run in (kept, dropped)}
    for session in sessions.values():
        service.sessions.finish(session, "local", "success")
    parked = tmp_path / "data" / "parked"
    # Parked once ended, each in its turn: on a busy host one run's parked state may be deleted (0.5 s
    # unused) before the other's is written, so each is looked for on its own.
    seen: set[str] = set()

    def both_parked() -> bool:
        seen.update(run for run in (kept, dropped) if (parked / run).is_dir())
        return seen == {kept, dropped}

    _wait_until(both_parked)
    _wait_until(lambda: not any(parked.iterdir()))  # ... and deleted once unused past 0.5 s

    checkpoint = tmp_path / "data" / "checkpoints" / kept / "weights" / "keep"
    assert checkpoint.is_dir()  # named checkpoints are never deleted by this
    assert service.store.get_run(kept).status == "expired"  # its checkpoint names it: its row stays
    _wait_until(lambda: service.store.get_run(dropped) is None)  # nothing left of it
    assert service.state.run(kept) is None and service.state.run(dropped) is None  # nor in memory
    _wait_until(lambda: service.store.get_session(sessions[dropped]) is None)
    assert service.store.get_session(sessions[kept]) is not None  # still holds a run
    with pytest.raises(NotFoundError, match=r"live state was deleted \(--parked-retention-s\)"):
        service.training.submit("local", kept, 4, sft_pass())
    resumed_session = service.sessions.create("local", {})
    source = CheckpointPath.parse(f"tinker://{kept}/weights/keep")
    resumed = service.training.create_run("local", resumed_session, 0, CreateRunFromCheckpoint(source, True))
    assert result_of(service, resumed).status == "complete"


def test_a_run_the_engine_loop_holds_or_a_live_session_uses_keeps_its_parked_state(
    service_factory, tmp_path
) -> None:
    service = service_factory(session_timeout_s=0.2, parked_retention_s=0.3, retention_sweep_s=3600.0)
    busy = create_run(service, seed=1)
    train_steps(service, busy, 1)
    service.sessions.finish(service.training.run_state("local", busy).session_id, "local", "success")
    parked = tmp_path / "data" / "parked"
    _wait_until(lambda: (parked / busy).is_dir())
    time.sleep(0.4)  # unused past parked_retention_s
    with held(service):  # a request of the parked run is queued when the sweep comes
        waiting = service.training.submit("local", busy, 3, sft_pass(forward_only=True))
        removal = service.housekeeping.sweep()
        # Checked while the loop is held: once it runs, it brings the run back and its parked state goes.
        assert busy not in removal.expired_runs and (parked / busy).is_dir()
    assert result_of(service, waiting).status == "complete"  # it came back from its parked state

    # A session that heartbeats keeps its runs, however long they go unused.
    live = create_run(service, seed=2)
    train_steps(service, live, 1)
    live_session = service.training.run_state("local", live).session_id
    for _ in range(5):
        service.sessions.heartbeat(live_session, "local")
        time.sleep(0.1)
    assert live not in service.housekeeping.sweep().expired_runs
    assert service.state.run(live) is not None


def test_doctor_reports_parked_bytes_and_the_parked_state_the_next_sweep_removes(
    service_factory, tmp_path, capsys
) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 1)
    service.stop()  # parks the run
    parked = tmp_path / "data" / "parked" / run
    size_mib = sum(f.stat().st_size for f in parked.rglob("*") if f.is_file()) / 2**20
    data = str(tmp_path / "data")
    options = ["--data-dir", data, "--session-timeout-s", "0.001", "--parked-retention-s", "0.001"]
    time.sleep(0.01)
    assert main(["doctor", *options]) == 0
    report = capsys.readouterr().out
    assert "parked" in report and f"{size_mib:.1f} MiB" in report
    assert f"the parked state of 1 runs ({size_mib:.1f} MiB) unused for 0.001 s" in report
    assert "the rows of 1 of them with no checkpoint left" in report
    assert parked.is_dir()  # doctor changes nothing
    assert main(["gc", *options]) == 0
    assert not parked.exists()


def test_a_request_naming_a_run_id_no_database_can_hold_is_not_found_never_a_server_error(
    service_factory,
) -> None:
    service = service_factory()
    with pytest.raises(NotFoundError, match="not found"):  # a lone surrogate: no UTF-8 store can hold it
        service.training.submit("local", "\ud800", 1, sft_pass())


def test_a_sweep_tells_the_sampler_backend_each_snapshot_it_deleted(service_factory, tmp_path) -> None:
    """The vLLM sampler unloads a deleted snapshot (runtime/vllm/server.py): housekeeping hands it every
    directory a sweep removed."""
    service = service_factory(snapshot_idle_s=0.2, retention_sweep_s=3600.0)  # swept by hand below
    assert service.housekeeping.on_removed == service.sampler.forget_snapshot
    removed: list[Path] = []
    service.housekeeping.on_removed = removed.append
    run = create_run(service)
    sampler = run.replace(":train:0", ":sample:0")
    saved = service.training.submit("local", run, 1, SaveSnapshot(None, sampler_id=sampler))
    assert result_of(service, saved).status == "complete"
    time.sleep(0.3)  # unused past snapshot_idle_s
    assert service.housekeeping.sweep().samplers == [sampler]
    assert removed == [tmp_path / "data" / "snapshots" / sampler]
