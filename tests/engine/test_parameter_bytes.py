"""What an engine rank says its tensors hold (`LocalEngine.parameter_bytes`, reported through `usage`): the
base is its parameters' and buffers' bytes, a slot adds exactly its tensors' bytes and freeing it takes
them away, a pass during gradient accumulation grows the undo copy; and each figure is the memory plan's
(model/memory_plan.py) at T = 1."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.engine.interface import ParameterBytes
from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import DatumInput, LoraConfig, PassRequest
from loraplex.model.memory_plan import LoraSpec, RankPlan, plan_rank

FP32 = 4  # bytes: the engine runs fp32 on CPUs


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


def _plan(engine: LocalEngine, lora: LoraSpec, slots: int) -> RankPlan:
    return plan_rank(engine.decoder.config, 1, FP32, lora, slots, kv_tokens=0)


def test_the_base_is_the_decoders_parameters_and_buffers_as_the_plan_counts_them(engine: LocalEngine) -> None:
    decoder = engine.decoder
    assert decoder.lm_head.weight is decoder.model.embed_tokens.weight  # the tiny model is tied: once
    held = engine.parameter_bytes()
    assert held.base == sum(t.nbytes for t in (*decoder.parameters(), *decoder.buffers()))
    assert held.base == _plan(engine, LoraSpec(8), 1).base
    assert engine.usage().parameter_bytes == (held,)


def test_a_slot_adds_exactly_its_tensors_and_freeing_it_takes_them_away(engine: LocalEngine) -> None:
    before = engine.parameter_bytes()
    a = engine.create_slot(LoraConfig(rank=8))
    adam = engine.pool.get(a).adam
    weights = sum(t.nbytes for t in engine.pool.get(a).weights.values())  # views of adam.weights_N
    optimizer = adam.grad_rows.nbytes + adam.exp_avg_N.nbytes + adam.exp_avg_sq_N.nbytes
    assert engine.parameter_bytes() == ParameterBytes(
        before.base, before.adapter + weights, before.optimizer + optimizer
    )
    planned = _plan(engine, LoraSpec(8), 1).slot
    assert (weights, optimizer) == (planned.weights, planned.gradients + planned.moments)

    b = engine.create_slot(LoraConfig(rank=3, train_mlp=False))
    planned_b = _plan(engine, LoraSpec(3, frozenset({"attn", "unembed"})), 1).slot
    both = engine.parameter_bytes()
    assert both.adapter == before.adapter + weights + planned_b.weights
    assert both.optimizer == before.optimizer + optimizer + planned_b.gradients + planned_b.moments
    engine.free_slot(a)
    assert engine.parameter_bytes() == ParameterBytes(
        before.base,
        before.adapter + planned_b.weights,
        before.optimizer + planned_b.gradients + planned_b.moments,
    )
    engine.free_slot(b)
    assert engine.parameter_bytes() == before


def test_a_pass_over_slots_holding_gradients_grows_the_undo_copy_to_theirs(engine: LocalEngine) -> None:
    slots = [engine.create_slot(LoraConfig(rank=8, seed=seed)) for seed in (1, 2)]
    tokens = np.arange(10, 30, dtype=np.int64)
    datum = DatumInput(tokens[:-1], {"target_tokens": tokens[1:]})
    requests = [PassRequest(slot, "cross_entropy", {}, [datum], False) for slot in slots]
    fresh = engine.parameter_bytes()
    engine.run_pass(requests)  # the accumulators were zero: nothing to copy
    assert engine.parameter_bytes() == fresh
    engine.run_pass(requests)  # gradient accumulation: the pass first copies what the accumulators hold
    grads = sum(engine.pool.get(slot).adam.grads_N.nbytes for slot in slots)
    assert engine.parameter_bytes().optimizer == fresh.optimizer + grads
    # The plan's optimizer figure is this worst case: one undo copy of every slot's gradients.
    assert engine.parameter_bytes().optimizer == _plan(engine, LoraSpec(8), 2).optimizer
    for slot in slots:
        engine.free_slot(slot)
    assert engine.parameter_bytes().optimizer == grads  # the buffer keeps its size for the next pass
