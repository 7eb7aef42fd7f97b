"""Slot transactions: a pass or an optimizer step that raises leaves every slot as it found it.

Before work that changes slots, `SlotSnapshot` copies what that work may change: a pass changes only the
gradient accumulators of the slots it trains; a step also changes weights, both AdamW moments and the
step count. If the work raises, `restore` puts every copy back, so the failed requests can be retried
without counting anything twice. A slot whose accumulators are still zero (nothing trained since its last
step, the usual state at a pass) is restored by zeroing instead of from a copy.

Why copies rather than scratch accumulators committed at the end: backward writes straight into each
slot's flat `.grad` views (optimizer.py), and the fused AdamW kernel updates its buffers in place; a
scratch set would have to be swapped into every layer and every `.grad` per pass. The copies cost one
memcpy of LoRA-sized buffers (docs/BENCHMARKS.md, fourth session: +2% on a `bench train` pass, +3.6%
on a pass with its fused step). No HTTP, no SQL.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from loraplex.engine.optimizer import AdamSlot


class SlotSnapshot:
    """Copies of some slots' mutable buffers, to put back if the work that follows fails."""

    def __init__(self, slots: Iterable[AdamSlot], with_state: bool) -> None:
        """with_state False: gradients only (a pass); True: weights, moments, gradients, step (a step)."""
        self._copies: list[tuple[Tensor, Tensor | None]] = []
        self._steps: list[tuple[AdamSlot, int]] = []
        with torch.no_grad():
            for slot in slots:
                self._copies.append((slot.grads_N, slot.grads_N.clone() if slot.has_gradients else None))
                if with_state:
                    buffers = (slot.weights_N, slot.exp_avg_N, slot.exp_avg_sq_N)
                    self._copies += [(live, live.clone()) for live in buffers]
                self._steps.append((slot, slot.step))
        self._has_gradients = [(slot, slot.has_gradients) for slot, _ in self._steps]

    @torch.no_grad()
    def restore(self) -> None:
        """Put every copied buffer, step count and gradient flag back as it was when taken."""
        for live, copy in self._copies:
            if copy is None:
                live.zero_()
            else:
                live.copy_(copy)
        for slot, step in self._steps:
            slot.step = step
        for slot, has_gradients in self._has_gradients:
            slot.has_gradients = has_gradients
