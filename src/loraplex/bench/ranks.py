"""The engine `bench train` measures: one LocalEngine in this process, or, with `--nproc N --tp T`, rank 0
of N engine ranks as `loraplex serve --nproc N --tp T` runs them (this process is rank 0, ranks 1..N-1
are `loraplex engine-worker` children on the same model directory), so a multi-GPU figure is the
product's own path: the coordinator, its collectives and the tensor-parallel model.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from loraplex.engine.distributed.coordinator import DistributedEngine, start_coordinator
from loraplex.engine.distributed.group import RankEnv, RankTimeouts
from loraplex.engine.distributed.launch import LocalRanks
from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.model.tensor_parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

MODEL_NAME = "bench"
# Ranks load a random-init base from the scratch directory; a large one takes minutes on a slow disk.
_TIMEOUTS = RankTimeouts(collective_s=600.0, start_s=1800.0)

BenchEngine = LocalEngine | DistributedEngine


def local_part(engine: BenchEngine) -> LocalEngine:
    """This process's own engine: the engine itself, or rank 0's part of the ranks."""
    return engine.local if isinstance(engine, DistributedEngine) else engine


def build_bench_engine(
    model_dir: Path, device: str, max_slots: int, max_rank: int, tp: TensorParallel = SINGLE
) -> LocalEngine:
    """The engine `loraplex serve` would build over `model_dir` (build_local_engine), this rank's part of
    it under `tp`."""
    return build_local_engine(
        str(model_dir), model_dir.parent, device, max_slots, max_rank, MODEL_NAME, None, tp
    )


@contextmanager
def engine_ranks(
    model_dir: Path, device: str, max_slots: int, max_rank: int, nproc: int = 1, tp: int = 1
) -> Iterator[BenchEngine]:
    """The engine `loraplex serve --nproc nproc --tp tp` builds over `model_dir`; ranks stopped on exit."""

    def build(rank_device: str, part: TensorParallel) -> LocalEngine:
        return build_bench_engine(model_dir, rank_device, max_slots, max_rank, part)

    if nproc == 1:
        yield build(device, SINGLE)
        return
    env = RankEnv.on_this_machine(nproc)
    worker = [sys.executable, "-m", "loraplex.cli", "engine-worker", "--model", str(model_dir)]
    worker += ["--data-dir", str(model_dir.parent), "--device", device, "--model-name", MODEL_NAME]
    worker += ["--max-slots", str(max_slots), "--max-rank", str(max_rank), "--tp", str(tp)]
    worker += ["--rank-timeout-s", str(_TIMEOUTS.collective_s)]
    threads = torch.get_num_threads()
    local_ranks = LocalRanks.spawn(worker, env)
    try:
        engine = start_coordinator(env, build, device, _TIMEOUTS, tp, log.error, local_ranks)
        try:
            yield engine
        finally:
            engine.close()
    finally:
        local_ranks.stop(0.0)
        torch.set_num_threads(threads)
