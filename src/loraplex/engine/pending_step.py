"""The one prepared optimizer step an engine holds between `prepare_step` and `apply_step` / `abort_step`.

A prepared step was computed from the slots as they were then; applying it after another call changed
them would step state it was not computed from. So an engine counts its slot-changing calls (the
generation), holds the plan of its last prepare, and lets apply or abort claim that plan once, only
while nothing has changed since. No torch, no HTTP, no SQL.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from loraplex.engine.types import PreparedStep
from loraplex.errors import ServerError

Plan = TypeVar("Plan")


class PendingStep(Generic[Plan]):
    """At most one prepared step and its engine-private plan, made stale by any slot-changing call."""

    def __init__(self) -> None:
        self._generation = 0
        self._held: tuple[PreparedStep, Plan] | None = None

    @property
    def prepared(self) -> PreparedStep | None:
        """The step prepared and neither applied, aborted nor made stale since; None if there is none."""
        return self._held[0] if self._held is not None else None

    def invalidate(self) -> None:
        """Record a call that changes slots: the held step, if any, is stale from now on."""
        self._generation += 1
        self._held = None

    def hold(self, metrics: dict[int, dict[str, float]], plan: Plan) -> PreparedStep:
        """Hold `plan` (replacing any older one) and return the PreparedStep that claims it."""
        self.invalidate()
        prepared = PreparedStep(metrics, self._generation)
        self._held = (prepared, plan)
        return prepared

    def claim(self, prepared: PreparedStep, action: str) -> Plan:
        """The plan of `prepared`, released (a second claim is refused); ServerError, with nothing changed,
        if it is not the step held now. `action` ("applied", "aborted") words the refusal."""
        held = self._held
        if held is None or held[0] is not prepared:
            raise ServerError(
                f"this prepared optimizer step cannot be {action}: it was prepared at change "
                f"{prepared.generation} of the engine's slots, which are now at change {self._generation} "
                "(a pass, another prepare, a create, free or load, or its own apply or abort came after it)"
            )
        self.invalidate()
        return held[1]
