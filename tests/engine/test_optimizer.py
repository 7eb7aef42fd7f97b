"""The fused multi-slot AdamW equals torch.optim.AdamW + clip_grad_norm_ run per slot (docs/WALKTHROUGH.md,
optim_step), taken at once or in its two phases (prepare_slots changes nothing; apply_slots steps)."""

import math
from dataclasses import replace

import pytest
import torch

from loraplex.engine.optimizer import AdamSlot, apply_slots, prepare_slots, step_slots, step_slots_reference
from loraplex.engine.types import AdamParams

RANKS = [1, 2, 4, 8, 3]
# (in_features, out_features) of each target: every slot has three, so six tensors.
TARGETS = [(16, 16), (16, 8), (8, 24)]
# Large enough that a slot's gradient buffer spans several norm rows and ends in a partial one.
WIDE_TARGETS = [(1000, 700), (64, 1500), (8, 24)]
HPARAMS = [
    AdamParams(learning_rate=1e-2),
    AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5),
    AdamParams(learning_rate=1e-3, beta2=0.999, eps=1e-6, weight_decay=0.01, grad_clip_norm=1e3),
    AdamParams(learning_rate=5e-2, beta1=0.5, beta2=0.9, grad_clip_norm=1.0),
    AdamParams(learning_rate=2e-2, beta1=0.95, eps=1e-10, weight_decay=0.5),
]
STATE = ("weights_N", "exp_avg_N", "exp_avg_sq_N")
BUFFERS = (*STATE, "grads_N", "grad_rows")


def _make_slots(targets: list[tuple[int, int]] = TARGETS) -> list[AdamSlot]:
    gen = torch.Generator().manual_seed(0)
    slots = []
    for rank in RANKS:
        params = []
        for fan_in, fan_out in targets:
            params.append(torch.randn(rank, fan_in, generator=gen))  # A_RI
            params.append(torch.randn(fan_out, rank, generator=gen))  # B_OR
        slots.append(AdamSlot.fresh(params))
    return slots


def _grads(step: int, index: int, slot: AdamSlot) -> list[torch.Tensor]:
    """Deterministic gradients; slot 1 and 3 are large so their clipping is active."""
    gen = torch.Generator().manual_seed(100 * step + index)
    scale = 5.0 if index in (1, 3) else 0.3
    return [scale * torch.randn(p.shape, generator=gen) for p in slot.params]


def _accumulate(slot: AdamSlot, grads: list[torch.Tensor]) -> None:
    for acc, g in zip(slot.grads, grads, strict=True):
        acc.add_(g)


def _lr(index: int, step: int) -> float:
    """A per-step schedule, so the learning rate changes between calls."""
    return HPARAMS[index].learning_rate * (1.0 + step) / 3.0


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to rounding: the fused kernel, the norm's summation order and clipping by grad_scale each
    move a result by about one ulp, so besides rtol 1e-6 an element may be off by 1e-6 of the tensor's
    largest magnitude (~8 ulps of it), where cancellation left it small. (torch's own fused-vs-for-loop
    AdamW tests use assertEqual's float32 defaults, rtol 1.3e-6 and atol 1e-5.)"""
    atol = 1e-6 * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol)


def _copy(slot: AdamSlot, names: tuple[str, ...] = BUFFERS) -> dict[str, torch.Tensor]:
    """Copies of the named flat buffers of a slot (by default all of them) and its step."""
    return {name: getattr(slot, name).clone() for name in names} | {"step": torch.tensor(slot.step)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _prepare_check_apply(steps: list[tuple[AdamSlot, AdamParams]]) -> list[dict[str, float]]:
    """The fused step's two phases, checking between them that prepare_slots changed no slot."""
    before = [_copy(slot) | {"has_gradients": torch.tensor(slot.has_gradients)} for slot, _ in steps]
    plan = prepare_slots(steps)
    after = [_copy(slot) | {"has_gradients": torch.tensor(slot.has_gradients)} for slot, _ in steps]
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # a NaN gradient stays
    apply_slots(plan)
    assert plan.applied == len(steps)
    return plan.metrics


@pytest.mark.parametrize("targets", [TARGETS, WIDE_TARGETS], ids=["small", "wide"])
@pytest.mark.parametrize(
    "step_fn", [step_slots, _prepare_check_apply, step_slots_reference], ids=["fused", "phases", "reference"]
)
def test_step_equals_torch_adamw_and_clip_per_slot(step_fn, targets):
    """5 slots, different ranks and AdamParams, 3 steps, lr changing, clipping on slots 1 and 3,
    a NaN gradient on slot 3 at step 1 (skipped, grads cleared, others unaffected)."""
    slots = _make_slots(targets)
    oracle_params = [[p.detach().clone().requires_grad_() for p in slot.params] for slot in slots]
    oracles = [
        torch.optim.AdamW(
            ps, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay
        )
        for ps, hp in zip(oracle_params, HPARAMS, strict=True)
    ]
    for step in range(3):
        steps = []
        for i, slot in enumerate(slots):
            grads = _grads(step, i, slot)
            if (step, i) == (1, 3):
                grads[2][0, 0] = math.nan
            _accumulate(slot, grads)
            for p, g in zip(oracle_params[i], grads, strict=True):
                p.grad = g.clone()
            hp = replace(HPARAMS[i], learning_rate=_lr(i, step))
            steps.append((slot, hp))

        metrics = step_fn(steps)

        for i, slot in enumerate(slots):
            expected_norm = torch.nn.utils.get_total_norm([p.grad for p in oracle_params[i]])
            assert metrics[i]["grad_norm"] == pytest.approx(expected_norm.item(), rel=1e-6, nan_ok=True)
            assert metrics[i]["learning_rate"] == _lr(i, step)
            if (step, i) == (1, 3):
                assert metrics[i]["skipped_nonfinite"] == 1.0
            else:
                assert "skipped_nonfinite" not in metrics[i]
                if HPARAMS[i].grad_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(oracle_params[i], HPARAMS[i].grad_clip_norm)
                oracles[i].param_groups[0]["lr"] = _lr(i, step)
                oracles[i].step()
            moments = zip(slot.views(slot.exp_avg_N), slot.views(slot.exp_avg_sq_N), strict=True)
            for p, (m, v), expected in zip(slot.params, moments, oracle_params[i], strict=True):
                state = oracles[i].state[expected]
                _assert_close(p, expected)
                _assert_close(m, state["exp_avg"])
                _assert_close(v, state["exp_avg_sq"])
                assert slot.step == int(state["step"].item())
            assert torch.count_nonzero(slot.grad_rows) == 0
    assert [slot.step for slot in slots] == [3, 3, 3, 2, 3]


@pytest.mark.parametrize("targets", [TARGETS, WIDE_TARGETS], ids=["small", "wide"])
def test_clipping_is_active_where_configured(targets):
    """The fixture really clips slots 1 and 3 (pre-clip norm above the limit) and not slot 2."""
    slots = _make_slots(targets)
    norms = [torch.nn.utils.get_total_norm(_grads(0, i, s)).item() for i, s in enumerate(slots)]
    assert norms[1] > HPARAMS[1].grad_clip_norm and norms[3] > HPARAMS[3].grad_clip_norm
    assert norms[2] < HPARAMS[2].grad_clip_norm


def test_params_and_their_gradients_are_views_of_the_slot_buffers():
    """Backward accumulates into grads_N in place, the step moves what the params read, and both stay
    true after steps; the padding past N stays zero."""
    slot = _make_slots(WIDE_TARGETS)[2]
    rows, row = slot.grad_rows.shape
    assert rows > 1 and rows * row > slot.grads_N.numel()  # several rows, the last one partial
    initial = [p.detach().clone() for p in slot.params]
    assert all(p.is_leaf and p.requires_grad and p.dtype == torch.float32 for p in slot.params)
    assert all(torch.equal(w, p) for w, p in zip(slot.views(slot.weights_N), initial, strict=True))
    gen = torch.Generator().manual_seed(1)
    x_TI = [torch.randn(5, p.shape[1], generator=gen) for p in slot.params]

    for _ in range(3):
        # d/dp of |x pᵀ|² is 2 (x pᵀ)ᵀ x; two backwards add up.
        expected = [4 * (x @ p.detach().t()).t() @ x for x, p in zip(x_TI, slot.params, strict=True)]
        for _ in range(2):
            sum((x @ p.t()).square().sum() for x, p in zip(x_TI, slot.params, strict=True)).backward()
        torch.testing.assert_close(slot.grads_N, torch.cat([g.reshape(-1) for g in expected]))
        step_slots([(slot, AdamParams(learning_rate=1e-2, weight_decay=0.1))])
        for p, weight, grad in zip(
            slot.params, slot.views(slot.weights_N), slot.views(slot.grads_N), strict=True
        ):
            assert p.data_ptr() == weight.data_ptr() and p.grad.data_ptr() == grad.data_ptr()
    assert not any(torch.equal(p, q) for p, q in zip(slot.params, initial, strict=True))
    assert torch.count_nonzero(slot.grad_rows) == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_norm_skips_the_slot_and_clears_its_gradients(bad):
    slots = _make_slots()[:2]
    for i, slot in enumerate(slots):
        _accumulate(slot, _grads(0, i, slot))
    step_slots([(slot, HPARAMS[i]) for i, slot in enumerate(slots)])
    for i, slot in enumerate(slots):
        _accumulate(slot, _grads(1, i, slot))
    slots[0].grads[1][0, 0] = bad
    before = _copy(slots[0], STATE)

    metrics = step_slots([(slot, HPARAMS[i]) for i, slot in enumerate(slots)])

    assert metrics[0]["skipped_nonfinite"] == 1.0 and not math.isfinite(metrics[0]["grad_norm"])
    assert "skipped_nonfinite" not in metrics[1] and slots[1].step == 2
    assert before["step"] == 1 and _equal(_copy(slots[0], STATE), before)
    assert all(torch.count_nonzero(slot.grad_rows) == 0 for slot in slots)


def test_weight_decay_of_one_slot_never_moves_a_slot_not_stepped():
    """Slot 1 steps with strong weight decay; slot 2, left out of the call, stays bit-identical."""
    slots = _make_slots()
    for i in (1, 2):
        _accumulate(slots[i], _grads(0, i, slots[i]))
    step_slots([(slots[1], HPARAMS[1]), (slots[2], HPARAMS[2])])
    _accumulate(slots[2], _grads(1, 2, slots[2]))
    before = _copy(slots[2])
    params_1 = [p.detach().clone() for p in slots[1].params]

    step_slots([(slots[1], replace(HPARAMS[1], weight_decay=0.9))])

    assert not any(torch.equal(a, b) for a, b in zip(slots[1].params, params_1, strict=True))
    assert before["step"] == 1 and _equal(_copy(slots[2]), before)


def test_empty_step_returns_no_metrics():
    assert step_slots([]) == []


def test_a_prepared_plan_applied_later_is_the_step_taken_at_once():
    """Nothing but the plan carries a step from prepare to apply: preparing, then applying after other
    slots stepped, equals the fused step taken at once, bit for bit."""
    later, at_once = _make_slots(), _make_slots()
    for slots in (later, at_once):
        for i, slot in enumerate(slots):
            _accumulate(slot, _grads(0, i, slot))
    plan = prepare_slots([(later[i], HPARAMS[i]) for i in (1, 3)])
    step_slots([(later[i], HPARAMS[i]) for i in (0, 2, 4)])  # other slots step in between
    apply_slots(plan)
    expected = step_slots([(at_once[i], HPARAMS[i]) for i in range(5)])
    assert plan.metrics == [expected[1], expected[3]]
    assert all(_equal(_copy(a), _copy(b)) for a, b in zip(later, at_once, strict=True))
