"""A mixture-of-experts model on two data-parallel ranks trains exactly as on one: expert LoRA slots are
replicated and stepped like dense ones. On two tensor-parallel ranks (expert parallelism) each holds half
the experts and reports every expert's load (that mesh's parity: tests/distributed/test_tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from transformers import Qwen3MoeConfig

from loraplex.engine.types import DatumInput, PassRequest, PassResult
from tests.distributed.conftest import (
    ReferenceEngine,
    ReferenceResult,
    adapter_state,
    build_reference,
    start_ranks,
)
from tests.distributed.test_parity import (
    ADAMW_NOISE_MULTIPLE,
    CONFIGS,
    PARAMS,
    assert_adapters_equal,
    assert_results_equal,
    slots_on,
)
from tests.model.rounding import rounding_bound
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_moe import moe_config


def _requests(slots: list[int], seed: int, vocab: int) -> list[PassRequest]:
    rng = np.random.default_rng(seed)

    def datum(n: int) -> DatumInput:
        tokens = rng.integers(0, vocab, n + 1)
        return DatumInput(tokens[:-1], {"target_tokens": tokens[1:]})

    return [PassRequest(slot, "cross_entropy", {}, [datum(n) for n in (9, 4, 13)], False) for slot in slots]


def test_an_moe_model_on_two_ranks_trains_its_expert_adapters_as_on_one(tmp_path: Path) -> None:
    config, model_dir, reference = _moe_model(tmp_path)
    with start_ranks(tmp_path, model=str(model_dir)) as ranks, slots_on(ranks.engine, reference) as slots:
        for step in range(2):
            requests = _requests(slots, seed=step, vocab=config.vocab_size)
            assert_results_equal(ranks.engine.run_pass(requests), reference.run_pass(requests))
            for engine in (ranks.engine, reference):
                engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
        assert_adapters_equal(ranks.engine.local, reference, slots)
        assert any(".experts." in name for name in reference.pool.get(slots[0]).weights)
        _assert_wrong_results_are_outside_the_bounds(reference, slots, config.vocab_size)


def test_rank_0_of_a_tensor_parallel_pair_holds_half_the_experts_and_reports_every_experts_load(
    tmp_path: Path,
) -> None:
    """Rank 0's pass metrics carry the (MoE layers, E) load the single rank counts: each rank routes every
    token itself, though it computes only its own experts' rows."""
    config, model_dir, reference = _moe_model(tmp_path)
    with (
        start_ranks(tmp_path, model=str(model_dir), tp=2) as ranks,
        slots_on(ranks.engine, reference) as slots,
    ):
        requests = _requests(slots, seed=0, vocab=config.vocab_size)
        ranks.engine.run_pass(requests)
        reference.run_pass(requests)
        rank_0 = ranks.engine.local
        experts = rank_0.decoder.model.layers[0].mlp.experts["gate_proj"]
        assert experts.weight.shape[0] == config.num_experts // 2
        load = rank_0.last_pass.expert_load
        assert load is not None and len(load[0]) == config.num_experts
        assert load == reference.last_pass.expert_load


def _moe_model(tmp_path: Path) -> tuple[Qwen3MoeConfig, Path, ReferenceEngine]:
    """A tiny random Qwen3-MoE directory under tmp_path, its config and the single-rank reference on it."""
    config = moe_config()
    model_dir = tmp_path / "qwen3_moe"
    save_random_hf_model(config, model_dir)
    return config, model_dir, build_reference(tmp_path, model=str(model_dir))


def _assert_wrong_results_are_outside_the_bounds(
    reference: ReferenceEngine, slots: list[int], vocab: int
) -> None:
    """The rounding bounds are over a thousand times tighter than a wrong computation's error: the
    reference's logprobs under another slot's adapter, and the adapter of a slot trained as the first
    but without one datum."""
    a, b, _ = slots
    check = [replace(r, forward_only=True) for r in _requests([a], seed=7, vocab=vocab)]
    (wrong,), (right,) = reference.run_pass([replace(r, slot=b) for r in check]), reference.run_pass(check)
    assert isinstance(wrong, PassResult) and isinstance(right, ReferenceResult)
    assert isinstance(right.exact, PassResult)
    g, w, x = (np.concatenate([o["logprobs"] for o in r.outputs]) for r in (wrong, right, right.exact))
    assert np.linalg.norm(g - w) > 1000 * rounding_bound(w, x)
    short = reference.create_slot(CONFIGS[0])  # as slot a: same config and seed, same steps, a datum less
    try:
        for step in range(2):
            request = _requests([short], seed=step, vocab=vocab)[0]  # slot a's datums at this step
            reference.run_pass([replace(request, datums=request.datums[:-1])])
            reference.optim_step({short: PARAMS[0]})
        got, want, exact = (
            adapter_state(engine, s)
            for engine, s in ((reference, short), (reference, a), (reference.exact, a))
        )
        for name in (n for n in want if "lora_B" in n):
            error = np.linalg.norm(got[name] - want[name])
            assert error > 1000 * rounding_bound(want[name], exact[name], ADAMW_NOISE_MULTIPLE), name
    finally:
        reference.free_slot(short)
