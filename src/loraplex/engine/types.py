"""Plain data crossing the runtime -> engine boundary: numpy arrays and dataclasses, no torch.

The runtime builds these; the engine consumes them and answers with numpy results. Field
conventions follow the Tinker protocol (shared/docs/tinker-protocol.md, losses.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LoraConfig:
    """One slot's adapter shape. alpha/rank is the scale (Tinker's rank-independent alpha=32)."""

    rank: int
    seed: int = 0
    alpha: float = 32.0
    train_attn: bool = True  # q, k, v, o projections
    train_mlp: bool = True  # gate, up, down projections
    train_unembed: bool = True  # lm_head


@dataclass(frozen=True)
class AdamParams:
    """Per-step AdamW hyperparameters (Tinker defaults). weight_decay is decoupled; 0 clip = off."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class DatumInput:
    """One sequence: N input tokens and its loss inputs, each with first dimension N."""

    tokens: np.ndarray  # (N,) int64
    loss_fn_inputs: dict[str, np.ndarray]  # target_tokens (N,)|(N,K), weights, logprobs, advantages, ...


@dataclass
class PassRequest:
    """One forward / forward_backward request of one run: its datums share slot, loss and config.

    slot None means the base model alone. forward_only requests never touch gradient accumulators.
    """

    slot: int | None
    loss_fn: str
    loss_fn_config: dict[str, float]
    datums: list[DatumInput]
    forward_only: bool


@dataclass
class PassResult:
    """Per-datum outputs in input order, plus request-level metrics keyed `name:reduction`."""

    outputs: list[dict[str, np.ndarray]]  # each: logprobs (shape of target_tokens), elementwise_loss (N,)
    metrics: dict[str, float] = field(default_factory=dict)  # at least "loss:sum"
