"""Kernel names for loraplex's threads, so `top -H`, `ps -L` and /proc say which thread uses the CPU
(`loraplex bench api` reads them).

Python 3.11 keeps a thread's name in the interpreter only; Linux keeps 15 bytes of a name per thread, and a
thread started by a named one (torch's OpenMP workers, say) inherits its name.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

_PR_SET_NAME = 15  # prctl option: the calling thread's name
_MAX_BYTES = 15

ENGINE, HTTP, SUBMIT = "lpx-engine", "lpx-http", "lpx-submit"


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) in the kernel; nothing where that is not Linux."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl in this libc: the name is a nicety
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:_MAX_BYTES], 0, 0, 0)
