"""Reading a local HF model directory into a Decoder: config.json plus one or many safetensors files.

The Decoder's module names are HF's for all three families, so the HF -> native name map is the
identity and one loop over `Decoder.state_dict()` serves them all. Every key is checked before any
tensor is read: a shape mismatch names the key and both shapes; missing and unexpected keys are listed.
Also the digest that identifies a base model's weights.
Knows nothing of slots, runs or the engine; writes nothing to disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.model.config import DecoderConfig, ModelLoadError
from loraplex.model.decoder import Decoder

_SINGLE_FILE = "model.safetensors"
_SHARD_INDEX = "model.safetensors.index.json"
# Older checkpoints saved the rotary inverse frequencies; we derive them from the config instead.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# A tied checkpoint may still carry lm_head.weight; accepted only if it equals the embedding it aliases.
_TIED_ALIAS, _TIED_TARGET = "lm_head.weight", "model.embed_tokens.weight"


def read_config(model_dir: Path | str) -> DecoderConfig:
    """The DecoderConfig of an HF model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist")
    return DecoderConfig.from_hf(json.loads(path.read_text()))


def load_decoder(
    model_dir: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Decoder:
    """Build the decoder described by `model_dir/config.json` and fill it from its safetensors files."""
    decoder = Decoder(read_config(model_dir), device=device, dtype=dtype)
    files = _weight_files(Path(model_dir))
    tensors = decoder.state_dict(keep_vars=True)
    if decoder.config.tie_word_embeddings:
        del tensors[_TIED_ALIAS]  # the same Parameter as embed_tokens' weight
    has_tied_alias = _check_keys_and_shapes(files, tensors, decoder.config.tie_word_embeddings)
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if key in tensors:
                        tensors[key].copy_(f.get_tensor(key))
        if has_tied_alias:
            _check_tied_alias(files, tensors[_TIED_TARGET])
    return decoder


def base_model_digest(model_dir: Path | str) -> str:
    """sha256 hex over config.json and every weight file's name and bytes; identifies the base weights.

    Reads every weight file once (seconds per GB), caches nothing.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    for path in [model_dir / "config.json", *_weight_files(model_dir)]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files: the shards its index names, else the single model file."""
    index_path = model_dir / _SHARD_INDEX
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        files = [model_dir / name for name in shard_names]
    else:
        files = [model_dir / _SINGLE_FILE]
    absent = [str(path) for path in files if not path.is_file()]
    if absent:
        raise ModelLoadError(f"weight files not found: {absent}")
    return files


def _check_keys_and_shapes(files: list[Path], expected: dict[str, torch.Tensor], is_tied: bool) -> bool:
    """Raise listing every missing, unexpected or misshapen key; return whether a tied lm_head is stored."""
    found: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    has_tied_alias = False
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                if is_tied and key == _TIED_ALIAS:
                    has_tied_alias = True
                    key_in_model = _TIED_TARGET
                elif key in expected:
                    key_in_model = key
                    found.add(key)
                else:
                    unexpected.append(key)
                    continue
                file_shape = tuple(f.get_slice(key).get_shape())
                model_shape = tuple(expected[key_in_model].shape)
                if file_shape != model_shape:
                    mismatched.append(f"{key}: checkpoint {file_shape} vs model {model_shape}")
    missing = sorted(set(expected) - found)
    problems = [
        *(["shape mismatch: " + "; ".join(mismatched)] if mismatched else []),
        *([f"missing keys: {missing}"] if missing else []),
        *([f"unexpected keys: {sorted(unexpected)}"] if unexpected else []),
    ]
    if problems:
        raise ModelLoadError(
            f"checkpoint in {files[0].parent} does not fit its config: " + " | ".join(problems)
        )
    return has_tied_alias


def _check_tied_alias(files: list[Path], embedding: torch.Tensor) -> None:
    """A stored lm_head.weight of a tied model must equal the embedding, or the tie would silently drop it."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            if _TIED_ALIAS in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                stored = f.get_tensor(_TIED_ALIAS).to(device=embedding.device, dtype=embedding.dtype)
                if not torch.equal(stored, embedding):
                    raise ModelLoadError(
                        f"config ties lm_head to embed_tokens but {path.name} holds a different {_TIED_ALIAS}"
                    )
