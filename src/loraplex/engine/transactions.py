"""Pass transactions: a pass that raises leaves every slot as it found it.

Before a pass, `SlotSnapshot` copies what it may change: the gradient accumulators of the slots it trains.
If the pass raises, `restore` puts every copy back, so the failed requests can be retried without counting
anything twice. A slot whose accumulators are still zero (nothing trained since its last step, the usual
state at a pass) is restored by zeroing instead of from a copy; only accumulators that already hold
gradients are copied.

An optimizer step needs no copy: it runs in two phases (optimizer.py), a read-only prepare that does
everything that can fail and an apply of in-place kernels only; the runtime records its outcome between
them (runtime/core/journal.py).

Why copies rather than scratch accumulators committed at the end: backward writes straight into each
slot's flat `.grad` views (optimizer.py); a scratch set would have to be swapped into every layer and
every `.grad` per pass. The copies cost one memcpy of LoRA-sized buffers (docs/BENCHMARKS.md).

The copies go into one `UndoBuffer` the engine keeps between transactions, not into fresh tensors: fresh
memory has its pages faulted in and zeroed by the kernel first, which made copies 4x dearer than the
memcpy itself (docs/BENCHMARKS.md, sixth session). No HTTP, no SQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from loraplex.engine.optimizer import AdamSlot


class UndoBuffer:
    """The memory snapshots copy into, reused from one transaction to the next.

    It holds as much as the largest snapshot taken so far (a pass's copies of the accumulators it trained)
    and never shrinks. The memory a snapshot's copies live in is only valid until the next snapshot is taken
    from the same buffer: the engine keeps at most one (it drops its kept undo before each transaction).
    """

    def __init__(self) -> None:
        self._flat: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes it holds now."""
        return 0 if self._flat is None else self._flat.nbytes

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

    def __init__(self, slots: Iterable[AdamSlot], into: UndoBuffer) -> None:
        """The slots' gradient accumulators, as a pass is about to change them; the copies live in `into`
        until the next snapshot taken from it."""
        slots = list(slots)
        zeroed: list[Tensor] = []  # accumulators with nothing in them: restored by zeroing, not copied
        copied: list[Tensor] = []
        for slot in slots:
            (copied if slot.has_gradients else zeroed).append(slot.grads_N)
        self._zeroed = zeroed
        self._copies = list(zip(copied, into.views(copied), strict=True))
        with torch.no_grad():
            for live, copy in self._copies:
                copy.copy_(live)
        self._has_gradients = [(slot, slot.has_gradients) for slot in slots]

    @torch.no_grad()
    def restore(self) -> None:
        """Put every accumulator and gradient flag back as it was when taken."""
        for live in self._zeroed:
            live.zero_()
        for live, copy in self._copies:
            live.copy_(copy)
        for slot, has_gradients in self._has_gradients:
            slot.has_gradients = has_gradients
