"""Minimal reproduction: ATen's small OpenMP-parallel CPU ops run slower on a thread other than the main one.

Plain torch, no loraplex code: each op is timed on the main thread and then on a freshly started thread,
alternately, and the median of each is printed with their ratio. On the 2-core AMD EPYC VM of
docs/BENCHMARKS.md (torch 2.13.0+cpu, libgomp, 2 threads) the small batched matmul took 29-34 us on the
main thread and 73-85 us on a second one, longer than on one thread alone (58 us), in every run; the
large ops moved within this host's noise either way. With `OMP_NUM_THREADS=1` every ratio is ~1. A
fixed ~40 us more per parallel region looks like waking a sleeping OpenMP worker each time instead of
handing work to a spinning one. This is why `loraplex serve` runs its engine on the main thread
(EngineLoop.run).

Usage (repo root): .venv/bin/python bench/second_thread.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch


def median_us(op: Callable[[], object], calls: int = 30) -> float:
    """Median microseconds of one call of `op`, after one untimed call."""
    op()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def on_new_thread(op: Callable[[], object]) -> float:
    """median_us of `op`, measured on a thread started for it."""
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(median_us(op)))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    x_TI, w_IO = torch.randn(256, 512), torch.randn(512, 32000)
    logits_TV = torch.randn(256, 32000)
    x_GLI, A_GIR = torch.randn(8, 32, 512), torch.randn(8, 512, 16)
    ops: dict[str, Callable[[], object]] = {
        "mm (256, 512) x (512, 32000)": lambda: x_TI @ w_IO,
        "bmm (8, 32, 512) x (8, 512, 16)": lambda: torch.bmm(x_GLI, A_GIR),
        "add (256, 32000)": lambda: logits_TV + logits_TV,
        "exp (256, 32000)": logits_TV.exp,
        "log_softmax (256, 32000)": lambda: logits_TV.log_softmax(-1),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for _ in range(args.rounds):
        for name, op in ops.items():
            main_us, thread_us = median_us(op), on_new_thread(op)
            ratio = thread_us / main_us
            print(f"{name:34s} main {main_us:9.1f} us   new thread {thread_us:9.1f} us   x{ratio:.2f}")


if __name__ == "__main__":
    main()
