"""Plain data crossing the runtime -> engine boundary: numpy arrays, paths and dataclasses, no torch.

The runtime builds these; the engine consumes them and answers with numpy results. Field
conventions follow the Tinker protocol (docs/PROTOCOL.md, docs/LOSSES.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass(frozen=True, eq=False)
class PreparedStep:
    """A fused optimizer step computed by `Engine.prepare_step` and not yet applied or aborted.

    Valid until the engine's next call that changes slots: `apply_step` or `abort_step` of it after any
    such call (a pass, another prepare, a create, free or load) is refused. Compared by identity.
    """

    metrics: dict[int, dict[str, float]]  # slot -> grad_norm, learning_rate (and skipped_nonfinite: 1.0)
    generation: int  # the engine's count of slot-changing calls when it was prepared (pending_step.py)


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
    """Per-datum outputs in input order, plus request-level metrics keyed `name:reduction`, and the
    server's own health statistics of the request (engine/health.py), which the client never receives."""

    outputs: list[dict[str, np.ndarray]]  # each: logprobs (shape of target_tokens), elementwise_loss (N,)
    metrics: dict[str, float] = field(default_factory=dict)  # at least "loss:sum"
    health: dict[str, float] = field(default_factory=dict)  # train/tokens, rl/... (docs/METRICS.md)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn (Tinker's sampling_params, docs/PROTOCOL.md §6.3)."""

    max_tokens: int | None = None  # None = the engine's default, capped by the context length
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = no limit
    top_p: float = 1.0  # 1 = no limit
    seed: int | None = None  # in [0, 2**64); None = fresh entropy
    # None = stop at EOS; () = only max_tokens stops; else stop strings (str) and stop token ids (int),
    # and EOS still stops.
    stop: tuple[str | int, ...] | None = None


@dataclass
class SampleRequest:
    """One asample / compute_logprobs request: a prompt, sampled num_samples times from one model."""

    prompt: np.ndarray  # (P,) int64 token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    prompt_logprobs: bool = False  # logprob of each prompt token given the ones before it
    topk_prompt_logprobs: int = 0  # k > 0: the k likeliest ids and their logprobs at each prompt position
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt positions; None = all
    topk_sample_logprobs: int = 0  # k > 0: the k likeliest ids at each sampled position, and their logprobs
    prompt_alt_tokens_k: int = 0  # k > 0: k draws at each prompt position after the first (sampling.py)
    # (P - 1, K) int64: row i names ids whose logprobs to return at prompt position i + 1; -1 names none.
    target_prompt_ids: np.ndarray | None = None
    target_prompt_is_sparse: bool = False  # sent as sparse CSR; the engine hands it on to the result
    snapshot: Path | None = None  # a PEFT snapshot directory; None = the base model alone
    streams: bool = False  # report the tokens drawn step by step (Engine.take_sample_progress)


@dataclass(frozen=True)
class SampleProgress:
    """What a streaming request's samples drew since its last report, per sample in order (a sample that
    drew nothing, or has stopped, has empty lists)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


@dataclass
class SampledSequence:
    """One sample: its tokens (with the stop token / the tokens completing a stop string) and logprobs."""

    tokens: np.ndarray  # (n,) int32
    logprobs: np.ndarray  # (n,) float32, each under the distribution it was drawn from (sampler/sampling.py)
    stop_reason: str  # "stop" (EOS, stop token or stop string) or "length" (max_tokens reached)
    # topk_sample_logprobs: (n, k) per sampled position, likeliest first, under the distribution the token
    # was drawn from; ids that distribution leaves out (top_k / top_p) are -1 with NaN logprobs.
    topk_ids: np.ndarray | None = None  # (n, k) int32
    topk_logprobs: np.ndarray | None = None  # (n, k) float32


@dataclass
class SampleResult:
    """A request's samples in order, plus prompt scores when asked; unscored positions are NaN / -1."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None  # (P,) float32; NaN at 0 and before the last n
    topk_prompt_ids: np.ndarray | None = None  # (P, k) int32; -1 where not scored
    topk_prompt_logprobs: np.ndarray | None = None  # (P, k) float32; NaN where not scored
    target_prompt_logprobs: np.ndarray | None = None  # (P - 1, K) float32; NaN where the request named -1
    target_prompt_is_sparse: bool = False  # the request's target_prompt_ids came as sparse CSR
    prompt_alt_ids: np.ndarray | None = None  # (P - 1, k) int32: the draws of prompt_alt_tokens_k
    prompt_alt_logprobs: np.ndarray | None = None  # (P - 1, k) float32
