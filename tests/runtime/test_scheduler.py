"""Scheduler: one pass packs every tenant's ready datums (fairly, within budget); optim steps fuse."""

from __future__ import annotations

import numpy as np

from loraplex.engine.types import AdamParams, DatumInput
from loraplex.runtime.commands import OptimStep, Pass, SaveState
from loraplex.runtime.run_queue import Entry, RunQueue, RunState
from loraplex.runtime.scheduler import BarrierWork, OptimWork, PassWork, Scheduler


def _pass(tokens: int) -> Pass:
    ids = np.zeros(tokens, np.int64)
    return Pass("cross_entropy", {}, [DatumInput(ids, {"target_tokens": ids})], False)


def _run(run_id: str, tenant: str, *commands: object) -> RunState:
    queue = RunQueue(next_seq_id=1)
    for seq, command in enumerate(commands, start=1):
        queue.add(Entry(seq, f"{run_id}-{seq}", command))  # type: ignore[arg-type]
    return RunState(run_id, tenant, "s", "m", queue)


def _ids(work: PassWork | OptimWork) -> list[str]:
    return [entry.future_id for _, entry in work.items]


def test_one_pass_packs_all_tenants_then_one_fused_step_covers_every_run_at_optim() -> None:
    a = _run("a", "alice", _pass(4), _pass(4), OptimStep(AdamParams()))
    b = _run("b", "bob", _pass(4), OptimStep(AdamParams()))
    plan = Scheduler(token_budget=100).plan([a, b])
    assert [type(w) for w in plan] == [PassWork, OptimWork]
    assert sorted(_ids(plan[0])) == ["a-1", "a-2", "b-1"]  # type: ignore[arg-type]
    assert sorted(_ids(plan[1])) == ["a-3", "b-2"]  # type: ignore[arg-type]


def test_token_budget_interleaves_tenants_round_robin_so_a_big_tenant_cannot_starve_others() -> None:
    big = _run("big", "alice", *[_pass(10) for _ in range(5)])
    small = _run("small", "bob", _pass(10))
    plan = Scheduler(token_budget=30).plan([big, small])
    assert _ids(plan[0]) == ["big-1", "small-1", "big-2"]  # type: ignore[arg-type]
    assert big.queue.next_seq_id == 3 and small.queue.next_seq_id == 2


def test_the_first_tenant_rotates_between_plans() -> None:
    scheduler = Scheduler(token_budget=10)
    first = scheduler.plan([_run("a", "alice", _pass(10)), _run("b", "bob", _pass(10))])
    second = scheduler.plan([_run("a", "alice", _pass(10)), _run("b", "bob", _pass(10))])
    assert (_ids(first[0]), _ids(second[0])) == (["a-1"], ["b-1"])  # type: ignore[arg-type]


def test_an_oversized_command_still_runs_alone() -> None:
    plan = Scheduler(token_budget=5).plan([_run("a", "alice", _pass(50))])
    assert _ids(plan[0]) == ["a-1"]  # type: ignore[arg-type]


def test_a_barrier_waits_for_the_passes_before_it_and_runs_alone() -> None:
    run = _run("a", "alice", _pass(2), SaveState("s1"), _pass(2))
    plan = Scheduler(token_budget=100).plan([run])
    assert [type(w) for w in plan] == [PassWork, BarrierWork]
    assert _ids(plan[0]) == ["a-1"]  # type: ignore[arg-type]
    assert plan[1].entry.future_id == "a-2"  # type: ignore[union-attr]
    assert [e.future_id for e in run.queue.ready()] == ["a-3"]
