"""Where the engine thread's wall time goes, so its duty cycle can be watched (/metrics) and benchmarked.

On a GPU the engine thread's only useful work is launching engine calls: every other moment it spends is
device time lost. `DutyMeter` splits the thread's wall time into states:

- engine: inside an engine call (a pass, a step, a save, a sampler step, ...);
- durable: waiting for the writer to make an earlier call's outcome durable before the next call;
- held: work is queued but the scheduler holds it (a pass gathering the runs expected to join it, a run
  waiting its turn for a slot);
- idle: nothing to do;
- other: everything else on the thread (planning, bookkeeping).

The duty cycle is engine ÷ (engine + durable + other): the share of the time the thread could be launching
work in which it does. `MeteredEngine` times every engine call the loop makes, so no call site can be
missed. No tensors, no SQL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from loraplex.engine.interface import Engine
from loraplex.runtime.observability.telemetry import ENGINE_THREAD_STATES, Telemetry

ENGINE, DURABLE, HELD, IDLE, OTHER = ENGINE_THREAD_STATES

# The Engine methods that do engine work. The rest are cheap reads (info, has_sampling_work, usage) or
# checks made on other threads (validate_*), which are not the engine thread's time.
_TIMED = frozenset(
    {
        "run_pass",
        "optim_step",
        "prepare_step",
        "apply_step",
        "abort_step",
        "undo_last",
        "create_slot",
        "free_slot",
        "load_state",
        "save_state",
        "offload_slot",
        "restore_slot",
        "spill_offloaded",
        "save_snapshot",
        "export_snapshot",
        "add_sample",
        "cancel_sample",
        "step_sampler",
    }
)


class DutyMeter:
    """The engine thread's wall time by state (see the module docstring), reported to telemetry as each
    cycle of the loop ends. Used by the engine thread alone."""

    def __init__(self, telemetry: Telemetry, clock: Callable[[], float] = time.perf_counter) -> None:
        self._telemetry, self._clock = telemetry, clock
        self._cycle_start = clock()
        self._measured: dict[str, float] = dict.fromkeys(ENGINE_THREAD_STATES, 0.0)
        self._depth = 0  # nested measured states count once (an engine call inside another state)

    @contextmanager
    def state(self, name: str) -> Iterator[None]:
        """Count the block's wall time as `name` (the outermost state wins when blocks nest)."""
        if self._depth:
            yield
            return
        self._depth += 1
        start = self._clock()
        try:
            yield
        finally:
            self._depth -= 1
            self._measured[name] += self._clock() - start

    def end_cycle(self) -> None:
        """Close the cycle: what no state claimed since the last call is `other`; report and restart."""
        now = self._clock()
        self._measured[OTHER] += max(0.0, now - self._cycle_start - sum(self._measured.values()))
        self._telemetry.record_engine_thread(self._measured)
        self._measured = dict.fromkeys(ENGINE_THREAD_STATES, 0.0)
        self._cycle_start = now


class MeteredEngine:
    """The engine as the engine thread calls it: the same object, with every call that does engine work
    timed as `engine` on the meter. Calls from other threads must use the engine itself."""

    def __init__(self, engine: Engine, meter: DutyMeter) -> None:
        self._engine, self._meter = engine, meter

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._engine, name)
        if name not in _TIMED:
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._meter.state(ENGINE):
                return attribute(*args, **kwargs)

        return timed
