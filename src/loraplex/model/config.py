"""The decoder's configuration, read from an HF `config.json` dict (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE).

Fields keep HF's names, so reading a config is a copy; what HF fixes per architecture rather than per
config (Qwen2's q/k/v bias, Qwen3's q/k norm, which families route to experts) comes from one table.
Knows nothing of weights or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.errors import LoraplexError

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelLoadError(LoraplexError, ValueError):
    """A model directory's config or weights cannot be served; the message names the field or tensor key."""


@dataclass(frozen=True)
class _Family:
    """What an architecture fixes regardless of its config. A bias of None follows `attention_bias`."""

    model_type: str
    qk_norm: bool  # RMSNorm over each q and k head before rope
    qkv_bias: bool | None
    o_bias: bool | None
    has_experts: bool = False  # reads the sparse-MoE fields (num_experts, ...) of its config


# The only per-family knowledge in model/: everything else is read from config fields.
_FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family("llama", qk_norm=False, qkv_bias=None, o_bias=None),
    "Qwen2ForCausalLM": _Family("qwen2", qk_norm=False, qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": _Family("qwen3", qk_norm=True, qkv_bias=None, o_bias=None),
    "Qwen3MoeForCausalLM": _Family("qwen3_moe", qk_norm=True, qkv_bias=None, o_bias=None, has_experts=True),
}
# HF's Qwen3MoeConfig defaults, for the MoE fields a config.json leaves out.
_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of one decoder; see `from_hf` for how HF fields map here."""

    # --- identity ---
    model_type: str  # "llama", "qwen2", "qwen3" or "qwen3_moe"
    # --- shapes ---
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # may differ from hidden_size // num_attention_heads (Qwen3)
    max_position_embeddings: int
    # --- family traits ---
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight
    # --- numerics ---
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain rope; else {"rope_type": "llama3", factor, ...}
    # --- sparse MoE (Qwen3-MoE); num_experts 0 = every layer has the dense MLP ---
    num_experts: int = 0  # E, routed experts per MoE layer
    num_experts_per_tok: int = 0  # k, experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to one
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 (and not in mlp_only_layers)
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (width intermediate_size)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes tokens to experts (HF's Qwen3MoeDecoderLayer rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Read an HF config.json dict; rope fields in the old or the 5.x `rope_parameters` layout."""
        family = _family_of(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
        if hf.get("use_sliding_window", False):
            raise ModelLoadError("use_sliding_window=true is not supported; only full attention is")
        attention_bias = bool(hf.get("attention_bias", False))
        num_heads = _required(hf, "num_attention_heads")
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        rope_theta, rope_scaling = _read_rope(hf)
        return cls(
            model_type=family.model_type,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=_required(hf, "hidden_size"),
            intermediate_size=_required(hf, "intermediate_size"),
            num_hidden_layers=_required(hf, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=hf.get("head_dim") or _required(hf, "hidden_size") // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            **_read_moe(hf, family),
        )


def _family_of(hf: dict[str, Any]) -> _Family:
    """Look the architecture up by `architectures[0]`, or by `model_type` when that list is absent."""
    supported = ", ".join(_FAMILIES)
    architectures = hf.get("architectures")
    if architectures:
        family = _FAMILIES.get(architectures[0])
        name = architectures[0]
    else:
        family = next((f for f in _FAMILIES.values() if f.model_type == hf.get("model_type")), None)
        name = f"model_type {hf.get('model_type')!r}"
    if family is None:
        raise ModelLoadError(f"architecture {name} is not supported; supported: {supported}")
    return family


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout; rope_scaling is None for plain rope."""
    # transformers 5.x folds rope_theta and the scaling fields into one `rope_parameters` dict.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    # Old Llama configs spell the key "type"; both name the same thing.
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return rope_theta, None
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in params]
    if missing:
        raise ModelLoadError(f"rope_scaling of type llama3 lacks {missing}")
    return rope_theta, {"rope_type": rope_type, **{key: params[key] for key in _LLAMA3_ROPE_KEYS}}


def _read_moe(hf: dict[str, Any], family: _Family) -> dict[str, Any]:
    """The sparse-MoE fields of an expert family's config (HF defaults where absent); none for dense ones."""
    if not family.has_experts:
        return {}
    moe = {key: hf.get(key, default) for key, default in _MOE_DEFAULTS.items()}
    # transformers 5 writes num_experts under the name it maps it to (num_local_experts).
    moe["num_experts"] = int(hf.get("num_experts", hf.get("num_local_experts", moe["num_experts"])))
    num_experts, top_k = moe["num_experts"], int(moe["num_experts_per_tok"])
    if num_experts == 0:  # HF builds every layer dense then
        return {}
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
    if int(moe["decoder_sparse_step"]) < 1:
        raise ModelLoadError(f"decoder_sparse_step={moe['decoder_sparse_step']} must be at least 1")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(moe["moe_intermediate_size"]),
        "norm_topk_prob": bool(moe["norm_topk_prob"]),
        "decoder_sparse_step": int(moe["decoder_sparse_step"]),
        "mlp_only_layers": tuple(int(layer) for layer in moe["mlp_only_layers"] or ()),
    }


def _required(hf: dict[str, Any], key: str) -> int:
    """An integer field that has no sensible default."""
    if key not in hf:
        raise ModelLoadError(f"config.json lacks the required field {key!r}")
    return int(hf[key])
