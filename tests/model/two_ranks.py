"""Scenarios on two gloo ranks on this machine: rank 0 in the test's process, rank 1 a child started with
the engine's LocalRanks as `python -m <scenarios module> MODEL_DIR ...`, both calling the module's
`run_all(model_dirs, tp)` over the same directories, in the same order of collectives.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from loraplex.engine.distributed.group import RankEnv, RankTimeouts, join_group, leave_group
from loraplex.engine.distributed.launch import LocalRanks
from loraplex.model.tensor_parallel import TensorParallel

T = TypeVar("T")
RunAll = Callable[[list[Path], TensorParallel], T]

TIMEOUT_S = 60.0  # each collective's; the test fails sooner when rank 1 exits (LocalRanks.run_watched)
STOP_GRACE_S = 10.0  # rank 1 exits right after the last collective; killed if it has not by then


def _run_in_group(env: RankEnv, run_all: RunAll[T], model_dirs: list[Path]) -> T:
    group = join_group(env, torch.device("cpu"), RankTimeouts(TIMEOUT_S, TIMEOUT_S))
    try:
        return run_all(model_dirs, TensorParallel.over(group.data))
    finally:
        leave_group()


def run_on_two_ranks(scenarios: str, run_all: RunAll[T], model_dirs: list[Path]) -> T:
    """Rank 0's `run_all` result, with rank 1 running module `scenarios` (whose main is `rank_main`)."""
    env = RankEnv.on_this_machine(2)
    command = [sys.executable, "-m", scenarios, *map(str, model_dirs)]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the child imports the tests package too
        local_ranks = LocalRanks.spawn(command, env)
    try:
        return local_ranks.run_watched(lambda: _run_in_group(env, run_all, model_dirs))
    finally:
        local_ranks.stop(STOP_GRACE_S)
        torch.set_num_threads(threads)


def rank_main(run_all: RunAll[object]) -> None:
    """Rank 1 (or any rank but 0): join the group the test's rank 0 opened and run every scenario."""
    _run_in_group(RankEnv.from_environ(), run_all, [Path(arg) for arg in sys.argv[1:]])
