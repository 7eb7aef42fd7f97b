#!/usr/bin/env bash
# The first thing to run the day a GPU is lent, in under 8 minutes of device time, with the machine's own
# python3 and torch (no project venv: the engine needs torch, numpy, safetensors, tokenizers, httpx,
# huggingface_hub and prometheus_client; the tests need pytest, transformers and peft):
#   1. tests: the engine's CUDA correctness tests, `pytest -m gpu` (bf16 parity, fp32 logits, sync-free
#      decode under torch.cuda.set_sync_debug_mode("error"), bit-for-bit repeats under --deterministic,
#      decode graph replays), one process per test file;
#   2. train: `bench train` on the Qwen3-4B shape, SLOTS x TOKENS_PER_SLOT tokens per step, MFU at 4N;
#   3. sample: `bench sample` on the same shape, tokens/s and the median decode step against the bound
#      its memory traffic sets at HBM_GBPS (docs/BENCHMARKS.md, "The paper model").
# Each benchmark then runs one more step (train) or round (sample) under torch.profiler and writes its
# timeline and op tables under PROFILE (bench/profile.py): copy PROFILE/*.ops.txt off the machine, they
# say where the time went (the engine's phases, the ops by device and host time, kernel and graph launches).
# Each stage has its own time limit, so one that hangs cannot eat the others' time; the exit status is
# the first failing stage's. Every large file (the random 4B weights, about 8 GB; pytest's and the
# benchmarks' temporary files) goes under SCRATCH.
#
# Usage, from anywhere: bench/gpu_check.sh SCRATCH
# Environment (defaults): PYTHON (python3), STAGES ("tests train sample"), MODEL (qwen3-4b-shape),
#   SLOTS (16), TOKENS_PER_SLOT (1024), ROUNDS (3), PEAK_TFLOPS (989: H200 dense bf16), HBM_GBPS (4800),
#   SAMPLE_SLOTS (16), PROMPTS_PER_SLOT (8), PROMPT_LEN (1024), NEW_TOKENS (64), DEVICE (cuda),
#   TESTS_TIMEOUT_S (180), TRAIN_TIMEOUT_S (150), SAMPLE_TIMEOUT_S (150), PROFILE (SCRATCH/profile; empty:
#   no profiled round).
# Dry run of the plumbing on a CPU (tests/test_gpu_scripts.py runs it; the gpu tests are then skipped):
#   DEVICE=cpu MODEL=smoke SLOTS=2 TOKENS_PER_SLOT=8 ROUNDS=1 SAMPLE_SLOTS=2 PROMPTS_PER_SLOT=2 \
#     PROMPT_LEN=8 NEW_TOKENS=4 bench/gpu_check.sh /tmp/scratch
set -uo pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: $0 SCRATCH  (a directory with ~20 GB free for the weights and temporary files)" >&2
  exit 2
fi
SCRATCH=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
STAGES=${STAGES:-tests train sample}
MODEL=${MODEL:-qwen3-4b-shape}
DEVICE=${DEVICE:-cuda}
SLOTS=${SLOTS:-16}
TOKENS_PER_SLOT=${TOKENS_PER_SLOT:-1024}
ROUNDS=${ROUNDS:-3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
HBM_GBPS=${HBM_GBPS:-4800}
SAMPLE_SLOTS=${SAMPLE_SLOTS:-16}
PROMPTS_PER_SLOT=${PROMPTS_PER_SLOT:-8}
PROMPT_LEN=${PROMPT_LEN:-1024}
NEW_TOKENS=${NEW_TOKENS:-64}
PROFILE=${PROFILE-$SCRATCH/profile}
profile=()
if [[ -n $PROFILE ]]; then profile=(--profile "$PROFILE"); fi

export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TMPDIR="$SCRATCH" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# The weights' and tokenizer's Hub cache, if anything asks for one: under SCRATCH, never the user's.
export HF_HOME="$SCRATCH/hf-home"

status=0
stage() {  # stage NAME TIMEOUT_S COMMAND...: run it within its limit, report, keep the first failure
  local name=$1 limit=$2 started=$SECONDS rc
  shift 2
  echo "# === $name (limit ${limit}s): $*" >&2
  timeout --signal=TERM --kill-after=10 "$limit" "$@" | tee "$SCRATCH/$name.out"
  rc=$?
  echo "# === $name: exit $rc after $((SECONDS - started)) s" >&2
  if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
}

"$PYTHON" -c 'import torch; print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"))' >&2

for name in $STAGES; do
  case $name in
    tests)
      # One process per test file: a kernel fault (a misaligned address, say) poisons the CUDA context
      # of its process, and would fail every later test of a shared one. Without CUDA (the dry run) there
      # is no context to poison, and one process collects them all at the cost of one start-up.
      stage tests "${TESTS_TIMEOUT_S:-180}" bash -c 'rc=0
        files=$(grep -l "pytest.mark.gpu" tests/model/test_*.py tests/engine/test_*.py)
        if ! "$0" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
          exec "$0" -m pytest -m gpu -q -rA -p no:cacheprovider --basetemp "$1/pytest" $files
        fi
        for file in $files; do
          "$0" -m pytest -m gpu -q -rA -p no:cacheprovider --basetemp "$1/pytest" "$file" || rc=1
        done
        exit $rc' "$PYTHON" "$SCRATCH"
      ;;
    train)
      stage train "${TRAIN_TIMEOUT_S:-150}" "$PYTHON" -m loraplex.bench train --model "$MODEL" \
        --device "$DEVICE" --slots "$SLOTS" --tokens-per-slot "$TOKENS_PER_SLOT" --rounds "$ROUNDS" \
        --peak-tflops "$PEAK_TFLOPS" --skip-naive --no-memory --json "${profile[@]}"
      ;;
    sample)
      stage sample "${SAMPLE_TIMEOUT_S:-150}" "$PYTHON" -m loraplex.bench sample --model "$MODEL" \
        --device "$DEVICE" --slots "$SAMPLE_SLOTS" --prompts-per-slot "$PROMPTS_PER_SLOT" \
        --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" --rounds "$ROUNDS" --hbm-gbps "$HBM_GBPS" \
        --skip-hf --no-memory --json "${profile[@]}"
      ;;
    *)
      echo "unknown stage '$name' (tests, train, sample)" >&2
      exit 2
      ;;
  esac
done

# The figures that matter, from the benchmarks' summary lines (the last JSON line of each).
"$PYTHON" - "$SCRATCH" <<'PY'
import json
import pathlib
import sys

def summary(name):
    path = pathlib.Path(sys.argv[1]) / f"{name}.out"
    lines = [l for l in path.read_text().splitlines() if l.startswith("{")] if path.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    return last if last.get("kind") == "summary" else None

if (s := summary("train")) is not None:
    print(f"train: {s['model']} {s['dtype']} on {s['device_name']}, {s['tokens_per_step']} tokens/step: "
          f"{s['tokens_per_s']:.0f} tokens/s, MFU at 4N {s['mfu']:.1%} (best {s['mfu_best']:.1%})")
if (s := summary("sample")) is not None:
    print(f"sample: {s['snapshots']} adapters x {s['prompts_per_snapshot']} prompts, {s['new_tokens']} new tokens: "
          f"{s['tokens_per_s']:.0f} tokens/s; decode step {s['decode_step_ms']:.2f} ms = "
          f"{s['decode_step_over_bound']:.2f}x its {s['hbm_gbps']:g} GB/s traffic bound of {s['decode_bound_ms']:.2f} ms")
for name in ("train", "sample"):
    s = summary(name)
    if s is None or "profile_phases" not in s:
        continue
    phases = ", ".join(f"{k} {v['host_ms'] / v['calls']:.2f}" for k, v in sorted(s["profile_phases"].items()))
    device = ""
    if "profile_device_busy" in s:
        device = (f"; device busy {s['profile_device_busy']:.0%}, {s['profile_kernel_launches']} kernel and "
                  f"{s['profile_graph_launches']} graph launches")
    print(f"{name} profile: {s['profile_wall_s']:.2f} s wall, {s['profile_host_cpu_s']:.2f} s host CPU{device}; "
          f"host ms per call: {phases} (tables: {s['profile_trace'].replace('.trace.json', '.ops.txt')})")
PY
exit $status
