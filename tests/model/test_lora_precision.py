"""The LoRA precision rule (model/lora_precision.py), dense and per expert: bf16 within a bound derived
from the computation, in values and gradients; fp32 bitwise what it computed before the rule.

The bound is propagated alongside the computation (`Bounded`): each value is held exactly in float64
(computed from the same bf16-rounded inputs and weights as the op under test) with a bound on each of
its elements' error, grown by the two things the op does:
- an fp32 accumulation of n products (a matmul's reduction: I for a shrink, R for an expand, with y
  for a baddbmm, O or the rows for a gradient) lies within γ_n·Σ|a_k||b_k| of its exact value (Higham,
  Accuracy and Stability of Numerical Algorithms, §3.1: γ_n = n·u/(1 - n·u), u = 2⁻²⁴ for fp32, in
  any summation order), and operand errors e_a, e_b carry through as e_a·(|b| + e_b) + |a|·e_b;
- a rounding to bf16 moves a value by at most u·|value| with u = 2⁻⁸ (bf16's 8 significant bits).
A worst-case bound per element: no constant is tuned, and none is measured on this CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from loraplex.model.grouped_mm import grouped_mm
from loraplex.model.moe import ExpertGroups, ExpertLinear
from loraplex.model.multi_lora import LoRARouting, Segment, SlotWeights, add_lora_delta
from tests.model.rounding import BF16_U, U

BF16, F32 = torch.bfloat16, torch.float32
# cuBLAS and the grouped GEMM kernel are what the rule is for; the CPU models them (fp32 sums, one rounding).
# On a GPU the long sums (the shrink's over I, the weight gradients' over tokens) return fp32, so cuBLAS's
# bf16 split-K reductions (allow_bf16_reduced_precision_reduction) can only touch the R-long ones.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def unit_of(dtype: torch.dtype) -> float:
    """The unit roundoff of rounding an fp32 result to `dtype` (none to fp32 itself)."""
    return BF16_U if dtype == BF16 else 0.0


def gamma(n: int) -> float:
    """Higham's γ_n for fp32: the relative error bound of an n-term fp32 dot product."""
    return n * U / (1 - n * U)


@dataclass(frozen=True)
class Bounded:
    """A value as computed in low precision: its exact float64 value and a bound on each element's error."""

    exact: Tensor
    error: Tensor

    @classmethod
    def of(cls, value: Tensor) -> Bounded:
        """An input: exactly its (bf16- or fp32-valued) elements."""
        exact = value.detach().cpu().double()
        return cls(exact, torch.zeros_like(exact))

    @property
    def mT(self) -> Bounded:
        return Bounded(self.exact.mT, self.error.mT)

    def __matmul__(self, other: Bounded) -> Bounded:
        """self @ other accumulated in fp32 over the shared dimension."""
        return self.matmul_plus(other, None)

    def matmul_plus(self, other: Bounded, plus: Bounded | None) -> Bounded:
        """plus + self @ other accumulated in fp32 as one sum (a baddbmm: plus is one more term)."""
        a, b = self.exact.abs() + self.error, other.exact.abs() + other.error
        n = self.exact.shape[-1] + (plus is not None)
        carried = self.error @ b + self.exact.abs() @ other.error
        magnitude = a @ b
        exact = self.exact @ other.exact
        if plus is not None:
            exact, carried = exact + plus.exact, carried + plus.error
            magnitude = magnitude + plus.exact.abs() + plus.error
        return Bounded(exact, carried + gamma(n) * magnitude)

    def scaled(self, scale: float) -> Bounded:
        """self · scale in fp32 (scale itself rounded to fp32, then the product: two fp32 roundings)."""
        error = abs(scale) * (self.error + 2 * U * (self.exact.abs() + self.error))
        return Bounded(scale * self.exact, error)

    def rounded(self, dtype: torch.dtype) -> Bounded:
        """Rounded once to `dtype`."""
        return Bounded(self.exact, self.error + unit_of(dtype) * (self.exact.abs() + self.error))

    def plus(self, other: Bounded, dtype: torch.dtype) -> Bounded:
        """self + other, rounded once to `dtype` (an fp32 sum: one fp32 rounding at most)."""
        total = Bounded(self.exact + other.exact, self.error + other.error)
        unit = unit_of(dtype) or U
        return Bounded(total.exact, total.error + unit * (total.exact.abs() + total.error))


def assert_within(got: Tensor, bound: Bounded, what: str) -> None:
    """Every element of `got` within its bound of the exact value."""
    excess = (got.detach().cpu().double() - bound.exact).abs() - bound.error
    assert excess.max() <= 0, f"{what}: {int((excess > 0).sum())} elements past their bound"


def fraction_past(got: Tensor, bound: Bounded) -> float:
    """The fraction of `got`'s elements past their bound: a wrong computation's should be most."""
    return float(((got.detach().cpu().double() - bound.exact).abs() > bound.error).double().mean())


# ---- dense ----

# One run of three stacked slots (slot 3 with its own scale: a per-segment scale tensor), a base-only
# segment, a lone rank-8 slot, and slot 0 again (its gradients summed over two segments).
DENSE_LAYOUT = LoRARouting(
    (
        Segment(0, 0, 4),
        Segment(1, 4, 8),
        Segment(3, 8, 12),
        Segment(None, 12, 15),
        Segment(2, 15, 20),
        Segment(0, 20, 24),
    )
)
# Today's runs of that layout: (first token, tokens per segment, slots stacked).
DENSE_RUNS = ((0, 4, (0, 1, 3)), (15, 5, (2,)), (20, 4, (0,)))
RANKS = {0: 4, 1: 4, 2: 8, 3: 4}
I, O = 48, 40


def dense_slots(seed: int, device: str) -> dict[int, SlotWeights]:
    generator = torch.Generator().manual_seed(seed)
    return {
        slot: SlotWeights(
            (torch.randn(rank, I, generator=generator) / I**0.5).to(device),
            torch.randn(O, rank, generator=generator).to(device),
            (32 if slot != 3 else 7) / rank,
        )
        for slot, rank in RANKS.items()
    }


def leaves_of(slots: dict[int, SlotWeights]) -> dict[int, SlotWeights]:
    return {
        s: SlotWeights(w.A_RI.clone().requires_grad_(), w.B_OR.clone().requires_grad_(), w.scale)
        for s, w in slots.items()
    }


def run_dense(
    x: Tensor, y: Tensor, g: Tensor, slots: dict[int, SlotWeights]
) -> tuple[Tensor, Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """The op's output and gradients of x, A and B against the output gradient g."""
    x = x.clone().requires_grad_()
    trained = leaves_of(slots)
    out = add_lora_delta(y, x, DENSE_LAYOUT, trained)
    out.backward(g)
    return out.detach(), x.grad, {s: (w.A_RI.grad, w.B_OR.grad) for s, w in trained.items()}


def dense_bounds(
    x: Tensor, y: Tensor, g: Tensor, slots: dict[int, SlotWeights]
) -> tuple[Bounded, Bounded, dict[int, tuple[Bounded, Bounded]]]:
    """The rule's output and gradients per segment, as Bounded values (x, y, g in their dtypes).

    Forward:  s = fl32((x Aᵀ) over I)·scale in fp32, rounded to y's dtype for the expand;
              out = (y + s Bᵀ over R, one fp32 sum) rounded once to y's dtype.
    Backward: grad_B = gᵀ s over the segment's L tokens, fp32; g_s = (g B over O)·scale, rounded to
              the compute dtype; grad_A = g_sᵀ x over L, fp32; grad_x = (g_s A over R) rounded to x's dtype.
    A in the compute dtype (x's, or y's where y is wider: the fp32-logits lm_head), B in y's: the exact
    values use A and B as the op rounds them.
    """
    compute, output = torch.promote_types(x.dtype, y.dtype), y.dtype
    outs, grad_xs, grads = [], [], {}
    for segment in DENSE_LAYOUT.segments:
        rows = slice(segment.start, segment.end)
        y_part, g_part = Bounded.of(y[rows]), Bounded.of(g[rows])
        if segment.slot is None:
            outs.append(y_part)
            grad_xs.append(Bounded.of(torch.zeros_like(x[rows])))
            continue
        A, B, scale = slots[segment.slot]
        A_c, B_e, x_part = Bounded.of(A.to(compute)), Bounded.of(B.to(output)), Bounded.of(x[rows])
        shrunk = (x_part @ A_c.mT).scaled(scale).rounded(output)
        outs.append(shrunk.matmul_plus(B_e.mT, y_part).rounded(output))
        g_shrunk = (g_part @ B_e).scaled(scale).rounded(compute)
        grad_xs.append((g_shrunk @ A_c).rounded(x.dtype))
        grad_A, grad_B = g_shrunk.mT @ x_part, g_part.mT @ shrunk
        if segment.slot in grads:  # a second segment: the two fp32 gradients summed in fp32
            first_A, first_B = grads[segment.slot]
            grad_A, grad_B = first_A.plus(grad_A, F32), first_B.plus(grad_B, F32)
        grads[segment.slot] = (grad_A, grad_B)
    return concatenated(outs), concatenated(grad_xs), grads


def concatenated(parts: list[Bounded]) -> Bounded:
    return Bounded(torch.cat([p.exact for p in parts]), torch.cat([p.error for p in parts]))


def dense_inputs(compute: torch.dtype, output: torch.dtype, device: str) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(3)
    T = DENSE_LAYOUT.num_tokens
    x = torch.randn(T, I, generator=generator).to(device, compute)
    y, g = (torch.randn(T, O, generator=generator).to(device, output) for _ in range(2))
    return x, y, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("compute", "output"), [(BF16, BF16), (BF16, F32)], ids=["bf16", "bf16_x_fp32_y"])
def test_dense_delta_and_its_gradients_stay_within_the_derived_bound(
    compute: torch.dtype, output: torch.dtype, device: str
) -> None:
    """bf16 layers, and the fp32-logits lm_head (bf16 x, fp32 y: its delta added in fp32)."""
    slots = dense_slots(seed=0, device=device)
    x, y, g = dense_inputs(compute, output, device)
    out, grad_x, grads = run_dense(x, y, g, slots)
    want_out, want_x, want_grads = dense_bounds(x, y, g, slots)
    assert out.dtype == output and grad_x.dtype == compute
    assert_within(out, want_out, "out")
    assert_within(grad_x, want_x, "grad x")
    for slot, (grad_A, grad_B) in grads.items():
        assert grad_A.dtype == grad_B.dtype == F32  # for the fp32 masters
        assert_within(grad_A, want_grads[slot][0], f"slot {slot} grad A")
        assert_within(grad_B, want_grads[slot][1], f"slot {slot} grad B")

    # Tight enough to mean something: another slot's adapter, or a forgotten scale, lands nearly every
    # element of the tokens it changes (slots 0 and 1's) outside it.
    changed = torch.cat([torch.arange(s.start, s.end) for s in DENSE_LAYOUT.segments if s.slot in (0, 1)])
    swapped = {**slots, 0: slots[1], 1: slots[0]}
    unscaled = {s: w._replace(scale=1.0) for s, w in slots.items()}
    for name, wrong in (("another slot", swapped), ("no scale", unscaled)):
        wrong_out, wrong_x, _ = run_dense(x, y, g, wrong)
        assert fraction_past(wrong_out[changed], bounded_rows(want_out, changed)) > 0.9, name
        assert fraction_past(wrong_x[changed], bounded_rows(want_x, changed)) > 0.9, name


def bounded_rows(value: Bounded, rows: Tensor) -> Bounded:
    return Bounded(value.exact[rows], value.error[rows])


def todays_dense(
    x: Tensor, y: Tensor, g: Tensor, slots: dict[int, SlotWeights]
) -> tuple[Tensor, Tensor, dict[int, list[Tensor]]]:
    """The fp32 formula of the dense delta before the rule, forward and backward, run by run."""
    out, grad_x = y.clone(), torch.zeros_like(x)
    grads: dict[int, list[Tensor]] = {}
    for start, L, run_slots in DENSE_RUNS:
        G, end = len(run_slots), start + len(run_slots) * L
        A = torch.stack([slots[s].A_RI for s in run_slots])
        B = torch.stack([slots[s].B_OR for s in run_slots])
        scales = [slots[s].scale for s in run_slots]
        scale = scales[0] if len(set(scales)) == 1 else torch.tensor(scales, device=x.device).view(-1, 1, 1)
        x_GLI, g_GLO = x[start:end].reshape(G, L, -1).float(), g[start:end].reshape(G, L, -1).float()
        shrunk = torch.bmm(x_GLI, A.transpose(1, 2)).mul_(scale)
        out[start:end].view(G, L, -1).baddbmm_(shrunk, B.transpose(1, 2))
        grad_B = torch.bmm(g_GLO.transpose(1, 2), shrunk)
        g_shrunk = torch.bmm(g_GLO, B).mul_(scale)
        grad_A = torch.bmm(g_shrunk.transpose(1, 2), x_GLI)
        grad_x[start:end] = torch.bmm(g_shrunk, A).view(G * L, -1)
        for k, slot in enumerate(run_slots):
            if slot in grads:
                grads[slot] = [grads[slot][0] + grad_A[k], grads[slot][1] + grad_B[k]]
            else:
                grads[slot] = [grad_A[k], grad_B[k]]
    return out, grad_x, grads


def test_fp32_dense_delta_and_gradients_are_bitwise_the_formula_before_the_rule() -> None:
    """The same kernels on the same operands (a GPU's choice of kernel may differ between two calls with
    differently aligned operands, so this is a CPU test: the point is the arithmetic, unchanged)."""
    slots = dense_slots(seed=1, device="cpu")
    x, y, g = dense_inputs(F32, F32, "cpu")
    out, grad_x, grads = run_dense(x, y, g, slots)
    want_out, want_x, want_grads = todays_dense(x, y, g, slots)
    assert torch.equal(out, want_out) and torch.equal(grad_x, want_x)
    for slot, (grad_A, grad_B) in grads.items():
        assert torch.equal(grad_A, want_grads[slot][0]) and torch.equal(grad_B, want_grads[slot][1])
    with torch.no_grad():  # the path without an autograd node (sampling)
        assert torch.equal(add_lora_delta(y, x, DENSE_LAYOUT, slots), want_out)


# ---- experts ----

E, EXPERT_RANK = 4, 8  # rank 8: 16-byte bf16 rows, as the GPU's grouped kernel takes them unpadded
# Slots 0 and 1 on tokens of every expert, slot 1 twice, and base-only tokens.
EXPERT_ROUTING = LoRARouting(
    (Segment(0, 0, 12), Segment(None, 12, 18), Segment(1, 18, 30), Segment(1, 30, 33))
)


def expert_layer(dtype: torch.dtype, seed: int, device: str) -> ExpertLinear:
    generator = torch.Generator().manual_seed(seed)
    layer = ExpertLinear(E, I, O, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / I**0.5)
    for slot in (0, 1):
        (A_rows, _), _ = layer.lora_shapes(EXPERT_RANK)
        A = (torch.randn(A_rows, I, generator=generator) / I**0.5).to(device).requires_grad_()
        B = torch.randn(O, A_rows, generator=generator).to(device).requires_grad_()
        layer.attach(slot, A, B, scale=(16 if slot else 12) / EXPERT_RANK)
    return layer


def expert_inputs(dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor, ExpertGroups, Tensor]:
    """x and g for the rows sorted by expert, the groups, and each sorted row's expert."""
    generator = torch.Generator().manual_seed(4)
    T = EXPERT_ROUTING.num_tokens
    experts_T1 = torch.randint(0, E, (T, 1), generator=generator)
    groups = ExpertGroups.build(experts_T1.to(device), EXPERT_ROUTING, E)
    order_N = groups.order_N.cpu()
    x = torch.randn(T, I, generator=generator)[order_N].to(device, dtype)
    g = torch.randn(T, O, generator=generator).to(device, dtype)
    return x, g, groups, experts_T1[order_N, 0]


def run_expert(
    forward: Callable[[Tensor], Tensor], layer: ExpertLinear, x: Tensor, g: Tensor
) -> list[Tensor]:
    """forward(x)'s output and gradients of x and every slot's A and B against the output gradient g."""
    x = x.clone().requires_grad_()
    out = forward(x)
    leaves = [t for slot in (0, 1) for t in layer._slots[slot][:2]]
    return [out.detach(), *torch.autograd.grad(out, [x, *leaves], g)]


def expert_bounds(
    layer: ExpertLinear, x: Tensor, g: Tensor, groups: ExpertGroups, expert_N: Tensor
) -> list[Bounded]:
    """The rule per (slot, expert) group of rows, as Bounded values; the kernel rounds its every result
    to bf16 (torch._grouped_mm returns its operands' dtype), so:
    Forward:  base = (x W_eᵀ over I)↓; s = ((x A_eᵀ over I)↓ · scale)↓; d = (s B_eᵀ over R)↓;
              out = (base + d)↓ (index_add_ into y), ↓ a rounding to bf16.
    Backward: g_s = ((g B_e over O)↓ · scale)↓; grad_x = ((g W_e over O)↓ + (g_s A_e over R)↓)↓;
              grad_A_e = (g_sᵀ x over the group's rows)↓, grad_B_e = (gᵀ s over them)↓, cast to fp32.
    """
    dtype, R = x.dtype, EXPERT_RANK
    slot_N = torch.full((x.shape[0],), -1)
    for part in groups.slot_rows:
        slot_N[part.rows_n.cpu()] = part.slot
    out = Bounded.of(torch.zeros(x.shape[0], O))
    grad_x = Bounded.of(torch.zeros(x.shape))
    grads = {slot: [Bounded.of(torch.zeros(t.shape)) for t in layer._slots[slot][:2]] for slot in (0, 1)}

    def put(target: Bounded, rows: Tensor | slice, value: Bounded) -> None:
        target.exact[rows], target.error[rows] = value.exact, value.error

    for e in range(E):
        W = Bounded.of(layer.weight[e])
        for slot in (-1, 0, 1):
            rows = torch.nonzero((expert_N == e) & (slot_N == slot))[:, 0]  # on the CPU, as the bounds
            if not len(rows):
                continue
            x_rows, g_rows = Bounded.of(x[rows.to(x.device)]), Bounded.of(g[rows.to(x.device)])
            base, g_base = (x_rows @ W.mT).rounded(dtype), (g_rows @ W).rounded(dtype)
            if slot < 0:
                put(out, rows, base)
                put(grad_x, rows, g_base)
                continue
            A, B, scale = layer._slots[slot]
            block = slice(e * R, (e + 1) * R)
            A_e, B_e = Bounded.of(A[block].detach().to(dtype)), Bounded.of(B[:, block].detach().to(dtype))
            shrunk = (x_rows @ A_e.mT).rounded(dtype).scaled(scale).rounded(dtype)
            put(out, rows, base.plus((shrunk @ B_e.mT).rounded(dtype), dtype))
            g_shrunk = (g_rows @ B_e).rounded(dtype).scaled(scale).rounded(dtype)
            put(grad_x, rows, g_base.plus((g_shrunk @ A_e).rounded(dtype), dtype))
            put(grads[slot][0], block, (g_shrunk.mT @ x_rows).rounded(dtype))
            put(grads[slot][1], (slice(None), block), (g_rows.mT @ shrunk).rounded(dtype))
    return [out, grad_x, *(b for slot in (0, 1) for b in grads[slot])]


@pytest.mark.parametrize("device", DEVICES)
def test_expert_delta_and_its_gradients_stay_within_the_derived_bound_in_bf16(device: str) -> None:
    layer = expert_layer(BF16, seed=0, device=device)
    x, g, groups, expert_N = expert_inputs(BF16, device)
    got = run_expert(lambda x: layer(x, groups), layer, x, g)
    want = expert_bounds(layer, x, g, groups, expert_N)
    names = ["out", "grad x", "slot 0 grad A", "slot 0 grad B", "slot 1 grad A", "slot 1 grad B"]
    assert [t.dtype for t in got] == [BF16, BF16, F32, F32, F32, F32]
    for name, value, bound in zip(names, got, want, strict=True):
        assert_within(value, bound, name)

    changed = groups.slot_rows[0].rows_n.cpu()  # slot 0's, which both wrong computations change
    slot_0, slot_1 = layer._slots[0], layer._slots[1]
    for name, wrong in (
        ("another slot", (slot_1, slot_0)),
        ("no scale", (slot_0._replace(scale=1.0), slot_1)),
    ):
        for slot, weights in zip((0, 1), wrong, strict=True):
            layer.attach(slot, *weights)
        wrong_out = run_expert(lambda x: layer(x, groups), layer, x, g)[0]
        assert fraction_past(wrong_out[changed], bounded_rows(want[0], changed)) > 0.9, name
        for slot, weights in zip((0, 1), (slot_0, slot_1), strict=True):
            layer.attach(slot, *weights)


def todays_expert(layer: ExpertLinear, x: Tensor, groups: ExpertGroups) -> Tensor:
    """ExpertLinear.forward's formula before the rule: the LoRA matmuls in x's dtype, scaled in place."""
    y = grouped_mm(x, layer.weight.transpose(1, 2), groups.offsets_H)
    for part in groups.slot_rows:
        A, B, scale = layer._slots[part.slot]
        A_HRI = A.to(x.dtype).view(E, EXPERT_RANK, I)
        B_HRO = B.to(x.dtype).view(O, E, EXPERT_RANK).permute(1, 2, 0)
        shrunk = grouped_mm(x.index_select(0, part.rows_n), A_HRI.transpose(1, 2), part.offsets_H)
        y.index_add_(0, part.rows_n, grouped_mm(shrunk.mul_(scale), B_HRO, part.offsets_H))
    return y


def test_fp32_expert_delta_and_gradients_are_bitwise_the_formula_before_the_rule() -> None:
    layer = expert_layer(F32, seed=1, device="cpu")
    x, g, groups, _ = expert_inputs(F32, "cpu")
    got = run_expert(lambda x: layer(x, groups), layer, x, g)
    want = run_expert(lambda x: todays_expert(layer, x, groups), layer, x, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
