"""Published model shapes as HF config.json dicts, by name: what `loraplex memory-plan` plans for and what
the benchmark presets (bench/presets.py) build on. Plain data: no torch, no weights.

The four published configs copy the shape fields of the models' config.json on the Hugging Face Hub
(Qwen/Qwen3-8B, meta-llama/Llama-3.3-70B-Instruct, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B);
tests/model/test_memory_plan.py checks that the parameter counts they give are the published totals.
"""

from __future__ import annotations

from typing import Any

# What every Qwen3 config.json of these sizes shares (and the bench presets take as their base).
QWEN3: dict[str, Any] = {
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

QWEN3_MOE: dict[str, Any] = {
    **QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}

PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen3-8B": {
        **QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "Llama-3.3-70B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "Qwen3-30B-A3B": {
        **QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # no layer is dense (mlp_only_layers is empty): unused
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "Qwen3-235B-A22B": {
        **QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,  # unused, as above
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}
