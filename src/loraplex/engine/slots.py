"""The slot pool: every live adapter's tensors, gradient accumulators and AdamW state, by slot id.

A slot stores one A (R, in) and B (out, R) per targeted linear layer at its own rank (never padded),
named as PEFT names them (`<module path>.lora_A.weight` / `.lora_B.weight`), and attaches them by
reference to the decoder's `MultiLoRALinear` layers; on an MoE layer's expert projection (an
`ExpertLinear`) A is (E·R, in) and B (out, E·R), one rank block per expert, named by that projection's
path (`<layer>.mlp.experts.gate_proj`; snapshots map it to PEFT's layout). The named tensors are views
into the slot's flat optimizer buffers (`AdamSlot`), so the fused step sees one buffer per kind per
slot. Freeing a slot detaches and drops everything. No HTTP, no SQL; knows nothing of runs or tenants.

Under tensor parallelism (the decoder's `tp`) a slot holds this rank's part of each tensor its layer
splits (`LoRATarget.lora_sharding`) and the others whole. Checkpoints and snapshots know only whole
tensors: `whole_state` gathers the parts from the ranks (a collective every rank of the group joins), and
`Slot.assign` takes whole tensors and keeps its part. The tensors every rank holds whole come first in the
slot's flat buffers (`AdamSlot.whole_numel`), so the engine reduces or norms each kind with one slice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from loraplex.engine.optimizer import AdamSlot, step_slots
from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.errors import CapacityError, NotFoundError, ServerError, UserError
from loraplex.model.decoder import Decoder
from loraplex.model.multi_lora import LoRATarget, init_slot_weights
from loraplex.model.tensor_parallel import Split, TensorParallel, gather_split

# LoraConfig flag -> the `Decoder.lora_targets()` group it switches on.
TARGET_GROUPS = {"train_attn": "attn", "train_mlp": "mlp", "train_unembed": "unembed"}


def lora_names(module_path: str) -> tuple[str, str]:
    """The PEFT names of a target's A and B tensors."""
    return f"{module_path}.lora_A.weight", f"{module_path}.lora_B.weight"


class OptimizerState(NamedTuple):
    """A slot's AdamW state keyed by weight name, as checkpoints store it."""

    exp_avg: Mapping[str, Tensor]  # first moments, shaped like the weights
    exp_avg_sq: Mapping[str, Tensor]  # second moments
    step: int  # AdamW steps taken


@dataclass
class Slot:
    """One live adapter: its config, its tensors by PEFT name, and the same tensors' AdamW state.

    `weights` and `adam.params` hold the same tensor objects (views of `adam.weights_N`) in the same order.
    """

    config: LoraConfig
    weights: dict[str, Tensor]  # "<path>.lora_A.weight" (R, in), "<path>.lora_B.weight" (out, R); fp32
    adam: AdamSlot
    splits: dict[str, Split]  # the tensors this rank holds a part of -> which part (none with one rank)

    def part(self, name: str, whole: Tensor) -> Tensor:
        """This rank's part of the whole tensor `name` (the tensor itself where this rank holds it whole)."""
        split = self.splits.get(name)
        return whole if split is None else split.of(whole)

    @property
    def scale(self) -> float:
        """The LoRA scale alpha / rank."""
        return self.config.alpha / self.config.rank

    def optimizer_state(self) -> OptimizerState:
        """The slot's AdamW state by weight name (views of the live buffers, not copies)."""
        return OptimizerState(
            dict(zip(self.weights, self.adam.views(self.adam.exp_avg_N), strict=True)),
            dict(zip(self.weights, self.adam.views(self.adam.exp_avg_sq_N), strict=True)),
            self.adam.step,
        )

    @torch.no_grad()
    def assign(
        self,
        weights: Mapping[str, Tensor],
        optimizer: OptimizerState | None,
        gradients: Mapping[str, Tensor] | None = None,
        *,
        are_parts: bool = False,
    ) -> None:
        """Overwrite in place from checked tensors of the same names: whole ones, of which this rank keeps
        its part, or with `are_parts` this rank's parts already (a replica's copy); optimizer None resets
        AdamW (zero moments, step 0); gradients None zeroes the accumulators (a parked run brings its
        unstepped gradients back)."""

        def own(name: str, tensor: Tensor) -> Tensor:
            return tensor if are_parts else self.part(name, tensor)

        for name, param in self.weights.items():
            param.copy_(own(name, weights[name]))
        self.adam.grads_N.zero_()
        if gradients is not None:
            for name, param in self.weights.items():
                param.grad.copy_(own(name, gradients[name]))
        self.adam.has_gradients = gradients is not None
        if optimizer is None:
            torch._foreach_zero_([self.adam.exp_avg_N, self.adam.exp_avg_sq_N])
            self.adam.step = 0
            return
        state = self.optimizer_state()
        for name in self.weights:
            state.exp_avg[name].copy_(own(name, optimizer.exp_avg[name]))
            state.exp_avg_sq[name].copy_(own(name, optimizer.exp_avg_sq[name]))
        self.adam.step = optimizer.step


class SlotPool:
    """Up to `max_slots` adapters of rank 1..`max_rank` attached to one decoder; ids 0..max_slots-1."""

    def __init__(self, decoder: Decoder, max_slots: int, max_rank: int) -> None:
        self.targets: dict[str, tuple[LoRATarget, str]] = decoder.lora_targets()
        self.tp: TensorParallel = decoder.tp
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.device = next(iter(self.targets.values()))[0].weight.device
        self._slots: dict[int, Slot] = {}
        self._poisoned: set[int] = set()  # slots whose state an optimizer step left half-changed
        self._held = (0, 0)  # (adapter, optimizer) bytes of every slot: see held_bytes

    def expected_shapes(self, config: LoraConfig) -> dict[str, tuple[int, ...]]:
        """PEFT name -> whole shape (as checkpoints hold it) of every tensor a slot of `config` has;
        UserError if it is not servable."""
        rank = config.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_rank:
            raise UserError(
                f"lora rank {rank!r} is not allowed; this server supports ranks 1..{self.max_rank}"
            )
        alpha = config.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
            raise UserError(f"lora alpha {alpha!r} is not allowed; it must be a positive number")
        groups = self._groups(config)
        if not groups:
            raise UserError(
                f"a LoRA config must train at least one of {', '.join(TARGET_GROUPS)}; all are false"
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for path, (layer, group) in self.targets.items():
            if group in groups:
                whole = layer.lora_sharding(rank).whole_shapes(layer.lora_shapes(rank))
                shapes.update(zip(lora_names(path), whole, strict=True))
        return shapes

    def create(self, config: LoraConfig) -> int:
        """Allocate a fresh slot (A seeded from config.seed, B zero, zero gradients, no AdamW steps)."""
        self.expected_shapes(config)
        free_ids = [i for i in range(self.max_slots) if i not in self._slots]
        if not free_ids:
            raise CapacityError(
                f"all {self.max_slots} adapter slots are in use; retry after a training run ends or its "
                "session expires"
            )
        slot = free_ids[0]
        initial = init_slot_weights(self.targets, config.rank, config.seed, self._groups(config))
        tensors = [
            (name, tensor, split)
            for path, pair in initial.items()
            for name, tensor, split in zip(
                lora_names(path), pair, self.targets[path][0].lora_sharding(config.rank), strict=True
            )
        ]
        tensors.sort(key=lambda entry: entry[2] is not None)  # stable: whole ones first, else in order
        whole = [tensor for _, tensor, split in tensors if split is None]
        adam = AdamSlot.fresh([tensor for _, tensor, _ in tensors], self.device, len(whole))
        weights = dict(zip((name for name, _, _ in tensors), adam.params, strict=True))
        splits = {name: split for name, _, split in tensors if split is not None}
        record = Slot(config, weights, adam, splits)
        for path in initial:
            name_A, name_B = lora_names(path)
            self.targets[path][0].attach(slot, record.weights[name_A], record.weights[name_B], record.scale)
        self._slots[slot] = record
        self._count_held()
        return slot

    def free(self, slot: int) -> None:
        """Detach the slot from every layer and drop its tensors and state (a poisoned slot too); the id may
        be reused."""
        if slot not in self._slots:
            raise NotFoundError(f"adapter slot {slot} is not in use")
        for layer, _ in self.targets.values():
            layer.detach(slot)
        del self._slots[slot]
        self._poisoned.discard(slot)
        self._count_held()

    @torch.no_grad()
    def whole_state(
        self, slot: int, with_optimizer: bool = True, with_gradients: bool = False
    ) -> tuple[dict[str, Tensor], OptimizerState | None, dict[str, Tensor] | None]:
        """The slot's weights, and if asked its AdamW state and gradient accumulators, as whole tensors by
        name: under tensor parallelism gathered from every rank's part (a collective: every rank of the
        group calls it, in the same order); with one rank, views of the live buffers (no copy)."""
        record = self.get(slot)
        state = record.optimizer_state()
        kinds = [record.weights]
        if with_optimizer:
            kinds += [state.exp_avg, state.exp_avg_sq]
        if with_gradients:
            kinds.append({name: param.grad for name, param in record.weights.items()})
        whole = [
            {name: gather_split(t.detach(), record.splits.get(name), self.tp) for name, t in kind.items()}
            for kind in kinds
        ]
        optimizer = OptimizerState(whole[1], whole[2], state.step) if with_optimizer else None
        return whole[0], optimizer, whole[-1] if with_gradients else None

    @property
    def writes_files(self) -> bool:
        """Whether this rank writes what its tensor-parallel group saves (rank 0 of it; the only rank)."""
        return self.tp.rank == 0

    def held_bytes(self) -> tuple[int, int]:
        """(adapter, optimizer) bytes of every slot allocated, poisoned ones included: the weights, and the
        gradient rows and moments (AdamSlot.optimizer_bytes). Counted as slots come and go; free to read."""
        return self._held

    def _count_held(self) -> None:
        adams = [record.adam for record in self._slots.values()]
        self._held = (sum(a.weights_N.nbytes for a in adams), sum(a.optimizer_bytes for a in adams))

    def get(self, slot: int) -> Slot:
        """The live slot `slot`; NotFoundError if no slot of that id is in use, ServerError if poisoned."""
        record = self._slots.get(slot)
        if record is None:
            raise NotFoundError(f"adapter slot {slot} is not in use")
        if slot in self._poisoned:
            raise ServerError(poisoned_message([slot]))
        return record

    def poison(self, slots: list[int]) -> None:
        """Refuse every later use of `slots` but freeing them: an optimizer step failed part way through
        them, so their weights, moments, gradients and step counts no longer belong together."""
        self._poisoned.update(slots)

    def poisoned(self, slots: list[int]) -> list[int]:
        """Those of `slots` that are poisoned, ascending."""
        return sorted(self._poisoned.intersection(slots))

    def has_slot(self, slot: int) -> bool:
        """Whether `slot` is in use."""
        return slot in self._slots

    @property
    def live_slots(self) -> list[int]:
        """Ids of the slots in use, ascending."""
        return sorted(self._slots)

    def step(self, steps: Mapping[int, AdamParams]) -> dict[int, dict[str, float]]:
        """One fused AdamW step of the given slots (see `step_slots`); every id is checked before any step."""
        records = {slot: self.get(slot) for slot in steps}
        metrics = step_slots([(records[slot].adam, params) for slot, params in steps.items()])
        return dict(zip(steps, metrics, strict=True))

    @staticmethod
    def _groups(config: LoraConfig) -> set[str]:
        """The target groups a config trains."""
        return {group for flag, group in TARGET_GROUPS.items() if getattr(config, flag)}


def poisoned_message(slots: list[int]) -> str:
    """Why a poisoned slot is refused (SlotPool.poison)."""
    if len(slots) == 1:
        return f"adapter slot {slots[0]}'s optimizer step failed part way; its state is lost"
    return f"adapter slots {slots}' optimizer step failed part way; their state is lost"
