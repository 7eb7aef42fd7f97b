#!/usr/bin/env bash
# bench/gpu.sh on a random-init Qwen3-30B-A3B-shaped MoE (its layer shape: 128 experts, top 8, hidden
# 2048, expert width 768; 24 of its 48 layers, see the preset in src/loraplex/bench/presets.py), bf16,
# LoRA on attention, every expert and lm_head. MFU is at 4N with N the parameters a token passes (router
# and its 8 experts, not all 128), as docs/BENCHMARKS.md counts it.
#
# Usage, from anywhere: bench/gpu_moe.sh [more `bench train` flags]; every bench/gpu.sh variable works.
# Defaults: SLOTS=4, TOKENS_PER_SLOT=2048 (8192 tokens per step), RANK=8.
# Memory: weights 31 GB bf16 (and a 31 GB weight file in the temp dir); per slot at rank 8 ~0.85 GB of
# LoRA weights, x4 with gradients and AdamW moments; activations ~200 KB per token per layer (the
# experts' gathered rows and each slot's LoRA rows), ~40 GB at 8192 tokens. 16k tokens per step
# (TOKENS_PER_SLOT=4096) needs ~80 GB of activations: it fits an H200 only just.
# NPROC and TP as in bench/gpu.sh; TP ranks of a group split the experts, 128/TP each (TP must divide
# 128 and the 4 KV heads), with their LoRA blocks (docs/MOE.md, expert parallelism).
# Dry run of the plumbing on a CPU (tests/test_gpu_scripts.py runs it):
#   MODEL=smoke-moe DEVICE=cpu SLOTS=2 TOKENS_PER_SLOT=8 ROUNDS=1 NPROC=2 TP=2 bench/gpu_moe.sh --no-memory
set -euo pipefail
export MODEL=${MODEL:-qwen3-30b-a3b-shape-24l}
export SLOTS=${SLOTS:-4}
export TOKENS_PER_SLOT=${TOKENS_PER_SLOT:-2048}
export RANK=${RANK:-8}
exec "$(dirname "$0")/gpu.sh" "$@"
