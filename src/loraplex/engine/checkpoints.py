"""Checkpoints of live slots on disk: weights + AdamW state + config + base identity + owner, atomic.

A checkpoint directory holds:
    manifest.json          format and version, lora config, AdamW step, base_model_digest, owner_digest,
                           and per file its size and sha256 (so a truncated or altered file is refused)
    weights.safetensors    the slot's A/B tensors under their PEFT names
    optimizer.safetensors  "exp_avg.<name>" and "exp_avg_sq.<name>" for every weight
    gradients.safetensors  only in a parked run's state: its gradient accumulators not yet stepped
Directories are written beside the target and renamed into place (`write_directory_atomically`, also
used for snapshots); loads verify everything before a live slot is touched. No HTTP, no SQL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from loraplex.durable import tidy, write_directory_atomically
from loraplex.engine.slots import OptimizerState, SlotPool
from loraplex.engine.types import LoraConfig
from loraplex.errors import PermissionDeniedError, UserError

FORMAT = "loraplex-checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
GRADIENTS_FILE = "gradients.safetensors"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def save_state(
    pool: SlotPool,
    slot: int,
    directory: Path,
    owner_digest: str,
    base_model_digest: str,
    with_gradients: bool = False,
) -> int:
    """Write the slot's checkpoint to `directory` atomically (replacing any old one); return bytes written.

    with_gradients also writes the gradient accumulators (parking a run between forward_backward and
    optim_step); `load_state` then restores them exactly. Under tensor parallelism every rank of the group
    calls it: they gather the whole tensors, rank 0 of the group writes them, the others return 0.
    """
    record = pool.get(slot)
    weights, optimizer, gradients = pool.whole_state(slot, with_optimizer=True, with_gradients=with_gradients)
    assert optimizer is not None  # asked for
    if not pool.writes_files:
        return 0
    return write_state(
        directory, record.config, weights, optimizer, gradients, owner_digest, base_model_digest
    )


def write_state(
    directory: Path,
    config: LoraConfig,
    weights: dict[str, Tensor],
    optimizer: OptimizerState,
    gradients: dict[str, Tensor] | None,
    owner_digest: str,
    base_model_digest: str,
) -> int:
    """Write whole tensors as a checkpoint directory, atomically; return bytes written (save_state's files:
    also how a slot held in host memory is parked to disk, engine/offload.py)."""
    files = {
        WEIGHTS_FILE: {name: t.cpu() for name, t in weights.items()},
        OPTIMIZER_FILE: {
            f"{moment}.{name}": t.cpu()
            for moment in _MOMENTS
            for name, t in getattr(optimizer, moment).items()
        },
    }
    if gradients is not None:
        files[GRADIENTS_FILE] = {name: t.cpu() for name, t in gradients.items()}

    def write(tmp: Path) -> None:
        for filename, tensors in files.items():
            safetensors.torch.save_file(tensors, tmp / filename)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "lora_config": dataclasses.asdict(config),
            "step": optimizer.step,
            "base_model_digest": base_model_digest,
            "owner_digest": owner_digest,
            "files": {name: _describe((tmp / name).read_bytes()) for name in files},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    return write_directory_atomically(Path(directory), write)


def load_state(
    pool: SlotPool,
    directory: Path,
    owner_digest: str,
    base_model_digest: str,
    with_optimizer: bool,
    slot: int | None = None,
) -> tuple[int, LoraConfig]:
    """Load a checkpoint into live `slot` (its config must match) or a new slot; return (slot, config).

    The manifest, both identities, and the hashes, names and shapes of the files it loads are all checked
    before any slot is touched or created. Without the optimizer (whose file is then not read), AdamW
    moments and step restart from zero. The slot's gradient accumulators end up zero, unless the state
    holds gradients (a parked run's): then they are those.
    """
    directory = Path(directory)
    manifest, config, weights = read_weights(pool, directory, owner_digest, base_model_digest)
    if slot is not None:
        _check_same_adapter(slot, pool.get(slot).config, config)
    shapes = pool.expected_shapes(config)
    optimizer = None
    if with_optimizer:
        names = {f"{moment}.{name}": shape for moment in _MOMENTS for name, shape in shapes.items()}
        moments = _read_tensors(directory, manifest, OPTIMIZER_FILE, names)
        by_moment = ({name: moments[f"{m}.{name}"] for name in shapes} for m in _MOMENTS)
        optimizer = OptimizerState(*by_moment, step=manifest["step"])
    gradients = None
    if GRADIENTS_FILE in manifest["files"]:
        gradients = _read_tensors(directory, manifest, GRADIENTS_FILE, shapes)
    if slot is None:
        slot = pool.create(config)
    pool.get(slot).assign(weights, optimizer, gradients)
    return slot, config


def read_weights(
    pool: SlotPool, directory: Path, owner_digest: str, base_model_digest: str
) -> tuple[dict[str, Any], LoraConfig, dict[str, Tensor]]:
    """A checkpoint's manifest, config and adapter weights, once its identities, hashes and shapes check
    out (UserError / PermissionDeniedError naming what does not)."""
    manifest = _read_manifest(directory)
    if manifest["base_model_digest"] != base_model_digest:
        raise UserError(
            f"checkpoint {directory.name} was saved on another base model "
            f"(digest {manifest['base_model_digest']!r}, this server runs {base_model_digest!r})"
        )
    if manifest["owner_digest"] != owner_digest:
        raise PermissionDeniedError(f"checkpoint {directory.name} belongs to another tenant")
    config = manifest["lora_config"]
    weights = _read_tensors(directory, manifest, WEIGHTS_FILE, pool.expected_shapes(config))
    return manifest, config, weights


def _describe(data: bytes) -> dict[str, Any]:
    """What the manifest records of one file."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _read_manifest(directory: Path) -> dict[str, Any]:
    """The checked manifest of a checkpoint, with `lora_config` as a LoraConfig."""
    tidy(directory)
    where = f"checkpoint {directory.name}"
    if not directory.is_dir():
        raise UserError(f"{where} does not exist")
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise UserError(
            f"{where} is incomplete or not a loraplex checkpoint: it has no {MANIFEST_FILE}"
        ) from None
    except (OSError, ValueError) as error:
        raise UserError(f"{where} has an unreadable {MANIFEST_FILE}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{where}: {MANIFEST_FILE} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{where} has format_version {manifest.get('format_version')!r}; "
            f"this server reads version {FORMAT_VERSION}"
        )
    try:
        manifest["lora_config"] = LoraConfig(**manifest["lora_config"])
        fields = (
            manifest["step"],
            manifest["base_model_digest"],
            manifest["owner_digest"],
            manifest["files"],
        )
    except (KeyError, TypeError) as error:
        raise UserError(f"{where}: {MANIFEST_FILE} is missing or has a malformed field: {error}") from None
    if not isinstance(fields[0], int) or fields[0] < 0:
        raise UserError(f"{where}: {MANIFEST_FILE} has an invalid step {fields[0]!r}")
    return manifest


def _read_tensors(
    directory: Path, manifest: dict[str, Any], filename: str, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """One file's tensors, once its size and sha256 match the manifest and its names and shapes the config."""
    where = f"checkpoint {directory.name}: {filename}"
    expected = manifest["files"].get(filename)
    if expected is None:
        raise UserError(f"{where} is not listed in {MANIFEST_FILE}")
    try:
        data = (directory / filename).read_bytes()
    except OSError:
        raise UserError(f"{where} is missing (a partial copy?)") from None
    if _describe(data) != expected:
        raise UserError(
            f"{where} is corrupt: {len(data)} bytes with another sha256 than the {expected.get('bytes')} "
            "bytes the manifest records"
        )
    tensors = safetensors.torch.load(data)
    if set(tensors) != set(shapes):
        missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
        raise UserError(f"{where} does not fit its lora config: missing {missing}, unexpected {unexpected}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape or tensors[name].dtype != torch.float32:
            raise UserError(
                f"{where}: {name} has shape {tuple(tensors[name].shape)} and dtype {tensors[name].dtype}; "
                f"expected {shape} float32"
            )
    return tensors


def _check_same_adapter(slot: int, live: LoraConfig, stored: LoraConfig) -> None:
    """A checkpoint loads into a live slot only if it has the same rank, alpha and targets."""
    fields = ("rank", "alpha", "train_attn", "train_mlp", "train_unembed")
    differ = [
        f"{f} {getattr(stored, f)!r} != {getattr(live, f)!r}"
        for f in fields
        if getattr(stored, f) != getattr(live, f)
    ]
    if differ:
        raise UserError(
            f"the checkpoint does not fit slot {slot}'s adapter: {', '.join(differ)} (checkpoint != slot)"
        )
