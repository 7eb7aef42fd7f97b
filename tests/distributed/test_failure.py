"""A dead or silent engine rank fails the engine within seconds, with a clear error, and never hangs.

Every call from then on raises the same ServerError at once, and `on_failure` is told once (the server
exits on it: tests/distributed/test_serve.py).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.errors import ServerError
from tests.distributed.conftest import Ranks, sft_request, start_ranks

TIMEOUT_S = 2.0  # the ranks' collective timeout where a test waits for it


def _wait_for_failure(ranks: Ranks, limit_s: float) -> float:
    """Seconds until the engine reported a failure (fails the test after limit_s)."""
    start = time.monotonic()
    while not ranks.failures:
        assert time.monotonic() - start < limit_s, "no failure was reported"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_killed_local_rank_fails_the_call_in_flight_naming_its_exit_code(tmp_path) -> None:
    with start_ranks(tmp_path) as ranks:
        slot = ranks.engine.create_slot(LoraConfig(rank=4))
        ranks.local_ranks.processes[1].kill()
        start = time.monotonic()
        with pytest.raises(ServerError, match=r"engine rank 1 exited with code -9;.*restart"):
            ranks.engine.run_pass([sft_request(slot, [5, 9, 13], seed=0)])
        assert time.monotonic() - start < 3
        with pytest.raises(ServerError, match="engine rank 1 exited with code -9"):
            ranks.engine.optim_step({slot: AdamParams()})
        assert len(ranks.failures) == 1 and "exited with code -9" in ranks.failures[0]


@pytest.mark.parametrize(
    ("how", "limit_s"),
    [(signal.SIGKILL, 2.0), (signal.SIGSTOP, TIMEOUT_S + 2.0)],  # a stopped rank: found by the timeout
    ids=["killed", "stopped"],
)
def test_an_idle_rank_on_another_machine_that_dies_or_hangs_is_found_by_the_heartbeat(
    tmp_path, how: signal.Signals, limit_s: float
) -> None:
    with start_ranks(tmp_path, timeout_s=TIMEOUT_S, is_watched=False) as ranks:
        ranks.local_ranks.processes[1].send_signal(how)
        assert _wait_for_failure(ranks, limit_s) < limit_s
        assert "an engine rank stopped answering" in ranks.failures[0]
        start = time.monotonic()
        with pytest.raises(ServerError, match="stopped answering"):
            ranks.engine.create_slot(LoraConfig(rank=4))
        assert time.monotonic() - start < 0.5


def test_a_share_of_a_pass_that_raises_fails_that_pass_only(tmp_path, monkeypatch) -> None:
    with start_ranks(tmp_path) as ranks:
        slot = ranks.engine.create_slot(LoraConfig(rank=4))
        request = sft_request(slot, [5, 9, 13], seed=0)

        def out_of_memory(requests, keep_undo=False):
            raise RuntimeError("CUDA out of memory")

        with monkeypatch.context() as patch:
            patch.setattr(ranks.engine.local, "run_pass", out_of_memory)
            with pytest.raises(
                ServerError, match=r"engine rank 0 failed its share of the pass: .*out of memory"
            ):
                ranks.engine.run_pass([request])
        assert ranks.engine.failure is None and ranks.failures == []
        (result,) = ranks.engine.run_pass([request])  # the group still works
        assert len(result.outputs) == 3


def test_under_tensor_parallelism_a_failed_share_fails_the_engine_at_once_naming_the_rank(
    tmp_path, monkeypatch
) -> None:
    """Its peers wait in a collective it will not join: no take-back is possible, so the engine fails now,
    not at the collective timeout (60 s here)."""
    with start_ranks(tmp_path, tp=2) as ranks:
        slot = ranks.engine.create_slot(LoraConfig(rank=4))

        def out_of_memory(requests, keep_undo=False):
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(ranks.engine.local, "run_pass", out_of_memory)
        start = time.monotonic()
        with pytest.raises(
            ServerError, match=r"engine rank 0 failed its part of a RunPass .*out of memory.*restart"
        ):
            ranks.engine.run_pass([sft_request(slot, [5, 9, 13], seed=0)])
        assert time.monotonic() - start < 5
        assert len(ranks.failures) == 1


@pytest.mark.parametrize("is_watched", [True, False], ids=["this-machine", "another-machine"])
def test_under_tensor_parallelism_a_rank_killed_mid_pass_fails_that_pass_within_seconds(
    tmp_path, is_watched: bool
) -> None:
    """Rank 0 computes its half of the pass in the same collectives as rank 1: killed in the middle, rank
    1 must not leave rank 0 waiting for the collective timeout (60 s here). Whether rank 0 learns it from
    watching its child or from the collective's broken connection, the pass fails naming the cause."""
    with start_ranks(tmp_path, tp=2, is_watched=is_watched) as ranks:
        slot = ranks.engine.create_slot(LoraConfig(rank=4))
        request = sft_request(slot, [2000] * 8, seed=0)
        start = time.monotonic()
        ranks.engine.run_pass([request])
        pass_s = time.monotonic() - start  # the same pass, undisturbed
        assert pass_s > 0.2, "the pass is too short to be killed in the middle"
        killer = threading.Timer(pass_s / 4, ranks.local_ranks.processes[1].kill)
        killer.start()
        start = time.monotonic()
        cause = "engine rank 1 exited with code -9" if is_watched else "an engine rank stopped answering"
        with pytest.raises(ServerError, match=cause):
            ranks.engine.run_pass([request])
        assert time.monotonic() - start < pass_s + 3
        assert len(ranks.failures) == 1
