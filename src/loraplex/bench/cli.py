"""Argument parsing of `loraplex bench train|optim|sample|api|residency`, and dispatch to the subcommand's
entry point.

`add_bench_parser` registers `bench` on the `loraplex` command's subparsers; `main` serves
`python -m loraplex.bench`. Both set `handler=` on the parsed namespace, as loraplex.cli expects.
The measuring modules (torch, transformers, peft) are imported only when a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from loraplex.bench.presets import PRESETS
from loraplex.errors import UserError


def _common(parser: argparse.ArgumentParser, slots: int) -> None:
    """Flags every bench subcommand takes (docs/BENCHMARKS.md's contract)."""
    parser.add_argument("--slots", type=int, default=slots, help=f"adapter slots (default: {slots})")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every slot (default: 16)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds after one warm-up round (default: 5)"
    )
    parser.add_argument(
        "--model",
        default="tiny-qwen3-bench",
        help=f"a preset written with random weights ({', '.join(PRESETS)}) or an HF model directory "
        "(default: tiny-qwen3-bench)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line, the summary last")


def _handler(subcommand: str) -> Callable[[argparse.Namespace], int]:
    """The entry point `bench_<subcommand>` of `loraplex.bench.<subcommand>`, imported when it runs.

    Every configuration measured (baselines included) runs with the host allocator the server uses."""

    def run(args: argparse.Namespace) -> int:
        from loraplex.engine.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
        module = importlib.import_module(f"loraplex.bench.{subcommand}")
        return getattr(module, f"bench_{subcommand}")(args)

    return run


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    """`train`, `optim`, `sample`, `api` and `residency` under `parser`."""
    subcommands = parser.add_subparsers(dest="bench_command", required=True)
    train = subcommands.add_parser(
        "train", help="Fused multi-slot forward_backward vs the naive PEFT loop and the one-slot pass."
    )
    _common(train, slots=8)
    train.add_argument(
        "--tokens-per-slot", type=int, default=32, help="tokens per slot per step (default: 32)"
    )
    train.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: one sequence per slot)"
    )
    train.add_argument(
        "--sweep",
        action="store_true",
        help="tokens per slot (8, 32, 256) x slots (1, 8, 32) x rank (1, 16, 64); 2 rounds unless --rounds",
    )
    train.add_argument(
        "--logprob-chunk", type=int, default=None, help="lm_head tokens per chunk (default: the engine's)"
    )
    train.add_argument("--skip-naive", action="store_true", help="leave out the naive PEFT baseline")
    train.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure peak memory of each configuration alone (default: on, off for --sweep)",
    )
    train.add_argument(
        "--peak-tflops", type=float, default=None, help="device's nominal dense peak, to report MFU at 4N"
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="engine ranks, as `serve --nproc` runs them (one GPU each); MFU and roofline per device",
    )
    train.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per group, as `serve --tp`")
    _profile_option(train, "the fused pass")
    train.set_defaults(handler=_handler("train"))
    optim = subcommands.add_parser("optim", help="Fused multi-slot AdamW step vs a per-slot AdamW loop.")
    _common(optim, slots=64)
    optim.set_defaults(handler=_handler("optim"))
    sample = subcommands.add_parser(
        "sample",
        help="Multi-snapshot batched sampling vs HF generate + PEFT per adapter, and vs the base model.",
    )
    _common(sample, slots=8)
    sample.add_argument("--prompts-per-slot", type=int, default=8, help="prompts per snapshot (default: 8)")
    sample.add_argument(
        "--prompt-len", type=int, default=32, help="longest prompt; lengths vary down to half (default: 32)"
    )
    sample.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)"
    )
    sample.add_argument("--skip-hf", action="store_true", help="leave out the HF generate + PEFT baseline")
    sample.add_argument(
        "--sampler",
        choices=("loraplex", "vllm"),
        default="loraplex",
        help="vllm: also sample on a vLLM server (`serve --sampler vllm`), same rounds (default: loraplex)",
    )
    sample.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(".venv-vllm/bin/python"),
        help="--sampler vllm: the python of an environment with vLLM (default: .venv-vllm/bin/python)",
    )
    sample.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="device memory bandwidth in GB/s, to compare a decode step with its traffic's bound",
    )
    sample.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure peak memory of each configuration alone (default: on)",
    )
    _profile_option(sample, "the engine's sampling round")
    sample.set_defaults(handler=_handler("sample"))
    api = subcommands.add_parser(
        "api", help="The train workload through the tinker SDK over HTTP vs direct engine calls."
    )
    _common(api, slots=8)
    _server_options(api)
    api.set_defaults(handler=_handler("api"))
    residency = subcommands.add_parser(
        "residency",
        help="More runs than slots (--slots runs on half as many slots, host tier vs disk only) against a "
        "slot per run, through the tinker SDK.",
    )
    _common(residency, slots=8)
    _server_options(residency)
    residency.set_defaults(handler=_handler("residency"))


def _profile_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"after the timed rounds, run {what} once more under torch.profiler and write its timeline "
        "and op tables under DIR (bench/profile.py)",
    )


def _server_options(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommands that train through a `loraplex serve` subprocess."""
    parser.add_argument(
        "--tokens-per-slot", type=int, default=32, help="tokens per slot per step (default: 32)"
    )
    parser.add_argument(
        "--server-timeout-s",
        type=float,
        default=300.0,
        help="longest wait for the server to start (default: 300)",
    )


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` (with `train` and `optim`) on the `loraplex` command's subparsers."""
    bench = subparsers.add_parser(
        "bench", help="Measure throughput against the baselines (docs/BENCHMARKS.md)."
    )
    _add_subcommands(bench)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m loraplex.bench`."""
    parser = argparse.ArgumentParser(
        prog="loraplex bench", description="Measure loraplex against the baselines of docs/BENCHMARKS.md."
    )
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
