"""`bench api`: the `bench train` workload (K runs × tokens, cross_entropy forward_backward + optim_step
per round) sent through the official `tinker` SDK over HTTP to a `loraplex serve` subprocess, against the
same calls made directly on a `LocalEngine` in this process, interleaved round by round (docs/BENCHMARKS.md).

Both sides load the same model directory, train K fresh rank-R slots on the same token arrays and step
AdamW with the same parameters; the SDK side submits every run's forward_backward, then every run's
optim_step, back to back (as the Tinker cookbook does) and waits for all of them. The server is started
by the bench on 127.0.0.1 and always stopped. api_efficiency = direct seconds ÷ SDK seconds, per round.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.bench import report
from loraplex.bench.launcher import serve
from loraplex.bench.memory import own_peak_rss_mb
from loraplex.bench.timing import Stat, Timings, ratios, time_interleaved
from loraplex.bench.train import build_engine, run_dtype
from loraplex.bench.workloads import TrainShape, make_slot_datums, prepare_model_dir, to_requests
from loraplex.engine.local import LocalEngine, resolve_device
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig
from loraplex.errors import UserError
from loraplex.runtime.observability.telemetry import ENGINE_THREAD_STATES

Run = Callable[[], object]

_WARMUP = 1
_LEARNING_RATE = 1e-4
_LOSS = "cross_entropy"
ENGINE, DURABLE, HELD, _IDLE, OTHER = ENGINE_THREAD_STATES
ENGINE_THREAD_PROBE = "engine_thread"  # the CPU probe reporting the engine thread's seconds by state


class DirectSteps:
    """One training step of K slots as direct engine calls: a fused run_pass, then one optim_step."""

    def __init__(self, engine: LocalEngine, shape: TrainShape, slot_datums: list[list[DatumInput]]) -> None:
        self.engine = engine
        self.slot_ids = [engine.create_slot(LoraConfig(rank=shape.rank, seed=k)) for k in range(shape.slots)]
        self.requests = to_requests(self.slot_ids, slot_datums)
        self.steps = dict.fromkeys(self.slot_ids, AdamParams(learning_rate=_LEARNING_RATE))

    def __call__(self) -> None:
        for result in self.engine.run_pass(self.requests):
            if isinstance(result, UserError):
                raise result
        self.engine.optim_step(self.steps)


class SdkSteps:
    """One training step of K runs through the tinker SDK: every forward_backward, every optim_step,
    submitted back to back, then every result awaited."""

    def __init__(
        self, base_url: str, base_model: str, shape: TrainShape, slot_datums: list[list[DatumInput]]
    ) -> None:
        import tinker  # the SDK is a client dependency; only this configuration needs it
        from tinker import types

        service = self.service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        self.runs = [
            service.create_lora_training_client(base_model=base_model, rank=shape.rank, seed=k).result()
            for k in range(shape.slots)
        ]
        self.batches = [
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(d.tokens.tolist()), loss_fn_inputs=d.loss_fn_inputs
                )
                for d in datums
            ]
            for datums in slot_datums
        ]
        self.params = types.AdamParams(learning_rate=_LEARNING_RATE)

    def close(self) -> None:
        """Finish the SDK session while the server still runs (else its heartbeats fail until exit)."""
        self.service.close("success").result(timeout=30)

    def __call__(self) -> None:
        passes = [
            run.forward_backward(batch, _LOSS) for run, batch in zip(self.runs, self.batches, strict=True)
        ]
        steps = [run.optim_step(self.params) for run in self.runs]
        for future in passes + steps:
            future.result()


def _summarize(shape: TrainShape, timings: Timings) -> dict[str, Any]:
    """Medians and bests; the ratio taken round by round, then summarised. The CPU figures say where an
    SDK step's time goes: this process runs the SDK client during the sdk rounds (and the engine during
    the engine rounds), on the same cores as the server."""
    tokens, seconds, cpu = shape.num_tokens, timings.seconds, timings.cpu
    figures = {
        "sdk_tokens_per_s": Stat.of_rates([tokens / s for s in seconds["sdk"]]),
        "engine_tokens_per_s": Stat.of_rates([tokens / s for s in seconds["engine"]]),
        "api_efficiency": Stat.of_rates(ratios(seconds["engine"], seconds["sdk"])),
        "sdk_step_s": Stat.of_times(seconds["sdk"]),
        "engine_step_s": Stat.of_times(seconds["engine"]),
        "engine_cpu_s": Stat.of_times(cpu["process"]["engine"]),
        "sdk_client_cpu_s": Stat.of_times(cpu["process"]["sdk"]),
        "sdk_server_cpu_s": Stat.of_times(cpu["server"]["sdk"]),
        **_engine_thread_figures(timings),
    }
    for key, rounds in cpu.items():  # the server's CPU by thread during the SDK rounds
        if key.startswith("server_threads:"):
            figures[f"sdk_server_cpu_s_{key.split(':', 1)[1]}"] = Stat.of_times(rounds["sdk"])
    summary: dict[str, Any] = shape.summary_fields()
    return report.add_figures(summary, figures)


def _engine_thread_figures(timings: Timings) -> dict[str, Stat]:
    """The server's engine thread during the SDK rounds: its duty cycle (engine ÷ (engine + durable +
    other), docs/METRICS.md) and each working state's share of the round's wall time. Idle has no share:
    the thread reports a state when its loop cycle ends, so an idle wait that began before a round is
    counted in it."""
    spent = {
        key.split(":", 1)[1]: rounds["sdk"]
        for key, rounds in timings.cpu.items()
        if key.startswith(f"{ENGINE_THREAD_PROBE}:")
    }
    if not spent:
        return {}
    rounds = range(len(timings.seconds["sdk"]))
    working = [spent[ENGINE][r] + spent[DURABLE][r] + spent[OTHER][r] for r in rounds]
    figures = {"engine_duty_cycle": Stat.of_rates(ratios(spent[ENGINE], working))}
    for state in (ENGINE, DURABLE, HELD, OTHER):
        figures[f"engine_thread_{state}_share"] = Stat.of_rates(ratios(spent[state], timings.seconds["sdk"]))
    return figures


@dataclass(frozen=True)
class SdkWorkload:
    """What `bench api` and `bench residency` share: the device, the rounds, one run's shape and datums of
    each of `shape.slots` runs, and the model the servers load."""

    device: torch.device
    rounds: int
    shape: TrainShape
    model_dir: Path
    slot_datums: list[list[DatumInput]]

    @classmethod
    def prepare(cls, args: argparse.Namespace, scratch: Path) -> SdkWorkload:
        """The workload `args` ask for, its model written under `scratch`."""
        if args.threads:
            torch.set_num_threads(args.threads)
        os.environ.setdefault("TINKER_TELEMETRY", "0")
        device = resolve_device(args.device)
        shape = TrainShape(args.slots, args.tokens_per_slot, args.rank, args.tokens_per_slot)
        model_dir = prepare_model_dir(args.model, scratch, run_dtype(device), device)
        vocab_size = int(report.read_json(model_dir / "config.json")["vocab_size"])
        return cls(device, args.rounds or 5, shape, model_dir, make_slot_datums(shape, vocab_size))

    def serve_args(self) -> list[str]:
        """The `loraplex serve` options of the model (slots not included)."""
        model = ["--model", str(self.model_dir), "--model-name", self.model_dir.name]
        return [*model, "--device", self.device.type, "--max-rank", str(self.shape.rank)]

    def client(self, base_url: str) -> SdkSteps:
        """An SDK client of the server at `base_url` that trains every run of the workload a step a call."""
        return SdkSteps(base_url, self.model_dir.name, self.shape, self.slot_datums)


def bench_api(args: argparse.Namespace) -> int:
    """Entry point of `bench api`: starts the server, prints per-round rows and the summary, stops it."""
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as scratch:
        work = SdkWorkload.prepare(args, Path(scratch))
        shape = work.shape
        serve_args = [*work.serve_args(), "--max-slots", str(shape.slots)]
        threads = torch.get_num_threads()
        with serve(serve_args, Path(scratch) / "data", threads, args.server_timeout_s) as server:
            engine = build_engine(work.model_dir, work.device, shape.slots, shape.rank)
            sdk = work.client(server.base_url)
            runs: dict[str, Run] = {"sdk": sdk, "engine": DirectSteps(engine, shape, work.slot_datums)}
            probes = {
                "server": server.cpu_seconds,
                "server_threads": server.thread_cpu_seconds,
                ENGINE_THREAD_PROBE: server.engine_thread_seconds,
            }
            timings = time_interleaved(runs, work.rounds, _WARMUP, work.device, probes)
            sdk.close()
            # Each side alone: the server's own process, and this one (the direct engine and the SDK client).
            memory = {"server_peak_rss_mb": server.peak_rss_mb(), "process_peak_rss_mb": own_peak_rss_mb()}
        context = report.context(args, work.device, run_dtype(work.device), work.rounds, _WARMUP)
    report.emit_run(timings, shape.num_tokens, context, _summarize(shape, timings), memory, args.json)
    return 0
