"""Slot transactions: a pass or an optimizer step that raises leaves every slot as it found it.

Before work that changes slots, `SlotSnapshot` copies what that work may change: a pass changes only the
gradient accumulators of the slots it trains; a step also changes weights, both AdamW moments and the
step count. If the work raises, `restore` puts every copy back, so the failed requests can be retried
without counting anything twice. A slot whose accumulators are still zero (nothing trained since its last
step, the usual state at a pass) is restored by zeroing instead of from a copy.

Why copies rather than scratch accumulators committed at the end: backward writes straight into each
slot's flat `.grad` views (optimizer.py), and the fused AdamW kernel updates its buffers in place; a
scratch set would have to be swapped into every layer and every `.grad` per pass. The copies cost one
memcpy of LoRA-sized buffers (docs/BENCHMARKS.md, fourth and sixth sessions).

The copies go into one `UndoBuffer` the engine keeps between transactions, not into fresh tensors: a fresh
140 MB of copies per step (8 bench slots) had its pages faulted in and zeroed by the kernel first, which
made the step's copies 4x dearer than the memcpy itself (sixth session). No HTTP, no SQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from loraplex.engine.optimizer import AdamSlot


class UndoBuffer:
    """The memory snapshots copy into, reused from one transaction to the next.

    It holds as much as the largest snapshot taken so far (a step's copies of every slot it stepped) and
    never shrinks. The memory a snapshot's copies live in is only valid until the next snapshot is taken
    from the same buffer: the engine keeps at most one (it drops its kept undo before each transaction).
    """

    def __init__(self) -> None:
        self._flat: Tensor | None = None

    def views(self, like: Sequence[Tensor]) -> list[Tensor]:
        """Flat tensors shaped like `like` (same dtype and device, all alike), carved from the buffer."""
        if not like:
            return []
        sizes = [t.numel() for t in like]
        total, first = sum(sizes), like[0]
        flat = self._flat if self._fits(total, first) else None
        if flat is None:
            self._flat = None  # let the old memory go before the new is allocated
            self._flat = flat = torch.empty(total, dtype=first.dtype, device=first.device)
        return list(flat[:total].split(sizes))

    def _fits(self, numel: int, like: Tensor) -> bool:
        flat = self._flat
        if flat is None or flat.numel() < numel:
            return False
        return (flat.dtype, flat.device) == (like.dtype, like.device)


class SlotSnapshot:
    """Copies of some slots' mutable buffers, to put back if the work that follows fails."""

    def __init__(self, slots: Iterable[AdamSlot], with_state: bool, into: UndoBuffer) -> None:
        """with_state False: gradients only (a pass); True: weights, moments, gradients, step (a step).
        The copies live in `into` until the next snapshot taken from it."""
        zeroed: list[Tensor] = []  # accumulators with nothing in them: restored by zeroing, not copied
        copied: list[Tensor] = []
        self._steps: list[tuple[AdamSlot, int]] = []
        for slot in slots:
            (copied if slot.has_gradients else zeroed).append(slot.grads_N)
            if with_state:
                copied += [slot.weights_N, slot.exp_avg_N, slot.exp_avg_sq_N]
            self._steps.append((slot, slot.step))
        self._zeroed = zeroed
        self._copies = list(zip(copied, into.views(copied), strict=True))
        with torch.no_grad():
            for live, copy in self._copies:
                copy.copy_(live)
        self._has_gradients = [(slot, slot.has_gradients) for slot, _ in self._steps]

    @torch.no_grad()
    def restore(self) -> None:
        """Put every copied buffer, step count and gradient flag back as it was when taken."""
        for live in self._zeroed:
            live.zero_()
        for live, copy in self._copies:
            live.copy_(copy)
        for slot, step in self._steps:
            slot.step = step
        for slot, has_gradients in self._has_gradients:
            slot.has_gradients = has_gradients
