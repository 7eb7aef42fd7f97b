"""Sparse mixture-of-experts MLP (Qwen3-MoE) with LoRA on every expert, fused across slots and experts.

A frozen router sends each token to its top P of E SwiGLU experts. Once per layer forward,
`ExpertGroups` sorts the token-expert rows by expert and finds each slot's rows among them. Each expert
projection (`ExpertLinear`) then runs its frozen base as one grouped matmul over every slot's tokens
(one group per expert), and each attached slot's LoRA delta as two grouped matmuls over that slot's rows
(one group per expert): a Python loop per slot, none per token or per expert. `sparse_moe_reference` is
the per-token loop the block must equal.

A slot on an expert projection (in I, out O, rank R) holds A (E·R, I) and B (O, E·R), expert e owning
rows / columns [e·R, (e+1)·R): one rank-E·R LoRA whose rank axis is cut into a block per expert. The
tensors stay 2-D like every other target's, and each expert's block is a view (peft_format.py maps the
layout to PEFT's). Knows nothing of runs, tenants, optimizers or checkpoints.

Expert parallelism (a `TensorParallel` of T ranks, T dividing E): each rank holds E/T consecutive experts
and its experts' rank blocks of every slot's A and B, and the router whole. The block's input is already
the same on every rank of the group (the attention's output is all-reduced), so every rank routes every
token, identically, and no token has to travel: unlike expert parallelism across data-parallel ranks,
there is no all-to-all to dispatch rows and none to bring them back. A rank sorts its own experts' rows
first and runs the grouped matmuls over those rows only (`grouped_mm`'s ungrouped rows: zero, without a
host sync to count them); the other rows' outputs are zero, so the weighted sum over the picks is this
rank's partial output, and one all-reduce (`reduce_from_tp`, a (T, D) one per MoE layer, as the dense
MLP's row-parallel down_proj costs) sums the partials. The input enters through `copy_to_tp`, so its
gradient, the router's path included, is summed over the ranks. Each rank keeps the whole expert load:
the routing it computed is every rank's.

Shapes: T tokens, D hidden, E experts, P experts picked per token, F expert MLP width, N = T·P token-expert
rows sorted by expert, I / O a projection's in / out features, R a slot's rank, n one slot's rows, H the
experts this rank holds (E, or E/T under expert parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from loraplex.model.config import DecoderConfig
from loraplex.model.elementwise import EAGER
from loraplex.model.grouped_mm import grouped_mm
from loraplex.model.lora_precision import LoRADtypes, scaled_shrink
from loraplex.model.multi_lora import LoRARouting, SlotWeights
from loraplex.model.tensor_parallel import (
    SINGLE,
    WHOLE,
    LoRASharding,
    Split,
    TensorParallel,
    copy_to_tp,
    reduce_from_tp,
)

Device = torch.device | str | None


class SlotRows(NamedTuple):
    """One slot's rows among an `ExpertGroups`' sorted rows: ascending, so grouped by expert."""

    slot: int
    rows_n: Tensor  # (n,) int64 indices into the N sorted rows
    offsets_H: Tensor  # (H,) int32 end of each held expert's block within rows_n


@dataclass(frozen=True)
class ExpertGroups:
    """One MoE layer's token-expert rows sorted by expert, and where each slot's rows are among them;
    under expert parallelism this rank's experts' rows come first, and the offsets end there."""

    order_N: Tensor  # (N,) int64: flat (token · P + pick) index of the assignment at each sorted row
    offsets_H: Tensor  # (H,) int32: end row of each held expert's block
    load_E: Tensor  # (E,) int64: rows routed to each expert, every rank's experts included
    slot_rows: tuple[SlotRows, ...]  # every slot the routing names, in order of first appearance

    @classmethod
    def build(
        cls, experts_TP: Tensor, routing: LoRARouting | None, num_experts: int, held: Split | None = None
    ) -> ExpertGroups:
        """Sort by expert (stable, so each expert's rows keep token order), counting on the device and
        reading nothing back from it (the slots' token index comes from `LoRARouting.token_slots`, built
        once per routing). `held`: the experts this rank holds under expert parallelism (None: all)."""
        picks = experts_TP.shape[1]
        experts_N = experts_TP.reshape(-1)
        load_E = count_ids(experts_N, num_experts)
        keys_N, counts_E, num_held = experts_N, load_E, num_experts
        if held is not None:
            # Expert ids rotated so that the held ones come first, in order: their rows lead the sort.
            keys_N = (experts_N - held.start).remainder(num_experts)
            counts_E, num_held = load_E.roll(-held.start), held.size
        order_N = torch.argsort(keys_N, stable=True)
        offsets_H = counts_E[:num_held].cumsum(0).to(torch.int32)
        if routing is None or not any(segment.slot is not None for segment in routing.segments):
            return cls(order_N, offsets_H, load_E, ())
        slots, num_tokens, index_T = routing.token_slots(experts_TP.device)
        base = len(slots)  # the key of base-only rows, sorted after every slot's
        slot_N = index_T.index_select(0, order_N // picks)
        slot_N = torch.where(slot_N < 0, base, slot_N)
        # Stable: a slot's rows stay in sorted order, so they come grouped by expert.
        by_slot_N = torch.argsort(slot_N, stable=True)
        pairs_N = slot_N * num_experts + keys_N.index_select(0, order_N)
        counts_SE = count_ids(pairs_N, (base + 1) * num_experts).view(base + 1, num_experts)
        offsets_SH = counts_SE[:base, :num_held].cumsum(1).to(torch.int32)
        sizes = [picks * n for n in num_tokens]
        rows = by_slot_N[: sum(sizes)].split(sizes)
        slot_rows = tuple(
            SlotRows(slot, rows_n, offsets_H)
            for slot, rows_n, offsets_H in zip(slots, rows, offsets_SH.unbind(0), strict=True)
        )
        return cls(order_N, offsets_H, load_E, slot_rows)


def count_ids(ids_N: Tensor, num_ids: int) -> Tensor:
    """(num_ids,) int64: how often each id in [0, num_ids) occurs in the int64 `ids_N`, as
    `torch.bincount(ids_N, minlength=num_ids)` counts them, without its host syncs: on CUDA bincount reads
    the ids' min and max back to size its result, whereas integer adds into a buffer of known size read
    nothing back (and, exact and order-free, are bitwise repeatable on GPUs too)."""
    counts = torch.zeros(num_ids, dtype=torch.int64, device=ids_N.device)
    return counts.scatter_add_(0, ids_N, torch.ones_like(ids_N))


class ExpertLinear(nn.Module):
    """E frozen linear maps x W_eᵀ, one per expert, plus each routed slot's per-expert LoRA delta.

    `num_experts`, `in_features` and `out_features` are the whole layer's. `weight` (H, O, I) holds the
    experts this rank holds (`held`: E/T consecutive ones under expert parallelism, else all E), allocated
    uninitialised (a checkpoint loader fills it); slots attach A (H·R, I) and B (O, H·R), those experts'
    rank blocks, by reference, as MultiLoRALinear's do.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        device: Device,
        dtype: torch.dtype | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.tp = tp
        # check_shardable ensures tp.size divides E: every rank holds as many whole experts.
        self.held = tp.split(num_experts, 0)
        self.num_held = num_experts if self.held is None else self.held.size
        weight = torch.empty(self.num_held, out_features, in_features, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        # Plain dict, not registered: slot tensors are the slot pool's, not this module's state.
        self._slots: dict[int, SlotWeights] = {}

    def lora_shapes(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of a rank-`rank` slot's A and B as this rank attaches them: one rank block per
        expert it holds."""
        rows = self.num_held * rank
        return (rows, self.in_features), (self.out_features, rows)

    def lora_sharding(self, rank: int) -> LoRASharding:
        """Whole with one rank; under expert parallelism this rank's experts' rank blocks of a rank-`rank`
        slot: A's rows and B's columns [start·R, end·R) of E·R. T divides E, so the even split of E·R that
        `TensorParallel.split` makes is exactly these blocks (as `gather_split` needs)."""
        if self.held is None:
            return WHOLE
        A, B = self.tp.split(self.num_experts * rank, 0), self.tp.split(self.num_experts * rank, 1)
        assert A is not None and B is not None and A.start == self.held.start * rank, "T must divide E"
        return LoRASharding(A, B)

    def parameter_splits(self) -> dict[str, Split]:
        """Parameter name -> this rank's part of the whole layer's: the held experts of the stacked weight."""
        return {} if self.held is None else {"weight": self.held}

    def attach(self, slot: int, A_RI: Tensor, B_OR: Tensor, scale: float) -> None:
        """Route `slot`'s rows through A (H·R, in) and B (out, H·R), held by reference (replacing any)."""
        rows, H = A_RI.shape[0], self.num_held
        expected = self.lora_shapes(rows // H)
        if rows % H or (A_RI.shape, B_OR.shape) != expected:
            held = "" if self.held is None else f" (the {H} of {self.num_experts} this rank holds)"
            raise ValueError(
                f"slot {slot}: A {tuple(A_RI.shape)} and B {tuple(B_OR.shape)} do not fit "
                f"{H} experts{held} of {self.in_features} -> {self.out_features}; expected "
                f"(E·R, {self.in_features}) and ({self.out_features}, E·R) with E = {H}"
            )
        if A_RI.dtype != torch.float32 or B_OR.dtype != torch.float32:
            raise ValueError(f"slot {slot}: LoRA tensors must be float32, got {A_RI.dtype} and {B_OR.dtype}")
        self._slots[slot] = SlotWeights(A_RI, B_OR, float(scale))

    def detach(self, slot: int) -> None:
        """Stop routing `slot` through this layer (no-op if it is not attached)."""
        self._slots.pop(slot, None)

    def has_slot(self, slot: int) -> bool:
        """Whether `slot` is attached to this layer."""
        return slot in self._slots

    def forward(self, x_NI: Tensor, groups: ExpertGroups) -> Tensor:
        """Every row through its expert's base weight, plus its slot's delta for that expert; under
        expert parallelism, zero for the rows of experts this rank does not hold (they follow its own).

        Semantics (see `sparse_moe_reference`): row r of expert e and slot s gives
            x[r] @ W[e].T + scale_s · B_s[:, e·R:(e+1)·R] @ A_s[e·R:(e+1)·R] @ x[r]
        The LoRA delta follows lora_precision.py's rule, as the dense layers' do. torch._grouped_mm (the
        one grouped GEMM kernel, for bf16 on GPUs; in fp32 a GPU would fall back to one matmul launch
        and a host sync per (expert, slot) group) accumulates in fp32 but returns its operands' dtype: the
        shrink is rounded to x's dtype once before its fp32 scale, and each delta once before its add
        into y. A and B stay fp32 and receive fp32 gradients (summed in fp32, rounded once to x's dtype
        by the same kernel in the backward).
        """
        others = self.held is not None  # rows of other ranks' experts: no group of this rank's
        y_NO = grouped_mm(x_NI, self.weight.transpose(1, 2), groups.offsets_H, others)
        H, I, O = self.num_held, self.in_features, self.out_features
        dtypes = LoRADtypes.of(x_NI, y_NO)
        for part in groups.slot_rows:
            weights = self._slots.get(part.slot)
            if weights is None:
                continue
            R = weights.A_RI.shape[0] // H
            A_1RI, B_1OR = dtypes.operands([weights.A_RI], [weights.B_OR])
            A_HRI = A_1RI.view(H, R, I)
            B_HRO = B_1OR.view(O, H, R).permute(1, 2, 0)
            x_nI = x_NI.index_select(0, part.rows_n)
            shrunk_nR = scaled_shrink(
                grouped_mm(x_nI, A_HRI.transpose(1, 2), part.offsets_H, others), weights.scale
            )
            delta_nO = grouped_mm(dtypes.expand_operand(shrunk_nR), B_HRO, part.offsets_H, others)
            # A slot's rows are distinct, so no two deltas add into one row (deterministic on GPUs too).
            y_NO.index_add_(0, part.rows_n, delta_nO)
        return y_NO

    def extra_repr(self) -> str:
        held = "" if self.held is None else f", held={self.held.start}..{self.held.end - 1}"
        return (
            f"num_experts={self.num_experts}{held}, in_features={self.in_features}, "
            f"out_features={self.out_features}, slots={sorted(self._slots)}"
        )


class SparseMoE(nn.Module):
    """Router plus experts: out(x) = Σ over x's top-P experts e of w_e · down_e(silu(gate_e(x)) · up_e(x)).

    Module names are HF's (`gate` is the router; `experts.gate_proj` holds every expert's gate_proj, or
    under expert parallelism this rank's experts', see the module docstring). `load_E` keeps the rows each
    of the E experts received in the last forward, on the device (no host sync), for the engine to report.
    """

    def __init__(
        self, config: DecoderConfig, device: Device, dtype: torch.dtype | None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.tp = tp
        self.held = tp.split(E, 0)  # this rank's experts; None: all of them
        self.gate = nn.utils.skip_init(nn.Linear, D, E, bias=False, device=device, dtype=dtype)
        self.experts = nn.ModuleDict(
            {
                "gate_proj": ExpertLinear(E, D, F, device, dtype, tp),
                "up_proj": ExpertLinear(E, D, F, device, dtype, tp),
                "down_proj": ExpertLinear(E, F, D, device, dtype, tp),
            }
        )
        self.load_E: Tensor | None = None
        self.elementwise = EAGER  # the decoder's choice (Decoder.use_elementwise)

    def route(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """(weights_TP in x's dtype, experts_TP): top-P of the fp32 softmax over router logits, as HF does."""
        probs_TE = self.gate(x_TD).softmax(-1, dtype=torch.float32)
        weights_TP, experts_TP = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TP = weights_TP / weights_TP.sum(-1, keepdim=True)
        return weights_TP.to(x_TD.dtype), experts_TP

    def forward(self, x_TD: Tensor, routing: LoRARouting | None) -> Tensor:
        """Each token's weighted sum over its experts, each expert with the token's slot's LoRA blocks.

        Semantics (`sparse_moe_reference` runs exactly this loop, with the same routing):
            for t in range(T):
                out[t] = Σ over (w, e) in top-P of route(x[t]) of
                         w · down_e(silu(gate_e(x[t])) · up_e(x[t]))   (each projection per ExpertLinear)
        Under expert parallelism each rank sums the terms of its experts, and the ranks' sums are summed.
        """
        T, D = x_TD.shape
        x_TD = copy_to_tp(x_TD, self.tp)  # once for the router and every expert: one gradient all-reduce
        weights_TP, experts_TP = self.route(x_TD)
        groups = ExpertGroups.build(experts_TP, routing, self.num_experts, self.held)
        self.load_E = groups.load_E
        # Each token repeated once per pick, then permuted: a gather whose backward adds no two rows into one.
        x_ND = x_TD[:, None, :].expand(T, self.top_k, D).reshape(-1, D).index_select(0, groups.order_N)
        experts = self.experts
        hidden_NF = self.elementwise.swiglu(
            experts["gate_proj"](x_ND, groups), experts["up_proj"](x_ND, groups)
        )
        y_ND = experts["down_proj"](hidden_NF, groups)
        # Back to (token, pick) order, then the weighted sum over picks: no scattered adds.
        y_TPD = y_ND.new_empty(y_ND.shape).index_copy_(0, groups.order_N, y_ND).view(T, self.top_k, D)
        return reduce_from_tp((y_TPD * weights_TP[..., None]).sum(1), self.tp)


def sparse_moe_reference(block: SparseMoE, x_TD: Tensor, slot_of_token: list[int | None]) -> Tensor:
    """Plain per-token loop that `SparseMoE.forward` must equal (values and gradients); for tests (slow)."""
    weights_TP, experts_TP = block.route(x_TD)
    gate, up, down = (block.experts[name] for name in ("gate_proj", "up_proj", "down_proj"))
    rows_D = []
    for t, slot in enumerate(slot_of_token):
        out_D = torch.zeros_like(x_TD[t])
        for weight, expert in zip(weights_TP[t], experts_TP[t].tolist(), strict=True):
            x_D = x_TD[t]
            hidden_F = nn.functional.silu(_project(gate, expert, slot, x_D)) * _project(up, expert, slot, x_D)
            out_D = out_D + weight * _project(down, expert, slot, hidden_F)
        rows_D.append(out_D)
    return torch.stack(rows_D)


def _project(layer: nn.Module, expert: int, slot: int | None, x_I: Tensor) -> Tensor:
    """One row through one expert of an ExpertLinear, with its slot's block of A and B."""
    y_O = layer.weight[expert] @ x_I
    lora = layer._slots.get(slot) if slot is not None else None
    if lora is None:
        return y_O
    R = lora.A_RI.shape[0] // layer.num_experts
    A_RI, B_OR = (t.to(x_I.dtype) for t in (lora.A_RI, lora.B_OR))
    block = slice(expert * R, (expert + 1) * R)
    return y_O + lora.scale * B_OR[:, block] @ (A_RI[block] @ x_I)
