"""The precision of every LoRA delta, dense (multi_lora.py) and per expert (moe.py): one rule, one place.

A slot's A and B are fp32 master weights, the slot pool's, which AdamW updates in fp32. A delta
y += scale · (x Aᵀ) Bᵀ computes with copies of them in the activations' dtypes (`LoRADtypes`):
- the shrink s = (x Aᵀ) · scale takes x and A in the compute dtype (x's, bf16 on GPUs; y's where y is
  wider, as the fp32-logits lm_head's is, whose delta is then all fp32), accumulates in fp32 and is
  kept in fp32 (`scaled_shrink`): it is narrow (R wide), and the backward
  reuses it. Where the kernel can only return its operands' dtype (torch._grouped_mm, the experts'),
  s is rounded to that dtype once before the scale;
- the expand takes s and B in y's dtype (the output dtype, x's too but for an fp32 lm_head) and adds
  into y in place: bf16 kernels accumulate in fp32 and round once into y, so no (·, O) fp32 delta is
  ever made; an fp32 y takes the fp32 masters themselves, exactly the all-fp32 computation;
- gradients: A's and B's come out in fp32 (matmuls with fp32 accumulation of the operands above) for
  the fp32 masters; x's in x's dtype, accumulated in fp32.
For fp32 activations every cast here is the identity: fp32 models compute exactly what they computed
before this rule existed. Why (on paper, Qwen3-8B's seven projections at rank 16, bf16): the fp32 upcast
of x and the fp32 (·, O) delta, cast back and added, moved 10·I + 16·O bytes per token and projection
forward and 20·I + 14·O backward, ~2.3 MB per token and layer; reading x and y in bf16 and writing y
once moves 2·I + 4·O forward and 4·I + 4·O backward, ~0.53 MB.

The casts are small ((I + O)·R per slot and layer) and made once per layer call for training slots;
sampling snapshots, immutable, keep theirs in `_StackCache` across decode steps.

Shapes: G slots stacked, R rank, I in, O out features.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor


class LoRADtypes(NamedTuple):
    """The dtypes of a delta's operands: the shrink's in the compute dtype, the expand's in the output's."""

    compute: torch.dtype  # x's: the shrink's x and A, and the backward's products with x
    output: torch.dtype  # y's: the expand's s and B, and the backward's products with y's gradient

    @classmethod
    def of(cls, x: Tensor, y: Tensor) -> LoRADtypes:
        """The rule for a delta of input x added into output y. An output wider than x (the lm_head's fp32
        logits, model/fp32_linear.py) takes the whole delta at its own precision, A included, so the only
        bf16 rounding its logits see is x's own."""
        return cls(torch.promote_types(x.dtype, y.dtype), y.dtype)

    def operands(self, As: list[Tensor], Bs: list[Tensor]) -> tuple[Tensor, Tensor]:
        """G slots' (A_GRI in the compute dtype, B_GOR in the output dtype), stacked (`_StackCache`)."""
        return _STACKS.stacked(As, self.compute), _STACKS.stacked(Bs, self.output)

    def expand_operand(self, shrunk: Tensor) -> Tensor:
        """The scaled shrink as the expand takes it (rounded once to the output dtype, if narrower)."""
        return shrunk.to(self.output)


def scaled_shrink(product: Tensor, scale: Tensor | float) -> Tensor:
    """(x Aᵀ) · scale in fp32 (wider stays wider), from the shrink's product: scaling the narrow (·, R)
    intermediate rather than the (·, O) result. In place where the product is fp32 already."""
    return (product if product.dtype in (torch.float32, torch.float64) else product.float()).mul_(scale)


class _Stack(NamedTuple):
    sources: tuple[weakref.ref[Tensor], ...]
    versions: tuple[int, ...]
    stacked: Tensor


class _StackCache:
    """Stacked compute-dtype copies of slot tensors, reused for as long as none of their sources changed.

    Sampling decodes hundreds of steps with the same snapshots in the same order, and without this every
    layer of every step cast and copied the same A and B into a fresh stack. Only tensors that take no
    gradient are cached (sampling snapshots, immutable): a training slot changes in place every step, and
    the fused AdamW kernel does not bump version counters, so its stacks are always built afresh. A cached
    source is the same when it is the same tensor object (held weakly, so the cache keeps no snapshot
    alive) with the same version counter (a guard against in-place writes such as copy_). Least
    recently used stacks are dropped past `max_bytes`.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._stacks: OrderedDict[tuple[torch.dtype, tuple[int, ...]], _Stack] = OrderedDict()
        self._bytes = 0

    def stacked(self, tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
        """(G, ...) of G equally shaped tensors, in `dtype`; a view, not a copy, of one tensor of `dtype`.
        Differentiable (a plain stack and cast) for tensors that take gradients."""
        if len(tensors) == 1 and tensors[0].dtype == dtype:
            return tensors[0].unsqueeze(0)
        if any(t.requires_grad for t in tensors):
            return _stack(tensors, dtype)
        key, versions = (dtype, tuple(map(id, tensors))), tuple(t._version for t in tensors)
        hit = self._stacks.get(key)
        if (
            hit is not None
            and hit.versions == versions
            and all(ref() is t for ref, t in zip(hit.sources, tensors, strict=True))
        ):
            self._stacks.move_to_end(key)
            return hit.stacked
        stacked = _stack(tensors, dtype)
        self._drop(key)
        self._stacks[key] = _Stack(tuple(map(weakref.ref, tensors)), versions, stacked)
        self._bytes += stacked.nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._stacks)))
        return stacked

    def _drop(self, key: tuple[torch.dtype, tuple[int, ...]]) -> None:
        if (old := self._stacks.pop(key, None)) is not None:
            self._bytes -= old.stacked.nbytes


def _stack(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """A fresh (G, ...) stack in `dtype`, each tensor cast before stacking (no fp32 stack of bf16 ones)."""
    if len(tensors) == 1:
        return tensors[0].to(dtype).unsqueeze(0)
    return torch.stack([t.to(dtype) for t in tensors])


# Enough for every stacked layer of a few batch compositions of the tiny and bench models at rank 16.
_STACKS = _StackCache(max_bytes=64 * 2**20)
