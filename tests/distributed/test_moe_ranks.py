"""A mixture-of-experts model on two data-parallel ranks trains exactly as on one: expert LoRA slots are
replicated and stepped like dense ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loraplex.engine.types import DatumInput, PassRequest
from tests.distributed.conftest import build_reference, start_ranks
from tests.distributed.test_parity import PARAMS, assert_adapters_equal, assert_results_equal, slots_on
from tests.model.test_decoder_parity import save_random_hf_model
from tests.model.test_moe import moe_config


def _requests(slots: list[int], seed: int, vocab: int) -> list[PassRequest]:
    rng = np.random.default_rng(seed)

    def datum(n: int) -> DatumInput:
        tokens = rng.integers(0, vocab, n + 1)
        return DatumInput(tokens[:-1], {"target_tokens": tokens[1:]})

    return [PassRequest(slot, "cross_entropy", {}, [datum(n) for n in (9, 4, 13)], False) for slot in slots]


def test_an_moe_model_on_two_ranks_trains_its_expert_adapters_as_on_one(tmp_path: Path) -> None:
    config = moe_config()
    model_dir = tmp_path / "qwen3_moe"
    save_random_hf_model(config, model_dir)
    reference = build_reference(tmp_path, model=str(model_dir))
    with start_ranks(tmp_path, model=str(model_dir)) as ranks, slots_on(ranks.engine, reference) as slots:
        for step in range(2):
            requests = _requests(slots, seed=step, vocab=config.vocab_size)
            assert_results_equal(ranks.engine.run_pass(requests), reference.run_pass(requests))
            for engine in (ranks.engine, reference):
                engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
        assert_adapters_equal(ranks.engine.local, reference, slots)
        assert any(".experts." in name for name in reference.pool.get(slots[0]).weights)
