"""What the engine reports for telemetry (`Engine.usage`): token counters and the KV cache it holds."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalEngine:
    return build_local_engine("tiny", tmp_path_factory.mktemp("data"), "cpu", 2, 8, None)


def test_usage_counts_prompt_and_sampled_tokens_and_the_cache_in_use(engine: LocalEngine) -> None:
    before = engine.usage()
    prompt = np.array([5, 6, 7, 8], dtype=np.int64)
    params = SamplingParams(max_tokens=3, temperature=1.0, stop=(), seed=0)
    engine.add_sample("a", SampleRequest(prompt, params, num_samples=2))
    engine.step_sampler()  # prefill: the first token of each sample, then one decode step
    during = engine.usage()
    assert during.prefill_tokens - before.prefill_tokens == 4  # one prefill serves both samples
    assert during.sampled_tokens - before.sampled_tokens == 4  # 2 samples x (first token + one decode)
    assert during.sequences == 2
    assert during.kv_cache_tokens == 2 * (4 + 1)  # each row: the prompt and the first token fed back
    cache = engine.sampler.cache
    stored = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)  # the tensors themselves
    assert during.kv_cache_bytes == stored > 0
    while engine.has_sampling_work():
        engine.step_sampler()
    after = engine.usage()
    assert after.sampled_tokens - before.sampled_tokens == 2 * 3
    assert (after.sequences, after.kv_cache_tokens, after.kv_cache_bytes) == (0, 0, 0)
    assert after.device_allocated_bytes is None  # CPU
