"""The sampler's admission limits: a topk or KV-cache ask over its cap is refused with the cap named; past the
KV budget a request waits for the running ones and then runs, never fails; the cache's size accounting,
which the budget reads, is what its tensors take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine.local import LocalEngine
from loraplex.engine.types import SampleRequest, SampleResult, SamplingParams
from loraplex.errors import UserError
from loraplex.model.kv_cache import KVCache

MIB = 1 << 20
# The tiny model (model/tiny.py): keys and values × 4 layers × 2 kv heads × head dim 64 × 4 bytes (fp32).
TINY_KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4


def _greedy(prompt_length: int, max_tokens: int, num_samples: int = 1) -> SampleRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=())
    return SampleRequest(np.arange(1, prompt_length + 1), params, num_samples)


def test_the_kv_cache_predicts_the_bytes_its_tensors_take(engine: LocalEngine) -> None:
    cache = KVCache(engine.decoder.config, "cpu", torch.float32)
    assert cache.bytes_per_token == TINY_KV_BYTES_PER_TOKEN
    assert cache.bytes_after([]) == 0
    rows = []
    for max_length in (10, 100, 5, 70, 300, 1, 1, 1, 1, 1, 1, 1):  # growth in capacity, then in rows
        predicted = cache.bytes_after([max_length])
        rows.append(cache.allocate(max_length))
        assert predicted == sum(t.nbytes for t in (*cache.keys, *cache.values))
    assert cache.bytes_after([]) == 16 * 512 * TINY_KV_BYTES_PER_TOKEN  # 16 rows, capacity 512
    assert cache.bytes_after([600, 2, 2, 2, 2]) == 32 * 1024 * TINY_KV_BYTES_PER_TOKEN
    for row in rows:
        cache.free(row)
    assert cache.bytes_after([]) == 0


def test_topk_prompt_logprobs_over_the_servers_cap_is_refused_naming_it(engine, set_limits) -> None:
    set_limits(max_topk_prompt_logprobs=20)
    engine.validate_sample_request(SampleRequest(np.array([1, 2]), topk_prompt_logprobs=20))
    with pytest.raises(UserError) as refused:
        engine.validate_sample_request(SampleRequest(np.array([1, 2]), topk_prompt_logprobs=21))
    assert str(refused.value) == (
        "topk_prompt_logprobs must be an integer in [0, 20] (this server's --max-topk-prompt-logprobs), "
        "got 21"
    )


def test_a_request_needing_more_kv_cache_than_one_request_may_have_is_refused(engine, set_limits) -> None:
    set_limits(max_request_kv_bytes=1 * MIB)
    engine.validate_sample_request(_greedy(3, 61, num_samples=4))  # (3 + 61) × 4 × 4096 = 1 MiB exactly
    with pytest.raises(UserError) as refused:
        engine.add_sample("big", _greedy(3, 62, num_samples=4))
    assert str(refused.value) == (
        "this request needs 1064960 bytes of KV cache ((prompt 3 + max_tokens 62) × num_samples 4 × 4096 "
        "bytes per token), over the 1048576 bytes (1 MiB) this server allows one request "
        "(--max-sample-kv-mib); lower max_tokens or num_samples"
    )
    assert not engine.has_sampling_work()


def _run(engine: LocalEngine, requests: dict[str, SampleRequest]) -> tuple[dict[str, SampleResult], list]:
    """Add every request at once and step to the end: the results, and per step (live cache rows, cache
    bytes, keys finished in it)."""
    for key, request in requests.items():
        engine.add_sample(key, request)
    results: dict[str, SampleResult] = {}
    steps = []
    while engine.has_sampling_work():
        finished = engine.step_sampler()
        cache = engine.sampler.cache
        steps.append((cache.num_live_rows, cache.bytes_after([]), [key for key, _ in finished]))
        for key, result in finished:
            assert not isinstance(result, UserError), result
            results[key] = result
    return results, steps


def test_past_the_kv_budget_a_request_waits_for_the_running_ones_then_runs_alone(engine, set_limits) -> None:
    short, long = _greedy(10, 20), _greedy(10, 100)
    # Alone: 8 rows × 64 tokens (short) or 8 rows × 128 tokens (long); together the long one's capacity.
    assert (8 * 64 * TINY_KV_BYTES_PER_TOKEN, 8 * 128 * TINY_KV_BYTES_PER_TOKEN) == (2 * MIB, 4 * MIB)
    alone = {key: _run(engine, {key: request})[0][key] for key, request in (("short", short), ("long", long))}

    together, steps = _run(engine, {"short": short, "long": long})
    assert steps[0][0] == 2  # without a budget both run at once

    set_limits(kv_budget_bytes=3 * MIB)
    queued, steps = _run(engine, {"short": short, "long": long})
    finished_short = next(i for i, (_, _, keys) in enumerate(steps) if "short" in keys)
    assert [rows for rows, _, _ in steps[: finished_short + 1]] == [1] * finished_short + [0]
    assert all(size <= 3 * MIB for _, size, _ in steps[: finished_short + 1])
    assert steps[finished_short + 1][:2] == (1, 4 * MIB)  # then the long one runs alone, past the budget
    for key in ("short", "long"):
        assert queued[key].sequences[0].tokens.tolist() == alone[key].sequences[0].tokens.tolist()
        assert together[key].sequences[0].tokens.tolist() == alone[key].sequences[0].tokens.tolist()
