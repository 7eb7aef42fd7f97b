"""The baselines a user would pick instead of loraplex (docs/BENCHMARKS.md), built as such a user would.

`NaivePeftLoop`: HF transformers + PEFT, K adapters on one model, trained one after another
(`set_adapter(k)`, padded batch forward, unfused cross entropy over full logits, `loss.backward()`).
`PerSlotAdamW`: one `torch.optim.AdamW` per slot (torch's default implementation for the device), stepped
after `clip_grad_norm_`, gradients zeroed after, slot after slot.
Knows nothing of timing or reporting.

Shapes: B sequences of one slot's batch, L padded length, V vocab.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loraplex.engine.types import AdamParams, DatumInput

# Every linear layer, as the engine's default LoraConfig trains (attn, mlp and unembed).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
_IGNORE = -100  # cross_entropy's ignore_index: padding positions


def _padded_batch(datums: list[DatumInput], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids_BL, attention_mask_BL, labels_BL) right-padded to the longest sequence."""
    width = max(len(d.tokens) for d in datums)
    ids = np.zeros((len(datums), width), dtype=np.int64)
    mask = np.zeros((len(datums), width), dtype=np.int64)
    labels = np.full((len(datums), width), _IGNORE, dtype=np.int64)
    for row, datum in enumerate(datums):
        n = len(datum.tokens)
        ids[row, :n], mask[row, :n] = datum.tokens, 1
        labels[row, :n] = datum.loss_fn_inputs["target_tokens"]
    return tuple(torch.from_numpy(a).to(device) for a in (ids, mask, labels))  # type: ignore[return-value]


class NaivePeftLoop:
    """K PEFT adapters on one HF model; `__call__` runs one forward + backward per adapter, in turn."""

    def __init__(
        self,
        model_dir: Path,
        slot_datums: list[list[DatumInput]],
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        alpha: float = 32.0,
    ) -> None:
        from peft import LoraConfig, get_peft_model  # heavy; only the baseline needs them
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tied lm_head notices of large presets; harmless here
            self.model = get_peft_model(base, config, adapter_name="slot0")
            for k in range(1, len(slot_datums)):
                self.model.add_adapter(f"slot{k}", config)
        self.model.train()
        self.batches = [_padded_batch(datums, device) for datums in slot_datums]

    def __call__(self) -> None:
        for k, (ids_BL, mask_BL, labels_BL) in enumerate(self.batches):
            self.model.set_adapter(f"slot{k}")
            logits_BLV = self.model(input_ids=ids_BL, attention_mask=mask_BL, use_cache=False).logits
            loss = F.cross_entropy(
                logits_BLV.float().flatten(0, 1), labels_BL.flatten(), ignore_index=_IGNORE, reduction="sum"
            )
            loss.backward()


class PerSlotAdamW:
    """One torch.optim.AdamW per slot, built once; `__call__` clips, steps and zeroes each slot in turn."""

    def __init__(self, slot_params: list[list[Tensor]], params: AdamParams) -> None:
        self.slot_params = slot_params
        self.max_norm = params.grad_clip_norm
        self.optimizers = [
            torch.optim.AdamW(
                tensors,
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
            for tensors in slot_params
        ]

    def __call__(self) -> None:
        for tensors, optimizer in zip(self.slot_params, self.optimizers, strict=True):
            if self.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(tensors, self.max_norm)
            optimizer.step()
            # Zeroed in place, as the fused step does: set_to_none would make later steps skip them.
            optimizer.zero_grad(set_to_none=False)
