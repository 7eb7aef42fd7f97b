"""Transactional passes and two-phase optimizer steps: work that raises part way leaves every slot as it
found it, so the client's retry counts once; a step is prepared (read-only, where anything can fail), then
applied or aborted, and takes no copy; a request built for a slot that is not loaded fails loudly, never
silently as the base model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine import local, optimizer, passes, transactions
from loraplex.engine.local import LocalEngine
from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.errors import ServerError
from tests.engine.test_passes import Case, _micro_engine, make_request, one_intra_op_thread  # noqa: F401

STEP = AdamParams(learning_rate=0.01, weight_decay=0.1, grad_clip_norm=0.5)


def _state(engine: LocalEngine, slots: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Every slot's (or each of `slots`') weights, gradients, moments, step and gradient flag, copied."""
    out: dict[str, torch.Tensor] = {}
    for slot in engine.pool.live_slots if slots is None else slots:
        adam = engine.pool.get(slot).adam
        for kind in ("weights_N", "grads_N", "exp_avg_N", "exp_avg_sq_N"):
            out[f"{slot}.{kind}"] = getattr(adam, kind).clone()
        out[f"{slot}.step"] = torch.tensor(adam.step)
        out[f"{slot}.has_gradients"] = torch.tensor(adam.has_gradients)
    return out


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _requests(engine: LocalEngine, seed: int) -> list:
    rng = np.random.default_rng(seed)
    s0, s1, _ = engine.pool.live_slots[:3]
    return [
        make_request(engine, rng, s0, Case("ppo"), [7, 9]),
        make_request(engine, rng, s1, Case("cross_entropy"), [6, 11]),
    ]


def fail_on_call(monkeypatch: pytest.MonkeyPatch, module: object, name: str, call: int) -> list[int]:
    """Make module.name raise on its `call`-th call (1-based); returns the call counter."""
    original, calls = getattr(module, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def _trained_pair() -> tuple[LocalEngine, LocalEngine]:
    """Two identical engines, each with one step taken and a second pass's gradients waiting."""
    engines = (_micro_engine(), _micro_engine())
    for engine in engines:
        engine.run_pass(_requests(engine, seed=3))
        engine.optim_step(dict.fromkeys(engine.pool.live_slots, AdamParams(learning_rate=0.01)))
        engine.run_pass(_requests(engine, seed=4))
    return engines


# --- passes ----------------------------------------------------------------------------------------


def test_a_pass_that_raises_after_some_lm_head_chunks_changes_no_slot_and_its_retry_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failed, clean = _micro_engine(), _micro_engine()
    for engine in (failed, clean):
        engine.logprob_chunk = 4  # 33 tokens: nine lm_head chunks
        engine.run_pass(_requests(engine, seed=1))  # accumulators already hold a pass
    before = _state(failed)
    with monkeypatch.context() as patch:
        calls = fail_on_call(patch, passes, "_chunk_objective", call=3)  # after two chunks' backward
        with pytest.raises(RuntimeError, match="injected"):
            failed.run_pass(_requests(failed, seed=2))
    assert calls[0] == 3
    _assert_same(_state(failed), before)

    for engine in (failed, clean):  # the client's retry, and a server that never failed
        engine.run_pass(_requests(engine, seed=2))
        engine.optim_step(dict.fromkeys(engine.pool.live_slots[:2], AdamParams(learning_rate=0.01)))
    _assert_same(_state(failed), _state(clean))


def test_a_pass_built_for_a_slot_that_is_not_loaded_fails_loudly_before_anything_runs() -> None:
    engine = _micro_engine()
    good, _ = _requests(engine, seed=5)
    engine.pool.free(engine.pool.live_slots[-1])
    orphan = make_request(engine, np.random.default_rng(6), 2, Case("cross_entropy"), [5])
    before = _state(engine)
    with pytest.raises(ServerError, match=r"a pass was built for adapter slots \[2\], which are not loaded"):
        engine.run_pass([good, orphan])
    _assert_same(_state(engine), before)


def test_undo_last_takes_back_a_kept_pass_but_not_one_that_failed(monkeypatch) -> None:
    engine = _micro_engine()
    before = _state(engine)
    engine.run_pass(_requests(engine, seed=7), keep_undo=True)
    engine.undo_last()
    _assert_same(_state(engine), before)

    engine.run_pass(_requests(engine, seed=8), keep_undo=True)
    kept = _state(engine)
    with monkeypatch.context() as patch:
        fail_on_call(patch, passes, "_chunk_objective", call=1)
        with pytest.raises(RuntimeError):
            engine.run_pass(_requests(engine, seed=9), keep_undo=True)
    engine.undo_last()  # the failed pass undid itself and kept nothing: the earlier pass stays
    _assert_same(_state(engine), kept)


def test_a_pass_copies_only_accumulators_that_hold_gradients_into_one_reused_buffer(monkeypatch) -> None:
    """From zeroed accumulators a pass copies nothing (its undo zeroes); over held gradients it copies the
    trained slots' accumulators into the engine's one UndoBuffer, the same memory pass after pass, and each
    restore still puts back exactly what its own pass found."""
    engine = _micro_engine()
    engine.run_pass(_requests(engine, seed=1), keep_undo=True)
    assert engine._undo_buffer._flat is None  # nothing was copied
    engine.undo_last()
    assert not any(engine.pool.get(slot).adam.grads_N.any() for slot in engine.pool.live_slots)

    engine.run_pass(_requests(engine, seed=1))
    trained = engine.pool.live_slots[:2]
    engine.run_pass(_requests(engine, seed=2))
    buffer = engine._undo_buffer._flat
    held = sum(engine.pool.get(slot).adam.grads_N.numel() for slot in trained)
    assert buffer is not None and buffer.numel() == held
    for seed in (3, 4):
        before = _state(engine)
        engine.run_pass(_requests(engine, seed=seed), keep_undo=True)
        assert engine._undo_buffer._flat is buffer  # the same memory, pass after pass
        engine.undo_last()
        _assert_same(_state(engine), before)
    with monkeypatch.context() as patch:
        fail_on_call(patch, passes, "_chunk_objective", call=1)
        with pytest.raises(RuntimeError):
            engine.run_pass(_requests(engine, seed=5))
    _assert_same(_state(engine), before)


# --- optimizer steps: prepare, then apply or abort ------------------------------------------------


def test_a_step_whose_prepare_raises_on_its_second_slot_changes_no_slot_and_its_retry_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failed, clean = _trained_pair()
    before = _state(failed)
    steps = dict.fromkeys(failed.pool.live_slots, STEP)
    with monkeypatch.context() as patch:
        calls = fail_on_call(patch, optimizer, "_grad_norm", call=2)  # the first slot's norm is taken
        with pytest.raises(RuntimeError, match="injected"):
            failed.optim_step(steps)
    assert calls[0] == 2
    _assert_same(_state(failed), before)
    assert failed.pending_step is None

    metrics = failed.optim_step(steps)
    assert metrics == clean.optim_step(steps)
    _assert_same(_state(failed), _state(clean))


def test_prepare_changes_nothing_and_abort_leaves_every_slot_as_before_it() -> None:
    aborted, clean = _trained_pair()
    before = _state(aborted)
    steps = dict.fromkeys(aborted.pool.live_slots, STEP)
    prepared = aborted.prepare_step(steps)
    _assert_same(_state(aborted), before)
    aborted.abort_step(prepared)
    _assert_same(_state(aborted), before)

    prepared = aborted.prepare_step(steps)  # the step taken after all: as if never aborted
    aborted.apply_step(prepared)
    assert prepared.metrics == clean.optim_step(steps)
    _assert_same(_state(aborted), _state(clean))


def test_prepare_reports_the_metrics_the_step_then_takes() -> None:
    """prepare_step's metrics are those of the reference loop (step_slots_reference: clip_grad_norm_'s
    total norm, the learning rate), and the step applied after it is the reference's step, both within
    test_optimizer's tolerance."""
    engine, reference = _trained_pair()
    steps = dict.fromkeys(engine.pool.live_slots, STEP)
    prepared = engine.prepare_step(steps)
    expected = optimizer.step_slots_reference([(reference.pool.get(s).adam, p) for s, p in steps.items()])
    for slot, want in zip(steps, expected, strict=True):
        assert prepared.metrics[slot].keys() == want.keys()
        assert prepared.metrics[slot]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
        assert prepared.metrics[slot]["learning_rate"] == STEP.learning_rate
    engine.apply_step(prepared)
    for slot in steps:
        got, want = engine.pool.get(slot).adam, reference.pool.get(slot).adam
        assert got.step == want.step == 2
        torch.testing.assert_close(got.weights_N, want.weights_N, rtol=1e-6, atol=1e-6)


def test_a_stale_or_used_prepared_step_is_refused_and_changes_nothing() -> None:
    engine = _micro_engine()
    engine.run_pass(_requests(engine, seed=1))
    steps = dict.fromkeys(engine.pool.live_slots, STEP)

    stale = engine.prepare_step(steps)
    engine.run_pass(_requests(engine, seed=2))  # the gradients it was computed from have changed
    after_pass = _state(engine)
    for refuse in (engine.apply_step, engine.abort_step):
        with pytest.raises(ServerError, match=r"prepared optimizer step cannot be (applied|aborted)"):
            refuse(stale)
    _assert_same(_state(engine), after_pass)

    first = engine.prepare_step(steps)
    second = engine.prepare_step(steps)  # a newer prepare replaces the first
    with pytest.raises(ServerError, match="cannot be applied"):
        engine.apply_step(first)
    engine.apply_step(second)
    stepped = _state(engine)
    with pytest.raises(ServerError, match="cannot be applied"):
        engine.apply_step(second)  # once only
    aborted = engine.prepare_step(steps)
    engine.abort_step(aborted)
    with pytest.raises(ServerError, match="cannot be applied"):
        engine.apply_step(aborted)
    _assert_same(_state(engine), stepped)


def test_a_step_takes_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """optim_step, and prepare_step followed by abort_step or apply_step, never snapshot a slot nor touch
    the undo buffer, and still equal an engine that could."""
    engine, clean = _trained_pair()
    steps = dict.fromkeys(engine.pool.live_slots, STEP)
    with monkeypatch.context() as patch:
        fail_on_call(patch, local, "SlotSnapshot", call=1)
        fail_on_call(patch, transactions.UndoBuffer, "views", call=1)
        engine.abort_step(engine.prepare_step(steps))
        engine.apply_step(engine.prepare_step(steps))
        engine.optim_step(steps)
    for _ in range(2):
        clean.optim_step(steps)
    _assert_same(_state(engine), _state(clean))


def test_a_failure_inside_apply_poisons_the_slots_it_had_not_finished_and_no_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    engine, clean = _trained_pair()
    s0, s1, s2 = clean.pool.live_slots
    bystander = engine.create_slot(LoraConfig(rank=2, seed=99))  # live, not in the step
    untouched = _state(engine, [bystander])
    steps = dict.fromkeys((s0, s1, s2), STEP)
    prepared = engine.prepare_step(steps)
    with monkeypatch.context() as patch:
        fail_on_call(patch, optimizer.torch, "_fused_adamw_", call=2)  # s0 finished, s1 half, s2 not begun
        with pytest.raises(ServerError, match=r"adapter slots \[1, 2\]' optimizer step failed part way"):
            engine.apply_step(prepared)
    clean.optim_step(steps)
    _assert_same(_state(engine, [s0]), _state(clean, [s0]))  # finished: the step of a clean engine
    _assert_same(_state(engine, [bystander]), untouched)

    rng = np.random.default_rng(7)
    uses = [
        lambda: engine.run_pass(_requests(engine, seed=6)),  # trains s0 and s1
        lambda: engine.run_pass(
            [make_request(engine, rng, s2, Case("cross_entropy"), [5], forward_only=True)]
        ),
        lambda: engine.prepare_step({s2: STEP}),
        lambda: engine.save_state(s1, tmp_path / "checkpoint", "owner"),
        lambda: engine.save_snapshot(s2, tmp_path / "snapshot"),
    ]
    for use in uses:
        with pytest.raises(
            ServerError, match=r"adapter slot [12]'s optimizer step failed part way; its state"
        ):
            use()
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "snapshot").exists()
    engine.optim_step({s0: STEP, bystander: STEP})  # the others work on
    engine.run_pass([make_request(engine, rng, slot, Case("cross_entropy"), [6]) for slot in (s0, bystander)])
    engine.free_slot(s1)
    engine.free_slot(s2)
    assert engine.create_slot(LoraConfig(rank=2, seed=5)) == s1  # a freed id serves a fresh adapter
    engine.run_pass(_requests(engine, seed=9))
