"""`bench train`: one fused multi-slot forward_backward against the naive PEFT loop, the one-slot pass and
the dense matmul rate, all in one process, interleaved round by round (docs/BENCHMARKS.md).

Each compared configuration is a zero-argument callable doing one training step's forward and backward
over the same tokens; `build_configuration` builds any one of them alone (the memory probe uses it).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch

from loraplex.bench import report
from loraplex.bench.baselines import NaivePeftLoop
from loraplex.bench.memory import own_peak_rss_mb, peak_gpu_mb, peak_rss_mb
from loraplex.bench.profile import profile_round
from loraplex.bench.ranks import BenchEngine, build_bench_engine, engine_ranks, local_part
from loraplex.bench.roofline import (
    DenseMatmul,
    attention_train_flops_per_token,
    matmul_params,
    train_flops_per_token,
)
from loraplex.bench.timing import Stat, ratios, time_interleaved
from loraplex.bench.workloads import TrainShape, make_slot_datums, prepare_model_dir, to_requests
from loraplex.engine.local import LocalEngine, resolve_device
from loraplex.engine.types import LoraConfig, PassRequest
from loraplex.errors import UserError
from loraplex.model.config import DecoderConfig

Run = Callable[[], object]

# The sweep grid (docs/BENCHMARKS.md issue #7 part 2).
SWEEP_TOKENS_PER_SLOT = (8, 32, 256)
SWEEP_SLOTS = (1, 8, 32)
SWEEP_RANKS = (1, 16, 64)
_WARMUP = 1


def run_dtype(device: torch.device) -> torch.dtype:
    """The dtype build_local_engine serves in on `device`: fp32 on CPU, bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def build_engine(model_dir: Path, device: torch.device, max_slots: int, max_rank: int) -> LocalEngine:
    """The engine `loraplex serve` would build over `model_dir` (build_local_engine), for benchmarks."""
    engine = build_bench_engine(model_dir, str(device), max_slots, max_rank)
    _check_dtype(engine, device)
    return engine


def _check_dtype(engine: LocalEngine, device: torch.device) -> None:
    if engine.decoder.lm_head.weight.dtype != run_dtype(device):
        raise RuntimeError("the engine's dtype differs from the one the baselines are built in")


def _pass_run(engine: BenchEngine, requests: list[PassRequest]) -> Run:
    def run() -> None:
        for result in engine.run_pass(requests):
            if isinstance(result, UserError):
                raise result

    return run


@dataclass
class EngineCase:
    """The fused K-slot pass and the one-slot pass over the same tokens, on fresh slots of one engine."""

    engine: BenchEngine
    slot_ids: list[int]
    fused: Run
    one_slot: Run

    @classmethod
    def open(cls, engine: BenchEngine, shape: TrainShape, vocab_size: int) -> EngineCase:
        """Create shape.slots + 1 fresh slots: K for the fused pass, one for the one-slot pass."""
        slot_datums = make_slot_datums(shape, vocab_size)
        slot_ids = [engine.create_slot(LoraConfig(rank=shape.rank, seed=k)) for k in range(shape.slots + 1)]
        fused = to_requests(slot_ids[:-1], slot_datums)
        one_slot = to_requests(slot_ids[-1:], [[d for datums in slot_datums for d in datums]])
        return cls(engine, slot_ids, _pass_run(engine, fused), _pass_run(engine, one_slot))

    def close(self) -> None:
        """Free the slots `open` created."""
        for slot in self.slot_ids:
            self.engine.free_slot(slot)


def _spec(engine: LocalEngine, model_dir: Path, shape: TrainShape) -> dict[str, Any]:
    """What a memory-probe subprocess needs to rebuild one configuration."""
    return {
        "model_dir": str(model_dir),
        "device": str(engine.decoder.lm_head.weight.device),
        "threads": torch.get_num_threads(),
        "logprob_chunk": engine.logprob_chunk,
        **asdict(shape),
    }


def build_configuration(kind: str, spec: dict[str, Any]) -> Run:
    """Build configuration `kind` ("fused", "one_slot" or "naive_peft") of `spec` alone, ready to call."""
    torch.set_num_threads(spec.pop("threads"))
    model_dir, device = Path(spec.pop("model_dir")), torch.device(spec.pop("device"))
    logprob_chunk = spec.pop("logprob_chunk")
    shape = TrainShape(**spec)
    config = DecoderConfig.from_hf(report.read_json(model_dir / "config.json"))
    if kind == "naive_peft":
        datums = make_slot_datums(shape, config.vocab_size)
        return NaivePeftLoop(model_dir, datums, shape.rank, device, run_dtype(device))
    engine = build_engine(model_dir, device, shape.slots + 1, shape.rank)
    engine.logprob_chunk = logprob_chunk
    case = EngineCase.open(engine, shape, config.vocab_size)
    return {"fused": case.fused, "one_slot": case.one_slot}[kind]


def _measure_point(
    engine: BenchEngine,
    model_dir: Path,
    config: DecoderConfig,
    shape: TrainShape,
    args: argparse.Namespace,
    rounds: int,
    has_memory: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time one workload point interleaved; (per-round rows, point summary)."""
    local = local_part(engine)
    device = local.decoder.lm_head.weight.device
    case = EngineCase.open(engine, shape, config.vocab_size)
    runs: dict[str, Run] = {"fused": case.fused, "one_slot": case.one_slot}
    if not args.skip_naive:
        datums = make_slot_datums(shape, config.vocab_size)
        runs["naive_peft"] = NaivePeftLoop(model_dir, datums, shape.rank, device, run_dtype(device))
    runs["matmul"] = matmul = DenseMatmul(device, run_dtype(device))
    try:
        timings = time_interleaved(runs, rounds, _WARMUP, device)
        memory = _memory(runs, local, model_dir, shape) if has_memory else {}
        profiled = profile_round(case.fused, device, args.profile, "train") if args.profile else {}
    finally:
        case.close()
    rows = report.round_rows(timings)
    summary = _summarize(
        config, shape, timings.seconds, matmul.flops, args.peak_tflops, local.logprob_chunk, args.nproc
    )
    summary.update(report.stall_summary(timings))
    return rows, {**summary, **memory, **profiled}


def _memory(
    runs: dict[str, Run], engine: LocalEngine, model_dir: Path, shape: TrainShape
) -> dict[str, float]:
    """Peak memory per compared configuration, each measured alone."""
    device = engine.decoder.lm_head.weight.device
    if device.type == "cuda":
        peak, extra = peak_gpu_mb(runs["fused"], device)
        return {"peak_gpu_mb": peak, "step_extra_gpu_mb": extra, "peak_rss_mb": own_peak_rss_mb()}
    memory = {"peak_rss_mb": peak_rss_mb("fused", _spec(engine, model_dir, shape))}
    if "naive_peft" in runs:
        memory["naive_peft_peak_rss_mb"] = peak_rss_mb("naive_peft", _spec(engine, model_dir, shape))
    return memory


def _summarize(
    config: DecoderConfig,
    shape: TrainShape,
    seconds: dict[str, list[float]],
    matmul_flops: float,
    peak_tflops: float | None,
    logprob_chunk: int,
    devices: int = 1,
) -> dict[str, Any]:
    """Medians and bests; every ratio taken round by round, then summarised. With several devices (engine
    ranks) the roofline and MFU are per device: the useful rate over all of them, each at the dense matmul
    rate measured on rank 0's."""
    tokens = shape.num_tokens
    fused_s = seconds["fused"]
    per_token = train_flops_per_token(config)
    attention = attention_train_flops_per_token(config, shape.seq_len)
    matmul_rate = [devices * matmul_flops / s for s in seconds["matmul"]]
    useful_rate = [tokens * per_token / s for s in fused_s]
    figures: dict[str, Stat] = {
        "tokens_per_s": Stat.of_rates([tokens / s for s in fused_s]),
        "one_slot_tokens_per_s": Stat.of_rates([tokens / s for s in seconds["one_slot"]]),
        "fusion_efficiency": Stat.of_rates(ratios(seconds["one_slot"], fused_s)),
        "dense_matmul_gflops": Stat.of_rates([r / devices / 1e9 for r in matmul_rate]),
        "useful_gflops": Stat.of_rates([r / 1e9 for r in useful_rate]),
        "roofline_fraction": Stat.of_rates(ratios(useful_rate, matmul_rate)),
        "roofline_fraction_with_attention": Stat.of_rates(
            [(tokens * (per_token + attention) / s) / m for s, m in zip(fused_s, matmul_rate, strict=True)]
        ),
        "step_s": Stat.of_times(fused_s),
    }
    if "naive_peft" in seconds:
        figures["naive_peft_tokens_per_s"] = Stat.of_rates([tokens / s for s in seconds["naive_peft"]])
        figures["speedup_vs_naive_peft"] = Stat.of_rates(ratios(seconds["naive_peft"], fused_s))
    if peak_tflops:
        figures["mfu"] = Stat.of_rates([r / (devices * peak_tflops * 1e12) for r in useful_rate])
    summary: dict[str, Any] = {
        **shape.summary_fields(),
        "matmul_params": matmul_params(config),
        "flops_per_token": per_token,
        "attention_flops_per_token": attention,
        "rounds": len(fused_s),
        "devices": devices,
        "peak_tflops": peak_tflops,
        "logprob_chunk": logprob_chunk,
    }
    return report.add_figures(summary, figures)


def bench_train(args: argparse.Namespace) -> int:
    """Entry point of `bench train` (one point, or the grid with --sweep); prints rows and the summary."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    points = _points(args)
    rounds = args.rounds or (2 if args.sweep else 5)
    has_memory = (not args.sweep) if args.memory is None else args.memory
    if args.nproc > 1 and not args.skip_naive:
        raise UserError(
            "--nproc > 1 measures the engine ranks alone: add --skip-naive (the PEFT loop is one device's)"
        )
    if args.profile and (args.sweep or args.nproc > 1):
        raise UserError("--profile records one point in this process: leave out --sweep and --nproc")
    if args.nproc > 1 and has_memory and device.type != "cuda":
        raise UserError(
            "--nproc > 1 on a CPU measures no memory (the probe rebuilds one rank): add --no-memory"
        )
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as scratch, contextlib.ExitStack() as ranks:
        model_dir = prepare_model_dir(args.model, Path(scratch), run_dtype(device), device)
        config = DecoderConfig.from_hf(report.read_json(model_dir / "config.json"))
        max_slots = max(p.slots for p in points) + 1
        engine = ranks.enter_context(
            engine_ranks(model_dir, str(device), max_slots, max(p.rank for p in points), args.nproc, args.tp)
        )
        local = local_part(engine)
        _check_dtype(local, device)
        local.logprob_chunk = args.logprob_chunk or local.logprob_chunk
        context = {**report.context(args, device, run_dtype(device), rounds, _WARMUP), "tp": args.tp}
        summaries = []
        for shape in points:
            rows, summary = _measure_point(engine, model_dir, config, shape, args, rounds, has_memory)
            summaries.append(summary)
            if args.sweep:
                report.emit_point({"kind": "sweep_point", **summary}, args.json)
            else:
                report.emit_rows(rows, shape.num_tokens, args.json)
        last = {"kind": "summary", **context, **(summaries[0] if not args.sweep else {"points": len(points)})}
        report.emit_summary(last, args.json)
    return 0


def _points(args: argparse.Namespace) -> list[TrainShape]:
    if not args.sweep:
        seq_len = args.seq_len or args.tokens_per_slot
        return [TrainShape(args.slots, args.tokens_per_slot, args.rank, seq_len)]
    return [
        TrainShape(slots, tokens, rank, args.seq_len or tokens)
        for rank, slots, tokens in product(SWEEP_RANKS, SWEEP_SLOTS, SWEEP_TOKENS_PER_SLOT)
    ]
