"""Model shapes the benchmarks build with random weights, by preset name. Plain data: no torch, so the
argument parser can list the names without importing anything heavy.
"""

from __future__ import annotations

from typing import Any

from loraplex.model.presets import PUBLISHED, QWEN3, QWEN3_MOE

# Shapes of the built-in presets; any other --model value is read as an HF model directory.
PRESETS: dict[str, dict[str, Any]] = {
    # docs/BENCHMARKS.md's workload. intermediate_size 1536 = 3 × hidden, the Qwen3-0.6B ratio; untied
    # lm_head so that PEFT and the engine train exactly the same LoRA targets without tying caveats.
    "tiny-qwen3-bench": {
        **QWEN3,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # Qwen3-4B's published shape (random weights): the GPU target workload.
    "qwen3-4b-shape": {
        **QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # tiny-qwen3-bench with its MLPs made sparse: 32 experts, top 4, each a quarter of the dense width, so
    # a token's active MLP weights (and 4N) equal the dense preset's while the experts hold 8x as many.
    "tiny-qwen3-moe-bench": {
        **QWEN3_MOE,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B's published layer shape (random weights), at 24 of its 48 layers: the full model's
    # 61 GB of bf16 weights plus ~90 GB of activations at 16k tokens exceed one H200 (141 GB), and its
    # weight file the 64 GB disk of the machine it runs on. Per-token cost and MFU are per layer alike.
    "qwen3-30b-a3b-shape-24l": {**PUBLISHED["Qwen3-30B-A3B"], "num_hidden_layers": 24},
    # Seconds-fast MoE shape (8 experts, top 2, layer 1 dense) for smoke tests and the CPU bench.
    "smoke-moe": {
        **QWEN3_MOE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "vocab_size": 512,
        "tie_word_embeddings": False,
    },
    # Seconds-fast shape for smoke tests and argument checks.
    "smoke": {
        **QWEN3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    },
}
