"""Multi-LoRA compute: a frozen linear layer plus any number of attached slots, routed by token segment.

`LoRARouting` says which slot each contiguous run of packed tokens uses; it is built once per batch
and passed to every `MultiLoRALinear`. `add_lora_delta` (one custom autograd node, `_SegmentedLoRA`) is
the one place the delta is computed, with `add_lora_delta_reference` (a per-token loop) beside it;
changing the strategy changes this file only. Its precision (A in the compute dtype, B in y's, fp32
accumulation, the delta added into y with one rounding, fp32 gradients for the fp32 A and B) is
lora_precision.py's rule, the experts' too.
The slot tensors belong to the engine's slot pool: layers keep references, never copies. Under tensor
parallelism a layer holds this rank's part of the base weight and of each slot's A or B
(tensor_parallel.py says which); the delta op itself never learns of it.
Knows nothing of runs, tenants, optimizers or checkpoints.

Shapes: T packed tokens, I in features, O out features, R a slot's rank, G segments computed together,
L tokens of each of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from loraplex.model.fp32_linear import linear_fp32
from loraplex.model.fp32_matmul import bmm_fp32
from loraplex.model.host_copy import to_device
from loraplex.model.lora_pool import LoRAPool, add_pooled_lora_delta_
from loraplex.model.lora_precision import LoRADtypes, scaled_shrink
from loraplex.model.tensor_parallel import SINGLE, WHOLE, LoRASharding, Split, TensorParallel, reduce_from_tp


class TokenSlots(NamedTuple):
    """Which slot each packed token uses, as indices into the distinct slots of a routing."""

    slots: tuple[int, ...]  # distinct slots, in order of first appearance (None = base only is left out)
    num_tokens: tuple[int, ...]  # tokens of each of them
    index_T: Tensor  # (T,) int64 index into `slots`, -1 for base-only tokens


class Segment(NamedTuple):
    """Tokens [start, end) of the pack use `slot` (None = the base model only)."""

    slot: int | None
    start: int
    end: int


@dataclass(frozen=True)
class LoRARouting:
    """Contiguous token segments covering [0, T) in order; built once per packed batch.

    `pool_index_T` (the decode step's): each token's entry in the layers' snapshot pools (lora_pool.py),
    -1 for base only; layers that hold a pool route by it instead of the segments, in ops that do not
    depend on how many adapters the batch holds. Layers without one (expert layers) use the segments.
    """

    segments: tuple[Segment, ...]
    pool_index_T: Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        end = 0
        for segment in self.segments:
            if segment.start != end or segment.end <= segment.start:
                raise ValueError(f"segments must tile [0, T) in order without gaps; got {self.segments}")
            end = segment.end

    @classmethod
    def from_sequences(cls, lengths: Sequence[int], slots: Sequence[int | None]) -> LoRARouting:
        """Route packed sequences (in pack order) to their slots, merging neighbours of the same slot."""
        if len(lengths) != len(slots):
            raise ValueError(f"{len(lengths)} sequence lengths but {len(slots)} slots")
        segments: list[Segment] = []
        start = 0
        for length, slot in zip(map(int, lengths), slots, strict=True):
            if segments and segments[-1].slot == slot:
                segments[-1] = segments[-1]._replace(end=start + length)
            else:
                segments.append(Segment(slot, start, start + length))
            start += length
        return cls(tuple(segments))

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens routed."""
        return self.segments[-1].end if self.segments else 0

    def token_slots(self, device: torch.device) -> TokenSlots:
        """Each token's slot as a tensor on `device`, built once per routing and device (MoE layers group
        their tokens by slot with it, so every layer of a forward shares it)."""
        cached = self._token_slots.get(device)
        if cached is None:
            slots = tuple(dict.fromkeys(s.slot for s in self.segments if s.slot is not None))
            lengths = [s.end - s.start for s in self.segments]
            indices = np.array([-1 if s.slot is None else slots.index(s.slot) for s in self.segments])
            counts = [sum(s.end - s.start for s in self.segments if s.slot == slot) for slot in slots]
            index_T = to_device(indices.repeat(lengths).astype(np.int64), device)
            cached = self._token_slots[device] = TokenSlots(slots, tuple(counts), index_T)
        return cached

    @cached_property
    def _token_slots(self) -> dict[torch.device, TokenSlots]:
        return {}

    def slice(self, start: int, end: int) -> LoRARouting:
        """The routing of tokens [start, end), renumbered from 0 (for the lm_head's token chunks)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slice [{start}, {end}) is outside [0, {self.num_tokens})")
        return LoRARouting(
            tuple(
                Segment(s.slot, max(s.start, start) - start, min(s.end, end) - start)
                for s in self.segments
                if max(s.start, start) < min(s.end, end)
            ),
            None if self.pool_index_T is None else self.pool_index_T[start:end],
        )


class SlotWeights(NamedTuple):
    """One slot's adapter on one layer: fp32 A (R, I) and B (O, R), owned by the slot pool (on an expert
    layer R counts every expert's rank block, see moe.py)."""

    A_RI: Tensor
    B_OR: Tensor
    scale: float  # alpha / rank


def add_lora_delta(
    y_TO: Tensor, x_TI: Tensor, routing: LoRARouting, slots: Mapping[int, SlotWeights]
) -> Tensor:
    """Return y plus, on each routed segment, its slot's scaled low-rank update of x, in the precision of
    lora_precision.py (in fp32 for fp32 x and y; bf16 rounds A, B, the shrink and the sum).

    Semantics (`add_lora_delta_reference` runs exactly this loop):
        out = y.clone()
        for t in range(T):
            slot = the slot of the segment holding t
            if slot in slots:
                A, B, scale = slots[slot]
                out[t] += (scale * B @ (A @ x[t].float())).to(y.dtype)

    y is left as it was; `MultiLoRALinear` uses `_add_lora_delta_` on its own fresh output instead.
    """
    return _add_lora_delta_(y_TO.clone(memory_format=torch.contiguous_format), x_TI, routing, slots)


# On CPU, stacking a run's A and B copies (I + O)·R floats per slot; past this many (measured on 2 cores:
# rank 16 MLP layers gain, rank 64 ones and a 32k-vocab lm_head lose) the copy costs more than the
# per-slot matmul calls it saves, so such slots keep runs of one. GPUs copy fast enough and launch
# kernels slowly enough that stacking always pays.
_CPU_MAX_STACKED_ELEMENTS = 1 << 15


class _Run(NamedTuple):
    """Adjacent routed segments of one length and one rank, computed together: tokens [start, start + G·L)."""

    start: int
    length: int  # L, tokens of each of the G segments
    rank: int  # R, shared by the G slots
    indices: tuple[int, ...]  # each segment's slot, as an index into the flat (A, B) pairs
    scales: tuple[float, ...]  # each segment's alpha / rank

    @property
    def end(self) -> int:
        """One past the run's last token."""
        return self.start + len(self.indices) * self.length


def _add_lora_delta_(
    y_TO: Tensor, x_TI: Tensor, routing: LoRARouting, slots: Mapping[int, SlotWeights]
) -> Tensor:
    """`add_lora_delta` written into y itself (y must be a fresh tensor no other autograd node saved)."""
    index_of: dict[int, int] = {}
    runs: list[_Run] = []
    for segment in routing.segments:
        weights = slots.get(segment.slot) if segment.slot is not None else None
        if weights is None:
            continue
        index = index_of.setdefault(segment.slot, len(index_of))
        length, rank = segment.end - segment.start, weights.A_RI.shape[0]
        last = runs[-1] if runs else None
        if (
            last is not None
            and (last.end, last.length, last.rank) == (segment.start, length, rank)
            and _is_stackable(weights)
        ):
            runs[-1] = last._replace(indices=(*last.indices, index), scales=(*last.scales, weights.scale))
        else:
            runs.append(_Run(segment.start, length, rank, (index,), (weights.scale,)))
    if not runs:
        return y_TO
    pairs = [t for slot in index_of for t in (slots[slot].A_RI, slots[slot].B_OR)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (y_TO, x_TI, *pairs)):
        return _SegmentedLoRA.apply(y_TO, x_TI, tuple(runs), *pairs)
    # Nothing to differentiate (sampling, forward-only passes): the same math without an autograd node,
    # whose bookkeeping added 10-30% to each layer call of a decode step (8 snapshots x 8 tokens, CPU).
    _add_runs_(y_TO, x_TI, runs, pairs)
    return y_TO


def _is_stackable(weights: SlotWeights) -> bool:
    """Whether a run may stack this slot's A and B with others' (see _CPU_MAX_STACKED_ELEMENTS)."""
    rank, in_features = weights.A_RI.shape
    size = (in_features + weights.B_OR.shape[0]) * rank
    return weights.A_RI.device.type != "cpu" or size <= _CPU_MAX_STACKED_ELEMENTS


def _scale_G11(run: _Run, like: Tensor) -> Tensor | float:
    """The run's per-segment scales, broadcastable over `like`'s (G, L, R); a plain float when they agree."""
    if len(set(run.scales)) == 1:
        return run.scales[0]
    return torch.tensor(run.scales, dtype=like.dtype, device=like.device).view(-1, 1, 1)


def _add_runs_(y_TO: Tensor, x_TI: Tensor, runs: Sequence[_Run], pairs: Sequence[Tensor]) -> list[Tensor]:
    """y[s:e] += scale · (x[s:e] Aᵀ) Bᵀ for every run, in place, in the precision of lora_precision.py;
    per run what its backward needs (the fp32 scaled (G, L, R) shrink and the stacked operands)."""
    dtypes = LoRADtypes.of(x_TI, y_TO)
    saved = []
    for run in runs:
        G, L = len(run.indices), run.length
        x_GLI = x_TI[run.start : run.end].reshape(G, L, -1)
        A_GRI, B_GOR = dtypes.operands(
            [pairs[2 * i] for i in run.indices], [pairs[2 * i + 1] for i in run.indices]
        )
        product_GLR = bmm_fp32(x_GLI, A_GRI.transpose(1, 2))
        shrunk_GLR = scaled_shrink(product_GLR, _scale_G11(run, product_GLR))
        # Accumulated in fp32 and rounded once into y: no (G, L, O) delta of its own.
        y_TO[run.start : run.end].view(G, L, -1).baddbmm_(
            dtypes.expand_operand(shrunk_GLR), B_GOR.transpose(1, 2)
        )
        saved += [shrunk_GLR, A_GRI, B_GOR]
    return saved


class _SegmentedLoRA(torch.autograd.Function):
    """y[s:e] += scale · (x[s:e] Aᵀ) Bᵀ for every routed segment; one autograd node per layer call.

    Inputs: y (T, O), written in place; x (T, I); the runs; then A, B of each distinct slot, flat. Each
    run of G adjacent equal-length, equal-rank segments is one (G, L, ·) bmm against its slots' stacked
    A and B, so the Python and dispatch cost grows with runs, not segments. One node with its own
    backward replaces plain autograd's per-segment split, matmuls, casts, adds and cat: no (T, O)
    concatenation forward, no zero-filled split gradients backward, and A and B receive gradients
    from their own segments only.
    """

    @staticmethod
    def forward(ctx: Any, y_TO: Tensor, x_TI: Tensor, runs: tuple[_Run, ...], *pairs: Tensor) -> Tensor:
        saved = _add_runs_(y_TO, x_TI, runs, pairs)
        ctx.mark_dirty(y_TO)
        ctx.runs = runs
        ctx.num_pairs = len(pairs)
        ctx.save_for_backward(x_TI, *saved)
        return y_TO

    @staticmethod
    def backward(ctx: Any, grad_TO: Tensor) -> tuple[Tensor | None, ...]:
        runs: tuple[_Run, ...] = ctx.runs
        x_TI, *saved = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[1]
        needs_pair = ctx.needs_input_grad[3:]
        grad_x_TI = None
        if needs_x:
            is_covered = sum(run.end - run.start for run in runs) == x_TI.shape[0]
            grad_x_TI = torch.empty_like(x_TI) if is_covered else torch.zeros_like(x_TI)
        grad_pairs: list[Tensor | None] = [None] * ctx.num_pairs
        dtypes = LoRADtypes.of(x_TI, grad_TO)
        for k, run in enumerate(runs):
            shrunk_GLR, A_GRI, B_GOR = saved[3 * k : 3 * k + 3]
            G, L = len(run.indices), run.length
            g_GLO = grad_TO[run.start : run.end].reshape(G, L, -1)
            needs_A = any(needs_pair[2 * i] for i in run.indices)
            if any(needs_pair[2 * i + 1] for i in run.indices):
                # Against the shrink as the expand took it (in y's dtype).
                grad_B_GOR = bmm_fp32(g_GLO.transpose(1, 2), dtypes.expand_operand(shrunk_GLR))
                for i, grad_B_OR in zip(run.indices, grad_B_GOR.unbind(0), strict=True):
                    if needs_pair[2 * i + 1]:
                        _accumulate(grad_pairs, 2 * i + 1, grad_B_OR)
            if not (needs_A or needs_x):
                continue
            product_GLR = bmm_fp32(g_GLO, B_GOR)
            # The shrink's gradient, fp32 and narrow, enters the products with x and A in the compute dtype.
            g_shrunk_GLR = scaled_shrink(product_GLR, _scale_G11(run, product_GLR)).to(dtypes.compute)
            if needs_A:
                x_GLI = x_TI[run.start : run.end].reshape(G, L, -1)
                grad_A_GRI = bmm_fp32(g_shrunk_GLR.transpose(1, 2), x_GLI)
                for i, grad_A_RI in zip(run.indices, grad_A_GRI.unbind(0), strict=True):
                    if needs_pair[2 * i]:
                        _accumulate(grad_pairs, 2 * i, grad_A_RI)
            if grad_x_TI is not None:
                grad_x_GLI = grad_x_TI[run.start : run.end].view(G, L, -1)
                if grad_x_GLI.dtype == g_shrunk_GLR.dtype:
                    torch.bmm(g_shrunk_GLR, A_GRI, out=grad_x_GLI)
                else:  # a delta computed wider than x (an fp32 output's): rounded once into x's dtype
                    grad_x_GLI.copy_(torch.bmm(g_shrunk_GLR, A_GRI))
        return grad_TO, grad_x_TI, None, *grad_pairs


def _accumulate(grads: list[Tensor | None], index: int, grad: Tensor) -> None:
    """grads[index] += grad, starting from the first contribution (a slot may own several segments)."""
    grads[index] = grad if grads[index] is None else grads[index] + grad


def add_lora_delta_reference(
    y_TO: Tensor, x_TI: Tensor, routing: LoRARouting, slots: Mapping[int, SlotWeights]
) -> Tensor:
    """Plain per-token loop that `add_lora_delta` must equal; for tests only (slow)."""
    rows_O = list(y_TO.unbind(0))
    for segment in routing.segments:
        weights = slots.get(segment.slot) if segment.slot is not None else None
        if weights is None:
            continue
        for t in range(segment.start, segment.end):
            delta_O = weights.scale * (weights.B_OR @ (weights.A_RI @ x_TI[t].float()))
            rows_O[t] = rows_O[t] + delta_O.to(y_TO.dtype)
    return torch.stack(rows_O) if rows_O else y_TO


class MultiLoRALinear(nn.Module):
    """y = x Wᵀ + b for every token, plus the routed slot's scale · (x Aᵀ) Bᵀ; W and b are frozen.

    `in_features` and `out_features` are the whole layer's. Under tensor parallelism (`tp` of several
    ranks) this rank holds a range of W's output rows (column-parallel, the default: the input must
    come through `copy_to_tp`) or, with `is_row_parallel`, of its input columns (the input is this
    rank's columns of x; the output is summed over the ranks here, base and slot deltas in one
    all-reduce, then the bias added once). Slots attach this rank's part of A and B (`lora_sharding`).
    With `is_fp32_output` (the lm_head, whose logits feed fp32 logprobs) the output is fp32 whatever W's
    dtype: the base projection keeps its fp32 sums (fp32_linear.py) and slot deltas are added in fp32.
    Parameters are allocated uninitialised: a checkpoint loader fills them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
        is_row_parallel: bool = False,
        is_fp32_output: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.is_fp32_output = is_fp32_output
        self.tp = tp
        self.split = tp.split(in_features, 1) if is_row_parallel else tp.split(out_features, 0)
        self._is_partial = is_row_parallel and self.split is not None  # outputs are partial sums
        rows, columns = (out_features, in_features)
        if self.split is not None:
            rows, columns = self.split.part_shape((out_features, in_features))
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(rows, columns, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, **factory), requires_grad=False) if bias else None
        # Plain dict, not registered: slot tensors are the slot pool's, not this module's state.
        self._slots: dict[int, SlotWeights] = {}
        # The sampler's snapshots, stacked (lora_pool.py); set by the snapshot cache, not module state.
        self.snapshot_pool: LoRAPool | None = None

    def attach(self, slot: int, A_RI: Tensor, B_OR: Tensor, scale: float) -> None:
        """Route `slot`'s segments through A (R, in) and B (out, R), held by reference (replacing any);
        under tensor parallelism, this rank's parts of them (`lora_sharding`)."""
        rank = A_RI.shape[0]
        shape_A, shape_B = self.lora_shapes(rank)
        if A_RI.shape != shape_A or B_OR.shape != shape_B:
            raise ValueError(
                f"slot {slot}: A {tuple(A_RI.shape)} and B {tuple(B_OR.shape)} do not fit a "
                f"{self.in_features} -> {self.out_features} layer; expected {shape_A} and {shape_B}"
                + ("" if self.split is None else f" (this rank's parts, tensor-parallel rank {self.tp.rank})")
            )
        if A_RI.dtype != torch.float32 or B_OR.dtype != torch.float32:
            raise ValueError(f"slot {slot}: LoRA tensors must be float32, got {A_RI.dtype} and {B_OR.dtype}")
        self._slots[slot] = SlotWeights(A_RI, B_OR, float(scale))

    def detach(self, slot: int) -> None:
        """Stop routing `slot` through this layer (no-op if it is not attached)."""
        self._slots.pop(slot, None)

    def has_slot(self, slot: int) -> bool:
        """Whether `slot` is attached to this layer."""
        return slot in self._slots

    def lora_shapes(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of a rank-`rank` slot's A and B as this rank attaches them (the whole layer's, but
        for the split dim under tensor parallelism)."""
        rows, columns = self.weight.shape
        return (rank, columns), (rows, rank)

    def lora_sharding(self, rank: int) -> LoRASharding:
        """Which of a slot's A and B this rank holds only part of: B by output rows on a column-parallel
        layer, A by input columns on a row-parallel one; the other is whole (at any slot rank `rank`)."""
        if self.split is None:
            return WHOLE
        return LoRASharding(self.split, None) if self._is_partial else LoRASharding(None, self.split)

    def parameter_splits(self) -> dict[str, Split]:
        """Parameter name -> this rank's part of the whole layer's, for the parameters that are split."""
        if self.split is None:
            return {}
        has_split_bias = self.bias is not None and not self._is_partial
        return {"weight": self.split, **({"bias": self.split} if has_split_bias else {})}

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype this layer's outputs, and so its LoRA deltas (lora_precision.py), come in: W's, or at
        least fp32 with `is_fp32_output`. A pool of snapshots for it holds their A and B in it."""
        if self.is_fp32_output:
            return torch.promote_types(self.weight.dtype, torch.float32)
        return self.weight.dtype

    def forward(self, x_TI: Tensor, routing: LoRARouting | None = None) -> Tensor:
        """Base projection of every token once, plus each routed segment's slot delta."""
        project = linear_fp32 if self.is_fp32_output else nn.functional.linear
        y_TO = project(x_TI, self.weight, None if self._is_partial else self.bias)
        if routing is not None:
            if routing.num_tokens != x_TI.shape[0]:
                raise ValueError(
                    f"routing covers {routing.num_tokens} tokens but the input has {x_TI.shape[0]}"
                )
            if routing.pool_index_T is not None and self.snapshot_pool is not None:
                y_TO = add_pooled_lora_delta_(y_TO, x_TI, routing.pool_index_T, self.snapshot_pool)
            else:
                y_TO = _add_lora_delta_(y_TO, x_TI, routing, self._slots)
        if not self._is_partial:
            return y_TO
        # One all-reduce sums the base's and every slot's partial products over the input columns.
        y_TO = reduce_from_tp(y_TO, self.tp)
        return y_TO if self.bias is None else y_TO + self.bias

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", split={tuple(self.split)}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{split}, slots={sorted(self._slots)}"
        )


class LoRATarget(Protocol):
    """What the slot pool and the snapshot cache need of a layer that slots attach to (MultiLoRALinear,
    moe.ExpertLinear): a frozen `weight`, its feature sizes, the slot tensors' shapes and how they are
    split over tensor-parallel ranks (which may depend on the slot's rank: an expert layer's rank blocks),
    attach / detach."""

    in_features: int
    out_features: int
    weight: Tensor

    def lora_shapes(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]: ...

    def lora_sharding(self, rank: int) -> LoRASharding: ...

    def attach(self, slot: int, A_RI: Tensor, B_OR: Tensor, scale: float) -> None: ...

    def detach(self, slot: int) -> None: ...

    def has_slot(self, slot: int) -> bool: ...


def init_lora_pair(
    in_features: int, out_features: int, rank: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """A slot's initial fp32 (A (R, in), B (out, R)) on CPU, the PEFT way: A kaiming-uniform(a=√5), B zero.

    A draws from `generator` (a CPU generator, so the values do not depend on the device); callers
    creating a whole slot draw for its targets in `Decoder.lora_targets()` order from one generator
    seeded with the slot's seed.
    """
    A_RI = torch.empty(rank, in_features, dtype=torch.float32)
    nn.init.kaiming_uniform_(A_RI, a=math.sqrt(5), generator=generator)
    return A_RI, torch.zeros(out_features, rank, dtype=torch.float32)


def init_slot_weights(
    targets: Mapping[str, tuple[LoRATarget, str]], rank: int, seed: int, groups: set[str]
) -> dict[str, tuple[Tensor, Tensor]]:
    """A new slot's initial (A, B) per target whose group is in `groups`, keyed like `targets`.

    One CPU generator seeded with `seed` draws A for every target in `targets` order, kept or not, so a
    target's initial A depends only on (seed, rank, model), never on which groups the slot trains. An
    expert layer's A stacks one rank block per expert, each drawn like a linear layer's A. Under tensor
    parallelism every rank draws the whole layer's A and keeps its part, so the parts are those of the
    single-rank slot.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (layer, group) in targets.items():
        sharding = layer.lora_sharding(rank)
        (rows, _), _ = sharding.whole_shapes(layer.lora_shapes(rank))
        pair = init_lora_pair(layer.in_features, layer.out_features, rows, generator)
        if group in groups:
            weights[name] = sharding.of(*pair)
    return weights
