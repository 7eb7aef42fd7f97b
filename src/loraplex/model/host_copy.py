"""Host data onto the device without making the host wait: the one way per-pass metadata crosses over.

Per-pass index tensors (packing, slot routing, KV-cache rows, loss inputs, sampling parameters) are built
on the host with numpy or Python, never with torch ops on CPU tensors, and cross once through `to_device`.
On CUDA a copy from pageable memory synchronises the stream (`.to(device)` and `torch.tensor(...,
device=...)` are such copies), whereas one from pinned memory with `non_blocking=True` is queued behind
the device's work and returns at once; torch's pinned-memory allocator keeps the staging buffer alive
until the copy has run. Knows nothing of what the values mean.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(host: np.ndarray | Tensor, device: torch.device | str | None) -> Tensor:
    """`host` (a numpy array, shared, or a CPU tensor) as a tensor on `device` (None: left on the host),
    copied through pinned memory without blocking on CUDA; on the CPU no copy is made (nor for a tensor
    already on `device`)."""
    # from_numpy shares the array's memory, which must be writable (a copy if it is not).
    tensor = torch.from_numpy(np.require(host, requirements="W")) if isinstance(host, np.ndarray) else host
    if device is None:
        return tensor
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
