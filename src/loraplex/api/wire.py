"""Wire models: the Tinker protocol's JSON bodies (pydantic), each converting once into runtime values.

Requests ignore unknown fields (the SDK adds e.g. `type`); responses are built by the `*_json`
functions from runtime views. No tensors, no engine calls.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any, Literal

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from loraplex.errors import UserError
from loraplex.runtime.catalog import CheckpointView, RunView
from loraplex.runtime.checkpoints import CheckpointPath
from loraplex.runtime.commands import (
    AdamParams,
    CreateRun,
    CreateRunFromCheckpoint,
    LoadState,
    LoraConfig,
    OptimStep,
    SaveSnapshot,
    SaveState,
)
from loraplex.runtime.sampling import SampleRequest, SamplingParams


class WireModel(BaseModel):
    """Base of request bodies: unknown fields are ignored, `model_` names are allowed."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# --- service and sessions
class CreateSessionRequest(WireModel):
    user_metadata: dict[str, Any] = Field(default_factory=dict)


class SessionRequest(WireModel):
    session_id: str


class FinishReason(WireModel):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishRequest(WireModel):
    reason: FinishReason = Field(default_factory=FinishReason)


# --- training
class WireLoraConfig(WireModel):
    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(WireModel):
    type: Literal["adamw"] = "adamw"  # Dimuon is refused here, with a 422 naming the field


class CreateModelRequest(WireModel):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, Any] | None = None
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
        return CreateRun(config, self.base_model, _metadata(self.user_metadata))


class LoadWeightsRequest(WireModel):
    """Create-via-load (session_id + model_seq_id) or legacy in-place (model_id + seq_id)."""

    path: str
    optimizer: bool = False
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    model_id: str | None = None
    seq_id: int | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None

    def to_command(self) -> CreateRunFromCheckpoint | LoadState:
        source = CheckpointPath.parse(self.path)
        if self.session_id is not None:
            return CreateRunFromCheckpoint(source, self.optimizer, _metadata(self.user_metadata))
        return LoadState(source, self.optimizer)


class ModelRequest(WireModel):
    model_id: str


class WireAdamParams(WireModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled hyperparameter must not be silently dropped

    learning_rate: float = Field(1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(WireModel):
    model_id: str
    seq_id: int
    params: WireAdamParams = Field(
        validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params")
    )

    def to_command(self) -> OptimStep:
        return OptimStep(AdamParams(**self.params.model_dump()))


class SaveWeightsRequest(WireModel):
    model_id: str
    seq_id: int
    path: str | None = None
    ttl_seconds: int | None = Field(None, ge=3600)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None

    def to_command(self) -> SaveState:
        return SaveState(
            self.path or f"step-{self.seq_id}", self.overwrite, self.ttl_seconds, self.user_metadata or {}
        )


class SaveWeightsForSamplerRequest(WireModel):
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = Field(None, ge=3600)
    user_metadata: dict[str, str] | None = None

    def to_command(self, session_id: str) -> SaveSnapshot:
        if self.path is not None:
            return SaveSnapshot(self.path, None, self.ttl_seconds, self.user_metadata or {})
        sampler_id = f"{session_id}:sample:{self.sampling_session_seq_id or 0}"
        return SaveSnapshot(None, sampler_id, self.ttl_seconds, self.user_metadata or {})


class SaveWeightsExternalRequest(WireModel):
    model_id: str
    seq_id: int
    path: str
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class RetrieveFutureRequest(WireModel):
    request_id: str


# --- sampling and REST
class CreateSamplingSessionRequest(WireModel):
    session_id: str
    sampling_session_seq_id: int
    model_path: str | None = None
    base_model: str | None = None


class WireChunk(WireModel):
    type: str
    tokens: list[int] | None = None  # encoded_text only


class WireModelInput(WireModel):
    chunks: list[WireChunk]

    def to_tokens(self) -> np.ndarray:
        for i, chunk in enumerate(self.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise UserError(f"prompt.chunks[{i}] is {chunk.type!r}; this server samples encoded_text")
        return np.array([t for chunk in self.chunks for t in chunk.tokens or ()], np.int64)


class WireSamplingParams(WireModel):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None  # None = EOS; [] = max_tokens only
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        values = self.model_dump(exclude={"stop"})
        return SamplingParams(**values, stop=tuple(stop) if stop is not None else None)


class AsampleRequest(WireModel):
    """asample; the 0.38.0 SDK always addresses a sampling session (never model_path / base_model)."""

    sampling_session_id: str
    seq_id: int = Field(ge=0)
    num_samples: int = 1
    prompt: WireModelInput
    sampling_params: WireSamplingParams = Field(default_factory=WireSamplingParams)
    prompt_logprobs: bool | None = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    # Not served: refused by name rather than silently ignored.
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None

    def to_request(self) -> SampleRequest:
        unsupported = {
            "topk_sample_logprobs": self.topk_sample_logprobs != 0,
            "prompt_alt_tokens_k": self.prompt_alt_tokens_k != 0,
            "target_prompt_logprobs": self.target_prompt_logprobs is not None,
        }
        for name, asked in unsupported.items():
            if asked:
                raise UserError(f"{name} is not supported by this server; leave it at its default")
        return SampleRequest(
            prompt=self.prompt.to_tokens(),
            params=self.sampling_params.to_params(),
            num_samples=self.num_samples,
            prompt_logprobs=bool(self.prompt_logprobs),
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            prompt_logprobs_last_n=self.prompt_logprobs_last_n,
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
        "public": False,
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
