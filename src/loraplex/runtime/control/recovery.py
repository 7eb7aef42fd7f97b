"""Start-up after a restart or a crash: what the database and the data directory say is true again.

Requests that were in flight fail with a server error (their work died with the process); every run
comes back parked if its parked state is on disk, else lost (its live state died; it can be resumed from
its checkpoints); directory writes a crash interrupted are finished or undone (durable.py). Runs on the
starting thread, before anything is served. No tensors, no HTTP.
"""

from __future__ import annotations

import logging

from loraplex.engine.types import LoraConfig
from loraplex.runtime.control.store import Store
from loraplex.runtime.core.checkpoints import DiskLayout
from loraplex.runtime.core.run_queue import EXPIRED, LOST, PARKED, RunQueue, RunState
from loraplex.runtime.core.state import SharedState

log = logging.getLogger(__name__)

RESTART_ERROR = "the server restarted before this request finished; submit it again"


def recover(
    store: Store, layout: DiskLayout, state: SharedState, max_seq_ids_ahead: int, max_queued_bytes: int
) -> None:
    """Fail in-flight futures, bring back every run (parked or lost) into `state`, tidy the data dir."""
    failed = store.fail_pending_futures(RESTART_ERROR)
    last_seq = store.last_seq_ids()
    removed = layout.remove_staging()
    for row in store.all_runs():
        if row.status == EXPIRED:  # its live state is gone for good: answered from its row (service.py)
            continue
        parked = layout.parked_dir(row.id)
        status = PARKED if parked.is_dir() else LOST
        if status != row.status:
            store.update_run(row.id, status=status)
        state.runs[row.id] = RunState(
            row.id,
            row.tenant,
            row.session_id,
            row.base_model,
            RunQueue(last_seq.get(row.id, 0) + 1, max_seq_ids_ahead, max_queued_bytes),
            lora_config=LoraConfig(**row.lora_config),
            status=status,
            user_metadata=row.user_metadata or {},
            parked_dir=parked if status == PARKED else None,
            optim_steps=row.last_step or 0,
        )
    if failed or state.runs or removed:
        log.info(
            "recovered %d runs; failed %d requests that were in flight; removed %d unfinished writes",
            len(state.runs),
            failed,
            removed,
        )
