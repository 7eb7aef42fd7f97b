"""The engine ranks' process group: who this rank is, how ranks meet, and the flat tensor collectives.

Ranks find each other as torchrun tells them: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
Two groups span all ranks: `data` moves tensors (nccl on CUDA, gloo on CPU); `control` moves pickled
commands and is always gloo, so control traffic never touches a GPU. Every collective has the group's
timeout, so no rank waits forever on a dead one.

The ranks form a mesh of N / T data-parallel groups of T tensor-parallel ranks (`--tp T`): ranks
d·T .. d·T + T - 1 split the base model between them (`tp`, consecutive ranks, so a group sits on one
machine's GPUs where it can), and the ranks that hold the same part, one per data-parallel group
(t, t + T, ...), are `replicas` of each other. With T = 1 every rank holds everything and `replicas` is
`data`. No HTTP, no SQL.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loraplex.engine.local import resolve_device
from loraplex.errors import UserError
from loraplex.model.tensor_parallel import SINGLE, TensorParallel, collective

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankTimeouts:
    """How long a rank waits on the others: to start (meet, load the model, compare digests), which can
    take minutes on a large base or a slow disk, and inside any later collective, where a rank that is
    silent for long has died or hung and must be found quickly."""

    collective_s: float
    start_s: float


@dataclass(frozen=True)
class RankEnv:
    """Where this rank sits in the group and where the group meets (rank 0's store)."""

    rank: int
    world_size: int
    local_rank: int  # index among this machine's ranks: picks the GPU
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankEnv:
        """The rank torchrun (or `serve --nproc`) described in the environment; UserError if it did not."""
        missing = [key for key in _ENV_KEYS if key not in environ]
        if missing:
            raise UserError(
                f"engine-worker needs {', '.join(_ENV_KEYS)} in its environment (torchrun sets them); "
                f"missing: {', '.join(missing)}"
            )
        rank = int(environ["RANK"])
        return cls(
            rank=rank,
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", rank)),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
        )

    @classmethod
    def on_this_machine(cls, world_size: int) -> RankEnv:
        """Rank 0 of `world_size` ranks that all run here, meeting on a free loopback port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls(rank=0, world_size=world_size, local_rank=0, master_addr="127.0.0.1", master_port=port)

    def for_rank(self, rank: int) -> RankEnv:
        """Another rank of the same single-machine group."""
        return replace(self, rank=rank, local_rank=rank)

    def to_environ(self) -> dict[str, str]:
        """The environment variables that describe this rank, as torchrun sets them."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class RankGroup:
    """This process's membership: its rank, the world size, the process groups and its place in the mesh."""

    rank: int
    world_size: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    start_group: dist.ProcessGroup  # gloo, with the start-up timeout: used before the engine is ready
    replicas: dist.ProcessGroup  # the ranks holding this rank's part of the model, one per data group
    tp: TensorParallel = SINGLE  # this rank's tensor-parallel group
    hosts: tuple[str, ...] = ()  # each rank's machine (hostname), by rank, once the ranks have started

    @property
    def dp_size(self) -> int:
        """How many data-parallel groups there are (N / T)."""
        return self.world_size // self.tp.size

    @property
    def dp_rank(self) -> int:
        """Which data-parallel group this rank is in (its index among `replicas`)."""
        return self.rank_dp(self.rank)

    def rank_dp(self, rank: int) -> int:
        """Which data-parallel group `rank` is in."""
        return rank // self.tp.size

    def ranks_of(self, dp_rank: int) -> range:
        """The ranks of one data-parallel group (a tensor-parallel group)."""
        return range(dp_rank * self.tp.size, (dp_rank + 1) * self.tp.size)


def rank_device(device: str, local_rank: int) -> str:
    """The device this rank computes on: --device resolved, and on CUDA the local rank's own GPU."""
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        return str(resolved)
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(
            f"engine ranks need one GPU each: local rank {local_rank} needs GPU {local_rank}, and this "
            f"machine has {count}; start fewer ranks per machine"
        )
    return f"cuda:{local_rank}"


def join_group(env: RankEnv, device: torch.device, timeouts: RankTimeouts, tp_size: int = 1) -> RankGroup:
    """Meet the other ranks (blocks until all have joined, at most timeouts.start_s) and open the groups of
    a mesh of tensor-parallel groups of `tp_size` ranks (which must divide the world size).

    The default group (gloo) keeps the start-up timeout and serves start-up alone (`start_group`); the
    others, used from then on, have the collective timeout.
    """
    if tp_size < 1 or env.world_size % tp_size:
        raise UserError(f"--tp {tp_size} must divide the number of engine ranks ({env.world_size})")
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr  # IPv6 literal
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeouts.start_s),
    )
    collective = timedelta(seconds=timeouts.collective_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    data = dist.new_group(backend=backend, timeout=collective)
    control = dist.new_group(backend="gloo", timeout=collective)
    if tp_size == 1:
        return RankGroup(env.rank, env.world_size, data, control, dist.group.WORLD, replicas=data)
    # Every rank creates every group, in the same order (new_group is collective), and keeps its own.
    dp_size = env.world_size // tp_size
    tp_groups = [
        dist.new_group(list(range(d * tp_size, (d + 1) * tp_size)), timeout=collective, backend=backend)
        for d in range(dp_size)
    ]
    replica_groups = [
        dist.new_group(list(range(t, env.world_size, tp_size)), timeout=collective, backend=backend)
        for t in range(tp_size)
    ]
    tp = TensorParallel.over(tp_groups[env.rank // tp_size])
    replicas = replica_groups[env.rank % tp_size]
    return RankGroup(env.rank, env.world_size, data, control, dist.group.WORLD, replicas, tp)


def leave_group() -> None:
    """Close both groups; never while another thread of this process is inside a collective."""
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def all_reduce_flat(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Sum each tensor over all ranks, in place, with one collective.

    Semantics: `for t in tensors: dist.all_reduce(t, SUM)`, as one all-reduce of their concatenation.
    """
    flat = _flatten_dense_tensors(list(tensors))
    with collective():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    _copy_back(tensors, flat)


@torch.no_grad()
def broadcast_flat(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite each tensor with the group's first rank's, in place, with one collective.

    Semantics: `for t in tensors: dist.broadcast(t, group_src=0)`, as one broadcast of their concatenation.
    """
    flat = _flatten_dense_tensors(list(tensors))
    with collective():
        dist.broadcast(flat, group=group, group_src=0)
    if dist.get_rank(group) != 0:
        _copy_back(tensors, flat)


def _copy_back(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy a flat buffer's segments into the tensors it was made from (a no-op where it is their view)."""
    for tensor, segment in zip(tensors, _unflatten_dense_tensors(flat, list(tensors)), strict=True):
        if segment.data_ptr() != tensor.data_ptr():
            tensor.copy_(segment)
