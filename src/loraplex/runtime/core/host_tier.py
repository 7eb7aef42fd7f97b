"""How many runs the host tier holds by default: a share of the host memory free at start-up.

The host tier (executor.py) keeps the state of runs that gave up their adapter slot in host memory
(pinned on CUDA), so a run taking its turn again is a memory copy rather than a write and read of files.
Each run held there costs `Engine.host_bytes_per_slot()` at most (a slot of the largest rank). No SQL, no
tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

# Of the memory free at start-up, what the host tier may fill: the rest is left to the process's own
# growth (sampling, checkpoint writes, the database) and to whatever else runs on the machine.
HOST_MEMORY_SHARE = 0.5


def default_host_slots(bytes_per_slot: int, available_bytes: int | None = None) -> int:
    """Runs that fit in HOST_MEMORY_SHARE of `available_bytes` (default: the host's available memory now)."""
    available = available_host_bytes() if available_bytes is None else available_bytes
    return int(HOST_MEMORY_SHARE * available) // max(1, bytes_per_slot)


def available_host_bytes() -> int:
    """Linux's MemAvailable (free memory plus what the page cache can give back); elsewhere free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
