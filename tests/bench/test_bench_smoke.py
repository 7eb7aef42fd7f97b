"""`loraplex bench` runs end to end on a micro model and keeps its output contract (docs/BENCHMARKS.md).

Smoke tests only: one round, the `smoke` preset, one thread. They check what the output says and the
figures that do not depend on timing (FLOP counts, token counts, tensor counts); never a timing.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.bench import launcher, train
from loraplex.bench.chart import read_points, render_sweep, sweep_table
from loraplex.bench.cli import add_bench_parser, main

# The `smoke` preset by hand: per layer q 64·64 + k, v 64·32 each + o 64·64 + MLP 3·64·128, two layers,
# plus the lm_head 64·512; embeddings excluded.
SMOKE_MATMUL_PARAMS = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 512
# Two layers of seven targets plus the lm_head, an A and a B each.
SMOKE_TENSORS_PER_SLOT = 2 * (2 * 7 + 1)
TRAIN_SUMMARY_FIELDS = (
    "tokens_per_s",
    "naive_peft_tokens_per_s",
    "speedup_vs_naive_peft",
    "one_slot_tokens_per_s",
    "fusion_efficiency",
    "roofline_fraction",
    "peak_rss_mb",
)
OPTIM_SUMMARY_FIELDS = ("fused_ms", "per_slot_loop_ms", "speedup")
SAMPLE_SUMMARY_FIELDS = (
    "tokens_per_s",
    "hf_peft_tokens_per_s",
    "speedup_vs_hf_peft",
    "base_only_tokens_per_s",
    "peak_rss_mb",
    "hf_peft_peak_rss_mb",
)
API_SUMMARY_FIELDS = (
    "sdk_tokens_per_s",
    "engine_tokens_per_s",
    "api_efficiency",
    "server_peak_rss_mb",
)
# CPU seconds per step, counted in 10 ms ticks: a micro model's step may count none.
API_CPU_FIELDS = ("sdk_client_cpu_s", "sdk_server_cpu_s", "engine_cpu_s")
FAST = ["--model", "smoke", "--rounds", "1", "--threads", "1", "--device", "cpu", "--json"]


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """Run `python -m loraplex.bench` in-process; every stdout line must be one JSON object."""
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def assert_positive_numbers(summary: dict[str, Any], fields: tuple[str, ...]) -> None:
    for name in fields:
        value = summary[name]
        assert isinstance(value, float | int) and math.isfinite(value) and value > 0, (name, value)


def test_train_prints_one_row_per_round_and_configuration_then_a_summary_with_the_contract_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = run_json(["train", *FAST, "--slots", "2", "--tokens-per-slot", "6", "--rank", "4"], capsys)

    *rows, summary = lines
    assert [(r["kind"], r["round"], r["config"]) for r in rows] == [
        ("round", 0, config) for config in ("fused", "one_slot", "naive_peft", "matmul")
    ]
    assert summary["kind"] == "summary"
    assert_positive_numbers(summary, TRAIN_SUMMARY_FIELDS)
    assert summary["tokens_per_step"] == 2 * 6
    assert summary["matmul_params"] == SMOKE_MATMUL_PARAMS
    assert summary["flops_per_token"] == 4 * SMOKE_MATMUL_PARAMS
    assert summary["command"].startswith("loraplex bench train --model smoke")


def test_optim_compares_the_fused_step_with_the_per_slot_loop_over_the_same_tensors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    *rows, summary = run_json(["optim", *FAST, "--slots", "3", "--rank", "2"], capsys)

    assert [r["config"] for r in rows] == ["fused", "per_slot_loop"]
    assert summary["kind"] == "summary"
    assert_positive_numbers(summary, OPTIM_SUMMARY_FIELDS)
    assert summary["tensors"] == 3 * SMOKE_TENSORS_PER_SLOT


def test_sample_times_the_engine_with_adapters_the_base_model_and_hf_peft_on_the_same_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--slots", "2", "--prompts-per-slot", "3", "--prompt-len", "5", "--new-tokens", "4"]
    shape += ["--rank", "2", "--hbm-gbps", "100"]
    *rows, summary = run_json(["sample", *FAST, *shape], capsys)

    assert [r["config"] for r in rows] == ["engine", "base_only", "hf_peft"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert summary["kind"] == "summary"
    assert_positive_numbers(summary, SAMPLE_SUMMARY_FIELDS)
    assert math.isfinite(summary["lora_overhead"])  # a difference of timings: may be negative
    assert summary["generated_tokens"] == 2 * 3 * 4
    # The median sampler step against its traffic's bound at 100 GB/s.
    assert_positive_numbers(summary, ("decode_step_ms", "decode_bytes_per_step", "decode_bound_ms"))
    assert summary["decode_bound_ms"] == pytest.approx(1e3 * summary["decode_bytes_per_step"] / 100e9)
    assert summary["decode_step_over_bound"] == pytest.approx(
        summary["decode_step_ms"] / summary["decode_bound_ms"]
    )
    assert summary["command"].startswith("loraplex bench sample --model smoke")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[launcher.Server]:
    """The servers a benchmark starts, in order (to check that it stops them)."""
    servers: list[launcher.Server] = []
    real_wait = launcher._wait_healthy

    def record(server: launcher.Server, timeout_s: float) -> None:
        servers.append(server)
        real_wait(server, timeout_s)

    monkeypatch.setattr(launcher, "_wait_healthy", record)
    return servers


def test_api_sends_the_train_workload_through_the_sdk_and_stops_its_server(
    capsys: pytest.CaptureFixture[str], started: list[launcher.Server]
) -> None:
    *rows, summary = run_json(["api", *FAST, "--slots", "2", "--tokens-per-slot", "6", "--rank", "2"], capsys)

    assert [r["config"] for r in rows] == ["sdk", "engine"]
    assert summary["kind"] == "summary"
    assert_positive_numbers(summary, API_SUMMARY_FIELDS)
    assert all(math.isfinite(summary[name]) and summary[name] >= 0 for name in API_CPU_FIELDS)
    assert all("process_cpu_s" in row and "server_cpu_s" in row for row in rows)
    assert summary["tokens_per_step"] == 2 * 6
    assert [server.proc.poll() is not None for server in started] == [True]


def test_residency_trains_on_a_slot_per_run_the_host_tier_and_disk_and_stops_every_server(
    capsys: pytest.CaptureFixture[str], started: list[launcher.Server]
) -> None:
    argv = ["residency", *FAST, "--slots", "4", "--tokens-per-slot", "6", "--rank", "2"]
    *rows, summary = run_json(argv, capsys)

    assert [r["config"] for r in rows] == ["slot_per_run", "host_tier", "disk_only"]
    assert all(r["tokens_per_s"] == 4 * 6 / r["seconds"] for r in rows)
    assert_positive_numbers(summary, ("residency_ratio", "disk_ratio", "host_tier_tokens_per_s"))
    assert (summary["runs"], summary["tokens_per_step"]) == (4, 4 * 6)
    # Four runs on two slots take turns each step (warm-up and round): through host memory, or disk.
    assert summary["slot_per_run_parks_to_host"] == summary["slot_per_run_parks_to_disk"] == 0
    assert summary["host_tier_parks_to_disk"] == 0 and summary["host_tier_parks_to_host"] >= 4
    assert summary["disk_only_parks_to_host"] == 0 and summary["disk_only_parks_to_disk"] >= 4
    assert [server.proc.poll() is not None for server in started] == [True, True, True]


def test_sweep_prints_one_point_per_grid_cell_and_the_chart_draws_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(train, "SWEEP_TOKENS_PER_SLOT", (2, 4))
    monkeypatch.setattr(train, "SWEEP_SLOTS", (1, 2))
    monkeypatch.setattr(train, "SWEEP_RANKS", (1,))
    lines = run_json(["train", *FAST, "--sweep", "--skip-naive"], capsys)

    *points, summary = lines
    assert [(p["kind"], p["slots"], p["tokens_per_slot"]) for p in points] == [
        ("sweep_point", slots, tokens) for slots in (1, 2) for tokens in (2, 4)
    ]
    assert summary == {**summary, "kind": "summary", "points": 4}
    jsonl = tmp_path / "sweep.jsonl"
    jsonl.write_text("\n".join(json.dumps(line) for line in lines))
    png = render_sweep(read_points(jsonl), "smoke sweep")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png.endswith(b"IEND\xaeB`\x82")
    table = sweep_table(read_points(jsonl)).splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| 1 | 1 | 2 |")


def test_bench_registers_on_the_loraplex_command_with_the_contract_flags() -> None:
    parser = argparse.ArgumentParser(prog="loraplex")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    flags = ["--slots", "3", "--tokens-per-slot", "16", "--rank", "8", "--rounds", "2"]
    flags += ["--model", "smoke", "--device", "cpu", "--json"]
    args = parser.parse_args(["bench", "train", *flags])

    assert (args.slots, args.tokens_per_slot, args.rank, args.rounds, args.model) == (3, 16, 8, 2, "smoke")
    assert args.json and args.device == "cpu" and callable(args.handler)
    optim = parser.parse_args(["bench", "optim"])
    assert (optim.slots, optim.rank) == (64, 16)
    sample = parser.parse_args(["bench", "sample"])
    assert (sample.slots, sample.prompts_per_slot, sample.new_tokens) == (8, 8, 64)
    api = parser.parse_args(["bench", "api", *flags])
    assert (api.slots, api.tokens_per_slot, api.rank, api.model) == (3, 16, 8, "smoke")
    assert callable(api.handler)
    residency = parser.parse_args(["bench", "residency", *flags])
    assert (residency.slots, residency.tokens_per_slot, residency.rank) == (3, 16, 8)
    assert callable(residency.handler) and residency.server_timeout_s == 300.0


def test_profile_runs_one_more_step_and_round_and_names_the_engines_phases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--profile DIR`: one more fused pass (train) or sampling round (sample) under torch.profiler, its
    timeline and op tables under DIR, and each phase's calls in the summary; the timed figures are the
    timed rounds' alone."""
    train_args = ["train", *FAST, "--slots", "2", "--tokens-per-slot", "6", "--skip-naive"]
    *_, summary = run_json([*train_args, "--profile", str(tmp_path)], capsys)
    calls = {name: phase["calls"] for name, phase in summary["profile_phases"].items()}
    assert calls == dict.fromkeys(
        ["pass.inputs", "pass.forward", "pass.head_and_loss", "pass.backward", "pass.read_back"], 1
    )
    assert summary["profile_wall_s"] > 0 and "profile_device_busy" not in summary  # no CUDA timeline here

    shape = ["--slots", "2", "--prompts-per-slot", "3", "--prompt-len", "5", "--new-tokens", "4"]
    *_, summary = run_json(
        ["sample", *FAST, *shape, "--skip-hf", "--no-memory", "--profile", str(tmp_path)], capsys
    )
    calls = {name: phase["calls"] for name, phase in summary["profile_phases"].items()}
    # 3 steps: the first admits and prefills every prompt (drawing each first token), then decodes as the
    # next two do: 4 draws, 3 decode forwards. Each step admits (nothing after the first).
    assert calls == {
        "sampler.admit": 3,
        "sampler.prefill": 1,
        "sampler.draw": 4,
        "sampler.read_back": 4,
        "sampler.decode_inputs": 3,
        "sampler.decode_forward": 3,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sample.ops.txt",
        "sample.trace.json",
        "train.ops.txt",
        "train.trace.json",
    ]
    table = (tmp_path / "sample.ops.txt").read_text()
    assert "sampler.decode_forward" in table and "ops by self_cpu_time_total:" in table
    assert json.loads((tmp_path / "train.trace.json").read_text())["traceEvents"]


def test_profile_refuses_a_sweep_it_would_not_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["train", *FAST, "--sweep", "--profile", str(tmp_path)]) == 2
    assert "--profile records one point in this process" in capsys.readouterr().err
    assert not tmp_path.joinpath("train.ops.txt").exists()
