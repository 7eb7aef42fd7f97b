"""Wire models: the Tinker protocol's JSON bodies (pydantic), each converting once into runtime values.

Requests ignore unknown fields (the SDK adds e.g. `type`); responses are built by the `*_json`
functions from runtime views. Sizes the operator limits (user_metadata, stop lists, names) are checked
against the request limits in force (api/limits.py). No tensors, no engine calls.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from loraplex.api.limits import current_limits
from loraplex.api.tinker.sparse import csr_problem, densify
from loraplex.errors import UserError
from loraplex.runtime.control.catalog import CheckpointView, RunView
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import (
    AdamParams,
    CreateRun,
    CreateRunFromCheckpoint,
    LoadState,
    LoraConfig,
    OptimStep,
    SaveExternal,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.core.encrypted_exports import parse_recipients
from loraplex.runtime.core.sampling import SampleRequest, SamplingParams


class WireModel(BaseModel):
    """Base of request bodies: unknown fields are ignored, `model_` names are allowed, text is Unicode."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @field_validator("*")
    @classmethod
    def _is_unicode(cls, value: Any) -> Any:
        """Refuse a lone surrogate ("\\ud800" parses as JSON, but no UTF-8 store or file name can hold it)."""
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError("text with a lone surrogate (\\ud800-\\udfff) is not Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_unicode(item)


# --- field types: what the database can hold, and what the operator bounds
# The database stores seq_ids, TTLs and offsets as 64-bit integers: a larger one is refused here (422)
# rather than overflowing there. Token ids too are int64 once decoded.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
SeqId = Annotated[int, Field(ge=0, lt=2**63)]
TtlSeconds = Annotated[int, Field(ge=3600, le=10 * 365 * 86400)]  # an hour up to ten years (Tinker's range)


def _text_values(value: Any) -> Any:
    """Metadata values as text, as Tinker keeps them (the cookbook sends some numbers)."""
    if isinstance(value, dict):
        return {key: item if isinstance(item, str) else str(item) for key, item in value.items()}
    return value


def _bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    limits = current_limits()
    if len(metadata) > limits.max_metadata_entries:
        raise ValueError(
            f"{len(metadata)} entries, over the {limits.max_metadata_entries} this server keeps "
            "(--max-metadata-entries)"
        )
    size = sum(len(key.encode()) + len(item.encode()) for key, item in metadata.items())
    if size > limits.max_metadata_bytes:
        raise ValueError(
            f"{size} bytes of keys and values, over the {limits.max_metadata_bytes} this server keeps "
            "(--max-metadata-bytes)"
        )
    return metadata


def _bounded_name(name: str) -> str:
    limit, size = current_limits().max_name_bytes, len(name.encode())
    if size > limit:
        raise ValueError(f"a name of {size} bytes, over the {limit} this server takes (--max-name-bytes)")
    return name


def _bounded_display_name(name: str) -> str:
    """A session's display name is free text, like a metadata value (the cookbook builds one from its
    dataset path and log dir): bounded by --max-metadata-bytes, not by the checkpoint-name limit."""
    limit, size = current_limits().max_metadata_bytes, len(name.encode())
    if size > limit:
        raise ValueError(
            f"a display name of {size} bytes, over the {limit} this server keeps (--max-metadata-bytes)"
        )
    return name


def _bounded_stop(stop: str | list[str] | list[int] | None) -> str | list[str] | list[int] | None:
    limits = current_limits()
    items = [stop] if isinstance(stop, str) else stop or []
    if len(items) > limits.max_stop_sequences:
        raise ValueError(
            f"{len(items)} stop items, over the {limits.max_stop_sequences} this server takes "
            "(--max-stop-sequences)"
        )
    longest = max((len(item) for item in items if isinstance(item, str)), default=0)
    if longest > limits.max_stop_chars:
        raise ValueError(
            f"a stop string of {longest} characters, over the {limits.max_stop_chars} this server takes "
            "(--max-stop-chars)"
        )
    return stop


def _bounded_num_samples(num_samples: int) -> int:
    # Checked here, not only by the engine: the route promises one sequence id per sample, also to a
    # resent request, which the service answers with its first future without looking at it again.
    limit = current_limits().max_queued_samples
    if num_samples > limit:
        raise ValueError(f"{num_samples} samples, over the {limit} this server queues (--max-queued-samples)")
    return num_samples


UserMetadata = Annotated[dict[str, str], BeforeValidator(_text_values), AfterValidator(_bounded_metadata)]
CheckpointName = Annotated[str, AfterValidator(_bounded_name)]
DisplayName = Annotated[str, AfterValidator(_bounded_display_name)]


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """Validation errors as one line naming each field, without echoing values (they may be huge, or NaN,
    which JSON cannot carry)."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors]
    return "invalid request body: " + "; ".join(problems)


# --- service and sessions
class CreateSessionRequest(WireModel):
    user_metadata: UserMetadata = Field(default_factory=dict)
    display_name: DisplayName | None = None


class SessionRequest(WireModel):
    session_id: str


class FinishReason(WireModel):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishRequest(WireModel):
    reason: FinishReason = Field(default_factory=FinishReason)


# --- training
class WireLoraConfig(WireModel):
    rank: int = Field(32, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


_ADAMW_ONLY = (
    'only AdamW: create the run with optimizer_config {"type": "adamw"} (the default) and step '
    "it with adam_params"
)


def _adamw_only(value: Any) -> Any:
    """Refuse another optimizer family (the SDK's Dimuon) by its name, before its fields are read as
    AdamW's and refused one by one as unknown."""
    kind = value.get("type", "adamw") if isinstance(value, dict) else "adamw"
    if kind != "adamw":
        raise ValueError(f"the {kind!r} optimizer is not supported by this server, {_ADAMW_ONLY}")
    return value


class OptimizerConfig(WireModel):
    type: Literal["adamw"] = "adamw"

    _adamw_only = model_validator(mode="before")(_adamw_only)


class CreateModelRequest(WireModel):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    user_metadata: UserMetadata | None = None
    lora_config: WireLoraConfig = Field(default_factory=WireLoraConfig)
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)

    def to_command(self) -> CreateRun:
        cfg = self.lora_config
        config = LoraConfig(
            rank=cfg.rank,
            # Tinker initialises an unseeded adapter randomly; the drawn seed is kept in checkpoints.
            seed=secrets.randbelow(2**31) if cfg.seed is None else cfg.seed,
            train_attn=cfg.train_attn,
            train_mlp=cfg.train_mlp,
            train_unembed=cfg.train_unembed,
        )
        return CreateRun(config, self.base_model, self.user_metadata or {})


class LoadWeightsRequest(WireModel):
    """Create-via-load (session_id + model_seq_id) or legacy in-place (model_id + seq_id)."""

    path: str
    optimizer: bool = False
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    model_id: str | None = None
    seq_id: Int64 | None = None
    user_metadata: UserMetadata | None = None
    optimizer_config: OptimizerConfig | None = None

    def to_command(self) -> CreateRunFromCheckpoint | LoadState:
        source = CheckpointPath.parse(self.path)
        if self.session_id is not None:
            return CreateRunFromCheckpoint(source, self.optimizer, self.user_metadata or {})
        return LoadState(source, self.optimizer)


class ModelRequest(WireModel):
    model_id: str


class WireAdamParams(WireModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled hyperparameter must not be silently dropped
    _adamw_only = model_validator(mode="before")(_adamw_only)  # DimuonParams carry their type

    learning_rate: float = Field(1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(WireModel):
    model_id: str
    seq_id: Int64
    params: WireAdamParams = Field(
        validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params")
    )

    def to_command(self) -> OptimStep:
        return OptimStep(AdamParams(**self.params.model_dump()))


class SaveWeightsRequest(WireModel):
    model_id: str
    seq_id: Int64
    path: CheckpointName | None = None
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    user_metadata: UserMetadata | None = None

    def to_command(self) -> SaveState:
        return SaveState(
            self.path or f"step-{self.seq_id}", self.overwrite, self.ttl_seconds, self.user_metadata or {}
        )


class SaveWeightsForSamplerRequest(WireModel):
    model_id: str
    seq_id: Int64
    path: CheckpointName | None = None
    sampling_session_seq_id: SeqId | None = None
    ttl_seconds: TtlSeconds | None = None
    user_metadata: UserMetadata | None = None

    def to_command(self, session_id: str) -> SaveSnapshot:
        if self.path is not None:
            return SaveSnapshot(self.path, None, self.ttl_seconds, self.user_metadata or {})
        sampler_id = f"{session_id}:sample:{self.sampling_session_seq_id or 0}"
        return SaveSnapshot(None, sampler_id, self.ttl_seconds, self.user_metadata or {})


class SaveWeightsExternalRequest(WireModel):
    model_id: str
    seq_id: Int64
    path: CheckpointName
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None

    def to_command(self) -> SaveExternal:
        recipients = tuple(self.age_encryption_recipients or ())
        parse_recipients(recipients)  # a recipient age cannot encrypt to is refused before anything runs
        return SaveExternal(self.path, self.ttl_seconds, age_recipients=recipients)


class RetrieveFutureRequest(WireModel):
    request_id: str


# --- sampling and REST
class CreateSamplingSessionRequest(WireModel):
    session_id: str
    sampling_session_seq_id: SeqId
    model_path: str | None = None
    base_model: str | None = None


class WireChunk(WireModel):
    type: str
    tokens: list[Int64] | None = None  # encoded_text only


class WireModelInput(WireModel):
    chunks: list[WireChunk]

    def to_tokens(self) -> np.ndarray:
        for i, chunk in enumerate(self.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise UserError(f"prompt.chunks[{i}] is {chunk.type!r}; this server samples encoded_text")
        return np.array([t for chunk in self.chunks for t in chunk.tokens or ()], np.int64)


class WireSamplingParams(WireModel):
    max_tokens: Int64 | None = None
    seed: int | None = None  # the engine names the allowed range, [0, 2**64)
    # None = EOS; [] = max_tokens only
    stop: Annotated[str | list[str] | list[Int64] | None, AfterValidator(_bounded_stop)] = None
    temperature: float = 1.0
    top_k: Int64 = -1
    top_p: float = 1.0

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        values = self.model_dump(exclude={"stop"})
        return SamplingParams(**values, stop=tuple(stop) if stop is not None else None)


class WireTensor(WireModel):
    """A TensorData: `data` row-major, or, with the sparse fields, the values CSR lists."""

    data: list[Int64 | float]
    dtype: str
    shape: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = None
    sparse_crow_indices: list[Int64] | None = None
    sparse_col_indices: list[Int64] | None = None


def _target_ids(tensor: WireTensor) -> tuple[np.ndarray, bool]:
    """target_prompt_logprobs as dense (R, K) int64 ids, -1 in the cells a sparse tensor leaves out, and
    whether it came sparse. Its structure and size are checked before anything is allocated; rows against
    the prompt and ids against the vocabulary are the engine's (sampler/validation.py)."""
    where, shape = "target_prompt_logprobs", tensor.shape
    if tensor.dtype != "int64":
        raise UserError(f"{where} must be an int64 tensor of token ids, got {tensor.dtype!r}")
    if shape is None or len(shape) != 2:
        raise UserError(f"{where} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    if any(isinstance(value, float) for value in tensor.data):
        raise UserError(f"{where} must hold integer token ids")
    limits = current_limits()
    rows, width = shape
    if width > limits.max_topk_prompt_logprobs:
        raise UserError(
            f"{where} is {width} ids wide; this server scores up to {limits.max_topk_prompt_logprobs} per "
            "prompt position (--max-topk-prompt-logprobs)"
        )
    # No more cells than a dense tensor in the largest body could hold (2 bytes a cell, "1,"): a sparse
    # tensor's shape costs nothing on the wire.
    max_cells = limits.max_json_body_bytes // 2
    if rows * width > max_cells:
        raise UserError(f"{where}: shape {shape} has over the {max_cells} cells this server decodes")
    values = np.asarray(tensor.data, np.int64)
    crow, cols = tensor.sparse_crow_indices, tensor.sparse_col_indices
    if crow is None and cols is None:
        if values.size != rows * width:
            raise UserError(f"{where}: shape {shape} does not match its {values.size} values")
        return values.reshape(rows, width), False
    if crow is None or cols is None:
        raise UserError(f"{where}: a sparse CSR tensor needs both sparse_crow_indices and sparse_col_indices")
    crow_array, cols_array = np.asarray(crow, np.int64), np.asarray(cols, np.int64)
    problem = csr_problem(shape, values.size, crow_array, cols_array)
    if problem is not None:
        raise UserError(f"{where}: sparse CSR tensor of shape {shape}: {problem}")
    return densify(shape, values, crow_array, cols_array, fill=-1), True


class AsampleRequest(WireModel):
    """asample; the 0.38.0 SDK always addresses a sampling session (never model_path / base_model)."""

    sampling_session_id: str
    seq_id: SeqId
    num_samples: Annotated[int, AfterValidator(_bounded_num_samples)] = 1
    prompt: WireModelInput
    sampling_params: WireSamplingParams = Field(default_factory=WireSamplingParams)
    prompt_logprobs: bool | None = False
    topk_prompt_logprobs: Int64 = 0
    prompt_logprobs_last_n: Int64 | None = None
    topk_sample_logprobs: Int64 = 0
    prompt_alt_tokens_k: Int64 = 0
    target_prompt_logprobs: WireTensor | None = None

    def to_request(self) -> SampleRequest:
        targets, is_sparse = None, False
        if self.target_prompt_logprobs is not None:
            targets, is_sparse = _target_ids(self.target_prompt_logprobs)
        return SampleRequest(
            prompt=self.prompt.to_tokens(),
            params=self.sampling_params.to_params(),
            num_samples=self.num_samples,
            prompt_logprobs=bool(self.prompt_logprobs),
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            prompt_logprobs_last_n=self.prompt_logprobs_last_n,
            topk_sample_logprobs=self.topk_sample_logprobs,
            prompt_alt_tokens_k=self.prompt_alt_tokens_k,
            target_prompt_ids=targets,
            target_prompt_is_sparse=is_sparse,
        )


class WeightsInfoRequest(WireModel):
    tinker_path: str


def _metadata(values: dict[str, Any] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (values or {}).items()}


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def checkpoint_json(view: CheckpointView) -> dict[str, Any]:
    """A Tinker `Checkpoint`."""
    return {
        "checkpoint_id": view.path.checkpoint_id,
        "checkpoint_type": view.path.checkpoint_type,
        "time": _time(view.created_at),
        "tinker_path": str(view.path),
        "size_bytes": view.size_bytes,
        "public": view.public,
        "user_metadata": view.user_metadata,
        "expires_at": _time(view.expires_at),
    }


def training_run_json(view: RunView) -> dict[str, Any]:
    """A Tinker `TrainingRun`."""
    last, last_sampler = view.last_checkpoint, view.last_sampler_checkpoint
    return {
        "training_run_id": view.run_id,
        "base_model": view.base_model,
        "model_owner": view.tenant,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": view.lora_config.rank,
        "last_request_time": _time(view.last_request_at),
        "user_metadata": _metadata(view.user_metadata),
        "last_checkpoint": checkpoint_json(last) if last else None,
        "last_sampler_checkpoint": checkpoint_json(last_sampler) if last_sampler else None,
    }


def lora_info_json(config: LoraConfig) -> dict[str, Any]:
    """The LoRA fields shared by get_info and weights_info."""
    return {
        "is_lora": True,
        "lora_rank": config.rank,
        "train_unembed": config.train_unembed,
        "train_mlp": config.train_mlp,
        "train_attn": config.train_attn,
    }
