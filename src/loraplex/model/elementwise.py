"""The decoder's elementwise math between its matmuls, as pure functions, and the same functions fused.

RMSNorm (the block norms, Qwen3's q/k norms, the final norm), the residual add before the MLP's norm,
rope's rotation and SwiGLU's gate. Eager, each is a chain of kernels that reads and writes the
activations once per step (RMSNorm alone is up to 8: cast to fp32, square, mean, add eps, rsqrt, scale,
cast back, times the weight); `fused()` gives the same functions through `torch.compile`, which makes
each one a single kernel (forward, and one for its backward) that reads its inputs once.

Why small regions rather than the whole block: the block also holds what must stay outside a graph,
- the LoRA layers' custom autograd Functions and their per-pass routing (multi_lora.py),
- tensor-parallel collectives (tensor_parallel.py),
- the MoE router's counts and grouped matmuls, whose shapes follow the routing (moe.py),
- packed attention's Python loop over the pack's distinct sequence lengths (attention.py), and the
  KV cache's per-step bookkeeping;
each would break the graph or recompile it per pack layout. These functions hold only tensor math, so
they compile with `fullgraph=True` (a graph break is an error, not a silent slowdown) and `dynamic=True`
(one graph for every token count T, which changes every pass). A function still compiles once per
variant of what dynamo guards: grad mode, whether its input requires grad (a training pass's first norm
does not, the later ones do), a size of 1 (one token in a decode step, one kv head per rank), and each
width its callers give (D, and H for the q/k norms) — about a dozen variants of rms_norm, each compiled
the first time a pass meets it, so the cost is spread over the first passes after start-up
(docs/OPERATIONS.md), once per process: every decoder shares `fused()`.

Semantics: fused().f(*args) == f(*args) up to rounding: inductor sums the norm's mean in another order,
and in bf16 it keeps fp32 between steps where eager rounds to bf16 (the norm's cast back before the
weight), so fused bf16 results are no longer HF's bit for bit. tests/model/test_elementwise.py bounds the
fp32 difference.

Shapes: T tokens, D hidden, F MLP width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor, nn

from loraplex.model.attention import apply_rope


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight over the last dim, normalised in fp32 whatever the activation dtype."""
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before the weight, as HF does, so bf16 results match it bit for bit.
    return weight * normed.to(x.dtype)


def add_rms_norm(x_TD: Tensor, delta_TD: Tensor, weight_D: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm that reads its sum, in one pass."""
    x_TD = x_TD + delta_TD
    return x_TD, rms_norm(x_TD, weight_D, eps)


def swiglu(gate_TF: Tensor, up_TF: Tensor) -> Tensor:
    """silu(gate) * up: the SwiGLU MLP's hidden activations."""
    return nn.functional.silu(gate_TF) * up_TF


@dataclass(frozen=True)
class Elementwise:
    """One implementation of each elementwise step; the decoder's blocks call whichever they are given."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    apply_rope: Callable[[Tensor, Tensor, Tensor], Tensor]
    swiglu: Callable[[Tensor, Tensor], Tensor]


EAGER = Elementwise(rms_norm, add_rms_norm, apply_rope, swiglu)
# The most variants of one function dynamo compiles: ample for those the module docstring counts.
_MOST_VARIANTS = 32


@cache
def fused() -> Elementwise:
    """EAGER's functions through torch.compile (inductor), compiled lazily at their first calls."""
    import torch._dynamo
    import torch._inductor.config

    # Inductor's half of torch.use_deterministic_algorithms, which engine/determinism.py leaves to here
    # (importing inductor costs every process seconds): no on-device benchmarking picks a kernel.
    torch._inductor.config.deterministic = torch.are_deterministic_algorithms_enabled()

    # Past dynamo's default of 8 variants per function it would run the function eagerly, with only a
    # warning; ours may meet more (see above), so the limit is raised (for this process, whose only
    # compiled functions these are).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _MOST_VARIANTS)

    def compile_(function: Callable) -> Callable:
        return torch.compile(function, fullgraph=True, dynamic=True)

    return Elementwise(compile_(rms_norm), compile_(add_rms_norm), compile_(apply_rope), compile_(swiglu))


def elementwise_for(setting: str, device: torch.device) -> Elementwise:
    """The `--compile` setting on `device`: "on" fused, "off" eager, "auto" fused on CUDA only (a CPU
    engine is bound by its fp32 matmuls, and its compile needs a C++ compiler and a minute of start-up)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"compile setting {setting!r}: expected auto, on or off")
    is_on = setting == "on" or (setting == "auto" and device.type == "cuda")
    return fused() if is_on else EAGER
