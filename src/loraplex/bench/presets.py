"""Model shapes the benchmarks build with random weights, by preset name. Plain data: no torch, so the
argument parser can list the names without importing anything heavy.
"""

from __future__ import annotations

from typing import Any

_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "use_cache": False,
}

# Shapes of the built-in presets; any other --model value is read as an HF model directory.
PRESETS: dict[str, dict[str, Any]] = {
    # performance.md's workload. intermediate_size 1536 = 3 × hidden, the Qwen3-0.6B ratio; untied
    # lm_head so that PEFT and the engine train exactly the same LoRA targets without tying caveats.
    "tiny-qwen3-bench": {
        **_QWEN3,
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
        **_QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # Seconds-fast shape for smoke tests and argument checks.
    "smoke": {
        **_QWEN3,
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
