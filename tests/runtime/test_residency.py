"""Slot residency and a worker that keeps going, through the Runtime over the fake engine: more
runs than slots all finish with what each gets alone, parked to host memory while the host tier has room
(nothing written to disk) or to disk without it; gradients not yet stepped pin a run to its slot
until a waiter has waited slot_wait_s, and a forced park keeps them exactly; work whose result the
database refuses fails alone and is taken back; two copies of one create_model share one future."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control import writer as writer_module
from loraplex.runtime.control.futures import FutureRecord
from loraplex.runtime.core.commands import CreateRun, OptimStep
from tests.fakes import FakeEngine
from tests.runtime.conftest import PHRASE, create_run, held, result_of, sft_pass

LR = 0.05


def _phrase(seed: int) -> np.ndarray:
    """Each run trains on its own data."""
    return np.random.default_rng(seed).permutation(PHRASE)


def _submit_rounds(service: Runtime, run: str, seed: int, rounds: int) -> list[FutureRecord]:
    """`rounds` x (forward_backward, forward_backward, optim_step), all submitted at once."""
    records, seq = [], 1
    for _ in range(rounds):
        for command in (sft_pass(_phrase(seed)), sft_pass(_phrase(seed + 100)), OptimStep(AdamParams(LR))):
            records.append(service.training.submit("local", run, seq, command))
            seq += 1
    return records


def _outcomes(service: Runtime, records: list[FutureRecord]) -> list[dict[str, float]]:
    """Each request's metrics (loss:sum of a pass, grad_norm of a step); fails on any failed request."""
    out = []
    for record in records:
        done = result_of(service, record)
        assert done.status == "complete", done.error
        result = done.result
        out.append(result.metrics if hasattr(result, "metrics") else result["metrics"])  # type: ignore[index,union-attr]
    return out


def _count_parks(service: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, float]]:
    """Record every park the worker makes: (run id, whether it held gradients, time.monotonic())."""
    parks: list[tuple[str, bool, float]] = []
    executor = service.engine_loop.executor
    original = executor.park

    def park(run):
        parks.append((run.run_id, run.pending_gradients, time.monotonic()))
        return original(run)

    monkeypatch.setattr(executor, "park", park)
    return parks


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _parks_to(service: Runtime) -> dict[str, float]:
    """loraplex_parks_total by where the runs' state went."""
    registry = service.telemetry.registry
    return {to: registry.get_sample_value("loraplex_parks_total", {"to": to}) for to in ("host", "disk")}


# The host tier as sized by default (room for every run here), and disk only.
HOST_TIERS = pytest.mark.parametrize("host_slots", [None, 0], ids=["host-tier", "disk-only"])


@HOST_TIERS
def test_more_runs_than_slots_all_finish_with_what_each_gets_alone(
    service_factory, monkeypatch, host_slots: int | None
) -> None:
    engine = FakeEngine(max_slots=2)
    service = service_factory(engine, slot_wait_s=0.2, host_slots=host_slots)
    seeds = [1, 2, 3, 4, 5]
    runs = {seed: create_run(service, seed=seed) for seed in seeds}
    parks = _count_parks(service, monkeypatch)
    submitted = {seed: _submit_rounds(service, runs[seed], seed, rounds=2) for seed in seeds}
    together = {seed: _outcomes(service, records) for seed, records in submitted.items()}
    assert len(parks) >= 3  # five runs took turns on two slots
    # While the host tier has room nothing is written to disk; without it every park is.
    went, other = ("disk", "host") if host_slots == 0 else ("host", "disk")
    counted = _parks_to(service)  # since start: the creations took turns too
    assert counted[other] == 0 and counted[went] >= len(parks)
    if host_slots is None:
        assert not any((service.layout.data_dir / "parked").glob("*"))

    alone = service_factory(FakeEngine(max_slots=1), subdir="alone")
    for seed in seeds:  # one run at a time: never parked
        run = create_run(alone, seed=seed)
        assert together[seed] == _outcomes(alone, _submit_rounds(alone, run, seed, rounds=2))


@HOST_TIERS
def test_a_run_holding_gradients_keeps_its_slot_until_a_waiter_waited_slot_wait_s_then_keeps_them(
    service_factory, monkeypatch, host_slots: int | None
) -> None:
    engine = FakeEngine(max_slots=1)
    service = service_factory(engine, slot_wait_s=1.0, host_slots=host_slots)
    a = create_run(service, seed=1)
    parks = _count_parks(service, monkeypatch)
    first = _outcomes(service, [service.training.submit("local", a, 1, sft_pass(_phrase(1)))])
    a_state = service.state.runs[a]
    assert a_state.pending_gradients and a_state.slot is not None

    session = service.sessions.create("local", {})
    asked_at = time.monotonic()
    create_b = service.training.create_run(
        "local", session, 0, CreateRun(LoraConfig(rank=4, seed=2), "fake/bigram")
    )
    b_state = service.state.runs[f"{session}:train:0"]
    _wait_until(lambda: b_state.waiting_since is not None)  # the scheduler has seen b wait for a slot
    assert a_state.slot is not None and parks == []  # ... and a, holding gradients, keeps its slot
    assert result_of(service, create_b).status == "complete"
    ((parked, pinned, parked_at),) = parks
    assert (parked, pinned) == (a, True) and parked_at - asked_at >= 1.0
    assert list(engine.slots) == [b_state.slot]
    if host_slots == 0:
        assert service.catalog.run("local", a).status == "parked" and a_state.parked_dir.is_dir()
    else:  # in host memory, gradients included: nothing on disk, and to the database still live
        assert service.catalog.run("local", a).status == "live" and a_state.host_key in engine.offloaded
        assert a_state.parked_dir is None and _parks_to(service) == {"host": 1, "disk": 0}

    # a comes back (b, idle, makes room) with the gradients it was parked with: its step and the loss
    # after it equal those of a run that was never parked.
    later = _outcomes(
        service,
        [
            service.training.submit("local", a, 2, OptimStep(AdamParams(LR))),
            service.training.submit("local", a, 3, sft_pass(_phrase(1))),
        ],
    )
    reference = service_factory(subdir="reference")
    r = create_run(reference, seed=1)
    expected = _outcomes(
        reference,
        [
            reference.training.submit("local", r, 1, sft_pass(_phrase(1))),
            reference.training.submit("local", r, 2, OptimStep(AdamParams(LR))),
            reference.training.submit("local", r, 3, sft_pass(_phrase(1))),
        ],
    )
    assert first + later == expected
    assert expected[1]["grad_norm"] > 0


def _refuse_to_record(service: Runtime, monkeypatch: pytest.MonkeyPatch, doomed: str) -> list[list[str]]:
    """Make the database refuse every write of `doomed`'s outcome; the attempts it saw to write the outcome
    (not those to write, later, that it failed)."""
    original, attempts = service.store.write_batch, []

    def refusing(batch):
        rows = batch.outcomes
        if any(row.id == doomed for row in rows):
            if any(row.id == doomed and row.status == "complete" for row in rows):
                attempts.append([row.id for row in rows])
            raise RuntimeError("disk I/O error (injected)")
        return original(batch)

    monkeypatch.setattr(service.store, "write_batch", refusing)
    return attempts


@pytest.mark.parametrize("refused", ["forward_backward", "optim_step"])
def test_work_whose_result_the_database_refuses_fails_alone_is_taken_back_and_its_retry_counts_once(
    service_factory, monkeypatch, refused: str
) -> None:
    monkeypatch.setattr(writer_module, "RETRY_PAUSES_S", (0.01, 0.02))
    service = service_factory()
    run = create_run(service)
    commands = [sft_pass(), OptimStep(AdamParams(LR)), sft_pass()]
    doomed_at = 0 if refused == "forward_backward" else 1
    records = [
        service.training.submit("local", run, seq, cmd) for seq, cmd in enumerate(commands[:doomed_at], 1)
    ]
    _outcomes(service, records)
    with held(service):  # the worker cannot finish it before the fault is armed
        doomed = service.training.submit("local", run, doomed_at + 1, commands[doomed_at])
        attempts = _refuse_to_record(service, monkeypatch, doomed.id)

    failed = result_of(service, doomed)
    assert (failed.status, failed.category) == ("failed", "server")
    assert "could not record this request's outcome" in failed.error
    assert "(RuntimeError; the server log has the details)" in failed.error  # never the error text
    assert failed.error.endswith("nothing it did was kept, so it can be retried")
    assert attempts == [[doomed.id]] * 3  # the first try and one per pause
    assert service.store.get_future(doomed.id).status == "pending"  # a restart reports it failed
    assert service.engine_loop._thread is not None and service.engine_loop._thread.is_alive()

    # The client retries the failed request, then goes on: every outcome is that of a run that never
    # failed (a pass counted twice would double the step's grad norm; a step twice, move the loss).
    seq = doomed_at + 2
    retried = []
    for command in commands[doomed_at:]:
        retried.append(service.training.submit("local", run, seq, command))
        seq += 1
    reference = service_factory(subdir="reference")
    r = create_run(reference, seed=1)
    expected = _outcomes(
        reference, [reference.training.submit("local", r, i, c) for i, c in enumerate(commands, 1)]
    )
    assert _outcomes(service, records + retried) == expected
    assert expected[1]["grad_norm"] > 0
    assert service.store.get_future(retried[-1].id).status == "complete"


def test_two_racing_copies_of_one_create_model_share_one_future_and_one_slot(
    service_factory, monkeypatch
) -> None:
    engine = FakeEngine(max_slots=4)
    service = service_factory(engine)
    check_new_run, both_checked = service.training._checked_new_run, threading.Barrier(2)

    def checked_together(*args):  # both copies found no run by that id and are about to create it
        checked = check_new_run(*args)
        both_checked.wait(timeout=5)
        return checked

    monkeypatch.setattr(service.training, "_checked_new_run", checked_together)
    for _ in range(3):
        session = service.sessions.create("local", {})

        def copy(session: str = session) -> FutureRecord:
            command = CreateRun(LoraConfig(rank=4, seed=7), "fake/bigram")
            return service.training.create_run("local", session, 0, command)

        with ThreadPoolExecutor(2) as pool:
            first, second = (f.result() for f in [pool.submit(copy), pool.submit(copy)])
        assert first.id == second.id
        assert result_of(service, first).result == {"model_id": f"{session}:train:0", "type": "create_model"}
    assert len(engine.slots) == 3  # one adapter per run, not one per copy
