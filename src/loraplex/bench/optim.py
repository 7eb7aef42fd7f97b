"""`bench optim`: one fused AdamW step over many slots against a per-slot `torch.optim.AdamW` +
`clip_grad_norm_` loop over copies of the same tensors, interleaved round by round.

The fused side is the transactional step the runtime runs: `LocalEngine.prepare_step` then `apply_step`
(no undo copy; engine/optimizer.py). Both sides clip at norm 1.0 and zero the gradients after stepping;
gradients are random before the warm-up round and zero afterwards, which costs the same arithmetic (no
data-dependent branch on either side).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from loraplex.bench import report
from loraplex.bench.baselines import PerSlotAdamW
from loraplex.bench.memory import own_peak_rss_mb
from loraplex.bench.timing import Stat, ratios, time_interleaved
from loraplex.bench.train import run_dtype
from loraplex.bench.workloads import prepare_model_dir
from loraplex.engine.local import build_local_engine, resolve_device
from loraplex.engine.types import AdamParams, LoraConfig

_WARMUP = 1
_PARAMS = AdamParams(learning_rate=1e-4, weight_decay=0.01, grad_clip_norm=1.0)


def bench_optim(args: argparse.Namespace) -> int:
    """Entry point of `bench optim`: prints per-round rows and the summary."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    rounds = args.rounds or 5
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as scratch:
        model_dir = prepare_model_dir(args.model, Path(scratch), run_dtype(device), device)
        engine = build_local_engine(
            str(model_dir), Path(scratch), str(device), args.slots, args.rank, "bench"
        )
        slot_ids = [engine.create_slot(LoraConfig(rank=args.rank, seed=k)) for k in range(args.slots)]
        slot_params = [list(engine.pool.get(slot).weights.values()) for slot in slot_ids]
        generator = torch.Generator().manual_seed(0)
        copies = []
        for tensors in slot_params:
            for p in tensors:
                p.grad.copy_(torch.randn(p.shape, generator=generator))
            copies.append([_copy_with_grad(p) for p in tensors])
        steps = dict.fromkeys(slot_ids, _PARAMS)
        runs = {
            "fused": lambda: engine.apply_step(engine.prepare_step(steps)),
            "per_slot_loop": PerSlotAdamW(copies, _PARAMS),
        }
        timings = time_interleaved(runs, rounds, _WARMUP, device)
        context = report.context(args, device, run_dtype(device), rounds, _WARMUP)
    figures = _summarize(args, slot_params, timings.seconds)
    # Both sides live in this process (the engine's slots and the loop's copies): one peak for the two.
    memory = {"process_peak_rss_mb": own_peak_rss_mb()}
    report.emit_run(timings, None, context, figures, memory, args.json)
    return 0


def _copy_with_grad(p: torch.Tensor) -> torch.Tensor:
    copy = p.detach().clone().requires_grad_()
    copy.grad = p.grad.clone()
    return copy


def _summarize(
    args: argparse.Namespace, slot_params: list[list[torch.Tensor]], seconds: dict[str, list[float]]
) -> dict[str, Any]:
    fused = Stat.of_times([s * 1e3 for s in seconds["fused"]])
    loop = Stat.of_times([s * 1e3 for s in seconds["per_slot_loop"]])
    speedup = Stat.of_rates(ratios(seconds["per_slot_loop"], seconds["fused"]))
    return {
        "slots": args.slots,
        "rank": args.rank,
        "tensors": sum(len(t) for t in slot_params),
        "params": sum(p.numel() for t in slot_params for p in t),
        "fused_ms": fused.median,
        "fused_ms_best": fused.best,
        "per_slot_loop_ms": loop.median,
        "per_slot_loop_ms_best": loop.best,
        "speedup": speedup.median,
        "speedup_best": speedup.best,
    }
