"""The in-process engine: one decoder on one device, its slot pool, fused passes and fused steps.

`build_local_engine` turns start-up options (model, device, capacity) into a ready `LocalEngine`.
Engine code: no HTTP, no SQL; knows nothing of runs, tenants or futures.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from loraplex.engine import checkpoints, snapshots
from loraplex.engine.host_memory import keep_freed_host_memory
from loraplex.engine.interface import Engine, EngineInfo, EngineUsage, ParameterBytes
from loraplex.engine.offload import HostSlot, SlotMover
from loraplex.engine.optimizer import StepPlan, apply_slots, prepare_slots
from loraplex.engine.passes import run_pass
from loraplex.engine.pending_step import PendingStep
from loraplex.engine.sampler.decode_graphs import use_cuda_graphs
from loraplex.engine.sampler.generation import Sampler
from loraplex.engine.sharding import merge_results, piece_requests, split_by_budget
from loraplex.engine.slots import SlotPool, poisoned_message
from loraplex.engine.transactions import SlotSnapshot, UndoBuffer
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
from loraplex.engine.validation import validate_pass_request
from loraplex.errors import NotFoundError, ServerError, UserError
from loraplex.model.decoder import Decoder
from loraplex.model.elementwise import elementwise_for
from loraplex.model.hf_checkpoint import base_model_digest, load_decoder
from loraplex.model.tensor_parallel import SINGLE, TensorParallel
from loraplex.model.tiny import TINY_MODEL_NAME, ensure_tiny_model

# Tokens per lm_head chunk: bounds the loss path's extra memory at chunk × vocab fp32 values.
DEFAULT_LOGPROB_CHUNK = 1024
# Sequences of one decode step (a request's samples are never split) and snapshots kept on the device
# (the snapshot pool's entries: `loraplex serve --max-sampling-snapshots`).
DEFAULT_MAX_SAMPLING_BATCH = 128
DEFAULT_MAX_SAMPLING_SNAPSHOTS = 64


@dataclass
class PassMetrics:
    """What the last pass did, for whoever reports on the engine: its tokens and requests, and on a
    mixture-of-experts model the rows each MoE layer routed to each expert (MoE layers x experts), summed
    over the pieces a pass past the token budget ran as."""

    tokens: int = 0
    requests: int = 0
    expert_load: list[list[int]] | None = None

    def add_expert_load(self, load_LE: Tensor | None) -> None:
        """Add one forward's expert load (a device tensor, read once per forward)."""
        if load_LE is None:
            return
        load = load_LE.tolist()
        if self.expert_load is not None:
            load = [
                [a + b for a, b in zip(x, y, strict=True)]
                for x, y in zip(self.expert_load, load, strict=True)
            ]
        self.expert_load = load


class LocalEngine(Engine):
    """Engine over a decoder held in this process."""

    def __init__(
        self,
        decoder: Decoder,
        info: EngineInfo,
        max_slots: int,
        logprob_chunk: int = DEFAULT_LOGPROB_CHUNK,
        max_sampling_batch: int = DEFAULT_MAX_SAMPLING_BATCH,
        snapshot_capacity: int = DEFAULT_MAX_SAMPLING_SNAPSHOTS,
        max_pass_tokens: int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.decoder = decoder
        self.info = info
        self.pool = SlotPool(decoder, max_slots, info.max_rank)
        self.max_slots = max_slots
        self._undo: SlotSnapshot | None = None  # the last keep_undo pass
        self._undo_buffer = UndoBuffer()  # where every pass transaction's copies go (transactions.py)
        self._step: PendingStep[tuple[list[int], StepPlan]] = PendingStep()  # the prepared step, if any
        self.last_pass = PassMetrics()
        self._mover = SlotMover(self.pool.device)
        self._offloaded: dict[int, HostSlot] = {}  # host copies by key (offload_slot)
        self._next_key = 0  # keys follow from the same offloads on every data-parallel rank
        self.logprob_chunk = logprob_chunk
        self.max_pass_tokens = max_pass_tokens  # a larger pass runs as several (None: never split)
        self.sampler = Sampler(
            decoder,
            Path(info.tokenizer_dir),
            info.max_context_length,
            max_sampling_batch,
            snapshot_capacity,
            info.max_rank,
            logprob_chunk,
            cuda_graphs,
        )

    def validate_pass_request(self, request: PassRequest) -> None:
        """Raise UserError naming datum index, key and expectation; reads no slot state."""
        self._validate(request)

    def _validate(self, request: PassRequest) -> dict[str, float]:
        return validate_pass_request(request, self.info.vocab_size, self.info.max_context_length)

    def create_slot(self, config: LoraConfig) -> int:
        """A fresh adapter: A seeded from config.seed, B zero, zero accumulators, no AdamW steps."""
        self._begin_change()
        return self.pool.create(config)

    def free_slot(self, slot: int) -> None:
        """Drop the slot's weights, accumulators and AdamW state (a poisoned slot's too)."""
        self._begin_change()  # the undo may hold copies of this slot, not to be written into a reused id
        self.pool.free(slot)

    def _begin_change(self) -> None:
        """Every call that changes slots starts here: what an undo or a prepared step was taken from is
        about to change, so neither may be used from now on."""
        self._undo = None
        self._step.invalidate()

    def run_pass(self, requests: list[PassRequest], keep_undo: bool = False) -> list[PassResult | UserError]:
        """All requests in one packed pass (see `passes.run_pass`); if it raises, every slot's gradients are
        as before. keep_undo: keep the copies so `undo_last` can take a successful pass back (a data
        parallel rank whose peer failed its share; a runtime that cannot record the outcome)."""
        self._begin_change()  # whatever fails from here, a Rollback must not take back an earlier pass
        self.require_live_slots(requests)
        trained = {r.slot for r in requests if r.slot is not None and not r.forward_only}
        adams = [self.pool.get(slot).adam for slot in sorted(trained)]  # type: ignore[type-var]
        with self._transaction(SlotSnapshot(adams, self._undo_buffer), keep_undo):
            results = self._run_within_budget(requests)
        for adam in adams:
            adam.has_gradients = True
        return results

    def _run_within_budget(self, requests: list[PassRequest]) -> list[PassResult | UserError]:
        """One packed pass, or, past `max_pass_tokens`, consecutive passes of at most that many tokens
        whose outputs are joined back per request: each datum's outputs and gradient depend only on the
        datum, so the result is the one big pass's, with its activation memory bounded by the budget."""
        tokens = sum(len(d.tokens) for r in requests for d in r.datums)
        self.last_pass = PassMetrics(tokens=tokens, requests=len(requests))
        if self.max_pass_tokens is None or tokens <= self.max_pass_tokens:
            results = run_pass(self.decoder, requests, self._validate, self.logprob_chunk)
            self.last_pass.add_expert_load(self.decoder.expert_load())
            return results
        results: list[PassResult | UserError | None] = [None] * len(requests)
        accepted = []
        for index, request in enumerate(requests):
            try:
                self._validate(request)
                accepted.append(index)
            except UserError as error:
                results[index] = error
        chosen = [requests[i] for i in accepted]
        groups = split_by_budget(chosen, self.max_pass_tokens)
        passes = []
        for group in groups:
            passes.append(
                run_pass(self.decoder, piece_requests(chosen, group), self._validate, self.logprob_chunk)
            )
            self.last_pass.add_expert_load(self.decoder.expert_load())
        for index, result in zip(accepted, merge_results(chosen, groups, passes), strict=True):  # type: ignore[arg-type]
            results[index] = result
        return results  # type: ignore[return-value]  # every request got its result or error above

    def prepare_step(self, steps: dict[int, AdamParams]) -> PreparedStep:
        """Compute the fused step of the given slots without taking it (`optimizer.prepare_slots`): changes
        no slot, copies nothing. Valid until the next call that changes slots (Engine.prepare_step)."""
        self._begin_change()
        adams = [self.pool.get(slot).adam for slot in steps]  # NotFoundError, poisoned: before anything
        plan = prepare_slots(list(zip(adams, steps.values(), strict=True)), self.pool.tp)
        return self._step.hold(dict(zip(steps, plan.metrics, strict=True)), (list(steps), plan))

    def apply_step(self, prepared: PreparedStep) -> None:
        """Take the prepared step (`optimizer.apply_slots`: in-place kernels only). If it raises all the
        same, the slots it had not finished are poisoned, so none is used half-stepped."""
        slots, plan = self._step.claim(prepared, "applied")
        self._undo = None
        try:
            apply_slots(plan)
        except BaseException as error:
            lost = slots[plan.applied :]
            self.pool.poison(lost)
            if not isinstance(error, Exception):
                raise
            raise ServerError(f"{poisoned_message(lost)} ({type(error).__name__}: {error})") from error

    def abort_step(self, prepared: PreparedStep) -> None:
        """Drop the prepared step: prepare changed nothing, so every slot is as before it."""
        self._step.claim(prepared, "aborted")

    @property
    def pending_step(self) -> PreparedStep | None:
        """The step prepared and not yet applied, aborted or made stale (what a data-parallel rank applies
        or aborts when rank 0 says so); None if there is none."""
        return self._step.prepared

    def require_live_slots(self, requests: list[PassRequest]) -> None:
        """ServerError if a request names a slot that is not loaded: the runtime built it without its run's
        slot, which must fail loudly rather than run on the base model; or one that is poisoned."""
        named = {r.slot for r in requests if r.slot is not None}
        missing = sorted(slot for slot in named if not self.pool.has_slot(slot))
        if missing:
            raise ServerError(f"a pass was built for adapter slots {missing}, which are not loaded")
        poisoned = self.pool.poisoned(list(named))
        if poisoned:
            raise ServerError(poisoned_message(poisoned))

    def undo_last(self) -> None:
        """Take back the last pass run with keep_undo (no-op if it failed or none was kept)."""
        undo = self._undo
        self._begin_change()
        if undo is not None:
            undo.restore()

    @contextmanager
    def _transaction(self, snapshot: SlotSnapshot, keep_undo: bool) -> Iterator[None]:
        """Restore `snapshot` if the body raises; else keep it for `undo_last` when asked (callers clear
        the previous one first, before anything can fail)."""
        try:
            yield
        except BaseException:
            snapshot.restore()
            raise
        if keep_undo:
            self._undo = snapshot

    def save_state(self, slot: int, directory: Path, owner_digest: str, with_gradients: bool = False) -> int:
        """Atomic checkpoint of weights, AdamW state, config, base identity and owner (and gradients)."""
        return checkpoints.save_state(
            self.pool, slot, directory, owner_digest, self.info.base_model_digest, with_gradients
        )

    def load_state(
        self, directory: Path, owner_digest: str, with_optimizer: bool, slot: int | None = None
    ) -> tuple[int, LoraConfig]:
        """Verify a checkpoint fully, then load it into `slot` or a new slot."""
        self._begin_change()  # as in free_slot
        return checkpoints.load_state(
            self.pool, directory, owner_digest, self.info.base_model_digest, with_optimizer, slot
        )

    def offload_slot(self, slot: int) -> int:
        """Move the slot's whole state to host memory (engine/offload.py) and free the slot."""
        self._begin_change()  # as in free_slot
        host = self._mover.to_host(self.pool.get(slot))
        self.pool.free(slot)
        key, self._next_key = self._next_key, self._next_key + 1
        self._offloaded[key] = host
        return key

    def restore_slot(self, key: int, forget: bool = True) -> int:
        """A new slot of the host copy's config, overwritten with the copy bit for bit; the copy is kept
        unless `forget` (a data-parallel rank keeps it until every rank has parked it: replica.py)."""
        host = self._host_copy(key)
        self._begin_change()
        slot = self.pool.create(host.config)  # CapacityError before the copy is forgotten
        self._mover.to_device(host, self.pool.get(slot))
        if forget:
            self.forget_offloaded(key)
        return slot

    def forget_offloaded(self, key: int) -> None:
        """Drop the host copy `key`."""
        self._host_copy(key)
        del self._offloaded[key]

    def spill_offloaded(self, key: int, directory: Path, owner_digest: str) -> int:
        """Write the host copy in the format a parked slot's save_state writes (gradients included)."""
        if self.pool.tp.is_parallel:  # a rank holds parts; DistributedEngine parks through a slot instead
            raise ServerError("a tensor-parallel rank cannot write its host copy alone")
        host = self._host_copy(key)
        weights, optimizer, gradients = host.tensors()
        size = checkpoints.write_state(
            directory, host.config, weights, optimizer, gradients, owner_digest, self.info.base_model_digest
        )
        self.forget_offloaded(key)
        return size

    def host_bytes_per_slot(self) -> int:
        """Four fp32 buffers (weights, gradients, two moments) of a max-rank slot training every target."""
        shapes = self.pool.expected_shapes(LoraConfig(rank=self.info.max_rank))
        return 4 * 4 * sum(math.prod(shape) for shape in shapes.values())

    def _host_copy(self, key: int) -> HostSlot:
        host = self._offloaded.get(key)
        if host is None:
            raise NotFoundError(f"no host copy of a slot has key {key}")
        return host

    def export_snapshot(self, checkpoint_dir: Path, snapshot_dir: Path, owner_digest: str) -> int:
        """A training checkpoint's weights as a PEFT snapshot, verified as a load verifies them; no slot."""
        _, config, weights = checkpoints.read_weights(
            self.pool, Path(checkpoint_dir), owner_digest, self.info.base_model_digest
        )
        return snapshots.write_snapshot(weights, config, snapshot_dir, self.info.model_name)

    def save_snapshot(self, slot: int, directory: Path) -> int:
        """Immutable PEFT-format copy of the slot's weights."""
        return snapshots.save_snapshot(self.pool, slot, directory, self.info.model_name)

    def snapshot_files(self, slot: int) -> dict[str, bytes]:
        """The PEFT snapshot's files of the slot, in memory."""
        return snapshots.slot_snapshot_files(self.pool, slot, self.info.model_name)

    def validate_sample_request(self, request: SampleRequest) -> None:
        """Raise UserError naming the field this model cannot serve (see sampler/validation.py)."""
        self.sampler.validate(request)

    def add_sample(self, key: str, request: SampleRequest) -> None:
        """Queue a sampling request for the next `step_sampler` calls."""
        self.sampler.add(key, request)

    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | UserError]]:
        """One admission + decode step of the sampler (see sampler/generation.py)."""
        return self.sampler.step(max_prefill_tokens)

    def cancel_sample(self, key: str) -> bool:
        """Drop a waiting or generating sampling request (see sampler/generation.py)."""
        return self.sampler.cancel(key)

    def take_sample_progress(self) -> dict[str, SampleProgress]:
        """The tokens streaming requests drew since the last call (see sampler/generation.py)."""
        return self.sampler.take_progress()

    def drop_samples(self) -> None:
        """Drop every sampling request, as a failed `step_sampler` does (a peer's step failed)."""
        self.sampler.drop_everything()

    def has_sampling_work(self) -> bool:
        """Whether a sampling request is waiting or generating."""
        return self.sampler.has_work()

    def sampling_rows(self) -> int:
        """The sampler's decode batch (--max-sampling-batch rows)."""
        return self.sampler.max_batch

    def parameter_bytes(self) -> ParameterBytes:
        """The bytes this engine's tensors hold by kind: the base model, the slots' weights, and their
        optimizer state with the undo buffer's copy of gradients (sizes only: no sync, no copy)."""
        adapter, optimizer = self.pool.held_bytes()
        return ParameterBytes(self._base_bytes, adapter, optimizer + self._undo_buffer.nbytes)

    @cached_property
    def _base_bytes(self) -> int:
        # Frozen: counted once. parameters() yields a tied lm_head once; the buffers are rope's frequencies.
        return sum(t.nbytes for t in (*self.decoder.parameters(), *self.decoder.buffers()))

    def usage(self) -> EngineUsage:
        """The sampler's token counters and KV cache, this engine's parameter bytes, and on CUDA the
        allocator's counters (no sync)."""
        cache = self.sampler.cache
        device = self.decoder.lm_head.weight.device
        on_cuda = device.type == "cuda"
        return EngineUsage(
            prefill_tokens=self.sampler.prefill_tokens,
            sampled_tokens=self.sampler.sampled_tokens,
            sequences=cache.num_live_rows,
            kv_cache_bytes=cache.stored_bytes,
            kv_cache_tokens=cache.num_cached_tokens,
            device_name=self._device_name,
            device_allocated_bytes=torch.cuda.memory_allocated(device) if on_cuda else None,
            device_reserved_bytes=torch.cuda.memory_reserved(device) if on_cuda else None,
            device_total_bytes=self._device_total_bytes,
            parameter_bytes=(self.parameter_bytes(),),
        )

    @cached_property
    def _device_name(self) -> str:
        device = self.decoder.lm_head.weight.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else ""

    @cached_property
    def _device_total_bytes(self) -> int | None:
        device = self.decoder.lm_head.weight.device
        return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(device)


def build_local_engine(
    model: str,
    data_dir: Path,
    device: str,
    max_slots: int,
    max_rank: int,
    model_name: str | None,
    max_pass_tokens: int | None = None,
    tp: TensorParallel = SINGLE,
    compile_setting: str = "auto",
    max_sampling_snapshots: int = DEFAULT_MAX_SAMPLING_SNAPSHOTS,
    cuda_graphs_setting: str = "auto",
) -> LocalEngine:
    """Load `model` ("tiny" = the built-in model, else an HF model directory) onto `device`, this rank's
    part of it under tensor parallelism (`tp`); passes past `max_pass_tokens` run in pieces; the decoder's
    elementwise math fused by torch.compile as `compile_setting` says (`serve --compile`); up to
    `max_sampling_snapshots` snapshots sample at once; decode steps replayed from CUDA graphs as
    `cuda_graphs_setting` says (`serve --cuda-graphs`)."""
    is_tiny = model == "tiny"
    # Absolute: get_info reports it as the tokenizer's location, which clients elsewhere must find.
    model_dir = (ensure_tiny_model(data_dir) if is_tiny else Path(model).expanduser()).resolve()
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model {model}: {model_dir} is not an HF model directory (no config.json)")
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        keep_freed_host_memory()
    # bf16 matmul on CPUs is ~100x slower than fp32; GPUs hold the frozen base in bf16.
    dtype = torch.float32 if torch_device.type == "cpu" else torch.bfloat16
    decoder = load_decoder(model_dir, torch_device, dtype, tp)
    decoder.use_elementwise(elementwise_for(compile_setting, torch_device))
    config = decoder.config
    info = EngineInfo(
        model_name=model_name or (TINY_MODEL_NAME if is_tiny else model_dir.name),
        arch=config.model_type,
        tokenizer_dir=str(model_dir),
        vocab_size=config.vocab_size,
        max_context_length=config.max_position_embeddings,
        max_rank=max_rank,
        base_model_digest=base_model_digest(model_dir),
        device=str(torch_device),
    )
    return LocalEngine(
        decoder,
        info,
        max_slots,
        max_pass_tokens=max_pass_tokens,
        snapshot_capacity=max_sampling_snapshots,
        cuda_graphs=use_cuda_graphs(cuda_graphs_setting, decoder),
    )
