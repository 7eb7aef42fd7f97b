"""`loraplex memory-plan`: what one rank holds (model/memory_plan.py) for each model and tensor-parallel
size T asked for, and which (N, T) fit on which card, as Markdown tables (docs/MEMORY.md pastes them) or
as JSON. Arithmetic only: nothing is loaded, and torch is not imported.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.errors import UserError
from loraplex.model.config import DecoderConfig, ModelLoadError
from loraplex.model.memory_plan import (
    CARDS,
    DEFAULT_HEADROOM_BYTES,
    LORA_GROUP_NAMES,
    Card,
    LoraSpec,
    RankPlan,
    ShardingError,
    base_parameters,
    plan_rank,
)
from loraplex.model.presets import PUBLISHED

HELP = (
    "Plan the memory of every rank: base, adapter, optimizer and KV cache bytes by tensor-parallel size, "
    "and which (N, T) fit on a card (docs/MEMORY.md). Computes, loads nothing."
)
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}
_GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument(
        "--model",
        nargs="+",
        default=list(PUBLISHED),
        help=f"Published shapes ({', '.join(PUBLISHED)}) or HF model directories (their config.json) "
        "(default: the four published shapes).",
    )
    parser.add_argument(
        "--tp", type=_int_list, default=[1, 2, 4, 8], help="Tensor-parallel sizes T, comma-separated."
    )
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank of every slot (default: 32).")
    parser.add_argument(
        "--targets",
        type=_groups,
        default=frozenset(LORA_GROUP_NAMES),
        help="LoRA target groups, comma-separated: attn, mlp, unembed (default: all three).",
    )
    parser.add_argument("--slots", type=int, default=8, help="Adapter slots, --max-slots (default: 8).")
    parser.add_argument(
        "--kv-tokens", type=int, default=32768, help="Tokens the sampler's KV cache holds (default: 32768)."
    )
    parser.add_argument(
        "--dtype", choices=tuple(_DTYPE_BYTES), default="bf16", help="Base weights' dtype (default: bf16)."
    )
    parser.add_argument(
        "--card",
        type=_card,
        action="append",
        help="A card as NAME=MIB, repeatable (default: 80 GB=81559 and 141 GB=143771, nvidia-smi's totals).",
    )
    parser.add_argument(
        "--headroom-gib",
        type=float,
        default=DEFAULT_HEADROOM_BYTES / _GIB,
        help="GiB a rank must keep free for activations, the CUDA context and allocator slack to fit "
        f"(default: {DEFAULT_HEADROOM_BYTES / _GIB:g}).",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of Markdown.")


@dataclass(frozen=True)
class _Model:
    name: str
    config: DecoderConfig
    plans: dict[int, RankPlan | ShardingError]  # by T


def run(args: argparse.Namespace) -> int:
    """The `loraplex memory-plan` command."""
    if min(args.rank, args.slots) < 1 or args.kv_tokens < 0:
        raise UserError("--rank and --slots must be at least 1, --kv-tokens at least 0")
    cards = tuple(args.card or CARDS)
    headroom = round(args.headroom_gib * _GIB)
    lora = LoraSpec(args.rank, args.targets)
    models = []
    for model in args.model:
        config = _read_config(model)
        plans: dict[int, RankPlan | ShardingError] = {}
        for tp in args.tp:
            try:
                plans[tp] = plan_rank(config, tp, _DTYPE_BYTES[args.dtype], lora, args.slots, args.kv_tokens)
            except ShardingError as refusal:
                plans[tp] = refusal
        models.append(_Model(Path(model).name if model not in PUBLISHED else model, config, plans))
    if args.json:
        print(json.dumps(_as_json(models, args, cards, headroom), indent=2))
    else:
        print(_as_markdown(models, args, cards, headroom), end="")
    return 0


def _read_config(model: str) -> DecoderConfig:
    """A published shape by name, else the config.json of a model directory."""
    if model in PUBLISHED:
        return DecoderConfig.from_hf(PUBLISHED[model])
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        raise UserError(
            f"--model {model!r} is neither a published shape ({', '.join(PUBLISHED)}) nor an HF "
            "model directory (no config.json)"
        )
    try:
        return DecoderConfig.from_hf(json.loads(path.read_text()))
    except ModelLoadError as error:
        raise UserError(f"--model {model}: {error}") from None


def _as_markdown(
    models: list[_Model], args: argparse.Namespace, cards: tuple[Card, ...], headroom: int
) -> str:
    targets = ", ".join(g for g in LORA_GROUP_NAMES if g in args.targets)
    columns = ["T", "base", "adapter", "optimizer", "KV", "total", *(f"{c.name} card" for c in cards)]
    lines = [
        f"GiB on each rank: the base in {args.dtype}; {args.slots} slots of LoRA rank {args.rank} on "
        f"{targets}; a KV cache of {args.kv_tokens} tokens. A card column says whether a rank keeps "
        f"{headroom / _GIB:g} GiB of the card free, the GiB it has free (or lacks), and how many slots "
        "would fit.",
        "",
    ]
    for model in models:
        lines += [
            f"### {model.name} ({base_parameters(model.config) / 1e9:.2f}B parameters)",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "--:|" * 6 + ":--|" * len(cards),
        ]
        for tp, plan in model.plans.items():
            if isinstance(plan, ShardingError):
                lines.append(f"| {tp} | {plan} |" + " |" * (len(columns) - 2))
                continue
            sizes = (plan.base, plan.adapter, plan.optimizer, plan.kv, plan.total)
            fit = [_fit(plan, c, headroom) for c in cards]
            lines.append(f"| {tp} | " + " | ".join([*(f"{s / _GIB:.1f}" for s in sizes), *fit]) + " |")
        lines.append("")
    lines += [
        "### Which (N, T) fit",
        "",
        "N ranks train as N/T data-parallel groups of T tensor-parallel ranks. A rank's memory depends on T "
        "alone, so a model fits with these T and any N that is a multiple of T.",
        "",
        "| model | " + " | ".join(f"{c.name} card" for c in cards) + " |",
        "|---|" + "---|" * len(cards),
    ]
    for model in models:
        lines.append(f"| {model.name} | " + " | ".join(_fitting(model, c, headroom) for c in cards) + " |")
    return "\n".join(lines) + "\n"


def _fit(plan: RankPlan, card: Card, headroom: int) -> str:
    """One card cell: fits or not, GiB free or short, slots that would fit."""
    free = plan.free_bytes(card) / _GIB
    room = f"{free:.1f} free" if free >= 0 else f"{-free:.1f} short"
    return (
        f"{'yes' if plan.fits(card, headroom) else 'no'}: {room}, {plan.slots_that_fit(card, headroom)} slots"
    )


def _fitting(model: _Model, card: Card, headroom: int) -> str:
    """The T that fit `card`, or why none does."""
    plans = {tp: p for tp, p in model.plans.items() if isinstance(p, RankPlan)}
    fit = [str(tp) for tp, plan in plans.items() if plan.fits(card, headroom)]
    refused = "; ".join(str(p) for p in model.plans.values() if isinstance(p, ShardingError))
    if fit:
        return f"T = {', '.join(fit)}"
    tried = ", ".join(map(str, plans))
    return f"none of T = {tried}" + (f" ({refused})" if refused else "") if tried else refused


def _as_json(
    models: list[_Model], args: argparse.Namespace, cards: tuple[Card, ...], headroom: int
) -> dict[str, Any]:
    def row(tp: int, plan: RankPlan | ShardingError) -> dict[str, Any]:
        if isinstance(plan, ShardingError):
            return {"tp": tp, "refused": str(plan)}
        kinds = ("base", "adapter", "optimizer", "kv", "total")
        return {
            "tp": tp,
            **{f"{kind}_bytes": getattr(plan, kind) for kind in kinds},
            "slot_parameters": plan.slot.parameters,
            "cards": {
                c.name: {
                    "fits": plan.fits(c, headroom),
                    "free_bytes": plan.free_bytes(c),
                    "slots_that_fit": plan.slots_that_fit(c, headroom),
                }
                for c in cards
            },
        }

    return {
        "dtype": args.dtype,
        "lora_rank": args.rank,
        "targets": [g for g in LORA_GROUP_NAMES if g in args.targets],
        "slots": args.slots,
        "kv_tokens": args.kv_tokens,
        "headroom_bytes": headroom,
        "cards": {c.name: c.total_bytes for c in cards},
        "models": [
            {
                "model": m.name,
                "parameters": base_parameters(m.config),
                "ranks": [row(tp, plan) for tp, plan in m.plans.items()],
            }
            for m in models
        ],
    }


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"every T must be at least 1, got {text!r}")
    return values


def _groups(text: str) -> frozenset[str]:
    groups = frozenset(part.strip() for part in text.split(","))
    if not groups or not groups <= set(LORA_GROUP_NAMES):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(LORA_GROUP_NAMES)}, got {text!r}")
    return groups


def _card(text: str) -> Card:
    name, _, mib = text.rpartition("=")
    if not name or not mib.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=MIB, e.g. 'B200=183359', got {text!r}")
    return Card(name, int(mib) << 20)
