"""bench/gpu.sh's sampling comparison (SAMPLE=1: `bench sample --sampler vllm`) dry-run on the CPU with a
tiny shape, as the day a GPU is lent will run it on the 4B shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.vllm.conftest import REPO, vllm_python


def test_gpu_sh_samples_on_vllm_beside_the_builtin_sampler_in_the_same_rounds(tmp_path: Path) -> None:
    out, out_sample = tmp_path / "train.jsonl", tmp_path / "sample.jsonl"
    env = {
        **os.environ,
        "MODEL": "smoke",
        "DEVICE": "cpu",
        "SLOTS": "2",
        "TOKENS_PER_SLOT": "8",
        "ROUNDS": "1",
        "PYTHON": sys.executable,
        "OUT": str(out),
        "SAMPLE": "1",
        "SAMPLE_MODEL": "tiny-qwen3-bench",  # vLLM's CPU build answers 500 on smoke's shape
        "SAMPLE_SLOTS": "2",
        "SAMPLE_PROMPTS": "2",
        "SAMPLE_PROMPT_LEN": "16",
        "SAMPLE_NEW_TOKENS": "8",
        "VLLM_PYTHON": str(vllm_python()),
        "OUT_SAMPLE": str(out_sample),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    done = subprocess.run(
        [str(REPO / "bench" / "gpu.sh"), "--no-memory"], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out_sample.read_text().splitlines()[-1])
    assert summary["generated_tokens"] == 2 * 2 * 8 and summary["rounds"] == 1
    assert summary["tokens_per_s"] > 0 and summary["vllm_tokens_per_s"] > 0 and summary["speedup_vs_vllm"] > 0
    assert "hf_peft_tokens_per_s" not in summary  # NAIVE=1 adds it
    assert "sampling, 32 tokens a round: built-in" in done.stdout and ", vLLM " in done.stdout
