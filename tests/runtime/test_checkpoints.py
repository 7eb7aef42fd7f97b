"""Checkpoints, resume, restart recovery and lease parking, through the Runtime and fake engine."""

from __future__ import annotations

import pytest

from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.recovery import RESTART_ERROR
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import CreateRunFromCheckpoint, SaveSnapshot, SaveState
from tests.fakes import FakeEngine
from tests.runtime.conftest import create_run, result_of, sft_pass, train_steps


def _save(service, run: str, seq: int, name: str, overwrite: bool = False):
    return result_of(
        service, service.training.submit("local", run, seq, SaveState(name, overwrite=overwrite))
    )


def _resume(service, path: str, with_optimizer: bool = True, tenant: str = "local") -> str:
    session = service.sessions.create(tenant, {})
    record = service.training.create_run(
        tenant, session, 0, CreateRunFromCheckpoint(CheckpointPath.parse(path), with_optimizer)
    )
    assert result_of(service, record, tenant).status == "complete"
    return f"{session}:train:0"


def test_resume_with_optimizer_continues_exactly_like_the_uninterrupted_run(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 3)
    path = _save(service, run, 7, "step3").result["path"]
    assert path == f"tinker://{run}/weights/step3"
    uninterrupted = train_steps(service, run, 2, first_seq=8)
    resumed = train_steps(service, _resume(service, path), 2)
    assert resumed == uninterrupted


def test_resume_without_optimizer_starts_fresh_moments_so_the_next_step_differs(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    train_steps(service, run, 3)
    path = _save(service, run, 7, "step3").result["path"]
    uninterrupted = train_steps(service, run, 2, first_seq=8)
    fresh = train_steps(service, _resume(service, path, with_optimizer=False), 2)
    assert fresh[0] == uninterrupted[0] and fresh[1] != uninterrupted[1]


def test_a_duplicate_checkpoint_name_fails_as_a_user_error_unless_overwriting(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    assert _save(service, run, 1, "ckpt").status == "complete"
    duplicate = _save(service, run, 2, "ckpt")
    assert duplicate.category == "user" and "already exists" in duplicate.error
    assert _save(service, run, 3, "ckpt", overwrite=True).status == "complete"
    assert [c.path.name for c in service.catalog.checkpoints("local", run)] == ["ckpt"]


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", ""])
def test_a_checkpoint_name_that_is_not_one_path_segment_is_refused(service_factory, name: str) -> None:
    service = service_factory()
    run = create_run(service)
    record = _save(service, run, 1, name)
    assert record.category == "user" and "invalid checkpoint name" in record.error
    assert not list((service.config.data_dir / "checkpoints").glob("**/escape"))


def test_loading_another_tenants_checkpoint_looks_like_a_missing_one(service_factory) -> None:
    service = service_factory()
    run = create_run(service, "alice")
    path = _save_as(service, "alice", run, "mine")
    with pytest.raises(NotFoundError, match="not found"):
        _resume(service, path, tenant="mallory")


def _save_as(service, tenant: str, run: str, name: str) -> str:
    return result_of(service, service.training.submit(tenant, run, 1, SaveState(name)), tenant).result["path"]


def test_optimizer_state_cannot_be_loaded_from_a_sampler_checkpoint(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    path = result_of(service, service.training.submit("local", run, 1, SaveSnapshot("s1"))).result["path"]
    assert path == f"tinker://{run}/sampler_weights/s1"
    with pytest.raises(UserError, match="holds no optimizer state"):
        _resume(service, path)
    assert _resume(service, path, with_optimizer=False)


def test_an_unnamed_sampler_save_opens_a_sampling_session_over_a_snapshot(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    sampler_id = run.replace(":train:0", ":sample:0")
    record = result_of(
        service, service.training.submit("local", run, 1, SaveSnapshot(None, sampler_id=sampler_id))
    )
    assert record.result == {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
    assert service.catalog.sampler("local", sampler_id).base_model == "fake/bigram"
    assert (service.config.data_dir / "snapshots" / sampler_id / "state.npz").exists()


def test_deleting_a_checkpoint_removes_its_row_and_files(service_factory) -> None:
    service = service_factory()
    run = create_run(service)
    _save(service, run, 1, "old")
    _save(service, run, 2, "new")
    service.catalog.delete_checkpoint("local", CheckpointPath(run, "weights", "old"))
    assert [c.path.name for c in service.catalog.checkpoints("local", run)] == ["new"]
    assert not (service.config.data_dir / "checkpoints" / run / "weights" / "old").exists()


def test_after_a_restart_finished_results_remain_and_in_flight_requests_fail_as_server_errors(
    service_factory,
) -> None:
    before = service_factory()
    run = create_run(before)
    done = before.training.submit("local", run, 1, sft_pass())
    loss = result_of(before, done).result.metrics["loss:sum"]
    path = _save(before, run, 2, "ckpt").result["path"]
    before.engine_loop.stop()  # the process "dies" with seq 3 queued
    in_flight = before.training.submit("local", run, 3, sft_pass())
    before.store.close()

    after = service_factory()
    assert result_of(after, done).result.metrics["loss:sum"] == loss
    lost = result_of(after, in_flight)
    assert (lost.category, lost.error) == ("server", RESTART_ERROR)
    assert (
        after.training.submit("local", run, 3, sft_pass()).id == in_flight.id
    )  # a resend finds the first future
    on_lost_run = result_of(after, after.training.submit("local", run, 4, sft_pass()))
    assert "lost its live state" in on_lost_run.error
    assert [r.run_id for r in after.catalog.runs("local", 10, 0)[0]] == [run]
    assert train_steps(after, _resume(after, path), 1)[0] == pytest.approx(loss)


def test_a_run_whose_lease_lapsed_is_parked_and_resumes_transparently(service_factory) -> None:
    engine = FakeEngine()
    service = service_factory(engine, session_timeout_s=0.2)
    run = create_run(service)
    expected = service_factory(subdir="reference")
    reference = create_run(expected)
    assert train_steps(service, run, 2) == train_steps(expected, reference, 2)
    # No heartbeats: the engine loop parks it, freeing the slot, then records the run as parked.
    _wait_until(lambda: not engine.slots and service.catalog.run("local", run).status == "parked")
    assert train_steps(service, run, 2, first_seq=5) == train_steps(expected, reference, 2, first_seq=5)


@pytest.mark.parametrize("host_slots", [None, 0], ids=["host-tier", "disk-only"])
def test_when_slots_run_out_an_idle_run_is_parked_to_make_room(service_factory, host_slots) -> None:
    service = service_factory(FakeEngine(max_slots=1), host_slots=host_slots)
    first = create_run(service, seed=1)
    losses = train_steps(service, first, 1)
    second = create_run(service, seed=2)
    # To host memory while the host tier has room (the database still says live: it lives in this
    # process only, as a slot does), else to disk.
    assert service.catalog.run("local", first).status == ("parked" if host_slots == 0 else "live")
    assert (service.state.runs[first].host_key is None) == (host_slots == 0)
    assert train_steps(service, second, 1) == losses  # same phrase, base init: same first loss
    assert train_steps(service, first, 1, first_seq=3)[0] < losses[0]  # came back with its trained weights


def _on_host(service_factory, **config) -> tuple[Runtime, str, str, list[float]]:
    """A service of one slot whose first run, trained a step, went to host memory for a second run."""
    engine = FakeEngine(max_slots=1)
    service = service_factory(engine, **config)
    first = create_run(service, seed=1)
    losses = train_steps(service, first, 1)
    second = create_run(service, seed=2)
    assert service.state.runs[first].host_key in engine.offloaded
    return service, first, second, losses


def test_a_run_in_host_memory_goes_to_disk_when_its_lease_lapses_and_resumes_transparently(
    service_factory,
) -> None:
    service, first, _, _ = _on_host(service_factory, session_timeout_s=1.5)
    run = service.state.runs[first]
    _wait_until(lambda: service.catalog.run("local", first).status == "parked")  # no heartbeats
    assert run.host_key is None and (run.parked_dir / "state.npz").is_file()
    assert not service.engine.offloaded
    expected = service_factory(subdir="reference")
    reference = create_run(expected, seed=1)
    assert train_steps(service, first, 2, first_seq=3) == train_steps(expected, reference, 3)[1:]


def test_a_stop_parks_the_runs_in_host_memory_to_disk_and_a_restart_resumes_them(service_factory) -> None:
    before, first, second, _ = _on_host(service_factory)
    before.stop()
    after = service_factory()
    assert {after.catalog.run("local", r).status for r in (first, second)} == {"parked"}
    expected = service_factory(subdir="reference")
    reference = create_run(expected, seed=1)
    assert train_steps(after, first, 1, first_seq=3) == train_steps(expected, reference, 2)[1:]


def test_a_run_in_host_memory_at_a_crash_is_lost_as_a_resident_run_is(service_factory) -> None:
    """The host tier holds live state, as a slot does: a crash loses it (resume from a checkpoint)."""
    before, first, second, _ = _on_host(service_factory)
    before.engine_loop.stop()  # the process dies: nothing is parked
    before.store.close()
    after = service_factory()
    assert {after.catalog.run("local", r).status for r in (first, second)} == {"lost"}
    on_lost_run = result_of(after, after.training.submit("local", first, 3, sft_pass()))
    assert "lost its live state" in on_lost_run.error


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
