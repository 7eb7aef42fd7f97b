"""bench/gpu.sh and bench/gpu_moe.sh run end to end on the CPU (their documented dry run), with several
engine ranks: the plumbing a GPU run goes through (environment, flags, the ranks, the summary) works
before a GPU is lent. Timings are not checked; the summary's figures are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "model", "tp"), [("gpu.sh", "smoke", "2"), ("gpu_moe.sh", "smoke-moe", "2")]
)
def test_the_gpu_scripts_dry_run_on_the_cpu_with_two_engine_ranks(
    script: str, model: str, tp: str, tmp_path: Path
) -> None:
    out = tmp_path / "bench.jsonl"
    env = {
        **os.environ,
        "MODEL": model,
        "DEVICE": "cpu",
        "SLOTS": "2",
        "TOKENS_PER_SLOT": "8",
        "ROUNDS": "1",
        "NPROC": "2",
        "TP": tp,
        "PYTHON": sys.executable,
        "OUT": str(out),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [str(ROOT / "bench" / script), "--no-memory"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["devices"] == 2 and summary["tp"] == int(tp)
    assert summary["tokens_per_step"] == 16 and summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    assert "tokens/step on 2 device(s)" in done.stdout and "MFU at 4N per device" in done.stdout


def test_gpu_check_dry_runs_every_stage_on_the_cpu_and_prints_the_figures(tmp_path: Path) -> None:
    """bench/gpu_check.sh's documented dry run: the gpu tests are collected (and skipped, no CUDA here),
    both benchmarks run on the smoke shape, each stage's output is kept under the scratch directory given;
    with the packages the GPU machine lacks made unimportable (tests/device_image/sitecustomize.py)."""
    scratch = tmp_path / "scratch"
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "MODEL": "smoke",
        "SLOTS": "2",
        "TOKENS_PER_SLOT": "8",
        "ROUNDS": "1",
        "SAMPLE_SLOTS": "2",
        "PROMPTS_PER_SLOT": "2",
        "PROMPT_LEN": "8",
        "NEW_TOKENS": "4",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "tests" / "device_image"),
    }
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), str(scratch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("tests", "train", "sample"):
        assert f"# === {stage}: exit 0" in done.stderr
    assert "SKIPPED" in (scratch / "tests.out").read_text()  # the gpu tests ran into their skip, visibly
    assert "MFU at 4N" in done.stdout and "traffic bound" in done.stdout
    assert sorted(p.name for p in scratch.glob("*.out")) == ["sample.out", "tests.out", "train.out"]
    # One profiled step and round: their tables under SCRATCH/profile, their phases in the last lines.
    profiles = sorted(p.name for p in (scratch / "profile").iterdir())
    assert profiles == ["sample.ops.txt", "sample.trace.json", "train.ops.txt", "train.trace.json"]
    assert "train profile:" in done.stdout and "pass.forward" in done.stdout
    assert "sample profile:" in done.stdout and "sampler.decode_forward" in done.stdout


def test_gpu_check_refuses_a_call_without_its_scratch_directory() -> None:
    done = subprocess.run([str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage:" in done.stderr
