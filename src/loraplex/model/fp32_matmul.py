"""Matrix products of low-precision operands with fp32 accumulation and an fp32 result.

A bf16 product rounded to bf16 carries a relative error of 2⁻⁸ per element: too coarse for logits that
feed importance ratios, or for gradients that feed fp32 master weights. On CUDA, `torch.mm` / `torch.bmm`
with `out_dtype=torch.float32` accumulate in fp32 and write fp32 straight from the kernel, at the cost
of the bf16 kernel (no upcast copy of either operand). The pinned torch has no CPU kernel for those
overloads, so elsewhere the operands are upcast first: bf16 → fp32 is exact, so the products are
exact and the sums are fp32 as on the GPU — the CPU path is a faithful (slower) model of the GPU's
math, which is what lets the CPU tests bound the GPU's error. fp32 and float64 operands take the plain
product, bitwise what it was before this module existed.

No autograd: callers that need gradients (the LoRA delta's and the lm_head's own autograd nodes) call
these in their forward and backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WIDE = (torch.float32, torch.float64)


def mm_fp32(a_MK: Tensor, b_KN: Tensor) -> Tensor:
    """a · b as fp32 (float64 operands stay float64), accumulated in fp32 or wider."""
    if a_MK.dtype in _WIDE and b_KN.dtype in _WIDE:
        return a_MK @ b_KN
    if a_MK.is_cuda and a_MK.dtype == b_KN.dtype:
        return torch.mm(a_MK, b_KN, out_dtype=torch.float32)
    return a_MK.float() @ b_KN.float()


def bmm_fp32(a_GMK: Tensor, b_GKN: Tensor) -> Tensor:
    """Batched a · b as fp32 (float64 operands stay float64), accumulated in fp32 or wider."""
    if a_GMK.dtype in _WIDE and b_GKN.dtype in _WIDE:
        return torch.bmm(a_GMK, b_GKN)
    if a_GMK.is_cuda and a_GMK.dtype == b_GKN.dtype:
        return torch.bmm(a_GMK, b_GKN, out_dtype=torch.float32)
    return torch.bmm(a_GMK.float(), b_GKN.float())
