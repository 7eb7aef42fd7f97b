"""A pass or optimizer step that fails on one rank is taken back on every rank, so its retry counts once.

Rank 0 (this process) is made to fail its share while rank 1 (another process) completes its own; the pass
or step raises a ServerError, the group keeps working, and after the client's retry every adapter equals a
single-rank engine's that never failed (its weights, moments and, through a later pass, rank 1's replica).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loraplex.engine import local, optimizer, passes
from loraplex.engine.local import LocalEngine
from loraplex.engine.sharding import split_by_tokens
from loraplex.engine.types import AdamParams, LoraConfig, PassRequest
from loraplex.errors import ServerError
from tests.distributed.conftest import Ranks, rl_request, sft_request
from tests.distributed.test_parity import assert_adapters_equal, assert_results_equal
from tests.engine.test_transactions import fail_on_call

CONFIGS = [LoraConfig(rank=4, seed=1), LoraConfig(rank=8, seed=2, train_attn=False)]
PARAMS = [AdamParams(learning_rate=1e-3), AdamParams(learning_rate=5e-4, weight_decay=0.1)]


@pytest.fixture
def slots(ranks: Ranks, reference: LocalEngine) -> Iterator[list[int]]:
    """CONFIGS as slots on both engines (the same ids), each already holding one pass of gradients."""
    engines = (ranks.engine, reference)
    ids = [[engine.create_slot(config) for config in CONFIGS] for engine in engines]
    assert ids[0] == ids[1]
    for engine in engines:
        engine.run_pass(_pass(ids[0], seed=0))
    try:
        yield ids[0]
    finally:
        for engine in engines:
            for slot in ids[0]:
                engine.free_slot(slot)


def _pass(slots: list[int], seed: int) -> list[PassRequest]:
    a, b = slots
    return [sft_request(a, [13, 5, 21], seed), rl_request(b, "importance_sampling", [9, 17], seed + 1)]


def _step_and_compare(ranks: Ranks, reference: LocalEngine, slots: list[int]) -> None:
    """One fused step on both engines, then every adapter and a pass over both ranks' replicas compared."""
    for engine in (ranks.engine, reference):
        engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
    assert_adapters_equal(ranks.engine.local, reference, slots)
    check = _pass(slots, seed=99)
    assert_results_equal(ranks.engine.run_pass(check), reference.run_pass(check))


def test_a_pass_rank_0_fails_after_some_lm_head_chunks_is_undone_on_both_ranks(
    ranks, reference, slots, monkeypatch
) -> None:
    requests = _pass(slots, seed=1)
    assert all(split_by_tokens(requests, 2))  # rank 1 has a share, which it completes
    monkeypatch.setattr(ranks.engine.local, "logprob_chunk", 4)  # rank 0's share: several lm_head chunks
    with monkeypatch.context() as patch:
        calls = fail_on_call(patch, passes, "_chunk_objective", call=2)  # after one chunk's backward
        with pytest.raises(ServerError, match=r"engine rank 0 failed its share of the pass: .*out of memory"):
            ranks.engine.run_pass(requests)
    assert calls[0] == 2
    assert ranks.engine.failure is None and ranks.failures == []
    for engine in (ranks.engine, reference):  # the client's retry, and an engine that never failed
        engine.run_pass(requests)
    _step_and_compare(ranks, reference, slots)


def test_an_optimizer_step_rank_0_fails_is_undone_on_rank_1_which_had_taken_it(
    ranks, reference, slots, monkeypatch
) -> None:
    steps = dict(zip(slots, PARAMS, strict=True))
    with monkeypatch.context() as patch:
        # Rank 0 fails on its second slot, after the gradient all-reduce and its first slot's update;
        # rank 1, another process, steps both slots.
        calls = fail_on_call(patch, optimizer.torch, "_fused_adamw_", call=2)
        with pytest.raises(ServerError, match=r"engine rank 0 failed its share of the optimizer step"):
            ranks.engine.optim_step(steps)
    assert calls[0] == 2
    assert ranks.engine.failure is None and ranks.failures == []
    _step_and_compare(ranks, reference, slots)  # the retried step sums each rank's gradients once


def test_a_share_that_fails_before_it_changes_anything_takes_back_no_earlier_pass(
    ranks, reference, slots, monkeypatch
) -> None:
    requests = _pass(slots, seed=2)
    for engine in (ranks.engine, reference):  # a pass every rank completed (and could have undone)
        engine.run_pass(_pass(slots, seed=1))
    with monkeypatch.context() as patch:
        fail_on_call(patch, local, "SlotSnapshot", call=1)  # rank 0 cannot copy its slots: nothing ran
        with pytest.raises(ServerError, match=r"engine rank 0 failed its share of the pass: .*out of memory"):
            ranks.engine.run_pass(requests)
    for engine in (ranks.engine, reference):
        engine.run_pass(requests)
    _step_and_compare(ranks, reference, slots)  # the earlier pass is still in every rank's gradients


def test_a_pass_and_a_step_the_runtime_could_not_record_are_taken_back_on_both_ranks(
    ranks, reference, slots
) -> None:
    """`undo_last` after a successful pass, then after a successful step (what the runtime asks when it
    cannot record their outcomes): the retries leave every replica as a run that did each once."""
    requests = _pass(slots, seed=1)
    ranks.engine.run_pass(requests, keep_undo=True)
    ranks.engine.undo_last()
    for engine in (ranks.engine, reference):
        engine.run_pass(requests)
    steps = dict(zip(slots, PARAMS, strict=True))
    ranks.engine.optim_step(steps, keep_undo=True)
    ranks.engine.undo_last()
    _step_and_compare(ranks, reference, slots)
