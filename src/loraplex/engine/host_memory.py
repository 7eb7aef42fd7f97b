"""Host (CPU) memory: keep freed tensor buffers in the process for the next step instead of returning them.

glibc's malloc serves every block above its mmap threshold (≤ 32 MiB) with a fresh mmap and unmaps it on
free, and a thread other than the main one allocates from an arena capped at 64 MiB. A training step frees
and re-allocates the same large activation, logits and gradient buffers every time, so with the defaults
each step pays for zero-filling tens of MB of new pages through page faults (~19,000 minor faults per
`bench train` step after warm-up, ~8 once tuned), and an engine on any thread but the main one cannot
keep its large buffers at all. Raising both thresholds and using one arena keeps them for reuse; the cost is
that up to the trim threshold of freed memory stays resident. `LORAPLEX_HOST_MALLOC=default` in the
environment keeps glibc's defaults (less memory, slower steps; also how the two are compared).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 256 * 2**20  # above the largest per-step buffer (the lm_head chunk's logits: 131 MB)
TRIM_THRESHOLD = 1024 * 2**20


def keep_freed_host_memory() -> bool:
    """Tune glibc's malloc for a process that re-allocates the same large buffers every step; False (and
    nothing changed) where the C library is not glibc or LORAPLEX_HOST_MALLOC=default."""
    if os.environ.get("LORAPLEX_HOST_MALLOC") == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_ARENA_MAX, 1))
    applied = all(mallopt(parameter, value) == 1 for parameter, value in settings)
    if not applied:
        log.warning("mallopt refused a setting; host memory keeps glibc's defaults for the rest")
    return applied


_releasing = threading.Lock()


def release_freed_memory() -> bool:
    """Hand the free pages of malloc's heap back to the system (glibc's malloc_trim), so that memory freed
    by requests that were refused does not stay counted to the process: with the thresholds above it
    would, up to the trim threshold. Not for every step (the engine re-faults what it re-allocates, the
    cost the tuning avoids); for the rare large request that was turned away. False where the C library
    is not glibc, or another release is under way (it returns the same pages)."""
    trim = _malloc_trim()
    if trim is None or not _releasing.acquire(blocking=False):
        return False
    try:
        trim(0)
    finally:
        _releasing.release()
    return True


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
