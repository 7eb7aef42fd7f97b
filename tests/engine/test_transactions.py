"""Transactional passes and steps: work that raises part way leaves every slot as it found it, so the
client's retry counts once; a request built for a slot that is not loaded fails loudly, never silently
as the base model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine import optimizer, passes
from loraplex.engine.local import LocalEngine
from loraplex.engine.types import AdamParams
from loraplex.errors import ServerError
from tests.engine.test_passes import Case, _micro_engine, make_request, one_intra_op_thread  # noqa: F401


def _state(engine: LocalEngine) -> dict[str, torch.Tensor]:
    """Every slot's weights, gradients, moments and step count, copied."""
    out: dict[str, torch.Tensor] = {}
    for slot in engine.pool.live_slots:
        adam = engine.pool.get(slot).adam
        for kind in ("weights_N", "grads_N", "exp_avg_N", "exp_avg_sq_N"):
            out[f"{slot}.{kind}"] = getattr(adam, kind).clone()
        out[f"{slot}.step"] = torch.tensor(adam.step)
    return out


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _requests(engine: LocalEngine, seed: int) -> list:
    rng = np.random.default_rng(seed)
    s0, s1, _ = engine.pool.live_slots
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


def test_an_optimizer_step_that_raises_on_its_second_slot_changes_no_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failed, clean = _micro_engine(), _micro_engine()
    for engine in (failed, clean):
        engine.run_pass(_requests(engine, seed=3))
        engine.optim_step(dict.fromkeys(engine.pool.live_slots, AdamParams(learning_rate=0.01)))
        engine.run_pass(_requests(engine, seed=4))
    before = _state(failed)
    steps = dict.fromkeys(failed.pool.live_slots, AdamParams(learning_rate=0.01, weight_decay=0.1))
    with monkeypatch.context() as patch:
        fail_on_call(patch, optimizer.torch, "_fused_adamw_", call=2)  # the first slot has stepped
        with pytest.raises(RuntimeError, match="injected"):
            failed.optim_step(steps)
    _assert_same(_state(failed), before)

    metrics = failed.optim_step(steps)
    assert metrics == clean.optim_step(steps)
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


def test_undo_last_takes_back_a_kept_pass_and_step_but_not_one_that_failed(monkeypatch) -> None:
    engine = _micro_engine()
    before = _state(engine)
    engine.run_pass(_requests(engine, seed=7), keep_undo=True)
    engine.undo_last()
    _assert_same(_state(engine), before)

    engine.run_pass(_requests(engine, seed=7))
    after_pass = _state(engine)
    engine.optim_step(dict.fromkeys(engine.pool.live_slots, AdamParams()), keep_undo=True)
    engine.undo_last()
    _assert_same(_state(engine), after_pass)

    engine.run_pass(_requests(engine, seed=8), keep_undo=True)
    kept = _state(engine)
    with monkeypatch.context() as patch:
        fail_on_call(patch, passes, "_chunk_objective", call=1)
        with pytest.raises(RuntimeError):
            engine.run_pass(_requests(engine, seed=9), keep_undo=True)
    engine.undo_last()  # the failed pass undid itself and kept nothing: the earlier pass stays
    _assert_same(_state(engine), kept)


def test_transactions_copy_into_one_reused_buffer_and_still_restore_exactly(monkeypatch) -> None:
    """Every snapshot copies into the engine's one UndoBuffer (no fresh memory per step); a later, larger
    snapshot grows it, and each restore still puts back exactly what its own transaction found."""
    engine = _micro_engine()
    slots = dict.fromkeys(engine.pool.live_slots, AdamParams(learning_rate=0.05))
    engine.run_pass(_requests(engine, seed=1))
    adams = [engine.pool.get(slot).adam for slot in slots]
    copied = sum((3 + adam.has_gradients) * adam.weights_N.numel() for adam in adams)
    engine.optim_step(slots, keep_undo=True)  # weights, both moments, and the gradients a pass filled
    buffer = engine._undo_buffer._flat
    assert buffer is not None and buffer.numel() == copied
    for seed in (2, 3):
        engine.run_pass(_requests(engine, seed=seed))  # a pass over held gradients: copies them
        before = _state(engine)
        engine.optim_step(slots, keep_undo=True)
        assert engine._undo_buffer._flat is buffer  # the same memory, step after step
        engine.undo_last()
        _assert_same(_state(engine), before)
        engine.optim_step(slots)
    with monkeypatch.context() as patch:
        engine.run_pass(_requests(engine, seed=4))
        before = _state(engine)
        fail_on_call(patch, optimizer.torch, "_fused_adamw_", call=2)
        with pytest.raises(RuntimeError):
            engine.optim_step(slots)
    _assert_same(_state(engine), before)
