"""Commands: what one training request asks the runtime to do, after the API decoded and checked its shape.

Plain dataclasses over engine/types.py values (numpy arrays). No HTTP, no SQL, no tensors.
Each command knows its Tinker request type (the name futures report) and whether it is batchable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.types import AdamParams, DatumInput, LoraConfig, PassResult
from loraplex.runtime.core.checkpoints import CheckpointPath

# The engine value types commands carry, re-exported so the API builds commands without importing the engine.
__all__ = [
    "AdamParams",
    "Command",
    "CreateRun",
    "CreateRunFromCheckpoint",
    "DatumInput",
    "ForwardBackward",
    "LoadState",
    "LoraConfig",
    "OptimStep",
    "PassResult",
    "SaveExternal",
    "SaveSnapshot",
    "SaveState",
    "is_batchable",
]


@dataclass(frozen=True)
class CreateRun:
    """Seq 0 of a run made by create_model: a fresh adapter."""

    lora_config: LoraConfig
    base_model: str
    user_metadata: dict[str, str] = field(default_factory=dict)

    request_type = "CreateModel"


@dataclass(frozen=True)
class CreateRunFromCheckpoint:
    """Seq 0 of a run made by create-via-load_weights: adapter (and optimizer) from a checkpoint."""

    source: CheckpointPath
    with_optimizer: bool
    user_metadata: dict[str, str] = field(default_factory=dict)
    # The owner digest stamped into the checkpoint (its saver's; the engine checks it on load), found by
    # the control plane when it checks the reader may read the checkpoint.
    source_owner: str = ""

    request_type = "LoadWeights"


@dataclass
class ForwardBackward:
    """forward (forward_only) or forward_backward over a run's datums with one loss."""

    loss_fn: str
    loss_fn_config: dict[str, float]
    datums: list[DatumInput]
    forward_only: bool

    request_type = "ForwardBackward"

    @property
    def num_tokens(self) -> int:
        """Input tokens over all datums: what the scheduler's token budget counts."""
        return sum(len(d.tokens) for d in self.datums)

    @property
    def nbytes(self) -> int:
        """The bytes its datums' arrays hold while it waits: what --max-queued-bytes-per-run counts."""
        return sum(d.tokens.nbytes + sum(a.nbytes for a in d.loss_fn_inputs.values()) for d in self.datums)


@dataclass(frozen=True)
class OptimStep:
    """Apply and clear the gradients accumulated since the last step."""

    params: AdamParams

    request_type = "OptimStep"


@dataclass(frozen=True)
class SaveState:
    """save_weights: adapter + optimizer state under a name (tinker://run/weights/name)."""

    name: str
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)

    request_type = "SaveWeights"


@dataclass(frozen=True)
class SaveSnapshot:
    """save_weights_for_sampler: named (a sampler checkpoint) or unnamed (a new sampling session)."""

    name: str | None
    sampler_id: str | None = None  # set for unnamed saves: the sampling session the snapshot serves
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)

    request_type = "SaveWeightsForSampler"


@dataclass(frozen=True)
class SaveExternal:
    """save_weights_external: a downloadable PEFT export of the adapter (tinker://run/external_weights/name),
    encrypted to `age_recipients` when there are any (runtime/core/encrypted_exports.py)."""

    name: str
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    age_recipients: tuple[str, ...] = ()  # empty: a plaintext export

    request_type = "SaveWeightsExternal"


@dataclass(frozen=True)
class LoadState:
    """Legacy in-place load_weights into an existing run."""

    source: CheckpointPath
    with_optimizer: bool
    source_owner: str = ""  # as CreateRunFromCheckpoint's

    request_type = "LoadWeights"


Command = (
    CreateRun
    | CreateRunFromCheckpoint
    | ForwardBackward
    | OptimStep
    | SaveState
    | SaveSnapshot
    | SaveExternal
    | LoadState
)


def is_batchable(command: Command) -> bool:
    """forward_backwards may share an engine pass with each other and with other runs; the rest are
    barriers."""
    return isinstance(command, ForwardBackward)
