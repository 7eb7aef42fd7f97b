"""Peak memory of one configuration: the peak resident set of a subprocess that runs it alone (CPU), or
`torch.cuda.max_memory_allocated` around one call (GPU).

The subprocess re-enters through `python -m loraplex.bench.memory <kind> <spec json>`, builds only the
configuration named by `kind` from the shared model directory (with the `build_configuration` of the
bench module named by the spec's "bench" key, `train` when absent), runs it twice and prints its peak
resident set (Python, torch and the model included). It reads VmHWM, the high-water mark of its own
address space, rather than ru_maxrss: Linux carries the parent's resident set at fork into the child's
ru_maxrss across exec, which would report the benchmark process's size instead of the configuration's.
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.host_memory import keep_freed_host_memory

_KIB_PER_MB = 1024  # /proc and ru_maxrss count KiB


def peak_rss_mb(kind: str, spec: dict[str, Any]) -> float:
    """Peak resident set (MB) of a fresh process running configuration `kind` of `spec` twice."""
    command = [sys.executable, "-m", "loraplex.bench.memory", kind, json.dumps(spec)]
    child = subprocess.run(command, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"memory probe {kind} failed ({child.returncode}): {child.stderr[-2000:]}")
    return float(child.stdout.splitlines()[-1])


def own_peak_rss_mb() -> float:
    """This process's resident-set high-water mark in MB (VmHWM; ru_maxrss where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / _KIB_PER_MB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _KIB_PER_MB


def peak_gpu_mb(run: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(peak allocated MB during one call, of which MB above what was allocated before it)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak / 2**20, (peak - before) / 2**20


def _child_main(kind: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    keep_freed_host_memory()  # as the measuring process does
    # The bench module is imported here, not at the top: the parent imported this module first.
    bench = importlib.import_module(f"loraplex.bench.{spec.pop('bench', 'train')}")
    run = bench.build_configuration(kind, spec)
    run()
    run()
    print(own_peak_rss_mb())


if __name__ == "__main__":
    _child_main(*sys.argv[1:3])
