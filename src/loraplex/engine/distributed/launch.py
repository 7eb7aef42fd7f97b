"""Bringing engine ranks up: the start-up every rank runs, and the local ranks `serve --nproc` spawns.

Every rank joins the group, builds its own LocalEngine on its own device and checks that all ranks
serve the same base model. Under `serve --nproc N`, rank 0 starts ranks 1..N-1 as child processes
running `engine-worker` and watches them; under torchrun, torchrun starts every rank.
No HTTP, no SQL.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from loraplex.engine.distributed.group import (
    RankEnv,
    RankGroup,
    RankTimeouts,
    join_group,
    leave_group,
    rank_device,
)
from loraplex.engine.local import LocalEngine
from loraplex.errors import ServerError, UserError
from loraplex.model.tensor_parallel import TensorParallel

T = TypeVar("T")
# Builds this rank's engine on the device it is given ("cpu", "cuda:1"), holding its tensor-parallel part.
EngineBuilder = Callable[[str, TensorParallel], LocalEngine]
_POLL_S = 0.05


def start_rank(
    env: RankEnv, build: EngineBuilder, device: str, timeouts: RankTimeouts, tp_size: int = 1
) -> tuple[LocalEngine, RankGroup]:
    """Join the mesh of tensor-parallel groups of `tp_size` ranks, build this rank's engine (its part of
    the model), check that every rank serves the same base model, and learn each rank's machine."""
    device_name = rank_device(device, env.local_rank)
    group = join_group(env, torch.device(device_name), timeouts, tp_size)
    try:
        engine = build(device_name, group.tp)
        # Each rank's base model digest and machine, in one collective.
        found: list[tuple[str, str] | None] = [None] * env.world_size
        identity = (engine.info.base_model_digest, socket.gethostname())
        dist.all_gather_object(found, identity, group=group.start_group)
        digests = [digest for digest, _ in found]  # type: ignore[misc]  # every rank sent its pair
        if len(set(digests)) > 1:
            raise UserError(
                f"the engine ranks loaded different base models (digest by rank: {digests}); "
                "give every rank the same --model"
            )
    except BaseException:
        leave_group()
        raise
    return engine, dataclasses.replace(group, hosts=tuple(host for _, host in found))  # type: ignore[misc]


def describe_exits(codes: dict[int, int]) -> str:
    """'engine rank 1 exited with code -9' for each exited rank."""
    return "; ".join(f"engine rank {rank} exited with code {code}" for rank, code in sorted(codes.items()))


class LocalRanks:
    """Ranks 1..N-1 of a group on this machine: child processes of rank 0, which watches and stops them."""

    def __init__(self, processes: dict[int, subprocess.Popen]) -> None:
        self.processes = processes

    @classmethod
    def spawn(cls, command: list[str], env: RankEnv) -> LocalRanks:
        """Start ranks 1..world_size-1 running `command` (an `engine-worker` command line).

        The ranks share this machine's cores: each, this process included, gets cores / world_size
        threads unless OMP_NUM_THREADS says otherwise.
        """
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // env.world_size))
        torch.set_num_threads(int(threads))
        processes = {}
        for rank in range(1, env.world_size):
            environ = {**os.environ, **env.for_rank(rank).to_environ(), "OMP_NUM_THREADS": threads}
            # A session of its own: a terminal's Ctrl-C reaches rank 0 only, which then stops the ranks.
            processes[rank] = subprocess.Popen(command, env=environ, start_new_session=True)
        return cls(processes)

    def exited(self, wait_s: float = 0.0) -> dict[int, int]:
        """The ranks whose process has exited, with exit codes; waits up to wait_s for the first one."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = {rank: process.poll() for rank, process in self.processes.items()}
            exited = {rank: code for rank, code in codes.items() if code is not None}
            if exited or time.monotonic() >= deadline:
                return exited
            time.sleep(_POLL_S)

    def run_watched(self, fn: Callable[[], T]) -> T:
        """fn() while watching the ranks: one that exits first fails the call at once, rather than after
        the group's rendezvous timeout (fn is left behind in its daemon thread)."""
        outcome: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(fn())
            except BaseException as error:
                failure.append(error)

        thread = threading.Thread(target=run, name="loraplex-rank-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and (exited := self.exited()):
                raise ServerError(f"{describe_exits(exited)} while the engine ranks were starting")
        if failure:
            raise failure[0]
        return outcome[0]

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for every rank to exit, then kill those still running."""
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
