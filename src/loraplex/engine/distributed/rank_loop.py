"""Engine ranks ≥ 1: execute rank 0's commands until it says Shutdown or the group breaks.

A worker holds a replica of every adapter and runs its share of each pass; it never touches disk
beyond loading the base model. No HTTP, no SQL.
"""

from __future__ import annotations

import logging

from loraplex.engine.distributed.group import RankEnv, RankGroup, RankTimeouts, leave_group
from loraplex.engine.distributed.launch import EngineBuilder, start_rank
from loraplex.engine.distributed.protocol import Shutdown, gather_replies, scatter_commands
from loraplex.engine.distributed.replica import reply
from loraplex.engine.local import LocalEngine
from loraplex.heap import freeze_startup_heap

log = logging.getLogger(__name__)


def serve_commands(engine: LocalEngine, group: RankGroup) -> None:
    """Receive, execute and answer commands until Shutdown; raises when a collective fails."""
    while True:
        command = scatter_commands(group, None)
        if isinstance(command, Shutdown):
            return
        gather_replies(group, reply(command, engine, group))


def run_rank(
    env: RankEnv, build: EngineBuilder, device: str, timeouts: RankTimeouts, tp_size: int = 1
) -> int:
    """A worker rank's whole life: start (in tensor-parallel groups of `tp_size`), serve commands, leave;
    the process exit code."""
    engine, group = start_rank(env, build, device, timeouts, tp_size)
    freeze_startup_heap()
    log.info("engine rank %d of %d ready on %s", env.rank, env.world_size, engine.info.device)
    try:
        serve_commands(engine, group)
    except Exception:
        # Rank 0 went away, a rank stopped answering, or this replica could not follow a command.
        log.exception("engine rank %d stops: it lost the group", env.rank)
        return 1
    leave_group()
    return 0
