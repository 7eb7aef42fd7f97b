"""What every engine rank does with a command, rank 0 included: one code path, so that all ranks enter
the same collectives in the same order and their adapter replicas stay identical.

Rank 0 has already validated a command and, for a slot it creates or loads, already holds the new
state; the others follow it. No HTTP, no SQL.
"""

from __future__ import annotations

import logging

import torch

from loraplex.engine.distributed.group import RankGroup, all_reduce_flat, broadcast_flat
from loraplex.engine.distributed.protocol import (
    REPORTED,
    AbortStep,
    ApplyStep,
    FreeSlot,
    GatherGradients,
    Ping,
    PrepareStep,
    RankCommand,
    RankError,
    RankReply,
    Rollback,
    RunPass,
    SyncSlot,
)
from loraplex.engine.local import LocalEngine
from loraplex.engine.optimizer import AdamSlot
from loraplex.engine.slots import OptimizerState
from loraplex.engine.types import AdamParams
from loraplex.errors import ServerError

log = logging.getLogger(__name__)


def reply(command: RankCommand, engine: LocalEngine, group: RankGroup) -> RankReply:
    """`answer`, sent back with the bytes this rank holds after it (the reply every rank gathers)."""
    return RankReply(answer(command, engine, group), engine.parameter_bytes())


def answer(command: RankCommand, engine: LocalEngine, group: RankGroup) -> object:
    """Execute `command` and return this rank's reply.

    A failed share of a pass or step becomes a RankError reply and the group stays usable: the local
    engine has already undone it on this rank (or poisoned what a failed apply left half-stepped), and
    rank 0 then has every rank take it back (or fails the engine). Any other failure propagates, because
    this replica may now differ from the others and must not go on.
    """
    try:
        return execute(command, engine, group)
    except Exception as error:
        if not isinstance(command, REPORTED):
            raise
        log.exception("engine rank %d: its share of a %s failed", group.rank, type(command).__name__)
        return RankError(group.rank, f"{type(error).__name__}: {error}")


def execute(command: RankCommand, engine: LocalEngine, group: RankGroup) -> object:
    """This rank's part of `command`; the reply rank 0 gathers."""
    if isinstance(command, RunPass):
        return engine.run_pass(command.requests, keep_undo=True)
    if isinstance(command, PrepareStep):
        return prepare_replicas(engine, command.steps, group)
    if isinstance(command, ApplyStep):
        return apply_replicas(engine, group)
    if isinstance(command, AbortStep):
        return abort_replicas(engine, command.slots, group)
    if isinstance(command, Rollback):
        return engine.undo_last()
    if isinstance(command, GatherGradients):
        return gather_gradients(engine, command.slot, group)
    if isinstance(command, SyncSlot):
        return sync_slot(engine, command, group)
    if isinstance(command, FreeSlot):
        return engine.free_slot(command.slot)
    if isinstance(command, Ping):
        return None
    raise ServerError(f"engine rank {group.rank} has no executor for {type(command).__name__}")


def prepare_replicas(
    engine: LocalEngine, steps: dict[int, AdamParams], group: RankGroup
) -> dict[int, dict[str, float]] | None:
    """Sum the stepped slots' gradient accumulators over all ranks in one all-reduce, then prepare the step
    locally; rank 0 answers its metrics, the others None.

    Semantics: `engine.prepare_step(steps)` on one rank that had run every rank's share of every pass:
    accumulators add, so their sum over ranks is that rank's accumulator. Every rank then holds the same
    gradients and prepares the same step, so the replicas stay identical and the grad norm needs no
    further collective. The all-reduce changes what each rank's accumulators mean (its share -> the
    whole), not the whole; `abort_replicas` puts back an equal split.
    """
    adams = [engine.pool.get(slot).adam for slot in steps]
    all_reduce_flat([adam.grads_N for adam in adams], group.data)
    for adam in adams:
        adam.has_gradients = True
    prepared = engine.prepare_step(steps)
    return prepared.metrics if group.rank == 0 else None


def apply_replicas(engine: LocalEngine, group: RankGroup) -> None:
    """Apply the step this rank prepared last (`LocalEngine.apply_step`: a failure poisons its slots)."""
    prepared = engine.pending_step
    if prepared is None:
        raise ServerError(f"engine rank {group.rank} holds no prepared optimizer step to apply")
    engine.apply_step(prepared)


def abort_replicas(engine: LocalEngine, slots: tuple[int, ...], group: RankGroup) -> None:
    """Take back a PrepareStep on this rank, whether or not its own prepare succeeded: drop the prepared
    step and keep the all-reduced gradients' sum on rank 0 alone.

    Semantics: after it, the sum over ranks of each slot's accumulators equals the sum before PrepareStep
    (rank 0 holds it, computed by the all-reduce; the others hold zero), and no copy was needed. Every later
    step reads only that sum, so it equals the step of an engine that never prepared, up to the rounding
    of adding in another order.
    """
    prepared = engine.pending_step
    if prepared is not None:
        engine.abort_step(prepared)
    _keep_sum_on_rank_0([engine.pool.get(slot).adam for slot in slots], group.rank)


@torch.no_grad()
def gather_gradients(engine: LocalEngine, slot: int, group: RankGroup) -> None:
    """Sum the slot's accumulators over the ranks onto rank 0; the others zero theirs (the sum is kept)."""
    adam = engine.pool.get(slot).adam
    all_reduce_flat([adam.grads_N], group.data)
    _keep_sum_on_rank_0([adam], group.rank)


@torch.no_grad()
def _keep_sum_on_rank_0(adams: list[AdamSlot], rank: int) -> None:
    """After an all-reduce of these slots' accumulators: rank 0 keeps the sum, the others zero theirs, so
    the sum over ranks is the all-reduced one, counted once."""
    for adam in adams:
        if rank != 0:
            adam.grads_N.zero_()
        adam.has_gradients = rank == 0


@torch.no_grad()
def sync_slot(engine: LocalEngine, command: SyncSlot, group: RankGroup) -> None:
    """Rank 0 broadcasts its slot's weights (and moments when step > 0); the others create or overwrite
    theirs with them, so a created or loaded slot is the same on every rank."""
    pool = engine.pool
    if group.rank != 0 and not pool.has_slot(command.slot):
        created = pool.create(command.config)
        if created != command.slot:  # slot ids follow from the same creates and frees on every rank
            raise ServerError(
                f"engine rank {group.rank} allocated slot {created}, rank 0 slot {command.slot}"
            )
    record = pool.get(command.slot)
    state = record.optimizer_state()
    local = [*record.weights.values()]
    if command.step > 0:
        local += [*state.exp_avg.values(), *state.exp_avg_sq.values()]
    received = local if group.rank == 0 else [torch.empty_like(t) for t in local]
    broadcast_flat(received, group.data)
    if group.rank == 0:
        return
    names, n = list(record.weights), len(record.weights)
    optimizer = None
    if command.step > 0:
        exp_avg, exp_avg_sq = received[n : 2 * n], received[2 * n :]
        optimizer = OptimizerState(
            dict(zip(names, exp_avg, strict=True)), dict(zip(names, exp_avg_sq, strict=True)), command.step
        )
    record.assign(dict(zip(names, received[:n], strict=True)), optimizer)
