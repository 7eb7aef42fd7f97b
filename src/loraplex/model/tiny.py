"""The built-in `tiny` model: a small random Qwen3-shaped model with a byte-level tokenizer, made on demand.

`ensure_tiny_model` writes a normal HF directory (config.json, model.safetensors, tokenizer files with
a ChatML template) so `loraplex serve` works offline and `transformers` loads the same directory.
The files are byte-identical on every creation. Knows nothing of the engine, runs or the API.

Tokenizer: token id b is byte b (0-255), then <|endoftext|> = 256 (pad), <|im_start|> = 257 and
<|im_end|> = 258 (eos: a chat turn ends there, so sampling stops there). No merges: every byte is one
token, so decode(encode(s)) == s for any text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from loraplex.durable import write_directory_atomically
from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import Decoder

# The name the built-in model is served under unless --model-name says otherwise. The "loraplex" namespace is
# ours, so the tokenizer filed under it in a Hugging Face cache (hub_cache.py) shadows nobody's repository.
TINY_MODEL_NAME = "loraplex/tiny"
_SEED = 0
_INIT_STD = 0.02  # HF's initializer_range
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
_PAD, _EOS = "<|endoftext|>", "<|im_end|>"
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,  # room above the 259 tokenizer ids, as real models pad their vocab
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": 256 + _SPECIAL_TOKENS.index(_EOS),
    "pad_token_id": 256 + _SPECIAL_TOKENS.index(_PAD),
    "torch_dtype": "float32",
}


def ensure_tiny_model(data_dir: Path | str) -> Path:
    """Return `data_dir/models/tiny`, creating it first if absent; safe when processes race (every writer
    writes the same files; the first to finish is kept)."""
    final = Path(data_dir) / "models" / "tiny"
    if not final.is_dir():
        write_directory_atomically(final, _write_model, replace=False)
    return final


def _write_model(directory: Path) -> None:
    """Write config, weights and tokenizer files into `directory`."""
    directory.chmod(0o755)  # readable by clients on this machine that load its tokenizer (get_info)
    _write_json(directory / "config.json", _CONFIG)
    # Fixed metadata: safetensors would otherwise be free to differ between writers.
    save_file(_random_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(directory / "tokenizer.json", json.loads(_byte_level_tokenizer().to_str()))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": _EOS,
            "pad_token": _PAD,
            "bos_token": None,
            "model_max_length": _CONFIG["max_position_embeddings"],
            "chat_template": _CHATML_TEMPLATE,
        },
    )
    _write_json(directory / "special_tokens_map.json", {"eos_token": _EOS, "pad_token": _PAD})


def _write_json(path: Path, content: dict[str, Any]) -> None:
    """Sorted keys and a fixed layout, so equal content gives equal bytes."""
    path.write_text(json.dumps(content, sort_keys=True, indent=2, ensure_ascii=True) + "\n")


def _random_weights() -> dict[str, torch.Tensor]:
    """HF-named fp32 weights from one seeded generator: norms at one, everything else N(0, 0.02²)."""
    config = DecoderConfig.from_hf(_CONFIG)
    # A meta-device decoder gives every tensor's name and shape without allocating any.
    shapes = {name: tensor.shape for name, tensor in Decoder(config, device="meta").state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # stored once, as the embedding
    generator = torch.Generator().manual_seed(_SEED)
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name])
        else:
            weights[name] = torch.empty(shapes[name]).normal_(0.0, _INIT_STD, generator=generator)
    return weights


def _byte_level_tokenizer() -> Tokenizer:
    """BPE over the 256-byte alphabet with no merges, GPT-2's byte-to-character map, and chat specials."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in _SPECIAL_TOKENS]
    )
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet the ByteLevel pre-tokenizer emits."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    # Unprintable bytes (controls, space, ...) take code points from 256 up, in byte order.
    unprintable = [byte for byte in range(256) if byte not in mapping]
    mapping.update({byte: chr(256 + offset) for offset, byte in enumerate(unprintable)})
    return mapping
