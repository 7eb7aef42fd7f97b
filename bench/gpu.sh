#!/usr/bin/env bash
# Training throughput on GPUs: `loraplex bench train` on a random-init Qwen3-4B-shaped model in bf16,
# SLOTS x TOKENS_PER_SLOT tokens per step (16 x 1024 = 16384 by default), then MFU at 4N against the
# device's dense bf16 peak (docs/BENCHMARKS.md: H200 989 TFLOP/s; target >= 40%, stretch 50%). With
# NPROC > 1 the step runs on NPROC engine ranks as `loraplex serve --nproc NPROC --tp TP` runs them (one
# GPU each; TP ranks per group split the base), and MFU is per GPU.
#
# Usage, from anywhere: bench/gpu.sh [more `bench train` flags, e.g. --seq-len 512]
# Environment (defaults): MODEL (qwen3-4b-shape), DEVICE (cuda), SLOTS (16), TOKENS_PER_SLOT (1024),
#   RANK (16), ROUNDS (5), PEAK_TFLOPS (989), NPROC (1), TP (1), NAIVE (0; 1 adds the HF + PEFT
#   baseline, one GPU only, ~+10 GB and minutes), PYTHON (.venv/bin/python if it exists, else python3),
#   OUT (JSON lines; default a temp file).
# Needs torch with CUDA, safetensors, tokenizers, numpy (+ transformers, peft with NAIVE=1).
# Memory: ~170 KB of saved activations per token per layer in bf16 (36 layers: ~100 GB at 16k tokens)
# plus 8 GB of weights; fits an H200 (141 GB), not an 80 GB card (use TOKENS_PER_SLOT=512 there).
# Dry run of the plumbing on a CPU (tests/test_gpu_scripts.py runs it):
#   MODEL=smoke DEVICE=cpu SLOTS=2 TOKENS_PER_SLOT=8 ROUNDS=1 NPROC=2 TP=2 bench/gpu.sh --no-memory
# The MoE variant (a Qwen3-30B-A3B-shaped model) is bench/gpu_moe.sh.
# SAMPLE=1 then runs the sampling comparison on the same shape: `bench sample --sampler vllm`, the built-in
# sampler against a vLLM server (VLLM_PYTHON, default .venv-vllm/bin/python: `make vllm` builds it) and,
# with NAIVE=1, HF + PEFT, on the same snapshots: SAMPLE_SLOTS snapshots x SAMPLE_PROMPTS prompts of up to
# SAMPLE_PROMPT_LEN tokens, SAMPLE_NEW_TOKENS each (defaults 16 x 8 x 1024 x 128), of SAMPLE_MODEL (default
# MODEL; the CPU dry run samples tiny-qwen3-bench: vLLM's CPU build answers 500 on smoke's shape),
# JSON lines to OUT_SAMPLE.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-qwen3-4b-shape}
DEVICE=${DEVICE:-cuda}
SLOTS=${SLOTS:-16}
TOKENS_PER_SLOT=${TOKENS_PER_SLOT:-1024}
RANK=${RANK:-16}
ROUNDS=${ROUNDS:-5}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
NAIVE=${NAIVE:-0}
NPROC=${NPROC:-1}
TP=${TP:-1}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-$(mktemp -t loraplex-gpu-bench.XXXXXX.jsonl)}
SAMPLE=${SAMPLE:-0}

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# Fewer fragmentation OOMs for the ~100 GB of activations of one step.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

args=(train --model "$MODEL" --device "$DEVICE" --slots "$SLOTS" --tokens-per-slot "$TOKENS_PER_SLOT"
  --rank "$RANK" --rounds "$ROUNDS" --peak-tflops "$PEAK_TFLOPS" --nproc "$NPROC" --tp "$TP" --json)
if [[ "$NAIVE" != 1 ]]; then args+=(--skip-naive); fi

echo "# $PYTHON -m loraplex.bench ${args[*]} $*  (JSON lines -> $OUT)" >&2
"$PYTHON" -m loraplex.bench "${args[@]}" "$@" | tee "$OUT"

"$PYTHON" - "$OUT" <<'PY'
import json
import sys

s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
if "peak_gpu_mb" in s:
    memory = f"{s['peak_gpu_mb'] / 1024:.1f} GiB on rank 0's GPU"
else:
    memory = f"{s['peak_rss_mb']:.0f} MB RSS" if "peak_rss_mb" in s else "not measured"
print(f"\n{s['device_name']}, {s['dtype']}, {s['tokens_per_step']} tokens/step on {s['devices']} device(s): "
      f"{s['tokens_per_s']:.0f} tokens/s median, {s['tokens_per_s_best']:.0f} best")
print(f"MFU at 4N per device ({s['flops_per_token'] / 1e9:.2f} GFLOP/token, peak {s['peak_tflops']:g} TFLOP/s): "
      f"{s['mfu']:.1%} median, {s['mfu_best']:.1%} best")
print(f"measured dense matmul {s['dense_matmul_gflops'] / 1e3:.1f} TFLOP/s -> roofline fraction "
      f"{s['roofline_fraction']:.1%}; attention adds {s['attention_flops_per_token'] / 1e9:.2f} GFLOP/token; "
      f"peak memory {memory}")
PY

if [[ "$SAMPLE" == 1 ]]; then
  OUT_SAMPLE=${OUT_SAMPLE:-$(mktemp -t loraplex-gpu-sample.XXXXXX.jsonl)}
  sample_args=(sample --model "${SAMPLE_MODEL:-$MODEL}" --device "$DEVICE" --slots "${SAMPLE_SLOTS:-16}"
    --prompts-per-slot "${SAMPLE_PROMPTS:-8}" --prompt-len "${SAMPLE_PROMPT_LEN:-1024}"
    --new-tokens "${SAMPLE_NEW_TOKENS:-128}" --rank "$RANK" --rounds "$ROUNDS" --sampler vllm
    --vllm-python "${VLLM_PYTHON:-.venv-vllm/bin/python}" --no-memory --json)
  if [[ "$NAIVE" != 1 ]]; then sample_args+=(--skip-hf); fi
  echo "# $PYTHON -m loraplex.bench ${sample_args[*]}  (JSON lines -> $OUT_SAMPLE)" >&2
  "$PYTHON" -m loraplex.bench "${sample_args[@]}" | tee "$OUT_SAMPLE"
  "$PYTHON" - "$OUT_SAMPLE" <<'PY'
import json
import sys

s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
line = f"\nsampling, {s['generated_tokens']} tokens a round: built-in {s['tokens_per_s']:.0f} tokens/s"
for baseline, name in (("vllm", "vLLM"), ("hf_peft", "HF + PEFT")):
    if f"{baseline}_tokens_per_s" in s:
        line += f", {name} {s[baseline + '_tokens_per_s']:.0f} ({s['speedup_vs_' + baseline]:.2f}x built-in over it)"
print(line)
PY
fi
