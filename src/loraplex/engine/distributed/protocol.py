"""The commands rank 0 sends the engine ranks, and how they travel.

One exchange: rank 0 scatters one command per rank (the same one, or each rank's share of a pass)
over the control group, every rank executes its own (replica.py), and rank 0 gathers the replies in
rank order, each with its rank's usage after the command (RankReply: the bytes it holds, its sampler's
counters): so rank 0 knows every rank's memory and sampling as of the last exchange, heartbeats
included, without a collective of its own.
Commands are plain picklable dataclasses; tensors they imply (gradients, slot state) move separately on
the data group. An optimizer step takes two exchanges, PrepareStep and then ApplyStep (or
AbortStep), so that rank 0's caller can record its outcome in between. No HTTP, no SQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from loraplex.engine.distributed.group import RankGroup
from loraplex.engine.interface import EngineUsage
from loraplex.engine.types import AdamParams, LoraConfig, PassRequest, SampleRequest
from loraplex.errors import UserError


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
class Checkpoint:
    """A checkpoint rank 0 loaded a slot from (LocalEngine.load_state's arguments), for the ranks of its
    tensor-parallel group to load their own parts from."""

    directory: Path
    owner_digest: str
    with_optimizer: bool


@dataclass(frozen=True)
class SyncSlot:
    """Make `slot` the one rank 0 just created or loaded on every rank: rank 0's tensor-parallel peers
    create it from `config` or load it from `source` themselves (each its own part), then every other rank
    copies its peer's in the first data-parallel group: the weights, and the AdamW state if step > 0."""

    slot: int
    config: LoraConfig
    step: int  # AdamW steps taken; 0 means the moments are zero, so they are not sent
    source: Checkpoint | None = None  # None: created fresh from config


@dataclass(frozen=True)
class FreeSlot:
    """Drop `slot` on every rank."""

    slot: int


@dataclass(frozen=True)
class Rollback:
    """Take back this rank's last pass: another rank failed its share, or the runtime could not record its
    outcome, so the whole one fails."""


@dataclass(frozen=True)
class SaveState:
    """Write `slot`'s checkpoint (LocalEngine.save_state): with gradients, every rank's share of them is
    first summed onto the first data-parallel group (the others zero theirs), so a run parked between
    forward_backward and optim_step keeps all of them; that group's ranks gather the whole tensors, and
    rank 0 writes them."""

    slot: int
    directory: Path
    owner_digest: str
    with_gradients: bool


@dataclass(frozen=True)
class OffloadSlot:
    """Move `slot` to host memory on every rank (each its own part and share: LocalEngine.offload_slot);
    every rank answers the same key."""

    slot: int


@dataclass(frozen=True)
class RestoreSlot:
    """Bring the host copy `key` back into a new slot on every rank; every rank answers the same slot."""

    key: int


@dataclass(frozen=True)
class SpillOffloaded:
    """Write the host copy `key` as SaveState(with_gradients) writes a slot: every rank restores it into a
    slot it frees again after the save, keeping its copy (ForgetOffloaded drops it once all succeeded)."""

    key: int
    directory: Path
    owner_digest: str


@dataclass(frozen=True)
class ForgetOffloaded:
    """Drop the host copy `key` on every rank."""

    key: int


@dataclass(frozen=True)
class SaveSnapshot:
    """Write `slot`'s PEFT snapshot: the first data-parallel group gathers its weights, rank 0 writes."""

    slot: int
    directory: Path


@dataclass(frozen=True)
class SnapshotFiles:
    """Answer `slot`'s PEFT snapshot files in memory: the first data-parallel group gathers its weights,
    rank 0 serialises them and replies with the bytes (Engine.snapshot_files)."""

    slot: int


@dataclass(frozen=True)
class AddSample:
    """Queue a sampling request on the sampling group's samplers (LocalEngine.add_sample)."""

    key: str
    request: SampleRequest


@dataclass(frozen=True)
class StepSampler:
    """One admission + decode step of the sampling group's samplers in lockstep (LocalEngine.step_sampler)."""

    max_prefill_tokens: int | None


@dataclass(frozen=True)
class CancelSample:
    """Drop a request from the sampling group's samplers (LocalEngine.cancel_sample)."""

    key: str


@dataclass(frozen=True)
class Ping:
    """A heartbeat: keeps idle ranks within the collective timeout and shows that every rank answers."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the command loop and the group; not answered."""


@dataclass(frozen=True)
class DropSamples:
    """Every sampler drops every request, as a failed step does: some sampling rank's step failed, and the
    runtime fails every request the samplers held."""


SamplerCommand = AddSample | StepSampler | CancelSample
RankCommand = (
    RunPass
    | PrepareStep
    | ApplyStep
    | AbortStep
    | Rollback
    | SaveState
    | SaveSnapshot
    | SnapshotFiles
    | OffloadSlot
    | RestoreSlot
    | SpillOffloaded
    | ForgetOffloaded
    | SyncSlot
    | FreeSlot
    | SamplerCommand
    | DropSamples
    | Ping
    | Shutdown
)
# Commands a rank answers with a RankError when its share raises, staying in the group: rank 0 then takes
# the whole back on every rank (take_back) and raises the error, or, where that cannot be done
# (ApplyStep), fails the engine. A failed save changed no slot: there is nothing to take back (a failed
# SpillOffloaded frees its slot on every rank, and every rank keeps its host copy).
REPORTED = (
    RunPass,
    PrepareStep,
    ApplyStep,
    SaveState,
    SaveSnapshot,
    SnapshotFiles,
    SpillOffloaded,
    StepSampler,
)


def take_back(command: RankCommand) -> RankCommand | None:
    """What every rank runs after a share of `command` (one of REPORTED but ApplyStep) failed, so that no
    rank keeps any of it; None where nothing changed."""
    if isinstance(command, PrepareStep):
        return AbortStep(tuple(command.steps))
    if isinstance(command, RunPass):
        return Rollback()
    if isinstance(command, StepSampler):
        return DropSamples()
    return None


@dataclass(frozen=True)
class RankError:
    """A rank's answer when its share of a command in REPORTED raised (and was undone on that rank): the
    whole pass or step is taken back on every rank, and the group stays usable (a failed apply: see
    take_back). A UserError travels as itself, so the caller gets its type and message."""

    rank: int
    message: str
    user_error: UserError | None = None


@dataclass(frozen=True)
class RankReply:
    """What a rank sends back for a command: the command's own reply, and the rank's usage right after it
    (LocalEngine.usage: a few integers, so every exchange carries them)."""

    value: object
    usage: EngineUsage


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
