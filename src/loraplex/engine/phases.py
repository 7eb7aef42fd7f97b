"""Named phases of an engine step on a profiler's timeline (`loraplex bench ... --profile`).

`phase(name)` is a `torch.profiler.record_function` range while a profiler listens, and nothing
otherwise: a range costs ~14 µs of host time even with no profiler (measured on torch 2.13, CPU) and puts
an op of its own into the step's op stream, which a decode step of 128 rows cannot spare.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function


def phase(name: str) -> AbstractContextManager[object]:
    """A profiler range named `name` ("sampler.draw", "pass.forward", ...) if a profiler is on."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
