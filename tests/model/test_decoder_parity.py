"""The packed Decoder equals transformers per sequence, for every family; checkpoints load strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from loraplex.model.config import DecoderConfig, ModelLoadError
from loraplex.model.hf_checkpoint import base_model_digest, load_decoder
from loraplex.model.packing import PackedSequences
from tests.model.float64 import float64_copy, float64_experts
from tests.model.rounding import assert_within_rounding

LENGTHS = (7, 3, 12, 7)  # distinct lengths plus a repeat, so a length group holds two sequences
SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the tiny head dim has low, medium and high frequency bands.
    "original_max_position_embeddings": 16,
}
FAMILIES = {
    "llama3_rope_scaling_and_biases": lambda: LlamaConfig(
        **SHAPES, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True
    ),
    "qwen2_qkv_bias_tied": lambda: Qwen2Config(**SHAPES, tie_word_embeddings=True),
    "qwen3_qk_norm_wide_heads": lambda: Qwen3Config(**SHAPES, head_dim=32, tie_word_embeddings=False),
}


def save_random_hf_model(config: PretrainedConfig, directory: Path, **save_kwargs: object) -> torch.nn.Module:
    """A transformers model with every weight randomised (biases and norms too), saved as safetensors."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(directory, **save_kwargs)
    return model.eval()


def per_sequence_hf_logits(
    model: torch.nn.Module, tokens: torch.Tensor, lengths: tuple[int, ...]
) -> torch.Tensor:
    """Each sequence run alone through transformers, logits concatenated in pack order."""
    with torch.no_grad():
        return torch.cat([model(input_ids=seq[None]).logits[0] for seq in tokens.split(lengths)])


def packed_logits(
    directory: Path, tokens: torch.Tensor, lengths: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    with torch.no_grad(), float64_experts():
        return load_decoder(directory, "cpu", dtype).logits(tokens, PackedSequences.from_lengths(lengths))


def assert_logits_equal_transformers(
    directory: Path, hf_model: torch.nn.Module, tokens: torch.Tensor, lengths: tuple[int, ...]
) -> None:
    """Our packed logits within rounding of transformers' per sequence; each side's float64 twin measures
    its rounding."""
    expected = per_sequence_hf_logits(hf_model, tokens, lengths)
    exact = per_sequence_hf_logits(float64_copy(hf_model), tokens, lengths)
    ours, ours_exact = (
        packed_logits(directory, tokens, lengths, dtype) for dtype in (torch.float32, torch.float64)
    )
    assert_within_rounding(ours, expected, exact, "logits", got_exact=ours_exact)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_transformers_per_sequence(family: str, tmp_path: Path) -> None:
    hf_model = save_random_hf_model(FAMILIES[family](), tmp_path)
    tokens = torch.randint(0, SHAPES["vocab_size"], (sum(LENGTHS),))
    assert_logits_equal_transformers(tmp_path, hf_model, tokens, LENGTHS)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    hf_model = save_random_hf_model(FAMILIES["qwen3_qk_norm_wide_heads"](), tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, SHAPES["vocab_size"], (sum(LENGTHS),))
    assert_logits_equal_transformers(tmp_path, hf_model, tokens, LENGTHS)


def test_tied_embeddings_share_one_tensor_and_untied_do_not(tmp_path: Path) -> None:
    save_random_hf_model(FAMILIES["qwen2_qkv_bias_tied"](), tmp_path / "tied")
    save_random_hf_model(FAMILIES["qwen3_qk_norm_wide_heads"](), tmp_path / "untied")
    tied, untied = load_decoder(tmp_path / "tied"), load_decoder(tmp_path / "untied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    save_random_hf_model(FAMILIES["qwen2_qkv_bias_tied"](), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_decoder(tmp_path)  # an identical copy is accepted
    weights["lm_head.weight"] += 1.0
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_decoder(tmp_path)


def test_shape_mismatch_names_the_key_and_both_shapes(tmp_path: Path) -> None:
    save_random_hf_model(FAMILIES["qwen3_qk_norm_wide_heads"](), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight: checkpoint \(96, 64\) vs model \(80, 64\)",
    ):
        load_decoder(tmp_path)


def test_missing_and_unexpected_keys_are_listed(tmp_path: Path) -> None:
    save_random_hf_model(FAMILIES["qwen3_qk_norm_wide_heads"](), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    weights["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    weights["model.rotary_emb.inv_freq"] = torch.zeros(16)  # derived buffer: ignored, not unexpected
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_decoder(tmp_path)
    message = str(error.value)
    assert "missing keys: ['model.layers.1.self_attn.k_norm.weight']" in message
    assert "unexpected keys: ['model.layers.1.self_attn.extra.weight']" in message


def test_unknown_architecture_error_names_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        DecoderConfig.from_hf({"architectures": ["MistralForCausalLM"], **SHAPES})


def test_old_and_new_rope_layouts_read_the_same() -> None:
    rope_scaling = {
        key: value for key, value in LLAMA3_ROPE.items() if key not in ("rope_type", "rope_theta")
    }
    old = {"architectures": ["LlamaForCausalLM"], **SHAPES, "rope_theta": 500000.0}
    old["rope_scaling"] = {"type": "llama3", **rope_scaling}
    new = {"architectures": ["LlamaForCausalLM"], **SHAPES, "rope_parameters": LLAMA3_ROPE}
    assert DecoderConfig.from_hf(old) == DecoderConfig.from_hf(new)
    assert DecoderConfig.from_hf(new).rope_theta == 500000.0


def test_digest_is_stable_and_changes_with_any_weight(tmp_path: Path) -> None:
    save_random_hf_model(FAMILIES["qwen3_qk_norm_wide_heads"](), tmp_path)
    first = base_model_digest(tmp_path)
    assert first == base_model_digest(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.norm.weight"][0] += 1e-3
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert base_model_digest(tmp_path) != first


def test_positions_restart_at_zero_for_every_sequence() -> None:
    packing = PackedSequences.from_lengths([3, 1, 2])
    assert packing.positions_T.tolist() == [0, 1, 2, 0, 0, 1]
    assert packing.cu_seqlens_Q1.tolist() == [0, 3, 4, 6]
