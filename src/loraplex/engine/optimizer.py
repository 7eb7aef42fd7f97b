"""Fused multi-slot AdamW: one call steps any set of slots, each with its own AdamParams.

Holds the optimizer math and the slot's optimizer-side storage; the slot pool names the tensors and the
engine picks which slots step. `step_slots_reference` beside it is the plain per-slot loop the fused step
must equal. No HTTP, no SQL.

Each slot keeps its weights, gradient accumulators and both AdamW moments in four flat fp32 buffers, and
its per-target A / B tensors are views into them. A step therefore runs a few kernels per slot over one
long buffer (multithreaded, streaming) instead of several per target tensor (~58 small, single-threaded
ones per slot on a 4-layer model).

A step runs in two phases so that it needs no undo copy (engine/local.py: prepare_step, apply_step):
`prepare_slots` does everything that can fail (norms, clip factors, the metrics, every allocation) and
changes nothing; `apply_slots` then only runs in-place kernels on buffers that already exist.

Legend: S slots in one call, N one slot's parameter count (all its A and B tensors), W `_NORM_ROW`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from loraplex.engine.types import AdamParams
from loraplex.model.host_copy import to_device
from loraplex.model.tensor_parallel import SINGLE, TensorParallel, collective

# clip_grad_norm_'s guard in coef = max_norm / (total_norm + eps); kept identical for parity.
_CLIP_EPS = 1e-6
# The gradient buffer is allocated in whole rows of W elements so its norm is a row-wise reduction:
# spread over all threads and summing short runs. One vector_norm over a 1.1M-element fp32 buffer runs on
# one thread and was off by 1e-5 relative (vs fp64); by rows, 4e-8 and 1.7x faster on 2 cores.
_NORM_ROW = 4096


@dataclass(eq=False)
class AdamSlot:
    """One slot as the optimizer sees it: flat weights, gradient accumulators and AdamW state.

    `params` are the leaf tensors that layers attach and checkpoints name; each is a view into
    `weights_N`, and its `.grad` the view of `grads_N` at the same offset, so backward accumulates into
    the flat buffer in place and a step on the flat buffers moves what the layers read. Gradients always
    exist: allocated zeroed, backward adds into them, a step zeroes them again, so a step on a slot with
    no new gradient still moves it (momentum, weight decay) as torch.optim.AdamW does with zero
    gradients. They are never set to None: autograd would then store a fresh tensor outside the flat
    buffer, which no step would see.
    """

    params: list[Tensor]  # the slot's A_RI / B_OR leaves in order, fp32, requires_grad; views of weights_N
    weights_N: Tensor  # fp32, the params laid end to end
    grads_N: Tensor  # fp32, gradient accumulators laid out like weights_N; the params' .grad are views
    grad_rows: Tensor  # (ceil(N / W), W): grads_N with a zero tail to whole rows (no param covers it)
    exp_avg_N: Tensor  # first moments, laid out like weights_N
    exp_avg_sq_N: Tensor  # second moments, laid out like weights_N
    # Leading elements of the buffers that every tensor-parallel rank holds whole (all of them with one
    # rank); the rest are this rank's parts of split tensors (slots.py).
    whole_numel: int
    step: int = 0  # AdamW steps taken; drives the bias corrections
    has_gradients: bool = False  # a pass added into grads_N since it was last zeroed (transactions.py)

    @classmethod
    def fresh(
        cls, initial: Sequence[Tensor], device: torch.device | str | None = None, whole: int | None = None
    ) -> AdamSlot:
        """A slot whose params start as fp32 copies of `initial` (in that order, on `device`, default
        where they are), with zero gradients and moments and no steps taken; the first `whole` of them
        (default all) are held whole by every tensor-parallel rank."""
        weights_N = torch.cat([t.detach().reshape(-1) for t in initial]).to(device, torch.float32)
        numel = weights_N.numel()
        grad_rows = weights_N.new_zeros(-(-numel // _NORM_ROW), _NORM_ROW)
        grads_N = grad_rows.view(-1)[:numel]
        sizes = [t.numel() for t in initial]
        params = []
        for weight, grad, t in zip(weights_N.split(sizes), grads_N.split(sizes), initial, strict=True):
            # detach: a leaf of its own (autograd does not track it as a view of weights_N), same storage.
            param = weight.view(t.shape).detach().requires_grad_()
            param.grad = grad.view(t.shape)
            params.append(param)
        whole_numel = sum(sizes[: len(sizes) if whole is None else whole])
        moments = torch.zeros_like(weights_N), torch.zeros_like(weights_N)
        return cls(params, weights_N, grads_N, grad_rows, *moments, whole_numel)

    @property
    def optimizer_bytes(self) -> int:
        """Bytes of what the slot holds for the optimizer: gradient rows and both moments (its weights,
        `weights_N`, are the adapter)."""
        return self.grad_rows.nbytes + self.exp_avg_N.nbytes + self.exp_avg_sq_N.nbytes

    @property
    def grads(self) -> list[Tensor]:
        """The gradient accumulators, one per param (views of `grads_N`)."""
        return [p.grad for p in self.params]

    def views(self, flat_N: Tensor) -> list[Tensor]:
        """One of this slot's flat buffers cut into tensors shaped and ordered like `params`."""
        parts = flat_N.split([p.numel() for p in self.params])
        return [part.view(p.shape) for part, p in zip(parts, self.params, strict=True)]


@dataclass(eq=False)
class StepPlan:
    """A fused step computed by `prepare_slots` and not yet taken: what `apply_slots` hands the kernel for
    each slot, already on the device, and the host metrics. `applied` counts the slots it has finished."""

    slots: list[AdamSlot]
    params: list[AdamParams]
    steps: list[Tensor]  # per slot, 0-D fp32: its step count + 1, what the kernel reads
    found_inf: list[Tensor]  # per slot, 0-D fp32: 1.0 where its norm is not finite (the kernel then skips it)
    grad_scale: list[Tensor | None]  # per slot, 0-D fp32: 1 / clip_grad_norm_'s coef; None: no clipping
    metrics: list[dict[str, float]]  # per slot: grad_norm, learning_rate, and skipped_nonfinite 1.0 if so
    applied: int = 0


@torch.no_grad()
def step_slots(steps: Sequence[tuple[AdamSlot, AdamParams]]) -> list[dict[str, float]]:
    """One fused AdamW step of every given slot with its own hyperparameters; per-slot metrics in order.

    Semantics: equal up to rounding (see below) to `step_slots_reference(steps)`:
        for slot, hp in steps:
            norm = total L2 norm of the slot's gradients                      -> metrics grad_norm
            if norm is not finite: skip the slot (weights, moments, step unchanged); skipped_nonfinite 1.0
            else: clip_grad_norm_(hp.grad_clip_norm) if > 0, then one torch.optim.AdamW step of its state
            zero the slot's gradients
    How: in two phases, so that a caller can record the outcome between them: `prepare_slots` reads the
    gradients (every norm, and one transfer of them for the metrics) and changes nothing; `apply_slots`
    then runs, slot by slot, one `torch._fused_adamw_` over its flat buffers (torch.optim.AdamW(fused=True)'s
    kernel), told on the device whether to skip (`found_inf`) and how much to clip (`grad_scale` = 1 / coef),
    and the zeroing of its gradients.
    Rounding: the kernel orders its fp32 operations unlike AdamW's per-tensor loop, the norm sums in
    another order, and clipping divides by 1 / coef instead of multiplying by coef; each moves a result
    by about one ulp (tests/engine/test_optimizer.py states the tolerance).
    """
    plan = prepare_slots(steps)
    apply_slots(plan)
    return plan.metrics


@torch.no_grad()
def prepare_slots(steps: Sequence[tuple[AdamSlot, AdamParams]], tp: TensorParallel = SINGLE) -> StepPlan:
    """The read-only phase of `step_slots`: every norm, clip factor, skip flag, step count and metric, and
    every tensor the kernels will read; changes no slot, so if it raises nothing has changed.

    Semantics: for slot, hp in steps: norm = total L2 norm of the slot's gradients; found_inf = norm is not
    finite; grad_scale = max(1, (norm + eps) / hp.grad_clip_norm) when clipping; step = slot.step + 1;
    metrics = grad_norm, learning_rate, skipped_nonfinite if the norm is not finite.
    Under tensor parallelism (`tp`, every rank of it calling with the same slots) the norm is that of the
    whole slot, every rank's parts together: each rank's whole-held gradients must then already be the
    whole gradient (the engine sums them over the ranks first), so they count once.
    """
    slots = [slot for slot, _ in steps]
    params = [hp for _, hp in steps]
    if not slots:
        return StepPlan([], [], [], [], [], [])
    if tp.is_parallel:
        norm_S = _sharded_grad_norms(slots, tp)
    else:
        norm_S = torch.stack([_grad_norm(slot) for slot in slots])
    found_inf_S = norm_S.isfinite().logical_not().float()
    # clip_grad_norm_'s coef = max_norm / (norm + eps), at most 1; the kernel divides by 1 / coef.
    clip_S = to_device(np.array([hp.grad_clip_norm for hp in params], dtype=np.float32), norm_S.device)
    grad_scale_S = ((norm_S + _CLIP_EPS) / clip_S).clamp(min=1.0)
    # What the kernel reads as the step count; torch.optim.AdamW(fused=True) also advances it first.
    steps_S = to_device(np.array([slot.step + 1 for slot in slots], dtype=np.float32), norm_S.device)
    metrics: list[dict[str, float]] = []
    for hp, norm in zip(params, norm_S.tolist(), strict=True):  # the step's one host sync
        metrics.append({"grad_norm": norm, "learning_rate": hp.learning_rate})
        if not math.isfinite(norm):
            metrics[-1]["skipped_nonfinite"] = 1.0
    scales = zip(params, grad_scale_S, strict=True)
    grad_scale = [scale if hp.grad_clip_norm > 0 else None for hp, scale in scales]
    return StepPlan(slots, params, list(steps_S), list(found_inf_S), grad_scale, metrics)


def _grad_norm(slot: AdamSlot) -> Tensor:
    """The total L2 norm of a slot's gradients (0-D), from its rows: see `_NORM_ROW`."""
    return torch.linalg.vector_norm(torch.linalg.vector_norm(slot.grad_rows, dim=1))


def _sharded_grad_norms(slots: Sequence[AdamSlot], tp: TensorParallel) -> Tensor:
    """(S,) each slot's total L2 norm over every rank's part: the whole-held gradients' squares once, the
    split ones' summed over the ranks, in one all-reduce for all slots."""
    whole_S = torch.stack([_sum_of_squares(slot.grads_N[: slot.whole_numel]) for slot in slots])
    split_S = torch.stack([_sum_of_squares(slot.grads_N[slot.whole_numel :]) for slot in slots])
    with collective():
        dist.all_reduce(split_S, group=tp.group)
    return (whole_S + split_S).sqrt()


def _sum_of_squares(flat: Tensor) -> Tensor:
    """Σ x² of a 1-D buffer (0-D), by whole rows of `_NORM_ROW` and then the tail, as `_grad_norm` sums."""
    rows = flat.numel() // _NORM_ROW
    body = flat[: rows * _NORM_ROW].view(rows, _NORM_ROW)
    return torch.linalg.vector_norm(body, dim=1).square().sum() + flat[rows * _NORM_ROW :].square().sum()


@torch.no_grad()
def apply_slots(plan: StepPlan) -> None:
    """The in-place phase of `step_slots`: per slot, in order, the fused kernel over its flat buffers, the
    zeroing of its gradients and its step count; allocates no tensor. A slot is finished (counted in
    `plan.applied`) only once all of that is done."""
    for i, (slot, hp) in enumerate(zip(plan.slots, plan.params, strict=True)):
        torch._fused_adamw_(
            [slot.weights_N],
            [slot.grads_N],
            [slot.exp_avg_N],
            [slot.exp_avg_sq_N],
            [],
            [plan.steps[i]],
            lr=hp.learning_rate,
            beta1=hp.beta1,
            beta2=hp.beta2,
            weight_decay=hp.weight_decay,
            eps=hp.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=plan.grad_scale[i],
            found_inf=plan.found_inf[i],
        )
        slot.grads_N.zero_()
        slot.has_gradients = False
        if "skipped_nonfinite" not in plan.metrics[i]:
            slot.step += 1
        plan.applied = i + 1


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
            moments = zip(slot.params, slot.views(slot.exp_avg_N), slot.views(slot.exp_avg_sq_N), strict=True)
            for p, m, v in moments:
                adamw.state[p] = {"step": torch.tensor(float(slot.step)), "exp_avg": m, "exp_avg_sq": v}
            adamw.step()
            slot.step += 1
        slot.grads_N.zero_()
        slot.has_gradients = False
    return metrics
