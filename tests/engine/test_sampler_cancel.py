"""Cancelling a sampling request (Engine.cancel_sample): it leaves the continuous batch with its KV cache
rows and its snapshot place, is never returned, and the requests that shared its steps go on exactly as
if it had never been there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import LoraConfig, SampleRequest, SampleResult, SamplingParams
from loraplex.errors import UserError
from loraplex.model.hf_checkpoint import load_decoder

PROMPT = np.array([5, 6, 7, 8], dtype=np.int64)
OTHER = np.array([40, 41, 42], dtype=np.int64)
LONG = SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=())  # nothing stops it early


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


def _finish(engine: LocalEngine) -> dict[str, SampleResult]:
    """Step until the sampler is idle; every result by key."""
    results: dict[str, SampleResult] = {}
    while engine.has_sampling_work():
        for key, result in engine.step_sampler():
            assert not isinstance(result, UserError), result
            results[key] = result
    return results


def test_a_generating_request_cancelled_frees_its_rows_and_the_others_decode_as_if_alone(
    engine: LocalEngine,
) -> None:
    engine.add_sample("kept", SampleRequest(PROMPT, LONG, num_samples=2))
    alone = _finish(engine)["kept"]
    engine.add_sample("kept", SampleRequest(PROMPT, LONG, num_samples=2))
    engine.add_sample("dropped", SampleRequest(OTHER, LONG, num_samples=3))
    for _ in range(3):  # prefill + 2 decode steps: every row holds its prompt and 3 tokens fed back
        assert engine.step_sampler() == []
    assert (engine.usage().sequences, engine.usage().kv_cache_tokens) == (5, 2 * (4 + 3) + 3 * (3 + 3))
    assert engine.cancel_sample("dropped") is True
    assert (engine.usage().sequences, engine.usage().kv_cache_tokens) == (2, 2 * (4 + 3))
    results = _finish(engine)
    assert list(results) == ["kept"]
    for together, by_itself in zip(results["kept"].sequences, alone.sequences, strict=True):
        assert together.tokens.tolist() == by_itself.tokens.tolist()
    usage = engine.usage()
    assert (usage.sequences, usage.kv_cache_tokens, usage.kv_cache_bytes) == (0, 0, 0)
    assert engine.cancel_sample("dropped") is False  # gone already
    assert engine.cancel_sample("kept") is False  # finished


def test_a_waiting_request_cancelled_is_never_prefilled(engine: LocalEngine) -> None:
    before = engine.usage().prefill_tokens
    engine.add_sample("waiting", SampleRequest(PROMPT, LONG))
    assert engine.cancel_sample("waiting") is True
    assert not engine.has_sampling_work()
    assert engine.step_sampler() == []
    assert engine.usage().prefill_tokens == before


def test_a_cancelled_request_gives_up_its_snapshot_place_to_a_waiting_one(
    engine: LocalEngine, tmp_path: Path
) -> None:
    for name in ("first", "second"):
        slot = engine.create_slot(LoraConfig(rank=4, seed=len(name)))
        engine.save_snapshot(slot, tmp_path / name)
        engine.free_slot(slot)
    # A decoder of its own with one snapshot place: the second request waits for the first's.
    decoder = load_decoder(engine.info.tokenizer_dir)
    small = LocalEngine(decoder, engine.info, max_slots=1, snapshot_capacity=1)
    small.add_sample("first", SampleRequest(PROMPT, LONG, snapshot=tmp_path / "first"))
    small.add_sample("second", SampleRequest(PROMPT, LONG, snapshot=tmp_path / "second"))
    small.step_sampler()
    small.step_sampler()
    assert (small.usage().sequences, small.usage().prefill_tokens) == (1, 4)  # the second waits
    assert small.cancel_sample("first") is True
    assert small.usage().sequences == 0
    small.step_sampler()
    assert (small.usage().sequences, small.usage().prefill_tokens) == (1, 8)  # the second took the place
    assert list(_finish(small)) == ["second"]
