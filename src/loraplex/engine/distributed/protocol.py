"""The commands rank 0 sends the engine ranks, and how they travel.

One exchange: rank 0 scatters one command per rank (the same one, or each rank's share of a pass)
over the control group, every rank executes its own (replica.py), and rank 0 gathers the replies in
rank order, each with the bytes its rank holds after the command (RankReply): so rank 0 knows every
rank's memory as of the last exchange, heartbeats included, without a collective of its own.
Commands are plain picklable dataclasses; tensors they imply (gradients, slot state) move separately on
the data group. An optimizer step takes two exchanges, PrepareStep and then ApplyStep (or
AbortStep), so that rank 0's caller can record its outcome in between. No HTTP, no SQL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from loraplex.engine.distributed.group import RankGroup
from loraplex.engine.interface import ParameterBytes
from loraplex.engine.types import AdamParams, LoraConfig, PassRequest


@dataclass(frozen=True)
class RunPass:
    """Run this rank's share of a pass (rank 0 has validated every request)."""

    requests: list[PassRequest]


@dataclass(frozen=True)
class PrepareStep:
    """All-reduce the stepped slots' gradients in one collective, then prepare the same fused step (rank 0
    answers its metrics); ApplyStep or AbortStep follows."""

    steps: dict[int, AdamParams]


@dataclass(frozen=True)
class ApplyStep:
    """Apply the step every rank prepared. A rank that fails it may now differ from the others."""


@dataclass(frozen=True)
class AbortStep:
    """Take back PrepareStep on every rank: drop the prepared step; rank 0 keeps the all-reduced sum of
    `slots`' gradients and the others zero theirs, so their total is what it was (no copy needed)."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class SyncSlot:
    """Make `slot` (created if absent) a copy of rank 0's: its weights, and its AdamW state if step > 0."""

    slot: int
    config: LoraConfig
    step: int  # AdamW steps taken; 0 means the moments are zero, so they are not sent


@dataclass(frozen=True)
class FreeSlot:
    """Drop `slot` on every rank."""

    slot: int


@dataclass(frozen=True)
class Rollback:
    """Take back this rank's last pass: another rank failed its share, or the runtime could not record its
    outcome, so the whole one fails."""


@dataclass(frozen=True)
class GatherGradients:
    """Sum `slot`'s gradient accumulators onto rank 0 (the others zero theirs), so rank 0's copy is the
    whole of them: a run parked between forward_backward and optim_step keeps every rank's share."""

    slot: int


@dataclass(frozen=True)
class Ping:
    """A heartbeat: keeps idle ranks within the collective timeout and shows that every rank answers."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the command loop and the group; not answered."""


RankCommand = (
    RunPass
    | PrepareStep
    | ApplyStep
    | AbortStep
    | Rollback
    | GatherGradients
    | SyncSlot
    | FreeSlot
    | Ping
    | Shutdown
)
# Commands a rank answers with a RankError when its share raises, staying in the group: rank 0 then takes
# the whole back on every rank (take_back), or, where that cannot be done (ApplyStep), fails the engine.
REPORTED = (RunPass, PrepareStep, ApplyStep)


def take_back(command: RankCommand) -> RankCommand | None:
    """What every rank runs after a share of `command` failed, so that no rank keeps any of it; None where
    nothing can (a failed ApplyStep: replicas may now differ)."""
    if isinstance(command, PrepareStep):
        return AbortStep(tuple(command.steps))
    if isinstance(command, RunPass):
        return Rollback()
    return None


@dataclass(frozen=True)
class RankError:
    """A rank's answer when its share of a command in REPORTED raised (and was undone on that rank): the
    whole pass or step is taken back on every rank, and the group stays usable (a failed apply: see
    take_back)."""

    rank: int
    message: str


@dataclass(frozen=True)
class RankReply:
    """What a rank sends back for a command: the command's own reply, and the bytes its tensors hold
    right after it (a few integers, so every exchange carries them)."""

    value: object
    held: ParameterBytes


def scatter_commands(group: RankGroup, commands: list[RankCommand] | None) -> RankCommand:
    """Rank 0 passes one command per rank (others pass None); every rank returns its own."""
    received: list[RankCommand | None] = [None]
    dist.scatter_object_list(received, commands, src=0, group=group.control)
    assert received[0] is not None  # the object collective filled it
    return received[0]


def gather_replies(group: RankGroup, reply: object) -> list[object]:
    """Every rank passes its reply; rank 0 returns all of them in rank order, the others []."""
    replies: list[object] | None = [None] * group.world_size if group.rank == 0 else None
    dist.gather_object(reply, replies, dst=0, group=group.control)
    return replies or []
