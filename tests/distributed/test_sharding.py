"""A pass is split across ranks by tokens, not by datum count, and merges back in datum order."""

from __future__ import annotations

import numpy as np

from loraplex.engine.sharding import Piece, merge_results, piece_requests, split_by_tokens
from loraplex.engine.types import PassResult
from tests.distributed.conftest import sft_request
from tests.model.rounding import assert_at_most, sums_bound


def _tokens_per_rank(requests, shares) -> list[int]:
    return [
        sum(len(d.tokens) for r in piece_requests(requests, pieces) for d in r.datums) for pieces in shares
    ]


def test_ranks_get_equal_tokens_not_equal_datum_counts() -> None:
    requests = [sft_request(0, [100], seed=0), sft_request(1, [10] * 10, seed=1)]
    shares = split_by_tokens(requests, 2)
    assert shares == [[Piece(0, 0, 1)], [Piece(1, 0, 10)]]  # 1 datum vs 10, 100 tokens each


def test_every_rank_is_within_the_longest_datum_of_the_mean() -> None:
    rng = np.random.default_rng(0)
    for world_size in (2, 3, 4, 8):
        lengths = [rng.integers(1, 60, rng.integers(1, 8)).tolist() for _ in range(5)]
        requests = [sft_request(i, n, seed=i) for i, n in enumerate(lengths)]
        counts = _tokens_per_rank(requests, split_by_tokens(requests, world_size))
        longest = max(max(n) for n in lengths)
        assert sum(counts) == sum(map(sum, lengths))
        assert max(abs(c - sum(counts) / world_size) for c in counts) <= longest


def test_a_request_may_be_cut_between_ranks_and_its_datums_keep_their_order() -> None:
    requests = [sft_request(0, [4, 4, 4, 4], seed=0), sft_request(1, [4, 4], seed=1)]
    shares = split_by_tokens(requests, 3)
    assert shares == [[Piece(0, 0, 2)], [Piece(0, 2, 4)], [Piece(1, 0, 2)]]


def test_more_ranks_than_datums_leaves_ranks_idle() -> None:
    shares = split_by_tokens([sft_request(0, [5, 7], seed=0)], 4)
    assert [len(pieces) for pieces in shares].count(0) == 2
    assert [p for pieces in shares for p in pieces] == [Piece(0, 0, 1), Piece(0, 1, 2)]


def test_merged_outputs_follow_datum_order_and_loss_sum_covers_every_datum() -> None:
    request = sft_request(0, [3, 2, 4], seed=0)
    shares = [[Piece(0, 0, 2)], [Piece(0, 2, 3)]]
    # Each datum's logprobs are -(its index + 1) per token, so its loss is (index + 1) * sum(weights).
    outputs = [
        {"logprobs": np.full(len(d.tokens), -(i + 1.0), np.float32)} for i, d in enumerate(request.datums)
    ]
    results = [[PassResult(outputs[:2])], [PassResult(outputs[2:])]]
    (merged,) = merge_results([request], shares, results)
    assert [o["logprobs"][0] for o in merged.outputs] == [-1.0, -2.0, -3.0]
    weights = [d.loss_fn_inputs["weights"].sum() for d in request.datums]
    expected = sum((i + 1) * w for i, w in enumerate(weights))
    # Both are fp32 sums of the same 9 terms (i + 1)·w_t, in other orders (the expected one by datum
    # first, within the rounding of summing 9 terms too): each within sum_rounding_bound of the exact sum.
    terms = np.concatenate(
        [(i + 1) * d.loss_fn_inputs["weights"].astype(np.float64) for i, d in enumerate(request.datums)]
    )
    assert_at_most(abs(merged.metrics["loss:sum"] - expected), sums_bound(terms, terms), "loss:sum")
