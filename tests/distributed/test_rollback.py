"""A pass or optimizer step that fails on one rank is taken back on every rank, so its retry counts once.

Rank 0 (this process) is made to fail its share by patching it; rank 1 (another process) is made to fail
through a switch its sitecustomize reads (a file whose presence fails its next gradient norm). The pass or
step raises a ServerError, the group keeps working, and after the client's retry every adapter equals a
single-rank engine's that never failed (its weights, moments and, through a later pass, rank 1's replica).
A prepared step that is aborted leaves the ranks' gradients summing to exactly what they summed to, with
no copy. Only a step that fails after it began to apply ends the engine (the module's last test).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from loraplex.engine import local, optimizer, passes
from loraplex.engine.interface import Engine
from loraplex.engine.local import LocalEngine
from loraplex.engine.sharding import split_by_tokens
from loraplex.engine.types import AdamParams, LoraConfig, PassRequest
from loraplex.errors import ServerError
from tests.distributed.conftest import Ranks, rl_request, sft_request, start_ranks
from tests.distributed.test_parity import assert_adapters_equal, assert_results_equal
from tests.engine.test_transactions import fail_on_call

CONFIGS = [LoraConfig(rank=4, seed=1), LoraConfig(rank=8, seed=2, train_attn=False)]
PARAMS = [AdamParams(learning_rate=1e-3), AdamParams(learning_rate=5e-4, weight_decay=0.1)]
# Rank 1's fault switch: while the file its environment names exists, its next gradient norm removes it
# and raises, as a rank running out of memory in the read-only phase of a step would.
_SWITCH_ENV = "LORAPLEX_TEST_FAIL_NEXT_NORM"
_SITECUSTOMIZE = f'''
import os

_switch = os.environ.get("{_SWITCH_ENV}")
if _switch:
    from loraplex.engine import optimizer

    _grad_norm = optimizer._grad_norm

    def _failing(slot):
        try:
            os.remove(_switch)
        except FileNotFoundError:
            return _grad_norm(slot)
        raise RuntimeError("CUDA out of memory (injected on rank 1)")

    optimizer._grad_norm = _failing
'''


@pytest.fixture(scope="module")
def switch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file that, while it exists, fails rank 1's next gradient norm."""
    return tmp_path_factory.mktemp("switch") / "fail-next-norm"


@pytest.fixture(scope="module")
def ranks(data_dir: Path, switch: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    """The module's two ranks (conftest's, whose rank 1 also has the fault switch)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:  # seen by rank 1's process only, which starts here
            patch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
            patch.setenv(_SWITCH_ENV, str(switch))
            running = stack.enter_context(start_ranks(data_dir))
        yield running


@contextmanager
def _slots_on(*engines: Engine) -> Iterator[list[int]]:
    """CONFIGS as slots on every engine (the same ids), each holding one pass of gradients; freed after."""
    ids = [[engine.create_slot(config) for config in CONFIGS] for engine in engines]
    assert all(i == ids[0] for i in ids)
    for engine in engines:
        engine.run_pass(_pass(ids[0], seed=0))
    try:
        yield ids[0]
    finally:
        for engine in engines:
            for slot in ids[0]:
                engine.free_slot(slot)


@pytest.fixture
def slots(ranks: Ranks, reference: LocalEngine) -> Iterator[list[int]]:
    with _slots_on(ranks.engine, reference) as ids:
        yield ids


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


def test_a_step_whose_prepare_rank_0_fails_is_aborted_on_rank_1_which_had_prepared_it(
    ranks, reference, slots, monkeypatch
) -> None:
    steps = dict(zip(slots, PARAMS, strict=True))
    with monkeypatch.context() as patch:
        # Rank 0 fails on its second slot's norm, after the gradient all-reduce; rank 1 prepares both.
        calls = fail_on_call(patch, optimizer, "_grad_norm", call=2)
        with pytest.raises(ServerError, match=r"engine rank 0 failed its share of the optimizer step"):
            ranks.engine.optim_step(steps)
    assert calls[0] == 2
    assert ranks.engine.failure is None and ranks.failures == []
    _step_and_compare(ranks, reference, slots)  # the retried step sums each rank's gradients once


def test_a_step_whose_prepare_rank_1_fails_is_aborted_on_rank_0_which_had_prepared_it(
    ranks, reference, slots, switch
) -> None:
    switch.touch()
    with pytest.raises(
        ServerError, match=r"engine rank 1 failed its share of the optimizer step: .*injected"
    ):
        ranks.engine.optim_step(dict(zip(slots, PARAMS, strict=True)))
    assert not switch.exists()  # rank 1 took the failure
    assert ranks.engine.failure is None and ranks.failures == []
    _step_and_compare(ranks, reference, slots)


def test_a_prepared_step_aborted_leaves_the_ranks_gradients_summing_to_exactly_what_they_did(
    ranks, reference, slots, tmp_path
) -> None:
    """prepare_step all-reduces the gradients; abort_step leaves the sum on rank 0 and zeroes rank 1's,
    copying nothing. Twins of the slots given the same pass (so the same share on each rank) and never
    prepared are the witness: once each slot's and twin's shares are summed onto rank 0 (save_state with
    gradients), they are equal bit for bit, and rank 0 already held that sum after the abort."""
    twins = [ranks.engine.create_slot(config) for config in CONFIGS]
    try:
        ranks.engine.run_pass(_pass(twins, seed=0))
        ranks.engine.abort_step(ranks.engine.prepare_step(dict(zip(slots, PARAMS, strict=True))))
        held = {slot: ranks.engine.local.pool.get(slot).adam.grads_N.clone() for slot in slots}
        for slot in (*slots, *twins):  # sums every rank's share of it onto rank 0
            ranks.engine.save_state(slot, tmp_path / str(slot), "owner", with_gradients=True)
        for slot, twin in zip(slots, twins, strict=True):
            summed = ranks.engine.local.pool.get(twin).adam.grads_N
            assert summed.any()
            assert torch.equal(ranks.engine.local.pool.get(slot).adam.grads_N, summed)  # rank 1 held zero
            assert torch.equal(held[slot], summed)  # rank 0 held the whole sum
    finally:
        for twin in twins:
            ranks.engine.free_slot(twin)
    _step_and_compare(ranks, reference, slots)


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
    """`undo_last` after a successful pass, `abort_step` after a prepared step (what the runtime asks when
    it cannot record their outcomes): the retries leave every replica as a run that did each once."""
    requests = _pass(slots, seed=1)
    ranks.engine.run_pass(requests, keep_undo=True)
    ranks.engine.undo_last()
    for engine in (ranks.engine, reference):
        engine.run_pass(requests)
    ranks.engine.abort_step(ranks.engine.prepare_step(dict(zip(slots, PARAMS, strict=True))))
    _step_and_compare(ranks, reference, slots)


def test_a_step_that_fails_part_way_through_its_apply_fails_the_engine_for_good(ranks, monkeypatch) -> None:
    """Last in this module: it ends the module's engine (closed at the module's end). Rank 0 fails on its
    second slot's kernel while rank 1 applies both: the replicas now differ, so the engine stops, as for a
    dead rank, and rank 0's half-stepped slot is poisoned."""
    assert ranks.engine.failure is None
    ids = [ranks.engine.create_slot(config) for config in CONFIGS]
    ranks.engine.run_pass(_pass(ids, seed=0))
    prepared = ranks.engine.prepare_step(dict(zip(ids, PARAMS, strict=True)))
    with monkeypatch.context() as patch:
        fail_on_call(patch, optimizer.torch, "_fused_adamw_", call=2)
        with pytest.raises(
            ServerError, match=r"engine rank 0 failed its share of the optimizer step"
        ) as error:
            ranks.engine.apply_step(prepared)
    assert f"adapter slot {ids[1]}'s optimizer step failed part way" in str(error.value)
    assert "the engine cannot go on" in str(error.value)
    assert ranks.failures == [ranks.engine.failure]
    with pytest.raises(ServerError, match="the engine cannot go on"):
        ranks.engine.run_pass(_pass(ids, seed=3))
    with pytest.raises(ServerError, match="its state is lost"):
        ranks.engine.local.pool.get(ids[1])
