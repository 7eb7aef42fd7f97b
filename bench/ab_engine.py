"""Before/after of the issue #7 engine changes, timed the `bench train` way: one process, interleaved rounds.

"before" puts back commit ce35848's LoRA delta (per-segment split, matmuls, adds and cat under plain
autograd) and its lm_head path for every loss (token chunks under activation checkpointing, so the
logits are computed twice); "after" is the working tree (one autograd node per layer call, equal
segments batched; the lm_head's backward inside its chunked forward for per-token losses).

Usage (repo root): .venv/bin/python bench/ab_engine.py [--slots 8] [--tokens-per-slot 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median

import torch

from loraplex.bench.timing import ratios, time_interleaved
from loraplex.bench.train import EngineCase, build_engine, run_dtype
from loraplex.bench.workloads import TrainShape, prepare_model_dir
from loraplex.engine import passes
from loraplex.model import multi_lora

BEFORE_COMMIT = "ce35848"


def _old_delta() -> Callable[..., torch.Tensor]:
    """`add_lora_delta` as commit BEFORE_COMMIT wrote it (read-only `git show`)."""
    source = subprocess.run(
        ["git", "show", f"{BEFORE_COMMIT}:src/loraplex/model/multi_lora.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("multi_lora_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{BEFORE_COMMIT}/multi_lora.py", "exec"), module.__dict__)
    return module.add_lora_delta


@contextmanager
def _before(old_delta: Callable[..., torch.Tensor]) -> Iterator[None]:
    saved = multi_lora._add_lora_delta_, passes.PER_TOKEN_LOSSES
    multi_lora._add_lora_delta_, passes.PER_TOKEN_LOSSES = old_delta, frozenset()
    try:
        yield
    finally:
        multi_lora._add_lora_delta_, passes.PER_TOKEN_LOSSES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens-per-slot", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    shape = TrainShape(args.slots, args.tokens_per_slot, args.rank, args.tokens_per_slot)
    old_delta = _old_delta()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = prepare_model_dir("tiny-qwen3-bench", Path(scratch), run_dtype(device), device)
        engine = build_engine(model_dir, device, shape.slots + 1, shape.rank)
        case = EngineCase.open(engine, shape, engine.info.vocab_size)

        def before(run: Callable[[], None]) -> Callable[[], None]:
            def timed() -> None:
                with _before(old_delta):
                    run()

            return timed

        runs = {
            "fused_before": before(case.fused),
            "one_slot_before": before(case.one_slot),
            "fused_after": case.fused,
            "one_slot_after": case.one_slot,
        }
        timings = time_interleaved(runs, args.rounds, 1, device)
    s = timings.seconds
    tokens = shape.num_tokens
    print(
        f"{shape}, {torch.get_num_threads()} threads, {args.rounds} rounds, {BEFORE_COMMIT} vs working tree"
    )
    for name, times in s.items():
        print(
            f"  {name:<16} median {tokens / median(times):8.1f} tok/s   best {tokens / min(times):8.1f} tok/s"
        )
    pairs = {
        "speedup after/before (fused)": ("fused_before", "fused_after"),
        "fusion efficiency before": ("one_slot_before", "fused_before"),
        "fusion efficiency after": ("one_slot_after", "fused_after"),
    }
    for label, (slower, faster) in pairs.items():
        print(f"  {label:<30} {median(ratios(s[slower], s[faster])):.3f} (pairwise median)")
    stalls = [v for values in timings.stall.values() for v in values if v is not None]
    if stalls:
        print(f"  cpu stalled: median {median(stalls):.0%}, worst {max(stalls):.0%}")


if __name__ == "__main__":
    main()
