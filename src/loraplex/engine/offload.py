"""Slots moved to host memory and back: the engine's half of the runtime's host tier.

A `HostSlot` is everything a slot holds, exactly: its four flat fp32 buffers (weights, gradient
accumulators, both AdamW moments), its step count, whether its accumulators hold a pass, and its config.
Bringing it back into a fresh slot of the same config (whose buffers have the same layout: slots.py lays
them out from the config alone) copies the buffers in bit for bit, so a run that went to host memory and
came back trains on as if it had never left.

On CUDA the copies go through pinned host memory on a side stream, queued behind the work already
launched: offloading returns at once and the next pass runs while the copy drains (the freed device
buffers are marked in use by the side stream, so the allocator does not hand them out before it is done);
bringing a slot back makes the compute stream wait for its copy. `HostSlot.tensors` waits for an offload's
copy before the host reads it (a write to disk). On the CPU the slot's buffers already live in host memory:
they move to the host slot as they are, with no copy. No HTTP, no SQL; knows nothing of runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loraplex.engine.optimizer import AdamSlot
from loraplex.engine.slots import OptimizerState, Slot
from loraplex.engine.types import LoraConfig


@dataclass(eq=False)
class HostSlot:
    """One slot's whole state in host memory (see the module docstring)."""

    config: LoraConfig
    names: list[str]  # the slot's PEFT tensor names, in the order of its flat buffers
    shapes: list[torch.Size]  # their shapes (this rank's parts under tensor parallelism)
    buffers: tuple[Tensor, Tensor, Tensor, Tensor]  # weights, gradients, exp_avg, exp_avg_sq; flat
    step: int
    has_gradients: bool
    copied: torch.cuda.Event | None = None  # recorded after the device-to-host copy; None: nothing pending

    def tensors(self) -> tuple[dict[str, Tensor], OptimizerState, dict[str, Tensor]]:
        """Weights, AdamW state and gradient accumulators by name, as a checkpoint stores them (views of the
        buffers, once their copy has landed)."""
        if self.copied is not None:
            self.copied.synchronize()
        weights, gradients, exp_avg, exp_avg_sq = (self._named(flat) for flat in self.buffers)
        return weights, OptimizerState(exp_avg, exp_avg_sq, self.step), gradients

    def _named(self, flat: Tensor) -> dict[str, Tensor]:
        parts = flat.split([shape.numel() for shape in self.shapes])
        return {
            name: part.view(shape) for name, part, shape in zip(self.names, parts, self.shapes, strict=True)
        }


def _flat(adam: AdamSlot) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return adam.weights_N, adam.grads_N, adam.exp_avg_N, adam.exp_avg_sq_N


class SlotMover:
    """Copies slots' buffers between the device and host memory (on CUDA: pinned, on a side stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @torch.no_grad()
    def to_host(self, record: Slot) -> HostSlot:
        """A host copy of the slot `record` (which the caller frees next)."""
        adam = record.adam
        sources = _flat(adam)
        copied = None
        if self._side is None:
            buffers = sources  # already host memory, and nothing else holds them once the slot is freed
        else:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                buffers = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources)
                for target, source in zip(buffers, sources, strict=True):
                    target.copy_(source, non_blocking=True)
                    source.record_stream(self._side)  # not reused by the allocator before the copy ran
                copied = torch.cuda.Event()
                copied.record(self._side)
        names, shapes = list(record.weights), [p.shape for p in adam.params]
        return HostSlot(record.config, names, shapes, buffers, adam.step, adam.has_gradients, copied)  # type: ignore[arg-type]

    @torch.no_grad()
    def to_device(self, host: HostSlot, record: Slot) -> None:
        """Overwrite the fresh slot `record` (of host.config) with the host copy, exactly."""
        adam = record.adam
        targets = _flat(adam)
        if self._side is None:
            for target, source in zip(targets, host.buffers, strict=True):
                target.copy_(source)
        else:
            current = torch.cuda.current_stream(self.device)
            self._side.wait_stream(current)  # the slot's fresh buffers are written before the copy lands
            with torch.cuda.stream(self._side):
                for target, source in zip(targets, host.buffers, strict=True):
                    target.copy_(source, non_blocking=True)
            current.wait_stream(self._side)
        adam.step, adam.has_gradients = host.step, host.has_gradients
