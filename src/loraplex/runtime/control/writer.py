"""The writer: the one thread that makes the engine loop's records durable (the journal of core/journal.py,
whose module docstring states the ordering rule).

Group commit: the records that queue while a transaction runs go together into the next one, so a fused
pass's outcomes and metrics, the sampler's finished requests and a step's outcome cost one commit between
them. Only once that commit returns are the futures settled (their waiters woken), the receipts answered
and the directories the records made obsolete removed.

A transaction the database refuses is retried with backoff. If it still fails, each record is tried alone,
so one record's bad row cannot fail the others. A record that cannot be written: its receipt says so (the
engine loop takes the call back where it can), the directory it wrote is removed, and its requests fail in
memory with a server error saying the outcome could not be recorded (and, where the call was taken back,
that nothing was kept). Those failures are written to the database once it answers again, so none of
these requests ever reads as pending again. No tensors, no HTTP.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import queue
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from loraplex.errors import ServerError
from loraplex.os_threads import name_os_thread
from loraplex.runtime.control.futures import FutureTable, outcome_row
from loraplex.runtime.control.store import Batch, FutureOutcome, Store
from loraplex.runtime.control.store.schema import CheckpointRow, RunRow, SamplerRow
from loraplex.runtime.core.journal import (
    OPTIM_STEP,
    CheckpointSaved,
    MetricsRecorded,
    Receipt,
    Record,
    Result,
    RunCreated,
    RunStatusChanged,
    SamplerCreated,
)
from loraplex.runtime.core.run_queue import LIVE
from loraplex.timestamps import utcnow

log = logging.getLogger(__name__)

WRITER = "lpx-writer"
# Pauses between attempts to write a batch the database refuses (then each record is tried alone).
RETRY_PAUSES_S = (0.05, 0.2, 1.0)
# The most records in one transaction: bounds how long the first of a long burst waits for its commit.
_MAX_BATCH = 256
# How often outcomes that could not be written are tried again while nothing else arrives.
_UNWRITTEN_RETRY_S = 5.0


@dataclass
class _Entry:
    record: Record
    receipt: Receipt = field(default_factory=Receipt)


class JournalWriter:
    """Writes records in batches on its own thread; `append` is the Journal the engine loop uses."""

    def __init__(
        self, store: Store, futures: FutureTable, retry_pauses_s: Sequence[float] | None = None
    ) -> None:
        self._store, self._futures = store, futures
        self._retry_pauses_s = None if retry_pauses_s is None else tuple(retry_pauses_s)  # None: the default
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._unwritten: dict[str, FutureOutcome] = {}  # failures settled in memory, to write when we can
        self._next_unwritten_try = 0.0  # time.monotonic() before which those are not tried again
        self._thread = threading.Thread(target=self._serve, name="loraplex-writer", daemon=True)
        self._lock = threading.Lock()  # append vs close
        self._closed = False

    # --- the journal
    def append(self, record: Record) -> Receipt:
        """Queue a record; its receipt settles once it is durable, or known never to be. After `close`, a
        record is written at once on the caller's thread (the loop parks runs after the writer stops
        taking work: nothing may be lost)."""
        entry = _Entry(record)
        with self._lock:
            if not self._closed:
                self._queue.put(entry)
                return entry.receipt
        self._write_or_give_up([entry])
        return entry.receipt

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def close(self) -> None:
        """Write everything queued, then stop the thread; later records are written by their callers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()
            return
        self._serve()  # never started: write what was queued here

    # --- writing
    def _serve(self) -> None:
        if threading.current_thread() is self._thread:
            name_os_thread(WRITER)
        while True:
            try:
                first = self._queue.get(timeout=_UNWRITTEN_RETRY_S if self._unwritten else None)
            except queue.Empty:
                self._write_unwritten(force=True)
                continue
            entries, stopping = ([] if first is None else [first]), first is None
            while len(entries) < _MAX_BATCH and not stopping:
                try:
                    entry = self._queue.get_nowait()
                except queue.Empty:
                    break
                if entry is None:
                    stopping = True
                else:
                    entries.append(entry)
            if entries:
                self._write_or_give_up(entries)
            self._write_unwritten(force=stopping)
            if stopping:
                return

    def _write_or_give_up(self, entries: Sequence[_Entry]) -> None:
        """`write`, and whatever goes wrong the thread goes on: the engine loop waits on these receipts."""
        try:
            self.write(entries)
        except Exception:
            log.exception("the writer failed on %d records", len(entries))
            for entry in entries:
                if not entry.receipt.is_settled:
                    self._give_up(entry)

    def write(self, entries: Sequence[_Entry]) -> None:
        """Write `entries` in one transaction (each alone if that fails), then settle what they concern."""
        refusal = self._try(entries, retries=True)
        if refusal is None:
            return
        if len(entries) > 1:
            log.warning("writing %d records in one transaction failed; writing each alone", len(entries))
        for entry in entries:
            alone = refusal if len(entries) == 1 else self._try([entry], retries=False)
            if alone is not None:
                self._give_up(entry, alone)

    def _try(self, entries: Sequence[_Entry], retries: bool) -> Exception | None:
        """Write the entries' records in one transaction (retried with backoff if `retries`); on success
        settle them and return None, else the database's last refusal."""
        now = utcnow()
        rows = {id(entry): _outcome_rows(entry.record) for entry in entries}
        batch = _batch([entry.record for entry in entries], rows, now)
        pauses = (RETRY_PAUSES_S if self._retry_pauses_s is None else self._retry_pauses_s) if retries else ()
        for attempt, pause_s in enumerate((*pauses, None)):
            try:
                self._store.write_batch(batch)
                break
            except Exception as exc:
                if pause_s is None:
                    log.exception("could not write %d records", len(entries))
                    return exc
                log.warning("writing %d records failed (attempt %d): %s", len(entries), attempt + 1, exc)
                time.sleep(pause_s)
        for entry in entries:
            settle = functools.partial(self._futures.settle, rows[id(entry)], is_written=True)
            if entry.record.is_held_until_applied:
                entry.receipt.settle(True, publish=settle)
            else:
                settle()
                entry.receipt.settle(True)
            for directory in entry.record.obsolete:
                shutil.rmtree(directory, ignore_errors=True)
        return None

    def _give_up(self, entry: _Entry, refusal: Exception) -> None:
        """A record the database refused: its requests fail in memory (written later), its receipt says so."""
        record = entry.record
        undone = "; nothing it did was kept, so it can be retried" if record.is_undone_if_unwritten else ""
        error = ServerError(
            f"the server could not record this request's outcome ({type(refusal).__name__}; the server log "
            f"has the details){undone}"
        )
        failures = [outcome_row(future_id, error) for future_id in record.outcomes]
        for row in failures:
            self._unwritten[row.id] = row
        self._futures.settle([(row, None) for row in failures], is_written=False)
        if record.written is not None:
            shutil.rmtree(record.written, ignore_errors=True)
        entry.receipt.settle(False)

    def _write_unwritten(self, force: bool = False) -> None:
        """Try again, in a transaction of their own and at most every few seconds (unless `force`), to
        write the failures of records that could not be written; once written they are evicted like any."""
        if not self._unwritten or (not force and time.monotonic() < self._next_unwritten_try):
            return
        self._next_unwritten_try = time.monotonic() + _UNWRITTEN_RETRY_S
        try:
            self._store.write_batch(Batch(outcomes=list(self._unwritten.values())))
        except Exception as exc:
            log.warning("%d request outcomes still cannot be written: %s", len(self._unwritten), exc)
            return
        self._futures.mark_written(list(self._unwritten))
        log.info("wrote %d request outcomes the database had refused", len(self._unwritten))
        self._unwritten.clear()


def _outcome_rows(record: Record) -> list[tuple[FutureOutcome, Result | None]]:
    return [
        (outcome_row(future_id, outcome), None if isinstance(outcome, BaseException) else outcome)
        for future_id, outcome in record.outcomes.items()
    ]


def _batch(
    records: Sequence[Record], rows: dict[int, list[tuple[FutureOutcome, Any]]], now: datetime
) -> Batch:
    """The rows of the records, in the order the records came."""
    batch = Batch(outcomes=[row for row_list in rows.values() for row, _ in row_list])
    for record in records:
        for fact in record.facts:
            if isinstance(fact, MetricsRecorded):
                batch.metrics.append(_metric_row(fact, now))
                if fact.kind == OPTIM_STEP:
                    batch.last_steps[fact.run_id] = fact.step
            elif isinstance(fact, RunCreated):
                batch.runs.append(_run_row(fact, now))
            elif isinstance(fact, RunStatusChanged):
                batch.statuses[fact.run_id] = fact.status
            elif isinstance(fact, CheckpointSaved):
                batch.checkpoints.append(_checkpoint_row(fact, now))
            elif isinstance(fact, SamplerCreated):
                batch.samplers.append(_sampler_row(fact, now))
    return batch


def _metric_row(entry: MetricsRecorded, recorded_at: datetime) -> dict[str, Any]:
    """The history row of one request's metrics (non-finite values left out, as the SDK's results leave
    them out)."""
    finite = {k: v for k, v in entry.metrics.items() if math.isfinite(v)}
    return {
        "run_id": entry.run_id,
        "seq_id": entry.seq_id,
        "step": entry.step,
        "kind": entry.kind,
        "metrics": json.dumps(finite),
        "recorded_at": recorded_at,
    }


def _run_row(fact: RunCreated, now: datetime) -> RunRow:
    return RunRow(
        id=fact.run_id,
        session_id=fact.session_id,
        tenant=fact.tenant,
        base_model=fact.base_model,
        lora_config=vars(fact.lora_config),
        user_metadata=dict(fact.user_metadata),
        status=LIVE,
        created_at=now,
        last_request_at=now,
    )


def _checkpoint_row(fact: CheckpointSaved, now: datetime) -> CheckpointRow:
    expires = None if fact.ttl_seconds is None else now + timedelta(seconds=fact.ttl_seconds)
    return CheckpointRow(
        run_id=fact.path.run_id,
        kind=fact.path.kind,
        name=fact.path.name,
        tenant=fact.tenant,
        size_bytes=fact.size_bytes,
        created_at=now,
        expires_at=expires,
        user_metadata=dict(fact.user_metadata),
    )


def _sampler_row(fact: SamplerCreated, now: datetime) -> SamplerRow:
    return SamplerRow(
        id=fact.sampler_id,
        session_id=fact.session_id,
        tenant=fact.tenant,
        base_model=fact.base_model,
        model_path=None,
        snapshot_dir=str(fact.snapshot_dir),
        created_at=now,
    )
