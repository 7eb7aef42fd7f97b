"""Fused multi-slot AdamW: one call steps any set of slots, each with its own AdamParams.

Holds the optimizer math only; the slot pool owns the tensors and the engine picks which slots step.
`step_slots_reference` beside it is the plain per-slot loop the fused step must equal. No HTTP, no SQL.

Legend: S slots in one call, P parameter tensors over all stepped slots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from loraplex.engine.types import AdamParams

# clip_grad_norm_'s guard in coef = max_norm / (total_norm + eps); kept identical for parity.
_CLIP_EPS = 1e-6


@dataclass
class AdamSlot:
    """One slot as the optimizer sees it: trainable tensors (gradient in `.grad`) and their AdamW state.

    Gradients are accumulators that always exist: the pool allocates them zeroed, backward adds into
    them, and a step zeroes them again (never sets None), so memory stays put and a step on a slot
    with no new gradient still decays it, as torch.optim.AdamW does with zero gradients.
    """

    params: list[Tensor]  # the slot's A_RI / B_OR tensors, fp32, requires_grad
    exp_avg: list[Tensor]  # first moments, shaped like params
    exp_avg_sq: list[Tensor]  # second moments, shaped like params
    step: int = 0  # AdamW steps taken; drives the bias corrections

    @classmethod
    def fresh(cls, params: list[Tensor]) -> AdamSlot:
        """A slot with zero moments, zero gradients and no steps taken."""
        for p in params:
            p.grad = torch.zeros_like(p)
        return cls(params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])

    @property
    def grads(self) -> list[Tensor]:
        """The gradient accumulators, one per parameter."""
        return [p.grad for p in self.params]


@torch.no_grad()
def step_slots(steps: Sequence[tuple[AdamSlot, AdamParams]]) -> list[dict[str, float]]:
    """One fused AdamW step of every given slot with its own hyperparameters; per-slot metrics in order.

    Semantics: equal to `step_slots_reference(steps)` — per slot, `clip_grad_norm_` (when
    grad_clip_norm > 0) then one `torch.optim.AdamW` step on the slot's own state — except that all
    slots' norms come from one `_foreach_norm`, the only host sync is one transfer of the S norms
    (metrics need it, and it decides which slots step), and the update of all stepped slots runs as
    `_foreach_*` calls over the flat list of their tensors with per-tensor scalars.
    A slot whose gradient norm is not finite is skipped (parameters, moments and step unchanged) and
    reports `skipped_nonfinite: 1.0`. Every given slot's gradients are zeroed afterwards.
    """
    if not steps:
        return []
    slots = [slot for slot, _ in steps]
    flat_grads = [g for slot in slots for g in slot.grads]
    tensor_norms = torch._foreach_norm(flat_grads)
    # Norm of each slot's per-tensor norms, as clip_grad_norm_ computes its total norm.
    per_slot_norms, start = [], 0
    for slot in slots:
        per_slot_norms.append(torch.stack(tensor_norms[start : start + len(slot.params)]))
        start += len(slot.params)
    norms_S = torch.stack(torch._foreach_norm(per_slot_norms))
    max_norms_S = torch.tensor(
        [hp.grad_clip_norm for _, hp in steps], dtype=norms_S.dtype, device=norms_S.device
    )
    coefs_S = torch.clamp((norms_S + _CLIP_EPS).reciprocal() * max_norms_S, max=1.0)
    norms, coefs = torch.stack([norms_S, coefs_S]).tolist()

    metrics: list[dict[str, float]] = []
    stepped: list[tuple[AdamSlot, AdamParams, float]] = []
    for (slot, hp), norm, coef in zip(steps, norms, coefs, strict=True):
        metrics.append({"grad_norm": norm, "learning_rate": hp.learning_rate})
        if math.isfinite(norm):
            stepped.append((slot, hp, coef))
        else:
            metrics[-1]["skipped_nonfinite"] = 1.0
    if stepped:
        _adamw_update(stepped)
    torch._foreach_zero_(flat_grads)
    return metrics


# One stepped slot: the slot, its hyperparameters for this step and its clip coefficient.
_Row = tuple[AdamSlot, AdamParams, float]


def _flat(rows: list[_Row], attr: str) -> list[Tensor]:
    """The named tensor lists (params, grads, exp_avg, exp_avg_sq) of all rows, concatenated."""
    return [t for slot, _, _ in rows for t in getattr(slot, attr)]


def _per_tensor(rows: list[_Row], values: list[float]) -> list[float]:
    """Expand one scalar per slot to one per tensor, aligned with `_flat(rows, ...)`."""
    return [v for (slot, _, _), v in zip(rows, values, strict=True) for _ in slot.params]


def _adamw_update(stepped: list[_Row]) -> None:
    """Clip, decay and Adam-update all stepped slots in fused calls over their concatenated tensors."""
    for slot, _, _ in stepped:
        slot.step += 1
    params, grads = _flat(stepped, "params"), _flat(stepped, "grads")
    exp_avg, exp_avg_sq = _flat(stepped, "exp_avg"), _flat(stepped, "exp_avg_sq")
    hps = [hp for _, hp, _ in stepped]

    # Slots without clipping or weight decay stay out of those calls, as in the reference.
    clipped = [row for row in stepped if row[1].grad_clip_norm > 0]
    if clipped:
        torch._foreach_mul_(_flat(clipped, "grads"), _per_tensor(clipped, [coef for _, _, coef in clipped]))
    decayed = [row for row in stepped if row[1].weight_decay != 0]
    if decayed:
        factors = [1 - hp.learning_rate * hp.weight_decay for _, hp, _ in decayed]
        torch._foreach_mul_(_flat(decayed, "params"), _per_tensor(decayed, factors))

    # Same operations and scalar arithmetic (Python doubles) as torch.optim.AdamW's update.
    torch._foreach_lerp_(exp_avg, grads, _per_tensor(stepped, [1 - hp.beta1 for hp in hps]))
    torch._foreach_mul_(exp_avg_sq, _per_tensor(stepped, [hp.beta2 for hp in hps]))
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, _per_tensor(stepped, [1 - hp.beta2 for hp in hps]))
    bias2_sqrt = [(1 - hp.beta2**slot.step) ** 0.5 for slot, hp, _ in stepped]
    neg_step_size = [-hp.learning_rate / (1 - hp.beta1**slot.step) for slot, hp, _ in stepped]
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, _per_tensor(stepped, bias2_sqrt))
    torch._foreach_add_(denom, _per_tensor(stepped, [hp.eps for hp in hps]))
    torch._foreach_addcdiv_(params, exp_avg, denom, _per_tensor(stepped, neg_step_size))


@torch.no_grad()
def step_slots_reference(steps: Sequence[tuple[AdamSlot, AdamParams]]) -> list[dict[str, float]]:
    """Plain per-slot loop: clip_grad_norm_ and one torch.optim.AdamW step on each slot's own state."""
    metrics: list[dict[str, float]] = []
    for slot, hp in steps:
        norm = torch.nn.utils.get_total_norm(slot.grads)
        metrics.append({"grad_norm": norm.item(), "learning_rate": hp.learning_rate})
        if not torch.isfinite(norm):
            metrics[-1]["skipped_nonfinite"] = 1.0
        else:
            if hp.grad_clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(slot.params, hp.grad_clip_norm, norm)
            adamw = torch.optim.AdamW(
                slot.params,
                lr=hp.learning_rate,
                betas=(hp.beta1, hp.beta2),
                eps=hp.eps,
                weight_decay=hp.weight_decay,
            )
            for p, m, v in zip(slot.params, slot.exp_avg, slot.exp_avg_sq, strict=True):
                adamw.state[p] = {"step": torch.tensor(float(slot.step)), "exp_avg": m, "exp_avg_sq": v}
            adamw.step()
            slot.step += 1
        for g in slot.grads:
            g.zero_()
    return metrics
