"""How a slot's tensors map to a PEFT adapter that `peft` (0.21) loads onto the transformers model.

Linear targets map to themselves: A (R, I) and B (O, R) under the module path, listed by leaf name in
`target_modules`. Expert projections do not: transformers 5 holds an MoE layer's experts as two 3-D
parameters, `mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F), which PEFT
adapts with `target_parameters` (lora.ParamWrapper). Its layout, for a parameter adapted at rank r:
    lora_A (E·r, in)   expert e's A in rows [e·r, (e+1)·r)
    lora_B (out, r·E)  expert e's B in columns r'·E + e for r' in [0, r)
The two wrappers of one module nest in the order transformers registers the parameters, so gate_up_proj
is the inner one (`mlp.experts.base_layer.lora_*`) and down_proj the outer one (`mlp.experts.lora_*`).
Our slots keep gate_proj and up_proj apart (each rank R, as on dense layers and in Tinker); the fused
gate_up_proj carries both at rank 2R: A is gate's rank block over up's, B block-diagonal, and
`rank_pattern` / `alpha_pattern` give it r = 2R and alpha = 2·alpha, so its scale alpha / R is unchanged
(what PEFT's own conversion of per-expert adapters does). PEFT rewrites `target_modules` naming gate_proj,
up_proj or down_proj into expert `target_parameters` on MoE models, which would drop the dense MLP
layers of `mlp_only_layers`; those are named as parameters (`mlp.gate_proj.weight`) instead, whose
tensors PEFT keys like a linear target's. Knows nothing of files, runs or the engine.

Shapes: E experts, R a slot's rank, I / O a projection's in / out features, F expert MLP width.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

_A, _B = ".lora_A.weight", ".lora_B.weight"
# A slot target path on an expert projection, and on an MLP projection (dense in an MoE model).
_EXPERT_PATH = re.compile(r"(?P<layer>.+\.mlp)\.experts\.(?P<proj>gate_proj|up_proj|down_proj)")
_MLP_PATH = re.compile(r"(?P<layer>.+\.mlp)\.(?P<proj>gate_proj|up_proj|down_proj)")
# PEFT's prefixes of the two ParamWrappers on `<layer>.experts`.
_GATE_UP, _DOWN = ".experts.base_layer", ".experts"
GATE_UP_PARAMETER, DOWN_PARAMETER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def to_peft(
    weights: Mapping[str, Tensor], rank: int, alpha: float
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Slot tensors by name (`<path>.lora_A.weight`, `.lora_B.weight`) -> (PEFT tensors by key, without
    the `base_model.model.` prefix; the adapter_config fields that name the targets)."""
    paths = list(dict.fromkeys(name.removesuffix(_A).removesuffix(_B) for name in weights))
    pairs = {path: (weights[path + _A], weights[path + _B]) for path in paths}
    expert_matches = [match for match in map(_EXPERT_PATH.fullmatch, paths) if match is not None]
    expert_paths = {match[0] for match in expert_matches}
    tensors: dict[str, Tensor] = {}
    for layer in dict.fromkeys(match["layer"] for match in expert_matches):
        (A_gate, B_gate), (A_up, B_up), (A_down, B_down) = (
            pairs[f"{layer}.experts.{proj}"] for proj in ("gate_proj", "up_proj", "down_proj")
        )
        tensors[layer + _GATE_UP + _A] = _stack_rank_blocks(A_gate, A_up, rank)
        tensors[layer + _GATE_UP + _B] = torch.block_diag(_to_peft_B(B_gate, rank), _to_peft_B(B_up, rank))
        tensors[layer + _DOWN + _A] = A_down
        tensors[layer + _DOWN + _B] = _to_peft_B(B_down, rank)
    linear = [path for path in paths if path not in expert_paths]
    for path in linear:
        tensors[path + _A], tensors[path + _B] = pairs[path]
    if not expert_paths:
        return tensors, {"target_modules": sorted({_leaf(path) for path in linear})}
    as_parameters = {path for path in linear if _MLP_PATH.fullmatch(path)}
    return tensors, {
        "target_modules": sorted({_leaf(path) for path in linear if path not in as_parameters}),
        "target_parameters": sorted(
            {GATE_UP_PARAMETER, DOWN_PARAMETER, *(f"mlp.{_leaf(path)}.weight" for path in as_parameters)}
        ),
        "rank_pattern": {GATE_UP_PARAMETER: 2 * rank},
        "alpha_pattern": {GATE_UP_PARAMETER: 2 * alpha},
    }


def from_peft(tensors: Mapping[str, Tensor], rank: int) -> dict[str, tuple[Tensor, Tensor]]:
    """PEFT tensors by key (without the prefix) -> (A, B) per slot target path, checked against `rank`;
    ValueError naming the first tensor that does not fit. Inverse of `to_peft`."""
    paths = sorted({key.removesuffix(_A).removesuffix(_B) for key in tensors})
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    for path in paths:
        if path + _A not in tensors or path + _B not in tensors:
            raise ValueError(f"{path} has only one of lora_A and lora_B")
        A, B = tensors[path + _A], tensors[path + _B]
        if A.dim() != 2 or B.dim() != 2:
            raise ValueError(
                f"{path} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}; both must be 2-D"
            )
        if path.endswith(_GATE_UP):
            layer = path.removesuffix(_GATE_UP)
            gate, up = _split_gate_up(path, A, B, rank)
            pairs[f"{layer}.experts.gate_proj"], pairs[f"{layer}.experts.up_proj"] = gate, up
        elif path.endswith(_DOWN):
            _check_expert_blocks(path, A, B, rank)
            pairs[f"{path.removesuffix(_DOWN)}.experts.down_proj"] = (A, _from_peft_B(B, rank))
        else:
            if A.shape[0] != rank or B.shape[1] != rank:
                raise ValueError(
                    f"{path} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}; "
                    f"expected (r, in) and (out, r) with r = {rank}"
                )
            pairs[path] = (A, B)
    return pairs


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _stack_rank_blocks(A_gate: Tensor, A_up: Tensor, rank: int) -> Tensor:
    """(E·R, I) twice -> (E·2R, I): per expert, gate's rank block then up's."""
    in_features = A_gate.shape[1]
    return torch.stack([A_gate.view(-1, rank, in_features), A_up.view(-1, rank, in_features)], dim=1).view(
        -1, in_features
    )


def _to_peft_B(B_OR: Tensor, rank: int) -> Tensor:
    """Our B (O, E·R), expert-major columns -> PEFT's (O, R·E), rank-major columns."""
    out_features = B_OR.shape[0]
    return B_OR.view(out_features, -1, rank).transpose(1, 2).reshape(out_features, -1)


def _from_peft_B(B: Tensor, rank: int) -> Tensor:
    """PEFT's B (O, R·E), rank-major columns -> ours (O, E·R), expert-major columns."""
    out_features = B.shape[0]
    return B.view(out_features, rank, -1).transpose(1, 2).reshape(out_features, -1)


def _check_expert_blocks(path: str, A: Tensor, B: Tensor, rank: int) -> None:
    """An expert parameter's A (E·r, I) and B (O, r·E) at rank `rank`."""
    if A.shape[0] % rank or B.shape[1] != A.shape[0]:
        raise ValueError(
            f"{path} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}; expected (E·r, in) and "
            f"(out, r·E) with r = {rank}"
        )


def _split_gate_up(
    path: str, A: Tensor, B: Tensor, rank: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """gate_up_proj's rank-2R PEFT pair -> gate's and up's (A, B); B must be block-diagonal."""
    _check_expert_blocks(path, A, B, 2 * rank)
    in_features, (out_features, columns) = A.shape[1], B.shape
    A_E2RI = A.view(-1, 2, rank, in_features)
    half_rows, half_columns = out_features // 2, columns // 2
    B_gate, B_up = B[:half_rows, :half_columns], B[half_rows:, half_columns:]
    if out_features % 2 or B[:half_rows, half_columns:].any() or B[half_rows:, :half_columns].any():
        raise ValueError(
            f"{path}: lora_B {tuple(B.shape)} is not block-diagonal over gate_proj and up_proj, so it is not "
            "a LoRA on each of them"
        )
    return (
        (A_E2RI[:, 0].reshape(-1, in_features), _from_peft_B(B_gate, rank)),
        (A_E2RI[:, 1].reshape(-1, in_features), _from_peft_B(B_up, rank)),
    )
