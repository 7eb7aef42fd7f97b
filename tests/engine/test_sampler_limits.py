"""The sampler's admission limits: a topk or KV-cache ask over its cap is refused with the cap named; past the
KV budget a request waits for the running ones and then runs, never fails; the cache's block accounting,
which the budget reads, and its pool, sized by the limits."""

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
TINY_KV_BLOCK_BYTES = 16 * TINY_KV_BYTES_PER_TOKEN  # the cache's blocks of 16 tokens


def _greedy(prompt_length: int, max_tokens: int, num_samples: int = 1) -> SampleRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=())
    return SampleRequest(np.arange(1, prompt_length + 1), params, num_samples)


def test_the_kv_cache_reserves_whole_blocks_of_one_pool_that_is_what_its_tensors_take(
    engine: LocalEngine,
) -> None:
    cache = KVCache(engine.decoder.config, "cpu", torch.float32, max_tokens=1000)  # 63 blocks of 16
    assert cache.bytes_per_token == TINY_KV_BYTES_PER_TOKEN
    assert cache.block_bytes == TINY_KV_BLOCK_BYTES
    assert cache.bytes_after([]) == 0 == cache.stored_bytes
    rows = []
    for max_length in (10, 100, 5, 70, 300, 1):  # 1 + 7 + 1 + 5 + 19 + 1 blocks
        predicted = cache.bytes_after([max_length])
        rows.append(cache.allocate(max_length))
        assert predicted == cache.bytes_after([])
        assert (
            cache.stored_bytes
            == sum(t.nbytes for t in (*cache.keys, *cache.values))
            == (63 + 1) * TINY_KV_BLOCK_BYTES  # the scratch block too
        )
    assert cache.bytes_after([]) == 34 * TINY_KV_BLOCK_BYTES
    assert cache.bytes_after([600, 2]) == (34 + 38 + 1) * TINY_KV_BLOCK_BYTES
    for row in rows:
        cache.free(row)
    assert cache.bytes_after([]) == 0 == cache.stored_bytes


def test_the_kv_pool_holds_the_budget_or_one_requests_cap_and_is_sized_while_idle(engine, set_limits) -> None:
    sampler = engine.sampler
    rows_of_whole_context = sampler.max_batch * sampler.max_context_length
    slack = sampler.max_batch * 16  # a partly filled block per row
    assert sampler.cache.num_blocks * 16 == rows_of_whole_context + slack  # no limits: all rows can hold
    set_limits(kv_budget_bytes=4 * MIB, max_request_kv_bytes=1 * MIB)
    assert sampler.cache.num_blocks * 16 == 4 * MIB // TINY_KV_BYTES_PER_TOKEN + slack
    set_limits(kv_budget_bytes=1 * MIB, max_request_kv_bytes=2 * MIB)  # a request alone may pass the budget
    assert sampler.cache.num_blocks * 16 == 2 * MIB // TINY_KV_BYTES_PER_TOKEN + slack
    set_limits(kv_budget_bytes=1 * MIB)  # no cap on one request: it may take every row
    assert sampler.cache.num_blocks * 16 == rows_of_whole_context + slack
    row = sampler.cache.allocate(1)
    with pytest.raises(RuntimeError, match="only while no request holds a cache row"):
        sampler.limits = sampler.limits
    sampler.cache.free(row)


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
        "sampling_params.max_tokens 62 needs 1064960 bytes of KV cache ((prompt 3 + 62 new tokens) × 4 "
        "samples × 4096 bytes per token), over the 1048576 bytes (1 MiB) this server allows one request "
        "(--max-sample-kv-mib); lower it or the number of samples"
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
    # Rows of 29 and 109 tokens: 2 and 7 blocks of 16; a budget of 5 holds the short one, not both.
    budget = 5 * TINY_KV_BLOCK_BYTES
    alone = {key: _run(engine, {key: request})[0][key] for key, request in (("short", short), ("long", long))}

    together, steps = _run(engine, {"short": short, "long": long})
    assert steps[0][0] == 2  # without a budget both run at once

    set_limits(kv_budget_bytes=budget)
    queued, steps = _run(engine, {"short": short, "long": long})
    finished_short = next(i for i, (_, _, keys) in enumerate(steps) if "short" in keys)
    assert [rows for rows, _, _ in steps[: finished_short + 1]] == [1] * finished_short + [0]
    assert all(size <= budget for _, size, _ in steps[: finished_short + 1])
    assert steps[finished_short + 1][:2] == (1, 7 * TINY_KV_BLOCK_BYTES)  # then the long one, past the budget
    for key in ("short", "long"):
        assert queued[key].sequences[0].tokens.tolist() == alone[key].sequences[0].tokens.tolist()
        assert together[key].sequences[0].tokens.tolist() == alone[key].sequences[0].tokens.tolist()
