"""Grouped matmul: consecutive row blocks of one matrix, each times its own matrix, as one call.

`grouped_mm` runs torch's `_grouped_mm` (a grouped GEMM kernel for bf16 on Hopper-class GPUs; elsewhere
torch loops over the groups in C++) inside one autograd node whose backward is two more grouped
matmuls. The kernel accepts only operands whose last two dims have one unit stride and the other a
multiple of 16 bytes, at a 16-byte aligned address (and its own backward does not make gradients fit);
a 3-D operand's group stride must be a multiple of 16 bytes as well, which torch does not check: the
kernel adds it to the address once per group, and a group at an unaligned address stops the GPU with
"misaligned address" (an expert LoRA B of rank 4 in bf16, viewed per expert, steps 8 bytes per expert).
An operand that does not fit is copied into a padded buffer that does. The groups may leave the last
rows out (`has_ungrouped_rows`: under expert parallelism, the rows of other ranks' experts), which torch
leaves unwritten and we zero, in the result and in a's gradient, without reading the offsets on the host.
`grouped_mm_reference` is the plain loop it must equal. Knows nothing of experts, slots or routing.

Shapes: N rows, C contraction, M output columns, G groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_ALIGN_BYTES = 16


def grouped_mm(a_NC: Tensor, b_GCM: Tensor, offsets_G: Tensor, has_ungrouped_rows: bool = False) -> Tensor:
    """Row block g of `a` times `b[g]` for every group; block g is rows [offsets[g-1], offsets[g]).

    `offsets_G` is int32, non-decreasing, on a's device, and its last entry is N (every row in a group),
    or at most N with `has_ungrouped_rows`, whose rows past it come out zero (and pass no gradient).
    The result may have padded row strides (as torch allocates it), not always a contiguous layout.

    Semantics (`grouped_mm_reference` runs exactly this loop):
        out = zeros(N, M); start = 0
        for g in range(G):
            out[start:offsets[g]] = a[start:offsets[g]] @ b[g]
            start = offsets[g]
    """
    return _GroupedMM.apply(a_NC, b_GCM, offsets_G, has_ungrouped_rows)


def grouped_mm_reference(
    a_NC: Tensor, b_GCM: Tensor, offsets_G: Tensor, has_ungrouped_rows: bool = False
) -> Tensor:
    """Plain loop over the groups that `grouped_mm` must equal; for tests."""
    blocks, start = [], 0
    for group, end in enumerate(offsets_G.tolist()):
        blocks.append(a_NC[start:end] @ b_GCM[group])
        start = end
    if has_ungrouped_rows:
        blocks.append(a_NC.new_zeros(a_NC.shape[0] - start, b_GCM.shape[2]))
    return torch.cat(blocks)


class _GroupedMM(torch.autograd.Function):
    """out = grouped a·b; grad_a = grouped grad·bᵀ; grad_b[g] = a[block g]ᵀ · grad[block g]."""

    @staticmethod
    def forward(ctx: Any, a_NC: Tensor, b_GCM: Tensor, offsets_G: Tensor, has_ungrouped_rows: bool) -> Tensor:
        ctx.save_for_backward(a_NC, b_GCM, offsets_G)
        ctx.has_ungrouped_rows = has_ungrouped_rows
        out = torch._grouped_mm(_fitted(a_NC), _fitted(b_GCM), offs=offsets_G)
        return _zero_ungrouped_rows_(out, offsets_G) if has_ungrouped_rows else out

    @staticmethod
    def backward(ctx: Any, grad_NM: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        a_NC, b_GCM, offsets_G = ctx.saved_tensors
        grad = _fitted(grad_NM)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch._grouped_mm(grad, _fitted(b_GCM.transpose(1, 2)), offs=offsets_G)
            if ctx.has_ungrouped_rows:
                _zero_ungrouped_rows_(grad_a, offsets_G)
        if ctx.needs_input_grad[1]:
            # 2-D x 2-D with offsets: the contraction runs over each group's rows, one (C, M) per group
            # (ungrouped rows take no part in it).
            grad_b = torch._grouped_mm(_fitted(a_NC.t()), grad, offs=offsets_G)
        return grad_a, grad_b, None, None


def _zero_ungrouped_rows_(out_NM: Tensor, offsets_G: Tensor) -> Tensor:
    """Zero, in place, the rows past the last group, which torch leaves unwritten: by a mask, as slicing
    them off would read the offset on the host."""
    is_ungrouped_N = torch.arange(out_NM.shape[0], device=out_NM.device) >= offsets_G[-1]
    return out_NM.masked_fill_(is_ungrouped_N[:, None], 0.0)


def _fitted(matrix: Tensor) -> Tensor:
    """`matrix` if the grouped kernel accepts its layout, else a copy with rows padded to 16 bytes."""
    if _fits(matrix):
        return matrix
    align = _ALIGN_BYTES // matrix.element_size()
    width = matrix.shape[-1]
    padded = matrix.new_empty(*matrix.shape[:-1], -(-width // align) * align)[..., :width]
    return padded.copy_(matrix)


def _fits(matrix: Tensor) -> bool:
    """The kernel's layout rule: in the last two dims one stride is 1 and the other a multiple of 16
    bytes, at least the extent it steps over; a 3-D operand's group stride a multiple of 16 bytes; the
    data starts 16-byte aligned."""
    if matrix.data_ptr() % _ALIGN_BYTES:
        return False
    align = _ALIGN_BYTES // matrix.element_size()
    if any(stride % align for stride in matrix.stride()[:-2]):
        return False
    rows, cols = matrix.shape[-2:]
    row_stride, col_stride = matrix.stride()[-2:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    return False
