"""Reading a local HF model directory into a Decoder: config.json plus one or many safetensors files.

The Decoder's module names are HF's, so most keys map to themselves; the exception is a table of HF's
layouts of MoE experts (`_LAYOUTS`): one (F, D) tensor per expert and projection as `save_pretrained`
and the hub write them, or transformers' fused in-memory (E, 2F, D) gate_up_proj and (E, D, F)
down_proj, each filling our one stacked (E, O, I) tensor per projection. One loop applies the table.
Every key is checked before any tensor is read: a shape mismatch names the key and both shapes;
missing and unexpected keys are listed. Under tensor parallelism each rank reads only its part of every
split tensor (a safetensors slice), so no rank ever holds a whole split weight, in host memory either; of
an MoE layer's experts, only its own experts' tensors (another rank's per-expert keys are never read).
Also the digest that identifies a base model's weights, and
`to_hf_layout`, which lays out a Decoder's state the way HF checkpoints store it.
Knows nothing of slots, runs or the engine; writes nothing to disk.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from loraplex.model.config import DecoderConfig, ModelLoadError
from loraplex.model.decoder import Decoder
from loraplex.model.tensor_parallel import SINGLE, Split, TensorParallel, check_shardable

_SINGLE_FILE = "model.safetensors"
_SHARD_INDEX = "model.safetensors.index.json"
# Older checkpoints saved the rotary inverse frequencies; we derive them from the config instead.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# A tied checkpoint may still carry lm_head.weight; accepted only if it equals the embedding it aliases.
_TIED_ALIAS, _TIED_TARGET = "lm_head.weight", "model.embed_tokens.weight"


class _Piece(NamedTuple):
    """Where a file tensor, or a slice of it, goes in the Decoder."""

    key: str  # the Decoder's state_dict key
    expert: int | None  # the row of a stacked expert tensor it fills; None = the whole tensor
    columns: slice | None  # the part of the file tensor's dim 1 it takes; None = all of it


# A stacked expert tensor of the Decoder: every expert's weight of one projection, (E, O, I).
_STACKED = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
# HF file key pattern -> the pieces it fills, given the match and the file tensor's dim 1. Keys that match
# no pattern are the Decoder's own.
_LAYOUTS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], int], list[_Piece]]], ...] = (
    (  # save_pretrained and the hub: one tensor per expert and projection
        re.compile(
            r"(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
        ),
        lambda m, width: [_Piece(f"{m['experts']}.{m['proj']}.weight", int(m["index"]), None)],
    ),
    (  # transformers' fused layout: gate rows first, then up rows
        re.compile(r"(?P<experts>.+\.mlp\.experts)\.gate_up_proj"),
        lambda m, width: [
            _Piece(f"{m['experts']}.gate_proj.weight", None, slice(0, width // 2)),
            _Piece(f"{m['experts']}.up_proj.weight", None, slice(width // 2, width)),
        ],
    ),
    (
        re.compile(r"(?P<experts>.+\.mlp\.experts)\.down_proj"),
        lambda m, width: [_Piece(f"{m['experts']}.down_proj.weight", None, None)],
    ),
)


def read_config(model_dir: Path | str) -> DecoderConfig:
    """The DecoderConfig of an HF model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist")
    return DecoderConfig.from_hf(json.loads(path.read_text()))


def load_decoder(
    model_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tp: TensorParallel = SINGLE,
) -> Decoder:
    """Build the decoder described by `model_dir/config.json` and fill it from its safetensors files;
    under tensor parallelism, this rank's part of it (Decoder's `tp`), read from slices of the files."""
    config = read_config(model_dir)
    check_shardable(config, tp, str(model_dir))  # as Decoder does, but naming the directory
    decoder = Decoder(config, device=device, dtype=dtype, tp=tp)
    files = _weight_files(Path(model_dir))
    tensors = decoder.state_dict(keep_vars=True)
    splits = decoder.parameter_splits()
    if decoder.config.tie_word_embeddings:
        del tensors[_TIED_ALIAS]  # the same Parameter as embed_tokens' weight
    has_tied_alias = _check_keys_and_shapes(files, tensors, splits, decoder.config.tie_word_embeddings)
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    file_shape = tuple(f.get_slice(key).get_shape())
                    for piece in _pieces(key, file_shape):
                        split = splits.get(piece.key)
                        target = _target(tensors[piece.key], piece, split) if piece.key in tensors else None
                        if target is not None:  # None: another rank's expert, left in the file
                            target.copy_(_read(f, key, piece, split))
        if has_tied_alias:
            _check_tied_alias(files, tensors[_TIED_TARGET], splits.get(_TIED_TARGET))
    return decoder


def to_hf_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Decoder state_dict as HF checkpoints store it: stacked experts split into one tensor per expert."""
    hf_state = {}
    for key, tensor in state.items():
        stacked = _STACKED.fullmatch(key)
        if stacked is None:
            hf_state[key] = tensor
            continue
        for expert, weight in enumerate(tensor.unbind(0)):
            # clone: safetensors refuses tensors that share storage.
            hf_state[f"{stacked['experts']}.{expert}.{stacked['proj']}.weight"] = weight.clone()
    return hf_state


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


def _pieces(key: str, file_shape: tuple[int, ...]) -> list[_Piece]:
    """The Decoder tensors (or rows, or parts) a file tensor fills, by `_LAYOUTS`; else its own key."""
    for pattern, pieces in _LAYOUTS:
        match = pattern.fullmatch(key)
        if match is not None:
            return pieces(match, file_shape[1] if len(file_shape) > 1 else 0)
    return [_Piece(key, None, None)]


def _target(tensor: torch.Tensor, piece: _Piece, split: Split | None) -> torch.Tensor | None:
    """The part of this rank's Decoder tensor a piece fills; None for one expert this rank does not hold
    (a stacked expert tensor is split by whole experts, `split` its rows)."""
    if piece.expert is None:
        return tensor
    row = piece.expert if split is None else piece.expert - split.start
    return tensor[row] if 0 <= row < tensor.shape[0] else None


def _source(tensor: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The part of a file tensor a piece takes."""
    return tensor if piece.columns is None else tensor[:, piece.columns]


def _read(f: Any, key: str, piece: _Piece, split: Split | None) -> torch.Tensor:
    """What a piece takes of an open file's tensor `key`; of a tensor split over tensor-parallel ranks, only
    this rank's part, read as a slice so that no other bytes leave the file. One expert's tensor is read
    whole: it is the expert's, and only the rank that holds the expert reads it (`_target`)."""
    if split is None or piece.expert is not None:
        return _source(f.get_tensor(key), piece)
    index = split.index()
    if piece.columns is not None:  # a fused gate_up_proj's half (dim 1) of this rank's experts (dim 0)
        index = (*index, piece.columns)
    return f.get_slice(key)[index]


def _check_keys_and_shapes(
    files: list[Path], expected: dict[str, torch.Tensor], splits: dict[str, Split], is_tied: bool
) -> bool:
    """Raise listing every missing, unexpected or misshapen key (against the whole model's shapes, of
    which `splits` names this rank's parts); return whether a tied lm_head is stored."""
    whole = {
        key: splits[key].full_shape(tuple(t.shape)) if key in splits else tuple(t.shape)
        for key, t in expected.items()
    }
    filled: dict[str, set[int | None]] = {}  # Decoder key -> expert rows filled (None: all of it)
    unexpected: list[str] = []
    mismatched: list[str] = []
    has_tied_alias = False
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                file_shape = tuple(f.get_slice(key).get_shape())
                is_alias = is_tied and key == _TIED_ALIAS
                has_tied_alias |= is_alias
                pieces = [_Piece(_TIED_TARGET, None, None)] if is_alias else _pieces(key, file_shape)
                if not all(_fits_model(piece, whole) for piece in pieces):
                    unexpected.append(key)
                    continue
                for piece in pieces:
                    if not is_alias:  # the alias is checked against the embedding, it does not fill it
                        filled.setdefault(piece.key, set()).add(piece.expert)
                    model_shape = whole[piece.key] if piece.expert is None else whole[piece.key][1:]
                    shape = _part_shape(file_shape, piece)
                    if shape != model_shape:
                        mismatched.append(f"{key}: checkpoint {shape} vs model {model_shape}")
    missing = [_describe_missing(key, filled.get(key, set()), whole[key]) for key in sorted(whole)]
    missing = [description for description in missing if description]
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


def _fits_model(piece: _Piece, whole: dict[str, tuple[int, ...]]) -> bool:
    """Whether a piece names a Decoder tensor (and, for one expert's weight, an expert the model has),
    given the whole model's shapes."""
    shape = whole.get(piece.key)
    return shape is not None and (piece.expert is None or 0 <= piece.expert < shape[0])


def _part_shape(file_shape: tuple[int, ...], piece: _Piece) -> tuple[int, ...]:
    """The shape of the part of a file tensor a piece takes."""
    if piece.columns is None:
        return file_shape
    return (file_shape[0], len(range(file_shape[1])[piece.columns]), *file_shape[2:])


def _describe_missing(key: str, filled: set[int | None], shape: tuple[int, ...]) -> str | None:
    """None if a Decoder tensor of the whole model's `shape` is wholly filled; else what is missing, named
    as HF names it."""
    if None in filled:
        return None
    stacked = _STACKED.fullmatch(key)
    if stacked is None:
        return key
    absent = sorted(set(range(shape[0])) - filled)
    if not absent:
        return None
    experts = f"0..{absent[-1]}" if len(absent) == shape[0] else str(absent)
    return f"{stacked['experts']}.N.{stacked['proj']}.weight for N in {experts}"


def _check_tied_alias(files: list[Path], embedding: torch.Tensor, split: Split | None) -> None:
    """A stored lm_head.weight of a tied model must equal the embedding (this rank's part of it, when
    split), or the tie would silently drop it."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            if _TIED_ALIAS in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                stored = _read(f, _TIED_ALIAS, _Piece(_TIED_TARGET, None, None), split)
                stored = stored.to(device=embedding.device, dtype=embedding.dtype)
                if not torch.equal(stored, embedding):
                    raise ModelLoadError(
                        f"config ties lm_head to embed_tokens but {path.name} holds a different {_TIED_ALIAS}"
                    )
