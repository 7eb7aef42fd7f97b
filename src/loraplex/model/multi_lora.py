"""Multi-LoRA compute: a frozen linear layer plus any number of attached slots, routed by token segment.

`LoRARouting` says which slot each contiguous run of packed tokens uses; it is built once per batch
and passed to every `MultiLoRALinear`. `add_lora_delta` is the one place the delta is computed, with
`add_lora_delta_reference` (a per-token loop) beside it; changing the strategy changes this file only.
The slot tensors belong to the engine's slot pool: layers keep references, never copies.
Knows nothing of runs, tenants, optimizers or checkpoints.

Shapes: T packed tokens, I in features, O out features, R a slot's rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn


class Segment(NamedTuple):
    """Tokens [start, end) of the pack use `slot` (None = the base model only)."""

    slot: int | None
    start: int
    end: int


@dataclass(frozen=True)
class LoRARouting:
    """Contiguous token segments covering [0, T) in order; built once per packed batch."""

    segments: tuple[Segment, ...]

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

    @classmethod
    def base_only(cls, num_tokens: int) -> LoRARouting:
        """Every token uses the base model alone."""
        return cls((Segment(None, 0, num_tokens),) if num_tokens else ())

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens routed."""
        return self.segments[-1].end if self.segments else 0

    def slice(self, start: int, end: int) -> LoRARouting:
        """The routing of tokens [start, end), renumbered from 0 (for the lm_head's token chunks)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slice [{start}, {end}) is outside [0, {self.num_tokens})")
        return LoRARouting(
            tuple(
                Segment(s.slot, max(s.start, start) - start, min(s.end, end) - start)
                for s in self.segments
                if max(s.start, start) < min(s.end, end)
            )
        )


class SlotWeights(NamedTuple):
    """One slot's adapter on one layer: fp32 A (R, I) and B (O, R), owned by the slot pool."""

    A_RI: Tensor
    B_OR: Tensor
    scale: float  # alpha / rank


def add_lora_delta(
    y_TO: Tensor, x_TI: Tensor, routing: LoRARouting, slots: Mapping[int, SlotWeights]
) -> Tensor:
    """Return y plus, on each routed segment, its slot's scaled low-rank update of x; math in fp32.

    Semantics (`add_lora_delta_reference` runs exactly this loop):
        out = y.clone()
        for t in range(T):
            slot = the slot of the segment holding t
            if slot in slots:
                A, B, scale = slots[slot]
                out[t] += (scale * B @ (A @ x[t].float())).to(y.dtype)

    How: split x and y into segment views, one (T_s, I) @ (I, R) @ (R, O) per segment at the slot's own
    rank, then one cat. Gradients reach A and B only from their own segments, and backward allocates no
    (T, O) zero buffers per slot as index_put would.
    """
    if not any(segment.slot in slots for segment in routing.segments):
        return y_TO
    sizes = [segment.end - segment.start for segment in routing.segments]
    parts_TO = []
    for segment, x_part, y_part in zip(routing.segments, x_TI.split(sizes), y_TO.split(sizes), strict=True):
        weights = slots.get(segment.slot) if segment.slot is not None else None
        if weights is None:
            parts_TO.append(y_part)
            continue
        # Scale the narrow (T_s, R) intermediate rather than the (T_s, O) result.
        shrunk_TR = (x_part.float() @ weights.A_RI.t()) * weights.scale
        parts_TO.append(y_part + (shrunk_TR @ weights.B_OR.t()).to(y_TO.dtype))
    return torch.cat(parts_TO)


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

    Parameters are allocated uninitialised: a checkpoint loader fills them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None
        # Plain dict, not registered: slot tensors are the slot pool's, not this module's state.
        self._slots: dict[int, SlotWeights] = {}

    def attach(self, slot: int, A_RI: Tensor, B_OR: Tensor, scale: float) -> None:
        """Route `slot`'s segments through A (R, in) and B (out, R), held by reference (replacing any)."""
        rank = A_RI.shape[0]
        if A_RI.shape != (rank, self.in_features) or B_OR.shape != (self.out_features, rank):
            raise ValueError(
                f"slot {slot}: A {tuple(A_RI.shape)} and B {tuple(B_OR.shape)} do not fit a "
                f"{self.in_features} -> {self.out_features} layer; expected (R, {self.in_features}) "
                f"and ({self.out_features}, R)"
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

    def forward(self, x_TI: Tensor, routing: LoRARouting | None = None) -> Tensor:
        """Base projection of every token once, plus each routed segment's slot delta."""
        y_TO = nn.functional.linear(x_TI, self.weight, self.bias)
        if routing is None:
            return y_TO
        if routing.num_tokens != x_TI.shape[0]:
            raise ValueError(f"routing covers {routing.num_tokens} tokens but the input has {x_TI.shape[0]}")
        return add_lora_delta(y_TO, x_TI, routing, self._slots)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, slots={sorted(self._slots)}"
        )


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
    targets: Mapping[str, tuple[MultiLoRALinear, str]], rank: int, seed: int, groups: set[str]
) -> dict[str, tuple[Tensor, Tensor]]:
    """A new slot's initial (A, B) per target whose group is in `groups`, keyed like `targets`.

    One CPU generator seeded with `seed` draws A for every target in `targets` order, kept or not, so a
    target's initial A depends only on (seed, rank, model), never on which groups the slot trains.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (layer, group) in targets.items():
        pair = init_lora_pair(layer.in_features, layer.out_features, rank, generator)
        if group in groups:
            weights[name] = pair
    return weights
