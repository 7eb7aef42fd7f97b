"""A detector, run on the CPU, of what would make the host wait for a CUDA device: `host_syncs()`.

Inside `with host_syncs() as found:` every aten op dispatched (forward and backward) is appended to
`found.recorded_ops`, and each call that on CUDA blocks the host until the device catches up is appended
to `found` as a `HostSync` naming the op, why it syncs, and the innermost frame of our code that made it.

Rules, by what the host waits for:
- a value read back: `aten._local_scalar_dense` (what `.item()`, `bool()`, `int()`, `float()` call;
  `torch.equal`, which on CUDA ends in it); `Tensor.tolist`, `.numpy`, `__array__` and `.cpu()`;
- a result whose size depends on the data (torch reads the size back to allocate it): `nonzero` (so
  `argwhere` and one-argument `where`), `masked_select`, `index` / `index_put_` with a boolean mask,
  every `unique`, `bincount` (it reads the ids' min and max), `repeat_interleave` without `output_size`;
- a blocking copy from the host: `Tensor.to` or `.cuda` naming a device without `non_blocking=True`,
  `torch.tensor` / `as_tensor` / `asarray` with a device, and `Tensor.new_tensor` of host data (torch
  makes these copies blocking, and a CUDA copy from pageable memory syncs the stream); `copy_` and
  `_to_copy` between two devices;
- a kernel CUDA lacks: `_grouped_mm` of operands not in bf16, which CUDA runs as a loop of matmuls
  reading each group's offset back.

Limits, since on a CPU every tensor lives on the host:
- torch ops on tensors built on the host (packing metadata, index lists) look like device ops and are
  flagged, as are reads of results already copied to the host (`.numpy()` after `.cpu()`); so host-side
  metadata is built with numpy or Python, and torch holds device tensors only.
- A copy is recognised by its call, not by its devices: `.to(device)` of a tensor already on the device
  (a no-op on CUDA) is flagged, `dst.copy_(host_tensor)` into a device tensor is not seen, and
  `non_blocking=True` is taken as asynchronous, which on CUDA it is only from pinned memory
  (`loraplex.model.host_copy.to_device` pins).
- What is not dispatched as an aten op, or syncs inside a kernel under a name not listed above, is not
  seen; a compiled graph is seen as the ops it runs eagerly on the CPU. An op the autograd engine runs
  on a worker thread (a CUDA backward) is seen, but `where` may then name no frame of ours.
`torch.cuda.set_sync_debug_mode("error")` is the check on a GPU (the `gpu`-marked tests).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Every overload of these synchronises, whatever its arguments.
_SYNCING_OPS: dict[Any, str] = {
    aten._local_scalar_dense: "reads a value back to the host",
    aten.equal: "returns a Python bool: reads the comparison back (on CPUs without an op of its own)",
    aten.nonzero: "output size depends on the data",
    aten.masked_select: "output size depends on the data",
    aten.bincount: "reads the ids' min and max back to size its result",
    aten._unique: "output size depends on the data",
    aten._unique2: "output size depends on the data",
    aten.unique_dim: "output size depends on the data",
    aten.unique_consecutive: "output size depends on the data",
    aten.unique_dim_consecutive: "output size depends on the data",
}
_HOST_READS = {"tolist", "numpy", "__array__", "cpu"}
_DEVICE_MOVES = {"to", "cuda"}
_HOST_COPIES_TO_DEVICE = {"tensor", "as_tensor", "asarray"}
_OUR_CODE = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class HostSync:
    """One call that would block the host on CUDA."""

    op: str  # the aten op or tensor method
    reason: str
    where: str  # "path/to/file.py:line in function": the innermost frame of our code

    @property
    def function(self) -> str:
        """'file.py:function' of `where`, without the line (stable across edits)."""
        location, _, function = self.where.partition(" in ")
        return f"{Path(location.rsplit(':', 1)[0]).name}:{function}"


class HostSyncs(list[HostSync]):
    """The syncs found (empty: none), and `recorded_ops`, every aten op dispatched, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded_ops: list[torch._ops.OpOverload] = []

    def add(self, op: str, reason: str) -> None:
        """Record a sync made by the code running now."""
        self.append(HostSync(op, reason, _innermost_frame_of_ours()))


@contextmanager
def host_syncs() -> Iterator[HostSyncs]:
    """Record every aten op the body dispatches and every call that would sync with a CUDA device."""
    found = HostSyncs()
    with _CallWatch(found), _OpWatch(found):
        yield found


@contextmanager
def cuda_syncs_raise() -> Iterator[None]:
    """torch's own check of every CUDA sync, as errors (the check on a GPU of what `host_syncs` finds)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class _OpWatch(TorchDispatchMode):
    """The aten-level rules."""

    def __init__(self, found: HostSyncs) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.found.recorded_ops.append(func)
        reason = _SYNCING_OPS.get(func.overloadpacket) or _op_reason(func, args, kwargs)
        if reason is not None:
            self.found.add(str(func), reason)
        return func(*args, **kwargs)


def _op_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why an op not synchronising by name does so with these arguments, or None."""
    packet = func.overloadpacket
    is_indexing = packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_)
    if is_indexing and any(_is_mask(index) for index in args[1] if index is not None):
        return "indexing by a boolean mask: output size depends on the data"
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None and _is_tensor_form(args):
        return "repeat_interleave without output_size reads the repeats' sum back"
    if packet is aten._grouped_mm and any(a.dtype != torch.bfloat16 for a in args[:2]):
        return "CUDA's grouped GEMM takes bf16 only; other dtypes loop, reading each offset back"
    if packet is aten.copy_ and args[0].device != args[1].device:
        is_upload = _is_queued_upload(args[1], args[0].device, len(args) > 2 and args[2])
        return None if is_upload else "copy between devices"
    if packet is aten._to_copy and kwargs.get("device") not in (None, args[0].device):
        is_upload = _is_queued_upload(args[0], kwargs["device"], kwargs.get("non_blocking", False))
        return None if is_upload else "copy between devices"
    return None


def _is_queued_upload(source: torch.Tensor, target: torch.device, non_blocking: bool) -> bool:
    """A non-blocking copy from pinned host memory to a CUDA device: queued behind the device's work, the
    host goes on (what model/host_copy.py's `to_device` does)."""
    return (
        bool(non_blocking)
        and source.device.type == "cpu"
        and torch.device(target).type == "cuda"
        and (source.is_pinned())
    )


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _is_tensor_form(args: tuple) -> bool:
    """repeat_interleave's overloads with repeats as a tensor (the scalar form knows its size)."""
    return isinstance(args[0], torch.Tensor) and (len(args) == 1 or isinstance(args[1], torch.Tensor))


class _CallWatch(TorchFunctionMode):
    """The rules on Python-level calls, which never reach the dispatcher for a CPU tensor."""

    def __init__(self, found: HostSyncs) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reason = _call_reason(name, args, kwargs)
        if reason is not None:
            self.found.add(name, reason)
        return func(*args, **kwargs)


def _call_reason(name: str, args: tuple, kwargs: dict) -> str | None:
    """Why a call to the torch function or Tensor method `name` syncs, or None."""
    if name in _HOST_READS:
        return "copies the tensor to the host"
    if name in _DEVICE_MOVES and _names_device(name, args[1:], kwargs) and not _is_non_blocking(args, kwargs):
        return "blocking copy to a device (from pageable memory: syncs the stream)"
    if name in _HOST_COPIES_TO_DEVICE and kwargs.get("device") is not None:
        return "blocking copy from host data to a device"
    if name == "new_tensor" and not isinstance(args[1], torch.Tensor):
        return "blocking copy from host data to the tensor's device"
    return None


def _names_device(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a Tensor.to / .cuda call moves to a device (a device, its name, or another tensor's)."""
    if name == "cuda" or kwargs.get("device") is not None:
        return True
    return any(isinstance(a, str | torch.device | torch.Tensor) for a in args)


def _is_non_blocking(args: tuple, kwargs: dict) -> bool:
    """non_blocking=True, by keyword or as the one positional bool Tensor.to / .cuda take."""
    return bool(kwargs.get("non_blocking")) or any(a is True for a in args)


def _innermost_frame_of_ours() -> str:
    """'path:line in function' of the innermost caller in this repository but outside this file; the
    function is the nearest named one around the line (a comprehension's or a lambda's, which Python
    names '<listcomp>' or '<lambda>', is its enclosing function's)."""
    this_file = str(Path(__file__).resolve())
    ours = [
        frame
        for frame in traceback.extract_stack()
        if (path := str(Path(frame.filename).resolve())).startswith(_OUR_CODE)
        and path != this_file
        and "site-packages" not in path  # a virtual environment inside the repository is not ours
    ]
    if not ours:
        return "outside our code"
    innermost = ours[-1]
    named = (frame.name for frame in reversed(ours) if not frame.name.startswith("<"))
    function = next(named, innermost.name)
    return f"{Path(innermost.filename).resolve().relative_to(_OUR_CODE)}:{innermost.lineno} in {function}"
