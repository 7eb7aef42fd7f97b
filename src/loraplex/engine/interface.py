"""The engine as the runtime sees it: one small abstract interface, so the runtime can be tested with a fake.

Every method is called from one engine worker thread at a time (the runtime serialises them).
Inputs and outputs are plain data (engine/types.py): numpy arrays, dataclasses, paths. No HTTP, no SQL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

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
from loraplex.errors import UserError


@dataclass(frozen=True)
class EngineInfo:
    """What the engine serves: reported by get_info / capabilities, stamped into checkpoints."""

    model_name: str  # e.g. "loraplex/tiny" or the --model-name given at start-up
    arch: str  # "qwen3", "qwen2", "llama"
    tokenizer_dir: str  # local HF tokenizer directory (get_info's tokenizer_id)
    vocab_size: int
    max_context_length: int
    max_rank: int
    base_model_digest: str  # identity of the base weights; checkpoints of another base are refused
    device: str


@dataclass(frozen=True)
class ParameterBytes:
    """The bytes of tensors one engine rank holds, by what they are for (sizes, never a device sync)."""

    base: int = 0  # the frozen model's parameters and buffers
    adapter: int = 0  # the LoRA weights of every allocated slot
    optimizer: int = 0  # those slots' gradient accumulators and AdamW moments, and the pass undo copy


@dataclass(frozen=True)
class EngineUsage:
    """What the engine reports for telemetry: cheap to read (no device sync), counters since start."""

    prefill_tokens: int = 0  # prompt tokens the sampler prefilled
    sampled_tokens: int = 0  # tokens the sampler drew
    sequences: int = 0  # sequences decoding now (KV cache rows in use)
    kv_cache_bytes: int = 0  # KV cache storage held now
    kv_cache_tokens: int = 0  # tokens cached in the rows in use
    device_name: str = ""  # e.g. the GPU's name; "" when there is nothing to add to EngineInfo.device
    device_allocated_bytes: int | None = None  # CUDA memory held by tensors; None off CUDA
    device_reserved_bytes: int | None = None  # CUDA memory the caching allocator holds
    device_total_bytes: int | None = None
    parameter_bytes: tuple[ParameterBytes, ...] = ()  # by engine rank, rank 0 first; () if not measured


class Engine(ABC):
    """Compute plane: slots, fused passes, fused optimizer steps, checkpoints, snapshots and sampling."""

    info: EngineInfo
    max_slots: int  # adapters held at once: the slots the runtime's scheduler hands out

    @abstractmethod
    def validate_pass_request(self, request: PassRequest) -> None:
        """Raise UserError naming datum index, key and expectation; cheap, numpy only, reads no slot state
        (the request's slot is not looked at: slots come and go on the worker thread)."""

    @abstractmethod
    def create_slot(self, config: LoraConfig) -> int:
        """Allocate a fresh adapter (A seeded, B zero, no optimizer state) and return its slot id."""

    @abstractmethod
    def free_slot(self, slot: int) -> None:
        """Drop a slot's weights, gradients and optimizer state; the id may be reused."""

    @abstractmethod
    def run_pass(self, requests: list[PassRequest], keep_undo: bool = False) -> list[PassResult | UserError]:
        """Run all requests in one packed pass; per request a result, or the UserError that rejected it.

        Semantics: equal to running each request alone, in order. Training requests add into their
        slot's gradient accumulators; a rejected request changes no state. Transactional: if the pass
        raises, no slot changed. A request whose slot is not live is a caller bug: ServerError, no pass.
        keep_undo: keep what `undo_last` needs to take the pass back, until the next call that changes slots.
        """

    @abstractmethod
    def prepare_step(self, steps: dict[int, AdamParams]) -> PreparedStep:
        """Phase 1 of a fused AdamW step of the given slots: compute it without taking it.

        Per slot, from its gradient accumulators as they are: the gradient norm, the clip factor, whether
        the norm is finite, and the metrics `apply_step` will have produced (`.metrics`: slot ->
        grad_norm, learning_rate, and skipped_nonfinite 1.0 when the norm is not finite). Everything that
        can fail happens here (slot lookups, allocations); it changes no slot's weights, moments,
        gradients or step count, so if it raises, nothing changed. The result is valid until the next
        call that changes slots (a pass, another prepare, create, free, load, undo); it is applied or
        aborted once. The runtime's order: prepare_step, record the outcome (`.metrics`) durably, then
        apply_step, or abort_step if the outcome could not be recorded.
        """

    @abstractmethod
    def apply_step(self, prepared: PreparedStep) -> None:
        """Phase 2: take the step `prepare_step` computed (in-place kernels only: nothing left to fail).

        A stale or already used `prepared` is a ServerError and changes nothing. Should a kernel fail all
        the same (a broken invariant), the slots it had not finished are poisoned: every later use of
        them but `free_slot` raises a ServerError saying their state is lost; this raises one too.
        """

    @abstractmethod
    def abort_step(self, prepared: PreparedStep) -> None:
        """Take back phase 1 when its outcome could not be recorded: every slot is left as before
        `prepare_step` (on data-parallel ranks, as an equal sum of the ranks' gradients). A stale or
        already used `prepared` is a ServerError and changes nothing."""

    def optim_step(self, steps: dict[int, AdamParams]) -> dict[int, dict[str, float]]:
        """`prepare_step` then `apply_step`: one fused AdamW step; its metrics. If it raises in the first
        phase, no slot changed (apply_step says what a failure in the second means)."""
        prepared = self.prepare_step(steps)
        self.apply_step(prepared)
        return prepared.metrics

    @abstractmethod
    def undo_last(self) -> None:
        """Take back the last pass run with keep_undo (nothing if it raised or none was kept). The runtime
        asks this when it cannot record that pass's outcome: its requests then fail, and their retry must
        not count twice. Valid only before any other call changes a slot."""

    @abstractmethod
    def save_state(self, slot: int, directory: Path, owner_digest: str, with_gradients: bool = False) -> int:
        """Write weights + AdamW state + config + base identity + owner atomically; return bytes written.
        with_gradients also keeps the unstepped gradient accumulators (a parked run), which load_state
        then restores."""

    @abstractmethod
    def load_state(
        self, directory: Path, owner_digest: str, with_optimizer: bool, slot: int | None = None
    ) -> tuple[int, LoraConfig]:
        """Load a checkpoint into `slot` (None = a new slot); verify everything before touching it."""

    # --- the host tier: slots moved to host memory and back (runtime/core/executor.py decides when)
    @abstractmethod
    def offload_slot(self, slot: int) -> int:
        """Copy the slot's whole state (weights, AdamW moments and step, unstepped gradient accumulators)
        to host memory and free the slot; return the key of the host copy."""

    @abstractmethod
    def restore_slot(self, key: int) -> int:
        """Put the host copy `key` back into a new slot, exactly as it was offloaded, and forget the copy;
        return the slot. CapacityError (the copy kept) if no slot is free."""

    @abstractmethod
    def spill_offloaded(self, key: int, directory: Path, owner_digest: str) -> int:
        """Write the host copy `key` to `directory` as `save_state(with_gradients=True)` would have written
        its slot, then forget the copy; return bytes written. If it raises, the copy is kept."""

    @abstractmethod
    def host_bytes_per_slot(self) -> int:
        """Host memory one offloaded slot of the largest rank takes, on every engine rank together."""

    @abstractmethod
    def export_snapshot(self, checkpoint_dir: Path, snapshot_dir: Path, owner_digest: str) -> int:
        """Write a training checkpoint's weights as a PEFT snapshot, without a slot; return bytes written."""

    @abstractmethod
    def save_snapshot(self, slot: int, directory: Path) -> int:
        """Write an immutable PEFT-format copy of the slot's weights atomically; return bytes written."""

    @abstractmethod
    def snapshot_files(self, slot: int) -> dict[str, bytes]:
        """The files `save_snapshot` would write, in memory (file name -> contents); nothing is written, so
        the caller decides what reaches the disk (an encrypted export writes only their ciphertext)."""

    # --- sampling: continuous batching, driven by the worker between training work
    @abstractmethod
    def validate_sample_request(self, request: SampleRequest) -> None:
        """Raise UserError naming the field that this model cannot serve; cheap, touches no state."""

    @abstractmethod
    def add_sample(self, key: str, request: SampleRequest) -> None:
        """Queue a sampling request under `key` (unique among unfinished ones); UserError if invalid."""

    @abstractmethod
    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | UserError]]:
        """Admit waiting requests (their prompts' prefill, at most `max_prefill_tokens` prompt tokens beyond
        the first request; None = no bound), run one decode step of every active sequence, and return the
        requests that finished, each with its result or the UserError that failed it (e.g. an unreadable
        snapshot). A request's result does not depend on what else shares its steps. If it raises, every
        request added so far is dropped (fail them all); the sampler stays usable."""

    @abstractmethod
    def cancel_sample(self, key: str) -> bool:
        """Forget the unfinished request `key`, waiting or generating: its sequences leave the batch and
        their KV cache rows are freed, and `step_sampler` never returns it. False if no unfinished request
        has that key (it finished, or was never added); nothing changes then."""

    def take_sample_progress(self) -> dict[str, SampleProgress]:
        """The tokens each unfinished streaming request (`SampleRequest.streams`) drew since the last call,
        by key; requests that drew nothing are left out, and so are finished ones, whose results hold every
        token. An engine that reports no progress returns {}: its streams arrive whole, with the result."""
        return {}

    @abstractmethod
    def has_sampling_work(self) -> bool:
        """Whether any sampling request is waiting or generating (step_sampler has work to do)."""

    def sampling_rows(self) -> int:
        """Rows (samples) the engine decodes at once across its samplers: handing it more only makes them
        wait inside it, first come first served, where the runtime can no longer order them fairly."""
        return 2**31

    def usage(self) -> EngineUsage:
        """Telemetry counters and gauges (see EngineUsage); an engine that keeps none reports zeros."""
        return EngineUsage()
