"""A frozen linear layer whose output is fp32 however low its weight's precision: the lm_head's logits.

A bf16 logit of magnitude 16 is rounded to a multiple of 2⁻³, so a logprob computed from it is off by
~1e-2 before the fp32 log_softmax even starts: far too much for the importance ratios of RL losses.
`linear_fp32` keeps the fp32 sums the matmul kernel accumulates anyway (fp32_matmul.py: CUDA writes them
straight out, no upcast copy of the (V, D) weight; elsewhere an exact upcast) at the cost of the bf16
product. Its backward gives the input's gradient in the input's dtype, also summed in fp32 (over the
vocabulary, the long side); the weight and bias are frozen and get none. fp32 and float64 weights take
`F.linear` itself: bitwise what they gave before.

Shapes: T tokens, I in features, O out features.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from loraplex.model.fp32_matmul import mm_fp32

_WIDE = (torch.float32, torch.float64)


def linear_fp32(x_TI: Tensor, weight_OI: Tensor, bias_O: Tensor | None = None) -> Tensor:
    """x Wᵀ + b accumulated in and returned as fp32 (float64 weights stay float64); W and b get no gradient.

    Semantics: (x.double() @ W.double().T + b) rounded as an fp32 matmul of the same operands rounds it;
    for fp32 and float64 weights, exactly F.linear(x, W, b).
    """
    if weight_OI.dtype in _WIDE:
        return F.linear(x_TI, weight_OI, bias_O)
    if torch.is_grad_enabled() and x_TI.requires_grad:
        return _LinearFp32.apply(x_TI, weight_OI, bias_O)
    return _forward(x_TI, weight_OI, bias_O)


def _forward(x_TI: Tensor, weight_OI: Tensor, bias_O: Tensor | None) -> Tensor:
    y_TO = mm_fp32(x_TI, weight_OI.T)
    if bias_O is not None:
        y_TO += bias_O
    return y_TO


class _LinearFp32(torch.autograd.Function):
    """`linear_fp32` with autograd for x only (W and b are frozen)."""

    @staticmethod
    def forward(ctx: Any, x_TI: Tensor, weight_OI: Tensor, bias_O: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight_OI)
        ctx.x_dtype = x_TI.dtype
        return _forward(x_TI, weight_OI, bias_O)

    @staticmethod
    def backward(ctx: Any, grad_TO: Tensor) -> tuple[Tensor, None, None]:
        (weight_OI,) = ctx.saved_tensors
        # The (T, O) gradient takes W's dtype (one copy of a chunk's logits), never W fp32 (a copy of W).
        grad_TI = mm_fp32(grad_TO.to(weight_OI.dtype), weight_OI).to(ctx.x_dtype)
        return grad_TI, None, None
