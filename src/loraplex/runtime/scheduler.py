"""Scheduler: decides what the engine does next, from the ready commands of every run.

One plan = at most one packed pass (leading batchable commands of all runs, round-robin between
tenants up to a token budget), then one fused optimizer step (every run whose head is optim_step
once its passes are taken), then the remaining barriers one by one. Executing a plan's work items
in order respects every run's seq_id order. Pure planning: no threads, no engine calls, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.runtime.commands import OptimStep, Pass, is_batchable
from loraplex.runtime.run_queue import Entry, RunState


@dataclass
class PassWork:
    """Pass commands of any runs and tenants, run as one engine pass."""

    items: list[tuple[RunState, Entry]]


@dataclass
class OptimWork:
    """optim_step commands of several runs, run as one fused optimizer step."""

    items: list[tuple[RunState, Entry]]


@dataclass
class BarrierWork:
    """One create / save / load command of one run."""

    run: RunState
    entry: Entry


Work = PassWork | OptimWork | BarrierWork


class Scheduler:
    """Plans work; remembers which tenant goes first next time so none starves."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self._rotation = 0

    def plan(self, runs: Iterable[RunState]) -> list[Work]:
        """Pop the next work items from the runs' queues (call under the service lock)."""
        runs = list(runs)
        plan: list[Work] = []
        if items := self._take_passes(runs):
            plan.append(PassWork(items))
        optim = [(run, run.queue.pop(1)[0]) for run in runs if _head_is(run, OptimStep)]
        if optim:
            plan.append(OptimWork(optim))
        for run in runs:
            ready = run.queue.ready()
            if ready and not is_batchable(ready[0].command) and not isinstance(ready[0].command, OptimStep):
                plan.append(BarrierWork(run, run.queue.pop(1)[0]))
        return plan

    def _take_passes(self, runs: list[RunState]) -> list[tuple[RunState, Entry]]:
        """Round-robin over tenants, one command at a time, until the token budget is used.

        A tenant whose next command does not fit stops for this pass (keeping its runs in order);
        the first command always fits, so an oversized one still runs alone.
        """
        by_tenant: dict[str, list[tuple[RunState, Entry]]] = {}
        for run in runs:
            for entry in run.queue.ready():
                if not is_batchable(entry.command):
                    break
                by_tenant.setdefault(run.tenant, []).append((run, entry))
        if not by_tenant:
            return []
        tenants = sorted(by_tenant)
        start = self._rotation % len(tenants)
        self._rotation += 1
        tenants = tenants[start:] + tenants[:start]
        taken: list[tuple[RunState, Entry]] = []
        tokens, cursor, open_tenants = 0, dict.fromkeys(tenants, 0), list(tenants)
        while open_tenants:
            for tenant in list(open_tenants):
                run, entry = by_tenant[tenant][cursor[tenant]]
                cost = _tokens(entry)
                if taken and tokens + cost > self.token_budget:
                    open_tenants.remove(tenant)
                    continue
                taken.append((run, entry))
                tokens += cost
                cursor[tenant] += 1
                if cursor[tenant] == len(by_tenant[tenant]):
                    open_tenants.remove(tenant)
        for run in {id(r): r for r, _ in taken}.values():
            run.queue.pop(sum(1 for r, _ in taken if r is run))
        return taken


def _tokens(entry: Entry) -> int:
    assert isinstance(entry.command, Pass)
    return entry.command.num_tokens


def _head_is(run: RunState, kind: type) -> bool:
    ready = run.queue.ready()
    return bool(ready) and isinstance(ready[0].command, kind)
