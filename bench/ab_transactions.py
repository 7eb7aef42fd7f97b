"""What transactional passes and steps cost on the happy path, timed the `bench train` way: one process,
interleaved rounds, the bench model.

"bare" calls the pass and the fused step without their transactions (passes.run_pass and
SlotPool.step directly); "transactional" calls LocalEngine.run_pass, which first copies the trained slots'
accumulators if they hold gradients (engine/transactions.py), and LocalEngine.prepare_step + apply_step,
the two-phase step the runtime runs, which copies nothing. Two step shapes: a pass alone over accumulators
that already hold gradients (the copy is taken: the worst case), and a training step of one pass + one
fused optimizer step from zeroed accumulators (the pass then zeroes instead of copying).

Usage (repo root): .venv/bin/python bench/ab_transactions.py [--slots 8] [--tokens-per-slot 32] [--rounds 10]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

from loraplex.bench.timing import ratios, time_interleaved
from loraplex.bench.train import build_engine, run_dtype
from loraplex.bench.workloads import TrainShape, make_slot_datums, prepare_model_dir, to_requests
from loraplex.engine import passes
from loraplex.engine.types import AdamParams, LoraConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens-per-slot", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    shape = TrainShape(args.slots, args.tokens_per_slot, args.rank, args.tokens_per_slot)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = prepare_model_dir("tiny-qwen3-bench", Path(scratch), run_dtype(device), device)
        engine = build_engine(model_dir, device, shape.slots, shape.rank)
        slots = [engine.create_slot(LoraConfig(rank=shape.rank, seed=k)) for k in range(shape.slots)]
        requests = to_requests(slots, make_slot_datums(shape, engine.info.vocab_size))
        steps = dict.fromkeys(slots, AdamParams(learning_rate=1e-6))

        def bare_pass() -> None:
            passes.run_pass(engine.decoder, requests, engine._validate, engine.logprob_chunk)
            for slot in slots:
                engine.pool.get(slot).adam.has_gradients = True

        def transactional_pass() -> None:
            engine.run_pass(requests)

        def step(run_pass: Callable[[], None], optim: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                run_pass()
                optim()

            return run

        runs = {
            "pass_bare": bare_pass,
            "pass_transactional": transactional_pass,
            "step_bare": step(bare_pass, lambda: engine.pool.step(steps)),
            "step_transactional": step(
                transactional_pass, lambda: engine.apply_step(engine.prepare_step(steps))
            ),
        }
        timings = time_interleaved(runs, args.rounds, 1, device)
    s = timings.seconds
    print(f"{shape}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, times in s.items():
        print(f"  {name:<20} median {median(times) * 1e3:8.2f} ms   best {min(times) * 1e3:8.2f} ms")
    for kind in ("pass", "step"):
        cost = median(ratios(s[f"{kind}_transactional"], s[f"{kind}_bare"])) - 1
        print(f"  {kind} cost of the transaction: {cost:+.2%} (pairwise median)")


if __name__ == "__main__":
    main()
