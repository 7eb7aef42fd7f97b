"""Tensor parallelism of the base model: which part of each weight a rank holds, and the collectives that
join the parts (Megatron-style column- and row-parallel linear layers over one process group).

A column-parallel layer (q/k/v_proj by heads, gate/up_proj by MLP width, lm_head by vocabulary) holds a
range of its output rows; its input must enter through `copy_to_tp`, whose backward sums the input's
gradient over the ranks. A row-parallel layer (o_proj, down_proj) holds the matching range of its input
columns, and `reduce_from_tp` sums the ranks' partial outputs. The embedding holds a range of vocabulary
rows (`vocab_parallel_embedding`). An MoE layer's experts are split whole, E/T consecutive experts a
rank (expert parallelism inside the group, moe.py); its router is whole. With one rank (`SINGLE`) nothing
is split and every function here returns its input untouched: the single-rank path runs exactly the ops
it ran before TP existed.

LoRA follows the base layer, as vLLM and Megatron do: on a column-parallel layer A is whole and B split by
output rows; on a row-parallel one A is split by input columns and B whole, its partial product summed in
the same all-reduce as the base's; on an expert layer both follow the experts (A's rows and B's columns
of this rank's experts' rank blocks). `LoRASharding` says which; the one rule for the optimizer and clipping:
a slot tensor every rank holds whole gets only its rank's part of the gradient, and its gradient is
summed over the ranks after backward (`all_reduce_whole_grads`). Slot ranks are never padded.

Hand-written rather than DTensor: a MultiLoRALinear computes every slot's delta in one custom autograd
node (multi_lora.py `_SegmentedLoRA`) over plain slot tensors the slot pool owns by reference; DTensor
would have to wrap each slot tensor and each activation and run its sharding propagation on every op
(per layer, per slot), while the whole scheme needs only three collectives. Measured on 2 CPU cores, one
thread: a 64x256 base linear plus one rank-8 LoRA delta took 175 µs on plain tensors and 383 µs on
DTensors (one rank, weight and B sharded), about 50 µs of dispatch per op. Knows nothing of slots, runs
or the engine; no HTTP, no SQL.

Shapes: T tokens, D hidden, V this rank's vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loraplex.model.config import DecoderConfig, ModelLoadError


class Split(NamedTuple):
    """This rank's part of a full tensor: indices [start, end) of its dim `dim`, which has `full` entries."""

    dim: int
    start: int
    end: int
    full: int

    @property
    def size(self) -> int:
        """Entries of the split dim this rank holds."""
        return self.end - self.start

    def of(self, tensor: Tensor) -> Tensor:
        """This rank's part of a full tensor (a view)."""
        return tensor.narrow(self.dim, self.start, self.size)

    def index(self) -> tuple[slice, ...]:
        """The index that reads this rank's part of a full tensor (e.g. from a safetensors slice)."""
        return (*[slice(None)] * self.dim, slice(self.start, self.end))

    def full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full tensor's shape, given this rank's part's."""
        return (*shape[: self.dim], self.full, *shape[self.dim + 1 :])

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """This rank's part's shape, given the full tensor's."""
        return (*shape[: self.dim], self.size, *shape[self.dim + 1 :])


class LoRASharding(NamedTuple):
    """How a layer's slot tensors A (R, in) and B (out, R) are split over the ranks; None = whole on every
    rank, whose gradient is then summed over the ranks (`all_reduce_whole_grads`)."""

    A: Split | None
    B: Split | None

    def of(self, A_RI: Tensor, B_OR: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's parts of a slot's full A and B (the tensors themselves where whole)."""
        return (
            A_RI if self.A is None else self.A.of(A_RI).contiguous(),
            B_OR if self.B is None else self.B.of(B_OR).contiguous(),
        )

    def whole_shapes(
        self, parts: tuple[tuple[int, ...], tuple[int, ...]]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The full shapes of A and B, given this rank's parts' (`LoRATarget.lora_shapes`)."""
        shape_A, shape_B = parts
        return (
            shape_A if self.A is None else self.A.full_shape(shape_A),
            shape_B if self.B is None else self.B.full_shape(shape_B),
        )


WHOLE = LoRASharding(None, None)


class CollectiveError(RuntimeError):
    """A collective of the ranks failed: a peer died, stopped answering past the timeout, or left the group.
    Told apart from a rank's own failure (out of memory, say), which the backends also raise as
    RuntimeError, so that rank 0 names its peers, not itself."""


@contextmanager
def collective() -> Iterator[None]:
    """Raise the collective run inside as CollectiveError if it fails."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        raise CollectiveError(str(error)) from error


@dataclass(frozen=True)
class TensorParallel:
    """The ranks one layer's weights are split over: a process group (None for one rank), this rank, their
    number."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    @classmethod
    def over(cls, group: dist.ProcessGroup) -> TensorParallel:
        """The tensor-parallel ranks of `group`, this process among them."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @property
    def is_parallel(self) -> bool:
        """Whether weights are split at all (more than one rank)."""
        return self.size > 1

    def split(self, full: int, dim: int) -> Split | None:
        """This rank's range of a dim of `full` entries, as even as can be (the first full % size ranks
        take one more); None with one rank.

        Uneven rather than padded, so a vocabulary or MLP width that the ranks do not divide needs no
        padding rows that would have to be masked out of every softmax and never trained.
        """
        if not self.is_parallel:
            return None
        return Split(dim, *_bounds(full, self.rank, self.size), full)


SINGLE = TensorParallel()


def _bounds(full: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of `rank`'s part of `full` entries split over `size` ranks (TensorParallel.split)."""
    base, extra = divmod(full, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class VocabShard(NamedTuple):
    """The vocabulary rows [split.start, split.end) of the logits this rank computes, and the ranks that
    compute the others (engine/logprobs.py normalises over all of them)."""

    split: Split
    tp: TensorParallel


def check_shardable(config: DecoderConfig, tp: TensorParallel, model: str) -> None:
    """Raise ModelLoadError naming `model` unless its layers can be split over tp's ranks."""
    if not tp.is_parallel:
        return
    if config.num_experts % tp.size:
        raise ModelLoadError(
            f"--tp {tp.size} does not divide num_experts={config.num_experts} of {model}: each rank holds "
            f"num_experts / --tp whole experts; use a --tp that divides {config.num_experts}"
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field)
        if heads % tp.size:
            raise ModelLoadError(
                f"--tp {tp.size} does not divide {field}={heads} of {model}: attention is split by heads; "
                f"use a --tp that divides both num_attention_heads={config.num_attention_heads} and "
                f"num_key_value_heads={config.num_key_value_heads}"
            )


def copy_to_tp(x: Tensor, tp: TensorParallel) -> Tensor:
    """x itself going into column-parallel layers; backward sums its gradient over the ranks (each rank's
    layers contribute only their own output rows' part)."""
    if not tp.is_parallel:
        return x
    return _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: Tensor, tp: TensorParallel) -> Tensor:
    """The sum of x over the ranks, written into x (a fresh contiguous tensor no autograd node saved, such
    as a row-parallel layer's partial output); the gradient passes through unchanged."""
    if not tp.is_parallel:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, tp.group)
    with collective():
        dist.all_reduce(x, group=tp.group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # A copy: autograd may hand the same gradient tensor to other nodes too.
        summed = grad.clone(memory_format=torch.contiguous_format)
        with collective():
            dist.all_reduce(summed, group=ctx.group)
        return summed, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        with collective():
            dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def vocab_parallel_embedding(ids_T: Tensor, weight_VD: Tensor, split: Split, tp: TensorParallel) -> Tensor:
    """Each id's embedding row, from whichever rank holds it: rows of this rank's vocabulary range are
    looked up here, the others are zero, and the sum over the ranks (one non-zero term each) is exact.

    Semantics: equals `embedding(ids_T, full_weight)` of the unsplit weight, bit for bit.
    """
    is_local_T = (ids_T >= split.start) & (ids_T < split.end)
    local_T = torch.where(is_local_T, ids_T - split.start, 0)
    x_TD = torch.nn.functional.embedding(local_T, weight_VD).masked_fill_(~is_local_T[:, None], 0.0)
    return reduce_from_tp(x_TD, tp)


@torch.no_grad()
def all_reduce_whole_grads(layers: Iterable[tuple[LoRASharding, Tensor, Tensor]], tp: TensorParallel) -> None:
    """Sum over the ranks, in place and in one collective, the gradients grad_A, grad_B of the slot
    tensors every rank holds whole, given (the layer's LoRASharding, grad_A, grad_B) per slot and layer.

    Semantics: `for sharding, grad_A, grad_B in layers: all_reduce(grad_X, SUM)` for each X whose split
    is None; split gradients are complete on their rank and stay as they are.
    """
    if not tp.is_parallel:
        return
    grads = [
        grad
        for sharding, grad_A, grad_B in layers
        for split, grad in ((sharding.A, grad_A), (sharding.B, grad_B))
        if split is None
    ]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    with collective():
        dist.all_reduce(flat, group=tp.group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(summed)


@torch.no_grad()
def gather_split(part: Tensor, split: Split | None, tp: TensorParallel) -> Tensor:
    """The full tensor whose `split` part this rank holds, from every rank's part (for checkpoints and
    snapshots of split slot tensors, and logits: `gather_vocab`); `part` itself when nothing is split.

    Every rank's part must be the one `TensorParallel.split` makes: an expert layer's rank blocks are, as T
    divides E (moe.py `ExpertLinear.lora_sharding`)."""
    if split is None:
        return part
    # all_gather takes equal sizes: every part is padded to the largest (rank 0's), then trimmed.
    sizes = [end - start for start, end in (_bounds(split.full, rank, tp.size) for rank in range(tp.size))]
    shape = list(part.shape)
    shape[split.dim] = sizes[0]
    padded = part.new_zeros(shape)
    padded.narrow(split.dim, 0, split.size).copy_(part)
    parts = [torch.empty_like(padded) for _ in sizes]
    with collective():
        dist.all_gather(parts, padded, group=tp.group)
    return torch.cat([p.narrow(split.dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=split.dim)


def gather_vocab(logits_TV: Tensor, vocab: VocabShard | None) -> Tensor:
    """The full-vocabulary (T, V) logits, the same on every rank, from each rank's vocabulary rows of them
    (what `lm_head` gives under `vocab`): one all_gather; `logits_TV` itself when `vocab` is None.

    For whatever needs the whole distribution at once (drawing a token, top-k): each part is computed by
    its owner alone, so every rank gets the same bits and draws the same tokens.
    """
    if vocab is None:
        return logits_TV
    return gather_split(logits_TV, vocab.split._replace(dim=1), vocab.tp)
