"""What tests/model/test_tensor_parallel_memory.py runs in a fresh process: load one rank's part of a model
and report the peak of the process's anonymous memory (its own tensors, not the mapped files) above what
it held before loading.

`python -m tests.model.load_memory_scenario MODEL_DIR RANK SIZE` prints that peak in bytes. Loading needs
no process group (TensorParallel's rank and size say which part), so each rank is measured alone.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.tensor_parallel import TensorParallel

_SAMPLE_S = 0.001


def anonymous_bytes() -> int:
    """This process's resident anonymous memory now (RssAnon of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def peak_load_bytes(model_dir: Path, tp: TensorParallel) -> int:
    """The most anonymous memory, above the start, held at any sample while loading `tp`'s part."""
    start = anonymous_bytes()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(_SAMPLE_S):
            peak[0] = max(peak[0], anonymous_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    decoder = load_decoder(model_dir, torch.device("cpu"), torch.float32, tp)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], anonymous_bytes())
    del decoder
    return peak[0] - start


def main() -> None:
    model_dir, rank, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    print(peak_load_bytes(model_dir, TensorParallel(None, rank, size)))


if __name__ == "__main__":
    main()
