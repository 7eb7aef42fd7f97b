"""Scheduler: decides what the engine does next, from the ready commands of every run, and which runs hold
the engine's adapter slots while it does.

One plan = residency moves (runs parked to disk, runs given a slot), then one packed pass (leading
batchable commands of the resident runs, round-robin between tenants up to a token budget), or else one
fused optimizer step (every resident run whose head is optim_step) and then the barriers one by one;
after a pass, the steps and barriers go first. Executing a plan in order respects every run's seq_id
order. Planning pops the commands it hands out; it never calls the engine and holds no tensors.

Residency, planned here so that packing and parking cannot undo each other:
- Work is planned only for runs resident when the plan is made; a run parked by this plan is in none of
  its work, and a run given a slot by this plan works from the next plan on. So no request is ever built
  without its run's slot.
- A run holding gradients not yet stepped is pinned: it is not parked to make room, so a forward_backward
  and its optim_step see the same accumulators.
- Runs without a slot that have work wait in one queue, oldest first. When there are more of them than free
  slots, idle resident runs (nothing ready, no gradients) are parked for them, the least recently active
  first, once requests stop arriving (as a pass gathers: `quiet_s` after the last, at most `max_wait_s`
  after the first waiter's), since a resident run idle now may be a few milliseconds from its own step.
  A resident run with work ready keeps its slot until that work is planned: its queued passes and
  steps run before another run is swapped in for it, so K runs on K/2 slots take turns once per step
  instead of parking runs whose work is ready (each swap a copy of its state out and back). Never parked
  either: a run given its slot for work not planned yet (else runs would swap slots without end). A
  waiter that has waited `slot_wait_s` may take a busy or pinned run's slot, busy ones first; a pinned
  run is parked with its gradients, which come back exactly (a client holding gradients on one run while
  it waits on another must not deadlock, and a run streaming work cannot hold its slot forever).

Gathering: clients submit their runs' forward_backwards one HTTP request after another, a few
milliseconds apart. Running the first one the moment it lands would split one step of K runs into a
pass of one run and a pass of the rest, and lose the fusion this service exists for. So while some
run that trained recently has nothing queued and passes are still arriving (the last one less than
`quiet_s` ago), the pass waits, at most `max_wait_s` after the first of them arrived. A lone client
never waits: every run it trains is already ready.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from loraplex.runtime.core.commands import ForwardBackward, OptimStep, is_batchable
from loraplex.runtime.core.run_queue import LOST, Entry, RunState


@dataclass
class PassWork:
    """forward_backward commands of any runs and tenants, run as one engine pass."""

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


@dataclass
class Plan:
    """What the worker does next, in this order: park, give slots, then the work."""

    parks: list[RunState] = field(default_factory=list)  # resident runs to save to disk, freeing their slot
    admits: list[RunState] = field(default_factory=list)  # runs to give a slot: create, or bring back
    work: list[Work] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.parks or self.admits or self.work)


# Each run with its leading ready commands that can join a pass (computed once per plan).
Joinable = list[tuple[RunState, list[Entry]]]


@dataclass(frozen=True)
class Gathering:
    """How long a pass may wait for the runs expected to join it (seconds)."""

    quiet_s: float = 0.025  # run once no pass has arrived for this long
    max_wait_s: float = 0.1  # never hold a pass longer than this after it arrived
    active_s: float = 10.0  # a run that took part in a pass this recently is expected to send another

    def settled_at(self, first_arrival: float, last_arrival: float) -> float:
        """When a burst of requests that began and (so far) ended at these times is taken to be over:
        `quiet_s` after the last, at most `max_wait_s` after the first."""
        return min(last_arrival + self.quiet_s, first_arrival + self.max_wait_s)


@dataclass
class Scheduler:
    """Plans work and residency; remembers which tenant goes first next time so none starves, and which
    runs train."""

    token_budget: int
    capacity: int  # adapter slots the engine holds (--max-slots)
    gathering: Gathering = field(default_factory=Gathering)
    slot_wait_s: float = 2.0  # how long a run waits for a slot before a pinned run is parked for it
    wake_at: float | None = None  # set by plan(): when a held pass or a waiting run must be looked at again
    _rotation: int = 0
    _trained_at: dict[str, float] = field(default_factory=dict)  # run id -> time of its last pass
    _passed_last: bool = False  # the previous plan was a pass
    _admitted: set[str] = field(default_factory=set)  # runs given a slot that have had no work planned since

    def plan(self, runs: Iterable[RunState], now: float) -> Plan:
        """Pop the next work items from the runs' queues (call under the service lock); `now` is
        time.monotonic(), the clock of Entry.arrived_at."""
        runs = list(runs)
        self.wake_at = None
        parks, admits = self._residency(runs, now)
        resident = [run for run in runs if run.slot is not None and all(run is not p for p in parks)]
        work = self._work(resident, now)
        for item in work:
            for run, _ in work_items(item):
                run.last_active = now
                self._admitted.discard(run.run_id)
        self._admitted.update(run.run_id for run in admits)
        return Plan(parks, admits, work)

    def _residency(self, runs: list[RunState], now: float) -> tuple[list[RunState], list[RunState]]:
        """Which resident runs to park and which waiting runs get a slot (see the module docstring)."""
        resident = [run for run in runs if run.slot is not None]
        waiting = [run for run in runs if run.slot is None and run.status != LOST and run.queue.ready()]
        # A run given a slot keeps it until the work it waited for has been planned: parked again first, it
        # would hand the slot straight back to the next waiter, and runs would swap slots without end.
        self._admitted = {r.run_id for r in resident if r.run_id in self._admitted and r.queue.ready()}
        movable = [run for run in resident if run.run_id not in self._admitted]
        for run in waiting:
            if run.waiting_since is None:
                run.waiting_since = run.queue.ready()[0].arrived_at
        waiting.sort(key=lambda run: run.waiting_since or 0.0)
        free = self.capacity - len(resident)
        if len(waiting) <= free:
            return [], waiting
        parks = sorted((r for r in movable if _is_idle(r)), key=lambda run: run.last_active)
        first_unserved = waiting[free].waiting_since or now
        if (
            parks
            and now - first_unserved < self.slot_wait_s
            and (settled_at := self._arrivals_settle_at(runs, waiting)) > now
        ):
            # Requests are still arriving: an idle resident run may be about to get work of its own.
            self._wake(settled_at)
            parks = []
        parks = parks[: len(waiting) - free]
        short = len(waiting) - free - len(parks)
        if short:
            oldest = waiting[free + len(parks)].waiting_since or now
            if now - oldest >= self.slot_wait_s:
                held = sorted((r for r in movable if not _is_idle(r)), key=_park_order)
                parks += held[:short]
            else:
                self._wake(oldest + self.slot_wait_s)
        return parks, waiting[: free + len(parks)]

    def _wake(self, at: float) -> None:
        """Have the worker plan again at `at` at the latest."""
        self.wake_at = at if self.wake_at is None else min(self.wake_at, at)

    def _arrivals_settle_at(self, runs: list[RunState], waiting: list[RunState]) -> float:
        """When the burst of requests the waiters' work arrived in is over, as the gathering of a pass
        reckons it: `quiet_s` after the last arrival, at most `max_wait_s` after the first waiter's.
        Clients send a step of all their runs one request after another, the waiters' often first; parking
        idle residents the moment a waiter's request lands would swap out runs whose own requests are a
        few milliseconds behind, and swap them back in for their work (twice the turns per step)."""
        last = max(entry.arrived_at for run in runs for entry in run.queue.ready())
        first = min(entry.arrived_at for run in waiting for entry in run.queue.ready()[:1])
        return self.gathering.settled_at(first, last)

    def _work(self, runs: list[RunState], now: float) -> list[Work]:
        """The next pass, or else the fused step and the barriers, over resident runs."""
        # After a pass, steps and barriers go first, so a stream of passes cannot starve them.
        steps_first, self._passed_last = self._passed_last, False
        if steps_first and (steps := self._take_steps(runs)):
            return steps
        passes = [(run, _leading_passes(run)) for run in runs]
        if not self._gathering(runs, passes, now) and (items := self._take_passes(passes)):
            # The pass alone: the optim_steps that arrive while it runs then join the one fused step
            # planned right after it, instead of splitting it in two.
            self._trained_at.update((run.run_id, now) for run, _ in items)
            self._passed_last = True
            return [PassWork(items)]
        return self._take_steps(runs)

    def _take_steps(self, runs: list[RunState]) -> list[Work]:
        """One fused optim step of every run at optim_step, then the runs' ready barriers."""
        plan: list[Work] = []
        optim = [(run, run.queue.pop(1)[0]) for run in runs if _head_is(run, OptimStep)]
        if optim:
            plan.append(OptimWork(optim))
        for run in runs:
            ready = run.queue.ready()
            if ready and not is_batchable(ready[0].command) and not isinstance(ready[0].command, OptimStep):
                plan.append(BarrierWork(run, run.queue.pop(1)[0]))
        return plan

    def _gathering(self, runs: list[RunState], passes: Joinable, now: float) -> bool:
        """Whether to hold the ready passes for recently active runs that have sent nothing yet."""
        live = {run.run_id for run in runs}
        self._trained_at = {
            r: t for r, t in self._trained_at.items() if r in live and now - t < self.gathering.active_s
        }
        ready = [entry for _, entries in passes for entry in entries]
        expected = any(run.run_id in self._trained_at and not run.queue.ready() for run in runs)
        if not ready or not expected or sum(_tokens(e) for e in ready) >= self.token_budget:
            return False
        arrivals = [entry.arrived_at for entry in ready]
        deadline = self.gathering.settled_at(min(arrivals), max(arrivals))
        if now >= deadline:
            return False
        self._wake(deadline)
        return True

    def _take_passes(self, passes: Joinable) -> list[tuple[RunState, Entry]]:
        """Round-robin over tenants, one command at a time, until the token budget is used.

        A tenant whose next command does not fit stops for this pass (keeping its runs in order);
        the first command always fits, so an oversized one still runs alone.
        """
        by_tenant: dict[str, list[tuple[RunState, Entry]]] = {}
        for run, entries in passes:
            if entries:
                by_tenant.setdefault(run.tenant, []).extend((run, entry) for entry in entries)
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


def _is_idle(run: RunState) -> bool:
    """A resident run that may give up its slot at once: nothing ready, no gradients waiting for a step."""
    return not run.pending_gradients and not run.queue.ready()


def _park_order(run: RunState) -> tuple[bool, float]:
    """Which busy or pinned run gives up its slot to a waiter that waited slot_wait_s: those without
    gradients first (no gradients to copy), then the least recently active."""
    return run.pending_gradients, run.last_active


def work_items(work: Work) -> list[tuple[RunState, Entry]]:
    """The (run, entry) pairs of a work item."""
    return [(work.run, work.entry)] if isinstance(work, BarrierWork) else work.items


def _leading_passes(run: RunState) -> list[Entry]:
    """The run's ready commands up to its first one that cannot join a pass."""
    out = []
    for entry in run.queue.ready():
        if not is_batchable(entry.command):
            break
        out.append(entry)
    return out


def _tokens(entry: Entry) -> int:
    assert isinstance(entry.command, ForwardBackward)
    return entry.command.num_tokens


def _head_is(run: RunState, kind: type) -> bool:
    ready = run.queue.ready()
    return bool(ready) and isinstance(ready[0].command, kind)
