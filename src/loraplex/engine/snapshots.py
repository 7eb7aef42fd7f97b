"""Snapshots: immutable copies of a slot's weights in PEFT format, and the reader the sampler uses.

A snapshot directory is what `peft.PeftModel.from_pretrained` (and, for dense models, vLLM) load:
    adapter_model.safetensors  base_model.model.<module path>.lora_A.weight (R, in), .lora_B.weight (out, R)
    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules (leaf names), base model, ...
MoE expert projections are stored as PEFT adapts transformers' fused expert parameters
(`target_parameters`, model/peft_format.py says how). Written atomically like checkpoints, from the
slot's values at save time, so later training never changes a snapshot. No HTTP, no SQL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
from torch import Tensor

from loraplex.durable import write_files_atomically
from loraplex.engine.slots import SlotPool
from loraplex.engine.types import LoraConfig
from loraplex.errors import UserError
from loraplex.model.peft_format import from_peft, to_peft

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
# PeftModel wraps the causal LM as `base_model.model`, so PEFT keys carry this before our module paths.
PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class Snapshot:
    """A snapshot read back: its adapter shape and weights keyed by module path."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # leaf names, as in adapter_config.json
    base_model_name: str
    pairs: dict[str, tuple[Tensor, Tensor]]  # slot target path -> (A_RI, B_OR) in slot layout, fp32 on CPU

    @property
    def scale(self) -> float:
        """The LoRA scale alpha / rank."""
        return self.alpha / self.rank


def save_snapshot(pool: SlotPool, slot: int, directory: Path, base_model_name: str) -> int:
    """Write a PEFT-format copy of the slot's weights to `directory` atomically; return bytes written.
    Under tensor parallelism every rank of the group calls it (SlotPool.whole_state); rank 0 of it writes,
    the others return 0."""
    files = slot_snapshot_files(pool, slot, base_model_name)
    return write_files_atomically(Path(directory), files) if files else 0


def slot_snapshot_files(pool: SlotPool, slot: int, base_model_name: str) -> dict[str, bytes]:
    """The files of the slot's PEFT snapshot, in memory (file name -> contents), nothing written. Under
    tensor parallelism every rank of the group calls it; rank 0 of it gets the files, the others {}."""
    weights, _, _ = pool.whole_state(slot, with_optimizer=False)
    if not pool.writes_files:
        return {}
    return snapshot_files(weights, pool.get(slot).config, base_model_name)


def write_snapshot(
    weights: Mapping[str, Tensor], config: LoraConfig, directory: Path, base_model_name: str
) -> int:
    """Write adapter weights (by PEFT name, as slots and checkpoints hold them) as a PEFT snapshot to
    `directory` atomically; return bytes written."""
    return write_files_atomically(Path(directory), snapshot_files(weights, config, base_model_name))


def snapshot_files(
    weights: Mapping[str, Tensor], config: LoraConfig, base_model_name: str
) -> dict[str, bytes]:
    """Adapter weights (by PEFT name) as the bytes of a PEFT snapshot's files: serialised in memory, so that
    a caller may encrypt them before anything reaches a disk."""
    peft_tensors, targets = to_peft(
        {name: t.detach().cpu() for name, t in weights.items()}, config.rank, config.alpha
    )
    tensors = {PEFT_PREFIX + key: t for key, t in peft_tensors.items()}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": config.rank,
        "lora_alpha": config.alpha,
        **targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    return {
        WEIGHTS_FILE: safetensors.torch.save(tensors, metadata={"format": "pt"}),
        CONFIG_FILE: json.dumps(adapter_config, indent=2, sort_keys=True).encode(),
    }


def load_snapshot(directory: Path) -> Snapshot:
    """Read a snapshot back into CPU tensors, checking that every A has its B at rank r."""
    directory = Path(directory)
    where = f"snapshot {directory.name}"
    config = _read_adapter_config(directory)
    try:
        tensors = safetensors.torch.load_file(directory / WEIGHTS_FILE)
    except (OSError, safetensors.SafetensorError) as error:
        raise UserError(f"{where}: {WEIGHTS_FILE} is missing or unreadable: {error}") from None
    rank = config["r"]
    unexpected = [k for k in tensors if not (k.startswith(PEFT_PREFIX) and k.endswith(_LORA_SUFFIXES))]
    if unexpected:
        raise UserError(f"{where}: unexpected tensors {sorted(unexpected)}")
    try:
        peft_pairs = from_peft({key.removeprefix(PEFT_PREFIX): t for key, t in tensors.items()}, rank)
    except ValueError as error:
        raise UserError(f"{where}: {error}") from None
    pairs = {path: (A_RI.float(), B_OR.float()) for path, (A_RI, B_OR) in peft_pairs.items()}
    return Snapshot(
        rank=rank,
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(config["target_modules"]),
        base_model_name=config.get("base_model_name_or_path") or "",
        pairs=pairs,
    )


def _read_adapter_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json, checked to be a LoRA config with an integer r, lora_alpha and target list."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise UserError(f"snapshot {directory.name} is incomplete: it has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"snapshot {directory.name} has an unreadable {CONFIG_FILE}: {error}") from None
    if (
        not isinstance(config, dict)
        or config.get("peft_type") != "LORA"
        or not isinstance(config.get("r"), int)
        or config["r"] < 1
        or not isinstance(config.get("lora_alpha"), int | float)
        or not isinstance(config.get("target_modules"), list)
    ):
        raise UserError(
            f"snapshot {directory.name}: {CONFIG_FILE} is not a LoRA config with r, lora_alpha, targets"
        )
    return config
