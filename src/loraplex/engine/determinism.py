"""`--deterministic`: the kernels of every pass and sampling step repeat bit for bit on one machine.

On a CPU our kernels already repeat (fixed summation order for a given shape and thread count). On a GPU
several do not by default: cuBLAS picks split-K reductions whose order depends on its workspace,
`index_add` and `scatter_add_` accumulate with atomics, and attention backward kernels may too. Asking
torch for its deterministic algorithms switches those to fixed-order versions (or raises for an op that
has none, which is better than a silent difference) and needs cuBLAS's workspace fixed before its first
call. What stays not repeatable, and why, is in docs/OPERATIONS.md ("Deterministic mode").

A process-wide switch: every engine rank applies it before it builds its model.
"""

from __future__ import annotations

import os

import torch

# cuBLAS reads it when it creates its first handle; ":4096:8" is one of the two settings NVIDIA documents
# as giving reproducible results (the other, ":16:8", costs more speed).
_CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_kernels() -> None:
    """Make torch use deterministic kernels from here on, in this process (idempotent)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    # torch.use_deterministic_algorithms(True) is this call plus inductor's own flag, and setting that flag
    # imports torch._inductor and torch._dynamo: about 2 s at the start of every server and rank, which
    # compile nothing unless `--compile` is on. Where they compile, model/elementwise.py sets the flag.
    torch._C._set_deterministic_algorithms(True)
    # Which also makes every torch.empty write NaN into its buffer: a debugging aid that touches every
    # page of the KV and snapshot pools (seconds and gigabytes at start of sampling), reading nothing we
    # compute, since no kernel of ours reads a slot before writing it (tests/model/test_kv_cache.py).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
