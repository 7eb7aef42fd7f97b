"""Benchmark workloads: model presets written as random-init HF directories, and the shared token batches.

Every compared configuration of one run reads the same model directory and the same token arrays, so
"same work on both sides" holds by construction. Knows nothing of timing or reporting.

Shapes: S slots, Q sequences of one slot, L sequence length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from loraplex.bench.presets import PRESETS
from loraplex.engine.types import DatumInput, PassRequest
from loraplex.errors import UserError
from loraplex.model.config import DecoderConfig
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import to_hf_layout

_INIT_STD = 0.02  # HF's initializer_range
_SEED = 0


def prepare_model_dir(model: str, scratch: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """The HF directory for `model`: a preset is written (random init, seeded) into `scratch`; else a path.

    The weights are drawn on `device` (seconds for a 4B model on a GPU, minutes on a CPU thread).
    """
    if model not in PRESETS:
        path = Path(model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise UserError(
                f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an HF directory"
            )
        return path
    directory = scratch / model
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = {**PRESETS[model], "torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    weights = _random_weights(DecoderConfig.from_hf(hf_config), dtype, device)
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def _random_weights(
    config: DecoderConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """HF-named CPU weights from one seeded generator on `device`: norms at one, the rest N(0, 0.02²);
    MoE experts one tensor per expert, as HF stores them."""
    shapes = {name: t.shape for name, t in Decoder(config, device="meta").state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # stored once, as the embedding
    generator = torch.Generator(device).manual_seed(_SEED)
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name], dtype=dtype)
        else:
            drawn = torch.empty(shapes[name], dtype=dtype, device=device)
            # Split into HF's layout tensor by tensor, so the stacked and split copies never all coexist.
            weights |= to_hf_layout({name: drawn.normal_(0.0, _INIT_STD, generator=generator).cpu()})
    return weights


@dataclass(frozen=True)
class TrainShape:
    """One training step's shape: S slots, each with `tokens_per_slot` tokens in sequences of `seq_len`."""

    slots: int
    tokens_per_slot: int
    rank: int
    seq_len: int  # tokens_per_slot must be a multiple of it

    def __post_init__(self) -> None:
        if min(self.slots, self.tokens_per_slot, self.rank, self.seq_len) < 1:
            raise UserError(f"slots, tokens per slot, rank and sequence length must be ≥ 1; got {self}")
        if self.tokens_per_slot % self.seq_len:
            raise UserError(
                f"tokens per slot {self.tokens_per_slot} is not a multiple of seq_len {self.seq_len}"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens in one step over all slots."""
        return self.slots * self.tokens_per_slot

    def summary_fields(self) -> dict[str, int]:
        """The shape as a bench summary reports it."""
        return {
            "slots": self.slots,
            "tokens_per_slot": self.tokens_per_slot,
            "rank": self.rank,
            "seq_len": self.seq_len,
            "tokens_per_step": self.num_tokens,
        }


def make_slot_datums(shape: TrainShape, vocab_size: int, seed: int = _SEED) -> list[list[DatumInput]]:
    """Per slot its sequences: random token ids, next-token targets, cross_entropy with unit weights."""
    rng = np.random.default_rng(seed)
    seqs_per_slot = shape.tokens_per_slot // shape.seq_len
    datums = []
    for _ in range(shape.slots):
        stream_QL = rng.integers(0, vocab_size, size=(seqs_per_slot, shape.seq_len + 1), dtype=np.int64)
        datums.append(
            [DatumInput(tokens=row[:-1], loss_fn_inputs={"target_tokens": row[1:]}) for row in stream_QL]
        )
    return datums


def to_requests(slot_ids: list[int], slot_datums: list[list[DatumInput]]) -> list[PassRequest]:
    """One forward_backward cross_entropy request per slot, slot_ids[i] carrying slot_datums[i]."""
    return [
        PassRequest(slot=slot, loss_fn="cross_entropy", loss_fn_config={}, datums=datums, forward_only=False)
        for slot, datums in zip(slot_ids, slot_datums, strict=True)
    ]
