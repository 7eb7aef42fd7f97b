"""Scheduler: one pass packs every tenant's ready datums (fairly, within budget); optim steps fuse; a pass
waits briefly for the recently active runs still sending theirs."""

from __future__ import annotations

import numpy as np

from loraplex.engine.types import AdamParams, DatumInput
from loraplex.runtime.core.commands import ForwardBackward, OptimStep, SaveState
from loraplex.runtime.core.run_queue import PARKED, Entry, RunQueue, RunState
from loraplex.runtime.core.scheduler import BarrierWork, Gathering, OptimWork, PassWork, Scheduler


def _pass(tokens: int) -> ForwardBackward:
    ids = np.zeros(tokens, np.int64)
    return ForwardBackward("cross_entropy", {}, [DatumInput(ids, {"target_tokens": ids})], False)


def _run(run_id: str, tenant: str, *commands: object) -> RunState:
    queue = RunQueue(next_seq_id=1)
    for seq, command in enumerate(commands, start=1):
        queue.add(Entry(seq, f"{run_id}-{seq}", command))  # type: ignore[arg-type]
    return RunState(run_id, tenant, "s", "m", queue, slot=_slot_of(run_id))


def _slot_of(run_id: str) -> int:
    """Runs of these tests hold a slot (residency has tests of its own below): a distinct one by name."""
    return sum(ord(c) for c in run_id) % 1000


def _send(run: RunState, command: object, at: float) -> None:
    """Submit `command` as the run's next seq_id at time `at`."""
    seq = run.queue.next_seq_id + len(run.queue.pending())
    run.queue.add(Entry(seq, f"{run.run_id}-{seq}", command, at))  # type: ignore[arg-type]


def _ids(work: PassWork | OptimWork) -> list[str]:
    return [entry.future_id for _, entry in work.items]


def test_one_pass_packs_all_tenants_then_one_fused_step_covers_every_run_at_optim() -> None:
    a = _run("a", "alice", _pass(4), _pass(4), OptimStep(AdamParams()))
    b = _run("b", "bob", _pass(4), OptimStep(AdamParams()))
    scheduler = Scheduler(capacity=8, token_budget=100)
    passes, steps = scheduler.plan([a, b], now=0.0).work, scheduler.plan([a, b], now=0.0).work
    assert [type(w) for w in passes + steps] == [PassWork, OptimWork]
    assert sorted(_ids(passes[0])) == ["a-1", "a-2", "b-1"]  # type: ignore[arg-type]
    assert sorted(_ids(steps[0])) == ["a-3", "b-2"]  # type: ignore[arg-type]


def test_optim_steps_arriving_during_a_pass_join_one_fused_step() -> None:
    a = _run("a", "alice", _pass(4), OptimStep(AdamParams()))
    b = _run("b", "bob", _pass(4))
    scheduler = Scheduler(capacity=8, token_budget=100)
    assert [type(w) for w in scheduler.plan([a, b], now=0.0).work] == [PassWork]
    _send(b, OptimStep(AdamParams()), at=0.01)  # b's step lands while the pass runs
    (step,) = scheduler.plan([a, b], now=0.02).work
    assert sorted(_ids(step)) == ["a-2", "b-2"]  # type: ignore[arg-type]


def test_token_budget_interleaves_tenants_round_robin_so_a_big_tenant_cannot_starve_others() -> None:
    big = _run("big", "alice", *[_pass(10) for _ in range(5)])
    small = _run("small", "bob", _pass(10))
    plan = Scheduler(capacity=8, token_budget=30).plan([big, small], now=0.0).work
    assert _ids(plan[0]) == ["big-1", "small-1", "big-2"]  # type: ignore[arg-type]
    assert big.queue.next_seq_id == 3 and small.queue.next_seq_id == 2


def test_the_first_tenant_rotates_between_plans() -> None:
    scheduler = Scheduler(capacity=8, token_budget=10)
    first = scheduler.plan([_run("a", "alice", _pass(10)), _run("b", "bob", _pass(10))], now=0.0).work
    second = scheduler.plan([_run("a", "alice", _pass(10)), _run("b", "bob", _pass(10))], now=0.0).work
    assert (_ids(first[0]), _ids(second[0])) == (["a-1"], ["b-1"])  # type: ignore[arg-type]


def test_an_oversized_command_still_runs_alone() -> None:
    plan = Scheduler(capacity=8, token_budget=5).plan([_run("a", "alice", _pass(50))], now=0.0).work
    assert _ids(plan[0]) == ["a-1"]  # type: ignore[arg-type]


def test_a_barrier_waits_for_the_passes_before_it_and_runs_alone() -> None:
    run = _run("a", "alice", _pass(2), SaveState("s1"), _pass(2))
    scheduler = Scheduler(capacity=8, token_budget=100)
    plan = scheduler.plan([run], now=0.0).work + scheduler.plan([run], now=0.0).work
    assert [type(w) for w in plan] == [PassWork, BarrierWork]
    assert _ids(plan[0]) == ["a-1"]  # type: ignore[arg-type]
    assert plan[1].entry.future_id == "a-2"  # type: ignore[union-attr]
    assert [e.future_id for e in run.queue.ready()] == ["a-3"]


GATHER = Gathering(quiet_s=0.025, max_wait_s=0.1, active_s=10.0)


def _trained_together(*run_ids: str) -> tuple[Scheduler, list[RunState]]:
    """A scheduler that has just run one pass of every named run (so it expects them back)."""
    scheduler = Scheduler(capacity=8, token_budget=1000, gathering=GATHER)
    runs = [_run(run_id, "alice", _pass(4)) for run_id in run_ids]
    assert [type(w) for w in scheduler.plan(runs, now=0.0).work] == [PassWork]
    return scheduler, runs


def test_a_pass_waits_for_the_runs_that_trained_with_it_and_runs_the_moment_the_last_arrives() -> None:
    scheduler, (a, b, c) = _trained_together("a", "b", "c")
    _send(a, _pass(4), at=1.000)
    assert scheduler.plan([a, b, c], now=1.001).work == []
    assert scheduler.wake_at == 1.025  # quiet window after the last arrival
    _send(b, _pass(4), at=1.010)
    assert scheduler.plan([a, b, c], now=1.011).work == []
    assert scheduler.wake_at == 1.035
    _send(c, _pass(4), at=1.020)
    plan = scheduler.plan([a, b, c], now=1.021).work
    assert sorted(_ids(plan[0])) == ["a-2", "b-2", "c-2"]  # type: ignore[arg-type]
    assert scheduler.wake_at is None


def test_a_held_pass_runs_once_arrivals_go_quiet() -> None:
    scheduler, (a, b) = _trained_together("a", "b")
    _send(a, _pass(4), at=1.0)
    assert scheduler.plan([a, b], now=1.02).work == []
    assert _ids(scheduler.plan([a, b], now=1.025).work[0]) == ["a-2"]  # type: ignore[arg-type]


def test_gathering_never_holds_a_pass_longer_than_max_wait() -> None:
    scheduler, runs = _trained_together("a", "b", "c", "d", "e", "f", "g")
    *arriving, missing = runs
    for i, run in enumerate(arriving):  # a steady trickle, each within the quiet window of the last
        _send(run, _pass(4), at=1.0 + 0.02 * i)
        now = 1.0 + 0.02 * i + 0.001
        plan = scheduler.plan(runs, now=now).work
        if now < 1.1:
            assert plan == [] and scheduler.wake_at == min(now - 0.001 + 0.025, 1.1)
        else:
            assert len(_ids(plan[0])) == i + 1  # type: ignore[arg-type]
            break
    else:
        raise AssertionError("the pass was held past max_wait_s")
    assert missing.queue.ready() == []


def test_a_lone_client_and_a_full_budget_never_wait() -> None:
    scheduler, (a,) = _trained_together("a")
    _send(a, _pass(4), at=1.0)
    assert _ids(scheduler.plan([a], now=1.0).work[0]) == ["a-2"]  # type: ignore[arg-type]
    scheduler, (a, b) = _trained_together("a", "b")
    scheduler.token_budget = 8
    _send(a, _pass(4), at=1.0)
    _send(a, _pass(4), at=1.0)
    assert _ids(scheduler.plan([a, b], now=1.0).work[0]) == ["a-2", "a-3"]  # type: ignore[arg-type]


def test_runs_idle_past_active_s_are_not_waited_for_and_other_work_is_not_held() -> None:
    scheduler, (a, b, c) = _trained_together("a", "b", "c")
    _send(a, _pass(4), at=20.0)  # b and c last trained 20 s ago: a runs at once
    assert _ids(scheduler.plan([a, b, c], now=20.0).work[0]) == ["a-2"]  # type: ignore[arg-type]
    _send(a, _pass(4), at=21.0)  # now b is expected (fresh from its pass below), yet b's optim step runs
    _send(b, OptimStep(AdamParams()), at=21.0)
    scheduler._trained_at["c"] = 21.0
    plan = scheduler.plan([a, b, c], now=21.001).work
    assert [type(w) for w in plan] == [OptimWork] and _ids(plan[0]) == ["b-2"]  # type: ignore[arg-type]


def test_a_stream_of_passes_does_not_starve_another_runs_step_or_barrier() -> None:
    busy = _run("busy", "alice", *[_pass(4) for _ in range(3)])
    stepping = _run("stepping", "bob", OptimStep(AdamParams()), SaveState("s1"))
    scheduler = Scheduler(capacity=8, token_budget=4)  # one pass command per plan
    kinds = [[type(w).__name__ for w in scheduler.plan([busy, stepping], now=0.0).work] for _ in range(4)]
    assert kinds == [["PassWork"], ["OptimWork", "BarrierWork"], ["PassWork"], ["PassWork"]]


# --- residency: which runs hold the engine's slots while the plan runs
def _resident(run_id: str, *commands: object, pinned: bool = False, last_active: float = 0.0) -> RunState:
    """A run holding a slot; pinned = it holds gradients not yet stepped."""
    run = _run(run_id, "alice", *commands)
    run.pending_gradients, run.last_active = pinned, last_active
    return run


def _waiter(run_id: str, at: float, *commands: object) -> RunState:
    """A parked run whose commands (a pass unless given) arrived at time `at`."""
    queue = RunQueue(next_seq_id=1)
    for seq, command in enumerate(commands or (_pass(4),), start=1):
        queue.add(Entry(seq, f"{run_id}-{seq}", command, at))  # type: ignore[arg-type]
    return RunState(run_id, "bob", "s", "m", queue, status=PARKED)


def _names(runs: list[RunState]) -> list[str]:
    return [run.run_id for run in runs]


def test_runs_without_a_slot_are_given_free_slots_oldest_first() -> None:
    late, early, middle = _waiter("late", 3.0), _waiter("early", 1.0), _waiter("middle", 2.0)
    scheduler = Scheduler(capacity=2, token_budget=100, slot_wait_s=2.0)
    plan = scheduler.plan([late, early, middle], now=4.0)
    assert (_names(plan.admits), plan.parks, plan.work) == (["early", "middle"], [], [])
    assert scheduler.wake_at == 5.0  # `late` may claim a pinned slot once it has waited slot_wait_s
    assert [run.waiting_since for run in (late, early, middle)] == [3.0, 1.0, 2.0]


def test_idle_runs_are_parked_for_waiters_the_least_recently_active_first() -> None:
    busy = _resident("busy", _pass(4), last_active=1.0)
    idle_recent, idle_old = _resident("idle_recent", last_active=5.0), _resident("idle_old", last_active=3.0)
    waiters = [_waiter("w1", 5.5), _waiter("w2", 5.6)]
    plan = Scheduler(capacity=3, token_budget=100).plan([busy, idle_recent, idle_old, *waiters], now=6.0)
    assert (_names(plan.parks), _names(plan.admits)) == (["idle_old", "idle_recent"], ["w1", "w2"])
    assert [_ids(w) for w in plan.work] == [["busy-1"]]  # type: ignore[arg-type]


def test_idle_runs_are_parked_for_waiters_once_requests_stop_arriving() -> None:
    """A step of four runs on two slots arrives one request after another, the waiters' first: the resident
    runs, idle when those land, are not swapped out for a moment before their own requests come."""
    a, b = _resident("a", last_active=0.0), _resident("b", last_active=0.0)
    c, d = _waiter("c", 10.000), _waiter("d", 10.002)
    gathering = Gathering(quiet_s=0.025, max_wait_s=0.1)
    scheduler = Scheduler(capacity=2, token_budget=100, gathering=gathering, slot_wait_s=2.0)
    plan = scheduler.plan([a, b, c, d], now=10.003)
    assert (plan.parks, plan.admits, plan.work) == ([], [], [])
    assert scheduler.wake_at == 10.002 + 0.025  # quiet_s after the last arrival
    _send(a, _pass(4), at=10.004)  # a's own step arrives; b sends nothing
    plan = scheduler.plan([a, b, c, d], now=10.010)
    assert (plan.parks, plan.admits, [_ids(w) for w in plan.work]) == ([], [], [["a-1"]])  # type: ignore[arg-type]
    a.pending_gradients = True  # as the worker marks it once the pass ran
    plan = scheduler.plan([a, b, c, d], now=10.029)  # quiet since 10.004: b, idle, makes room for c
    assert (_names(plan.parks), _names(plan.admits)) == (["b"], ["c"])

    # A stream of arrivals defers the parks max_wait_s after the first waiter's request at most.
    e, f = _resident("e"), _waiter("f", 20.0)
    scheduler = Scheduler(capacity=1, token_budget=100, gathering=gathering, slot_wait_s=2.0)
    for now in (20.02, 20.05, 20.08):
        _send(f, _pass(4), at=now)
        assert not scheduler.plan([e, f], now=now).parks
    assert scheduler.wake_at == 20.0 + 0.1
    assert _names(scheduler.plan([e, f], now=20.1).parks) == ["e"]


def test_runs_with_work_ready_run_it_before_a_waiter_takes_their_slot_until_it_waited_slot_wait_s() -> None:
    """Twice as many runs as slots, each with a step ready: the resident ones step, the others wait (each
    swap is a copy of a run's state out and back); a waiter past slot_wait_s takes the least recently
    active busy run's slot, one without gradients before one with."""
    runs = [_resident(name, _pass(4), last_active=t) for name, t in (("b2", 2.0), ("b1", 1.0), ("b3", 3.0))]
    waiter = _waiter("w", 5.0)
    scheduler = Scheduler(capacity=3, token_budget=100, slot_wait_s=2.0)
    plan = scheduler.plan([*runs, waiter], now=6.0)
    assert (plan.parks, plan.admits) == ([], [])
    assert sorted(_ids(plan.work[0])) == ["b1-1", "b2-1", "b3-1"]  # type: ignore[arg-type]
    assert scheduler.wake_at == 7.0

    runs = [_resident(name, _pass(4), last_active=t) for name, t in (("b2", 2.0), ("b1", 1.0), ("b3", 3.0))]
    runs[1].pending_gradients = True  # b1, least recently active, holds gradients: b2 goes first
    plan = Scheduler(capacity=3, token_budget=100, slot_wait_s=2.0).plan([*runs, waiter], now=7.0)
    assert (_names(plan.parks), _names(plan.admits)) == (["b2"], ["w"])
    assert sorted(_ids(plan.work[0])) == ["b1-1", "b3-1"]  # type: ignore[arg-type]


def test_a_run_holding_gradients_keeps_its_slot_until_a_waiter_has_waited_slot_wait_s() -> None:
    pinned = _resident("pinned", pinned=True, last_active=0.5)  # its optim_step has not arrived yet
    waiter = _waiter("w", 1.0)
    scheduler = Scheduler(capacity=1, token_budget=100, slot_wait_s=2.0)
    for now in (1.0, 2.0, 2.999):
        plan = scheduler.plan([pinned, waiter], now=now)
        assert (plan.parks, plan.admits, plan.work) == ([], [], [])
        assert scheduler.wake_at == 3.0  # the worker looks again when the waiter may take the slot
    plan = scheduler.plan([pinned, waiter], now=3.0)
    assert (_names(plan.parks), _names(plan.admits), plan.work) == (["pinned"], ["w"], [])

    # With an unpinned run to park, a pinned one keeps its slot even past the deadline.
    unpinned = _resident("unpinned", last_active=9.0)
    plan = Scheduler(capacity=2, token_budget=100, slot_wait_s=2.0).plan([pinned, unpinned, waiter], now=10.0)
    assert (_names(plan.parks), _names(plan.admits)) == (["unpinned"], ["w"])


def test_work_is_planned_only_for_runs_that_hold_their_slot_through_the_plan() -> None:
    resident = _resident("r", _pass(4), OptimStep(AdamParams()), last_active=0.0)
    waiter = _waiter("w", 0.5, _pass(4), SaveState("s"))
    scheduler = Scheduler(capacity=1, token_budget=100, slot_wait_s=2.0)
    plan = scheduler.plan([resident, waiter], now=2.5)  # w waited slot_wait_s for busy r
    assert (_names(plan.parks), _names(plan.admits), plan.work) == (["r"], ["w"], [])
    assert resident.queue.next_seq_id == waiter.queue.next_seq_id == 1  # nothing was popped for either

    # The worker parks r and gives w the slot; w does the work it waited for before it can be parked again
    # (parked at once, it would hand the slot straight back and the two would swap without end), and the
    # rest of its ready work (its barrier) before r has waited slot_wait_s in turn.
    resident.slot, resident.status, resident.waiting_since = None, PARKED, 2.5
    waiter.slot, waiter.status, waiter.waiting_since = 3, "live", None
    plan = scheduler.plan([resident, waiter], now=2.6)
    assert (plan.parks, plan.admits, [_ids(w) for w in plan.work]) == ([], [], [["w-1"]])  # type: ignore[arg-type]
    assert scheduler.wake_at == 4.5
    plan = scheduler.plan([resident, waiter], now=2.7)
    assert (plan.parks, plan.admits, [w.entry.future_id for w in plan.work]) == ([], [], ["w-2"])  # type: ignore[union-attr]
    plan = scheduler.plan([resident, waiter], now=2.8)  # w is idle now and not pinned: it yields the slot
    assert (_names(plan.parks), _names(plan.admits), plan.work) == (["w"], ["r"], [])
