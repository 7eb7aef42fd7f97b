"""Rank 0's engine: the Engine the runtime calls, spreading passes over the ranks and keeping replicas equal.

The ranks form N / T data-parallel groups of T tensor-parallel ranks (group.py); every group holds every
adapter, each of its ranks its own part. Rank 0 validates each call before anything is sent, makes a
change to a slot first (create, load) and then has the other ranks follow it, splits each pass's datums
across the data-parallel groups by tokens (each group's ranks run the same share together), and steps
with flat gradient all-reduces (prepared on every rank, then applied or aborted on every rank). Saves
and snapshots gather the first group's parts and rank 0 writes them, so checkpoints are those of a
single-rank engine whatever N and T are. Sampling requests are spread over the groups on rank 0's
machine (they read snapshots from its data dir), each group's ranks decoding in lockstep; each request
stays on its group until it finishes.

A watchdog thread pings idle ranks and watches local rank processes. When a rank dies, hangs past the
timeout or diverges, the engine fails for good: the call in flight and every later one raise a
ServerError saying so, and `on_failure` is told once (the server then exits; runs resume from their
checkpoints after a restart). No HTTP, no SQL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from loraplex.engine.distributed.group import RankEnv, RankGroup, RankTimeouts, leave_group
from loraplex.engine.distributed.launch import EngineBuilder, LocalRanks, describe_exits, start_rank
from loraplex.engine.distributed.protocol import (
    AbortStep,
    AddSample,
    ApplyStep,
    CancelSample,
    Checkpoint,
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
    SamplerCommand,
    SaveSnapshot,
    SaveState,
    Shutdown,
    SnapshotFiles,
    SpillOffloaded,
    StepSampler,
    SyncSlot,
    gather_replies,
    scatter_commands,
    take_back,
)
from loraplex.engine.distributed.replica import execute, reply
from loraplex.engine.interface import Engine, EngineUsage
from loraplex.engine.local import LocalEngine
from loraplex.engine.pending_step import PendingStep
from loraplex.engine.sharding import merge_results, piece_requests, split_by_tokens
from loraplex.engine.types import (
    AdamParams,
    LoraConfig,
    PassRequest,
    PassResult,
    PreparedStep,
    SampleProgress,
    SampleRequest,
    SampleResult,
)
from loraplex.errors import CapacityError, NotFoundError, ServerError, UserError
from loraplex.model.tensor_parallel import CollectiveError

log = logging.getLogger(__name__)

# How often the watchdog looks at local rank processes.
_WATCH_S = 0.2
# Longest quiet spell before the watchdog pings the ranks (capped at a quarter of the timeout).
_HEARTBEAT_S = 5.0
# How long a rank that just broke a collective may take to show up as exited, for a clearer message.
_EXIT_GRACE_S = 1.0
_SHUTDOWN_GRACE_S = 10.0


class DistributedEngine(Engine):
    """Rank 0 of N engine ranks (data-parallel groups of tensor-parallel ranks), over its own LocalEngine."""

    def __init__(
        self,
        local: LocalEngine,
        group: RankGroup,
        timeout_s: float,
        on_failure: Callable[[str], None],
        local_ranks: LocalRanks | None = None,
    ) -> None:
        self.local = local
        self.max_slots = local.max_slots
        self.info = dataclasses.replace(local.info, device=f"{local.info.device} ({_describe_mesh(group)})")
        self._group = group
        self._on_failure = on_failure
        self._local_ranks = local_ranks
        self._heartbeat_s = min(_HEARTBEAT_S, timeout_s / 4)
        self._lock = threading.Lock()  # one exchange at a time: the runtime's thread or the watchdog
        self._failure: str | None = None
        self._failure_lock = threading.Lock()
        self._last_exchange = time.monotonic()
        self._step: PendingStep[tuple[int, ...]] = PendingStep()  # the prepared step's slots, if any
        # Every rank's usage as its last reply carried it (protocol.RankReply), first by the Ping below:
        # usage() reads them, so /metrics sees every rank without a collective of its own.
        self._usages: tuple[EngineUsage, ...] = ()
        # Sampling groups read snapshots from rank 0's data dir: those whose ranks all run on its machine.
        self._sampling_groups = [
            dp_rank
            for dp_rank in range(group.dp_size)
            if all(group.hosts[rank] == group.hosts[0] for rank in group.ranks_of(dp_rank))
        ]
        self._sample_group: dict[str, int] = {}  # every queued or running sampling request's group
        self._sample_progress: dict[str, SampleProgress] = {}  # streaming requests' tokens, not yet taken
        self._closing = threading.Event()
        self._exchange([Ping()] * group.world_size)
        self._watchdog = threading.Thread(target=self._watch, name="loraplex-rank-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def failure(self) -> str | None:
        """Why the engine stopped working, or None while it works."""
        return self._failure

    # --- passes and steps
    def validate_pass_request(self, request: PassRequest) -> None:
        """Raise UserError naming datum index, key and expectation; touches no state."""
        self.local.validate_pass_request(request)

    def run_pass(self, requests: list[PassRequest], keep_undo: bool = False) -> list[PassResult | UserError]:
        """All requests in one pass spread over the ranks: each runs a contiguous share of the datums.

        Semantics: equal to `LocalEngine.run_pass(requests)` on one rank. Rejected requests are answered
        by rank 0 and never sent; per-datum outputs come back in order (each data-parallel group's from its
        first rank: its tensor-parallel ranks compute the same); metrics are recomputed from them
        (sharding.py); each rank's training datums add into its own accumulators, which `optim_step` sums.
        Every rank keeps its undo copies whatever keep_undo says: a failed share is rolled back on all.
        """
        self._raise_if_failed()  # before rank 0's own checks, which a failed apply may have poisoned
        self._step.invalidate()
        self.local.require_live_slots(requests)
        results: list[PassResult | UserError | None] = [None] * len(requests)
        accepted: list[int] = []
        for index, request in enumerate(requests):
            try:
                self.local.validate_pass_request(request)
                accepted.append(index)
            except UserError as error:
                results[index] = error
        if accepted:
            chosen = [requests[i] for i in accepted]
            group = self._group
            shares = split_by_tokens(chosen, group.dp_size)
            commands = [RunPass(piece_requests(chosen, shares[group.rank_dp(rank)])) for rank in self._ranks]
            replies = self._exchange(commands)
            first_ranks = [group.ranks_of(dp_rank)[0] for dp_rank in range(group.dp_size)]
            merged = merge_results(
                chosen, shares, [self._pass_results(replies[rank], rank) for rank in first_ranks]
            )
            for index, result in zip(accepted, merged, strict=True):
                results[index] = result
        return results  # type: ignore[return-value]  # every request got its result or error above

    def prepare_step(self, steps: dict[int, AdamParams]) -> PreparedStep:
        """One all-reduce of the stepped slots' gradients, then the same step prepared on every rank; rank
        0's metrics. If any rank's share fails, every rank aborts (AbortStep): the ranks' gradients then
        sum to what they summed to before, and this raises a ServerError."""
        self._raise_if_failed()
        self._step.invalidate()
        for slot in steps:
            self.local.pool.get(slot)  # NotFoundError before anything is sent
        if not steps:
            return self._step.hold({}, ())
        replies = self._exchange([PrepareStep(dict(steps))] * self._group.world_size)
        return self._step.hold(replies[0], tuple(steps))  # type: ignore[arg-type]  # rank 0's metrics

    def apply_step(self, prepared: PreparedStep) -> None:
        """Every rank applies the step it prepared. A rank that fails to fails the engine for good: the
        replicas may differ from then on."""
        if self._step.claim(prepared, "applied"):
            self._exchange([ApplyStep()] * self._group.world_size)

    def abort_step(self, prepared: PreparedStep) -> None:
        """Every rank drops its prepared step; rank 0 keeps the all-reduced gradients, the others zero
        theirs (their sum is unchanged; replica.abort_replicas)."""
        slots = self._step.claim(prepared, "aborted")
        if slots:
            self._exchange([AbortStep(slots)] * self._group.world_size)

    def undo_last(self) -> None:
        """Every rank takes back its part of the last pass."""
        self._step.invalidate()
        self._exchange([Rollback()] * self._group.world_size)

    # --- slots: changed on rank 0 first, then copied
    def create_slot(self, config: LoraConfig) -> int:
        """A fresh adapter on every rank, identical to rank 0's."""
        self._raise_if_failed()
        self._step.invalidate()
        slot = self.local.create_slot(config)
        self._sync(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """Drop the slot on every rank."""
        self._step.invalidate()
        if not self.local.pool.has_slot(slot):  # before anything is sent; a poisoned slot may go
            raise NotFoundError(f"adapter slot {slot} is not in use")
        self._exchange([FreeSlot(slot)] * self._group.world_size)

    def load_state(
        self, directory: Path, owner_digest: str, with_optimizer: bool, slot: int | None = None
    ) -> tuple[int, LoraConfig]:
        """Rank 0 verifies and loads the checkpoint; its tensor-parallel peers load their parts of it, and
        every other rank copies the slot from its peer in the first data-parallel group."""
        self._raise_if_failed()
        self._step.invalidate()
        slot, config = self.local.load_state(directory, owner_digest, with_optimizer, slot)
        self._sync(slot, Checkpoint(Path(directory), owner_digest, with_optimizer))
        return slot, config

    def _sync(self, slot: int, source: Checkpoint | None = None) -> None:
        record = self.local.pool.get(slot)
        command = SyncSlot(slot, record.config, record.optimizer_state().step, source)
        self._exchange([command] * self._group.world_size)

    # --- the host tier: every rank moves its own part and share of a slot
    def offload_slot(self, slot: int) -> int:
        """Every rank moves its copy of the slot to its host memory, under the same key."""
        self._raise_if_failed()
        self._step.invalidate()
        self.local.pool.get(slot)  # NotFoundError before anything is sent
        return self._agreed(self._exchange([OffloadSlot(slot)] * self._group.world_size), "host copy key")

    def restore_slot(self, key: int) -> int:
        """Every rank brings its host copy back, into the same new slot."""
        self._raise_if_failed()
        self._step.invalidate()
        self._require_free_slot()
        return self._agreed(self._exchange([RestoreSlot(key)] * self._group.world_size), "slot")

    def spill_offloaded(self, key: int, directory: Path, owner_digest: str) -> int:
        """Rank 0 writes the host copy as save_state writes a slot: the ranks' parts and shares go through
        a slot they hold for the save only, so one must be free (CapacityError otherwise, the copy kept)."""
        self._raise_if_failed()
        self._step.invalidate()
        self._require_free_slot()
        command = SpillOffloaded(key, Path(directory), owner_digest)
        size = self._exchange([command] * self._group.world_size)[0]
        self._exchange([ForgetOffloaded(key)] * self._group.world_size)
        return size  # type: ignore[return-value]

    def host_bytes_per_slot(self) -> int:
        """Every rank's host copy (ranks started by --nproc share this machine's memory)."""
        return self.local.host_bytes_per_slot() * self._group.world_size

    def _require_free_slot(self) -> None:
        pool = self.local.pool
        if len(pool.live_slots) >= pool.max_slots:
            raise CapacityError(f"all {pool.max_slots} adapter slots are in use")

    def _agreed(self, replies: list[object], what: str) -> int:
        """The one value every rank answered; ranks answering differently have diverged."""
        if len(set(replies)) != 1:
            raise self._fail(f"engine ranks answered different {what}s: {replies}")
        return replies[0]  # type: ignore[return-value]

    # --- files, written by rank 0 from the first data-parallel group's parts
    def save_state(self, slot: int, directory: Path, owner_digest: str, with_gradients: bool = False) -> int:
        """Rank 0 writes the checkpoint, in the single-rank format; with gradients, every rank's share of
        them is first summed (replica.save_state)."""
        self._raise_if_failed()
        if with_gradients:
            self._step.invalidate()
        self.local.pool.get(slot)  # NotFoundError before anything is sent
        command = SaveState(slot, Path(directory), owner_digest, with_gradients)
        return self._exchange([command] * self._group.world_size)[0]  # type: ignore[return-value]

    def export_snapshot(self, checkpoint_dir: Path, snapshot_dir: Path, owner_digest: str) -> int:
        """Rank 0 converts the checkpoint's files; no slot, no other rank."""
        return self.local.export_snapshot(checkpoint_dir, snapshot_dir, owner_digest)

    def save_snapshot(self, slot: int, directory: Path) -> int:
        """Rank 0 writes the PEFT snapshot, of the first data-parallel group's parts."""
        self._raise_if_failed()
        self.local.pool.get(slot)  # NotFoundError before anything is sent
        return self._exchange([SaveSnapshot(slot, Path(directory))] * self._group.world_size)[0]  # type: ignore[return-value]

    def snapshot_files(self, slot: int) -> dict[str, bytes]:
        """Rank 0's PEFT snapshot files, in memory, of the first data-parallel group's parts."""
        self._raise_if_failed()
        self.local.pool.get(slot)  # NotFoundError before anything is sent
        return self._exchange([SnapshotFiles(slot)] * self._group.world_size)[0]  # type: ignore[return-value]

    # --- sampling, on every data-parallel group on rank 0's machine
    def validate_sample_request(self, request: SampleRequest) -> None:
        """Rank 0 checks the request (snapshots are files; see LocalEngine)."""
        self.local.validate_sample_request(request)

    def add_sample(self, key: str, request: SampleRequest) -> None:
        """Queue a sampling request on the sampling group with the fewest requests (the first on a tie)."""
        queued = {group: 0 for group in self._sampling_groups}
        for group in self._sample_group.values():
            queued[group] += 1
        group = min(queued, key=queued.__getitem__)
        self._on_sampling_groups({group: AddSample(key, request)})
        self._sample_group[key] = group

    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | UserError]]:
        """One admission + decode step of every sampling group with requests, each with the whole prefill
        budget (a group is its own devices); the finished requests of all of them."""
        busy = sorted(set(self._sample_group.values()))
        try:
            replies = self._on_sampling_groups({group: StepSampler(max_prefill_tokens) for group in busy})
        except Exception:  # every sampler dropped every request (protocol.DropSamples): the caller fails them
            self._sample_group.clear()
            self._sample_progress.clear()
            raise
        finished: list[tuple[str, SampleResult | UserError]] = []
        for group in busy:
            group_finished, group_progress = replies[group]  # type: ignore[misc]
            finished += group_finished
            self._sample_progress.update(group_progress)
        for key, _ in finished:
            self._sample_group.pop(key, None)
        return finished

    def take_sample_progress(self) -> dict[str, SampleProgress]:
        """The streaming requests' new tokens of the last sampler steps, from every sampling group."""
        progress, self._sample_progress = self._sample_progress, {}
        return progress

    def cancel_sample(self, key: str) -> bool:
        """Drop a request from the group sampling it; False if no group holds it."""
        group = self._sample_group.pop(key, None)
        if group is None:
            return False
        return self._on_sampling_groups({group: CancelSample(key)})[group]  # type: ignore[return-value]

    def sampling_rows(self) -> int:
        """Every sampling group's decode batch (each group samples on its own devices)."""
        return len(self._sampling_groups) * self.local.sampling_rows()

    def has_sampling_work(self) -> bool:
        """Whether any sampling group holds a request (each request until it finishes or is cancelled)."""
        return bool(self._sample_group)

    def _on_sampling_groups(self, commands: dict[int, SamplerCommand]) -> dict[int, object]:
        """Each given data-parallel group's first rank's reply to its sampler command, which the group's
        ranks run together. Rank 0's group alone, of one rank, runs it here with no exchange."""
        group = self._group
        if set(commands) == {0} and not group.tp.is_parallel:
            return {0: execute(commands[0], self.local, group)}
        per_rank = [commands.get(group.rank_dp(rank), Ping()) for rank in self._ranks]
        replies = self._exchange(per_rank)
        return {dp_rank: replies[group.ranks_of(dp_rank)[0]] for dp_rank in commands}

    @property
    def _ranks(self) -> range:
        return range(self._group.world_size)

    def usage(self) -> EngineUsage:
        """Rank 0's device memory; every rank's parameter bytes; the sampler counters of every sampling
        group (its first rank's: its ranks sample together). Rank 0's own figures are read now, the
        others' as of the last exchange (commands and heartbeats: at most a few seconds old when idle)."""
        own = self.local.usage()
        usages = (own, *self._usages[1:])
        sampling = [usages[self._group.ranks_of(dp_rank)[0]] for dp_rank in self._sampling_groups]
        counters = {
            name: sum(getattr(usage, name) for usage in sampling)
            for name in ("prefill_tokens", "sampled_tokens", "sequences", "kv_cache_bytes", "kv_cache_tokens")
        }
        parameter_bytes = tuple(b for usage in usages for b in usage.parameter_bytes)
        return dataclasses.replace(own, parameter_bytes=parameter_bytes, **counters)

    # --- exchanges, failure and shutdown
    def _exchange(self, commands: list[RankCommand]) -> list[object]:
        """Send one command per rank, run rank 0's, and return every rank's reply in rank order."""
        if self._closing.is_set():
            raise ServerError("the engine was shut down")
        with self._lock:
            self._raise_if_failed()
            return self._exchange_locked(commands)

    def _exchange_locked(self, commands: list[RankCommand]) -> list[object]:
        stage = "exchange"
        try:
            own = scatter_commands(self._group, commands)
            stage = "own"
            envelope = reply(own, self.local, self._group)
            stage = "exchange"
            gathered = gather_replies(self._group, envelope)
        except Exception as error:  # a collective broke: a rank died, hung past the timeout or diverged
            # Rank 0's own part raised outside any collective (replica.answer): name rank 0.
            is_own = stage == "own" and not isinstance(error, CollectiveError)
            own_failure = f"engine rank 0 failed its part of a {type(commands[0]).__name__} ({error})"
            raise self._fail(self._diagnose(error, own_failure if is_own else None)) from error
        finally:
            self._last_exchange = time.monotonic()
        envelopes = cast(list[RankReply], gathered)  # what every rank sends (replica.reply)
        self._usages = tuple(envelope.usage for envelope in envelopes)
        replies = [envelope.value for envelope in envelopes]
        errors = [value for value in replies if isinstance(value, RankError)]
        if errors:
            command = commands[0]
            what = _WHAT.get(type(command), type(command).__name__)
            message = "; ".join(
                f"engine rank {e.rank} failed its share of the {what}: {e.message}" for e in errors
            )
            if isinstance(command, ApplyStep):  # that rank's replica may differ from the others for good
                raise self._fail(message)
            # The failed ranks undid their share; the others take theirs back, so no rank keeps any of it.
            undo = take_back(command)
            if undo is not None:
                self._exchange_locked([undo] * self._group.world_size)
            user_errors = [e.user_error for e in errors if e.user_error is not None]
            raise user_errors[0] if len(user_errors) == len(errors) else ServerError(message)
        return replies

    def _pass_results(self, reply: object, rank: int) -> list[PassResult]:
        """A rank's pass results; a request that rank 0 accepted and the rank rejected: replicas differ."""
        assert isinstance(reply, list)  # RunPass replies are result lists (errors were raised above)
        for result in reply:
            if isinstance(result, UserError):
                raise self._fail(f"engine rank {rank} rejected a request that rank 0 accepted ({result})")
        return reply

    def _diagnose(self, error: Exception, own_failure: str | None = None) -> str:
        """The likeliest cause of a failed exchange: a local rank that exited (whose death broke a
        collective rank 0 was in), else rank 0's own failure where it had one, else the error itself."""
        exited = self._local_ranks.exited(_EXIT_GRACE_S) if self._local_ranks else {}
        if exited:
            return describe_exits(exited)
        return own_failure or f"an engine rank stopped answering ({error})"

    def _fail(self, cause: str) -> ServerError:
        """Fail the engine for good (once; later causes are dropped) and return the error to raise."""
        with self._failure_lock:
            is_first = self._failure is None
            if is_first:
                self._failure = (
                    f"{cause}; the engine cannot go on and the server is shutting down: restart it, "
                    "and resume runs from their checkpoints"
                )
        if is_first:
            log.error("%s", self._failure)
            if not self._closing.is_set():  # a closing engine's owner is stopping already
                self._on_failure(self._failure)
        return ServerError(self._failure)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ServerError(self._failure)

    def _watch(self) -> None:
        """Notice a dead local rank at once; ping quiet ranks, so a silent one is found within the timeout."""
        while not self._closing.wait(_WATCH_S) and self._failure is None:
            exited = self._local_ranks.exited() if self._local_ranks else {}
            if exited:
                self._fail(describe_exits(exited))
            elif time.monotonic() - self._last_exchange >= self._heartbeat_s:
                self._ping()

    def _ping(self) -> None:
        """Exchange a Ping, unless a command is under way (whose own collectives watch the ranks)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._failure is None and not self._closing.is_set():
                self._exchange_locked([Ping()] * self._group.world_size)
        except ServerError:
            pass  # _fail has reported it
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the other ranks (in order if the group works, by kill if it failed) and leave the group."""
        self._closing.set()
        self._watchdog.join(_SHUTDOWN_GRACE_S)
        # Held from here on: nothing may be sent after Shutdown. Not getting it means an exchange is stuck
        # in a collective (a silent remote rank): then the group is left as it is, for the process to end.
        is_idle = self._lock.acquire(timeout=_SHUTDOWN_GRACE_S)
        is_clean = is_idle and self._failure is None
        if is_clean:
            try:
                scatter_commands(self._group, [Shutdown()] * self._group.world_size)
            except Exception as error:  # a rank died while the server was stopping
                is_clean = False
                self._fail(self._diagnose(error))
        if self._local_ranks is not None:
            self._local_ranks.stop(_SHUTDOWN_GRACE_S if is_clean else 0.0)
        if is_idle:
            leave_group()


# What a command's failure message calls it.
_WHAT = {
    RunPass: "pass",
    PrepareStep: "optimizer step",
    ApplyStep: "optimizer step",
    SaveState: "checkpoint save",
    SaveSnapshot: "snapshot save",
    SnapshotFiles: "snapshot export",
    SpillOffloaded: "parking of a host copy",
    StepSampler: "sampling step",
}


def _describe_mesh(group: RankGroup) -> str:
    """How the ranks split the work, for EngineInfo.device."""
    if not group.tp.is_parallel:
        return f"data parallel over {group.world_size} ranks"
    return (
        f"{group.world_size} ranks: {group.dp_size} data-parallel group(s) of {group.tp.size} "
        "tensor-parallel ranks"
    )


def start_coordinator(
    env: RankEnv,
    build: EngineBuilder,
    device: str,
    timeouts: RankTimeouts,
    tp_size: int,
    on_failure: Callable[[str], None],
    local_ranks: LocalRanks | None = None,
) -> DistributedEngine:
    """Rank 0's start-up: meet the other ranks (tensor-parallel groups of `tp_size`), build the local
    engine, and wrap it.

    `local_ranks` (ranks this process spawned) are watched during start-up and stopped if it fails.
    """
    try:
        if local_ranks is None:
            local, group = start_rank(env, build, device, timeouts, tp_size)
        else:
            local, group = local_ranks.run_watched(lambda: start_rank(env, build, device, timeouts, tp_size))
    except BaseException:
        if local_ranks is not None:
            local_ranks.stop(0.0)
        raise
    return DistributedEngine(local, group, timeouts.collective_s, on_failure, local_ranks)
