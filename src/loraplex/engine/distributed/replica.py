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
    AddSample,
    ApplyStep,
    CancelSample,
    DropSamples,
    ForgetOffloaded,
    FreeSlot,
    OffloadSlot,
    Ping,
    PrepareStep,
    RankCommand,
    RankError,
    RankReply,
    RestoreSlot,
    Rollback,
    RunPass,
    SaveSnapshot,
    SaveState,
    SnapshotFiles,
    SpillOffloaded,
    StepSampler,
    SyncSlot,
)
from loraplex.engine.local import LocalEngine
from loraplex.engine.optimizer import AdamSlot
from loraplex.engine.slots import OptimizerState
from loraplex.engine.types import AdamParams
from loraplex.errors import ServerError, UserError

log = logging.getLogger(__name__)


def reply(command: RankCommand, engine: LocalEngine, group: RankGroup) -> RankReply:
    """`answer`, sent back with this rank's usage after it (the reply every rank gathers)."""
    return RankReply(answer(command, engine, group), engine.usage())


def answer(command: RankCommand, engine: LocalEngine, group: RankGroup) -> object:
    """Execute `command` and return this rank's reply.

    A failed share of a pass, step or save becomes a RankError reply and the group stays usable: the local
    engine has already undone it on this rank (or poisoned what a failed apply left half-stepped), and
    rank 0 then has every rank take it back (or fails the engine). Any other failure propagates, because
    this replica may now differ from the others and must not go on. So does any failure under tensor
    parallelism but an apply's (which runs no collective): the rank's peers may be waiting in a collective
    it will never join, so it leaves the group at once (a worker exits, rank 0 fails the engine) and their
    collective breaks now rather than at the timeout.
    """
    try:
        return execute(command, engine, group)
    except Exception as error:
        in_lockstep = group.tp.is_parallel and not isinstance(command, ApplyStep)
        if not isinstance(command, REPORTED) or in_lockstep:
            raise
        log.exception("engine rank %d: its share of a %s failed", group.rank, type(command).__name__)
        user_error = error if isinstance(error, UserError) else None
        return RankError(group.rank, f"{type(error).__name__}: {error}", user_error)


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
    if isinstance(command, SaveState):
        return save_state(engine, command, group)
    if isinstance(command, SaveSnapshot):
        return engine.save_snapshot(command.slot, command.directory) if group.dp_rank == 0 else None
    if isinstance(command, SnapshotFiles):
        return engine.snapshot_files(command.slot) if group.dp_rank == 0 else None
    if isinstance(command, SyncSlot):
        return sync_slot(engine, command, group)
    if isinstance(command, FreeSlot):
        return engine.free_slot(command.slot)
    if isinstance(command, OffloadSlot):
        return engine.offload_slot(command.slot)
    if isinstance(command, RestoreSlot):
        return engine.restore_slot(command.key)
    if isinstance(command, SpillOffloaded):
        return spill_offloaded(engine, command, group)
    if isinstance(command, ForgetOffloaded):
        return engine.forget_offloaded(command.key)
    if isinstance(command, AddSample):
        return engine.add_sample(command.key, command.request)
    if isinstance(command, StepSampler):  # the finished requests, and the streaming ones' new tokens
        return engine.step_sampler(command.max_prefill_tokens), engine.take_sample_progress()
    if isinstance(command, CancelSample):
        return engine.cancel_sample(command.key)
    if isinstance(command, DropSamples):
        return engine.drop_samples()
    if isinstance(command, Ping):
        return None
    raise ServerError(f"engine rank {group.rank} has no executor for {type(command).__name__}")


def prepare_replicas(
    engine: LocalEngine, steps: dict[int, AdamParams], group: RankGroup
) -> dict[int, dict[str, float]] | None:
    """Sum the stepped slots' gradient accumulators over the ranks that share them (`sum_shares`), then
    prepare the step locally; rank 0 answers its metrics, the others None.

    Semantics: `engine.prepare_step(steps)` on one rank that had run every rank's share of every pass:
    accumulators add, so their sum over ranks is that rank's accumulator. Every rank then holds the whole
    gradient of what it holds of the slot and prepares the same step (under tensor parallelism the norm
    joins every part: optimizer.prepare_slots), so the replicas stay identical. The all-reduce changes
    what each rank's accumulators mean (its share -> the whole), not the whole; `abort_replicas` puts back
    a split that sums to it.
    """
    adams = [engine.pool.get(slot).adam for slot in steps]
    sum_shares(adams, group)
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
    step and keep each all-reduced sum once (`keep_sum_once`).

    Semantics: after it, the sum over ranks of each slot's accumulators equals the sum before PrepareStep,
    and no copy was needed. Every later step reads only that sum, so it equals the step of an engine that
    never prepared, up to the rounding of adding in another order.
    """
    prepared = engine.pending_step
    if prepared is not None:
        engine.abort_step(prepared)
    keep_sum_once([engine.pool.get(slot).adam for slot in slots], group)


@torch.no_grad()
def sum_shares(adams: list[AdamSlot], group: RankGroup) -> None:
    """All-reduce these slots' accumulators over the ranks whose shares make up each part: what every rank
    holds whole (the whole slot with one tensor-parallel rank) over all ranks, since each rank of a
    tensor-parallel group adds its own part of that gradient; what a rank holds a part of over its
    replicas, one per data-parallel group."""
    all_reduce_flat([adam.grads_N[: adam.whole_numel] for adam in adams], group.data)
    if group.tp.is_parallel and group.dp_size > 1:
        all_reduce_flat([adam.grads_N[adam.whole_numel :] for adam in adams], group.replicas)


@torch.no_grad()
def keep_sum_once(adams: list[AdamSlot], group: RankGroup) -> None:
    """After `sum_shares`: each sum stays on one of the ranks it was summed over and the others zero
    theirs, so the sum over ranks is the all-reduced one, counted once: the whole-held part on rank 0, each
    split part in the first data-parallel group."""
    for adam in adams:
        if group.rank != 0:
            adam.grads_N[: adam.whole_numel].zero_()
        if group.dp_rank != 0:
            adam.grads_N[adam.whole_numel :].zero_()
        adam.has_gradients = group.dp_rank == 0


def save_state(engine: LocalEngine, command: SaveState, group: RankGroup) -> int | None:
    """This rank's part of a checkpoint save: with gradients, sum every rank's share of them into the
    first data-parallel group; that group's ranks gather the whole tensors and rank 0 writes them (its
    reply is the bytes written)."""
    if command.with_gradients:
        adams = [engine.pool.get(command.slot).adam]
        sum_shares(adams, group)
        keep_sum_once(adams, group)
    if group.dp_rank != 0:
        return None
    return engine.save_state(command.slot, command.directory, command.owner_digest, command.with_gradients)


def spill_offloaded(engine: LocalEngine, command: SpillOffloaded, group: RankGroup) -> int | None:
    """This rank's part of writing a host copy: its part and share go back into a slot for as long as the
    save takes (save_state sums the shares and gathers the parts on the device), the copy itself kept."""
    slot = engine.restore_slot(command.key, forget=False)
    try:
        return save_state(engine, SaveState(slot, command.directory, command.owner_digest, True), group)
    finally:
        engine.free_slot(slot)


@torch.no_grad()
def sync_slot(engine: LocalEngine, command: SyncSlot, group: RankGroup) -> None:
    """Rank 0 created or loaded the slot. Its tensor-parallel peers make their own parts the same way;
    then the first data-parallel group's ranks broadcast theirs (weights, and moments when step > 0) to
    their replicas, which create or overwrite the slot with them."""
    pool = engine.pool
    if group.rank != 0 and group.dp_rank == 0:
        _make_own_part(engine, command, group)
    elif group.rank != 0 and not pool.has_slot(command.slot):
        _check_same_slot(pool.create(command.config), command, group)
    if group.dp_size == 1:
        return
    record = pool.get(command.slot)
    state = record.optimizer_state()
    local = [*record.weights.values()]
    if command.step > 0:
        local += [*state.exp_avg.values(), *state.exp_avg_sq.values()]
    received = local if group.dp_rank == 0 else [torch.empty_like(t) for t in local]
    broadcast_flat(received, group.replicas)
    if group.dp_rank == 0:
        return
    names, n = list(record.weights), len(record.weights)
    optimizer = None
    if command.step > 0:
        exp_avg, exp_avg_sq = received[n : 2 * n], received[2 * n :]
        optimizer = OptimizerState(
            dict(zip(names, exp_avg, strict=True)), dict(zip(names, exp_avg_sq, strict=True)), command.step
        )
    record.assign(dict(zip(names, received[:n], strict=True)), optimizer, are_parts=True)


def _make_own_part(engine: LocalEngine, command: SyncSlot, group: RankGroup) -> None:
    """A tensor-parallel peer of rank 0 creates the slot from its config, or loads its part of the
    checkpoint rank 0 loaded; a loaded slot's whole-held gradients stay on rank 0 alone (keep_sum_once)."""
    pool = engine.pool
    source = command.source
    if source is None:
        _check_same_slot(pool.create(command.config), command, group)
        return
    into = command.slot if pool.has_slot(command.slot) else None
    slot, _ = engine.load_state(source.directory, source.owner_digest, source.with_optimizer, into)
    _check_same_slot(slot, command, group)
    adam = pool.get(slot).adam
    adam.grads_N[: adam.whole_numel].zero_()


def _check_same_slot(slot: int, command: SyncSlot, group: RankGroup) -> None:
    """Slot ids follow from the same creates and frees on every rank; a different one means they diverged."""
    if slot != command.slot:
        raise ServerError(f"engine rank {group.rank} allocated slot {slot}, rank 0 slot {command.slot}")
