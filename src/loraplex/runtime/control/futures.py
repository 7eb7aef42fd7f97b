"""Futures: one per submitted request; completed by the engine worker, long-polled by the API.

Pending futures live in memory; every outcome is also written to the database, so finished results
stay retrievable after a restart. Completion may come from any thread; waiting is asyncio.
No tensors, no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.errors import LoraplexError, NotFoundError, ServerError, UserError
from loraplex.ids import random_hex
from loraplex.runtime.control.store import FutureOutcome, Store, utcnow
from loraplex.runtime.control.store.results import Result, decode_result, encode_result
from loraplex.runtime.control.store.schema import FutureRow
from loraplex.runtime.observability.telemetry import Telemetry

log = logging.getLogger(__name__)

PENDING, COMPLETE, FAILED = "pending", "complete", "failed"
# Pauses between attempts to record outcomes when the database refuses (then they fail in memory).
_WRITE_RETRY_PAUSES_S = (0.05, 0.2, 1.0)


@dataclass
class FutureRecord:
    """A future as the API reads it."""

    id: str
    tenant: str
    request_type: str
    status: str = PENDING
    result: Result | None = None
    error: str | None = None
    category: str | None = None  # "user" | "server" once failed
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list, repr=False
    )

    @property
    def is_done(self) -> bool:
        """Completed or failed."""
        return self.status != PENDING


def error_category(error: BaseException) -> str:
    """The Tinker category of an exception: user for UserError, server for anything else."""
    return "user" if isinstance(error, UserError) else "server"


class FutureTable:
    """All futures of the service, keyed by request id."""

    def __init__(
        self, store: Store, retention_s: float, retained: int = 4096, telemetry: Telemetry | None = None
    ) -> None:
        self._store = store
        self._telemetry = telemetry
        self._retention_s = retention_s  # how long finished futures stay in the database (retention.py)
        self._retained = retained  # finished records kept in memory; older ones are read from the DB
        self._lock = threading.Lock()
        self._pending: dict[str, FutureRecord] = {}
        self._done: OrderedDict[str, FutureRecord] = OrderedDict()

    def create(
        self, tenant: str, request_type: str, run_id: str | None = None, seq_id: int | None = None
    ) -> FutureRecord:
        """A new pending future, persisted."""
        record = self.new(tenant, request_type)
        try:
            self.persist([(record, run_id, seq_id)])
        except BaseException:
            self.drop(record.id)
            raise
        return record

    def new(self, tenant: str, request_type: str) -> FutureRecord:
        """A new pending future in memory only (cheap: callers holding a lock persist it after releasing)."""
        record = FutureRecord(id=f"req-{random_hex()}", tenant=tenant, request_type=request_type)
        with self._lock:
            self._pending[record.id] = record
        return record

    def persist(self, entries: Sequence[tuple[FutureRecord, str | None, int | None]]) -> None:
        """Write the rows of `new` futures, each with its run and seq_id (or None), in one transaction (and
        stamp their runs' last request times)."""
        created_at = utcnow()
        rows = [
            FutureRow(
                id=record.id,
                tenant=record.tenant,
                request_type=record.request_type,
                run_id=run_id,
                seq_id=seq_id,
                status=PENDING,
                created_at=created_at,
            )
            for record, run_id, seq_id in entries
        ]
        self._store.add_futures(rows)

    def drop(self, future_id: str) -> None:
        """Forget a `new` future whose row could not be written (nobody was given its id)."""
        with self._lock:
            self._pending.pop(future_id, None)

    def complete(self, future_id: str, result: Result) -> None:
        """Resolve a future with its result."""
        self.finish({future_id: result})

    def fail(self, future_id: str, error: BaseException) -> None:
        """Resolve a future with an error (category from the exception class)."""
        self.finish({future_id: error})

    def fail_if_pending(self, future_id: str, error: BaseException) -> None:
        """Fail a future unless it already has an outcome (clean-up after an unexpected engine error)."""
        with self._lock:
            pending = future_id in self._pending
        if pending:
            self.fail(future_id, error)

    def finish(
        self, outcomes: Mapping[str, Result | BaseException], undone_if_unrecorded: bool = False
    ) -> bool:
        """Resolve futures, each with its result or its error, in one database transaction (a fused pass
        answers many requests at once: one commit, not one per request), then wake their waiters; True if
        the outcomes were recorded.

        The write is retried with backoff; if the database still refuses, the futures fail in memory with a
        server error saying so (their rows stay pending and read as failed after a restart), and the caller
        goes on: a database fault must not end the worker. undone_if_unrecorded: the caller takes back the
        work behind these outcomes when this returns False, and the error tells the client so.
        """
        rows = [_outcome_row(future_id, outcome) for future_id, outcome in outcomes.items()]
        results = [None if isinstance(o, BaseException) else o for o in outcomes.values()]
        recorded = True
        for attempt, pause_s in enumerate((*_WRITE_RETRY_PAUSES_S, None)):
            try:
                self._store.finish_futures(rows)
                break
            except Exception as exc:
                if pause_s is None:
                    log.exception("could not record %d request outcomes; failing them in memory", len(rows))
                    undone = "; nothing it did was kept, so it can be retried" if undone_if_unrecorded else ""
                    unrecorded = ServerError(
                        f"the server could not record this request's outcome ({type(exc).__name__}; the "
                        f"server log has the details){undone}"
                    )
                    rows = [_outcome_row(row.id, unrecorded) for row in rows]
                    results = [None] * len(rows)
                    recorded = False
                    break
                log.warning("recording %d outcomes failed (attempt %d): %s", len(rows), attempt + 1, exc)
                time.sleep(pause_s)
        waiters = []
        complete, failed = 0, dict[str, int]()  # for telemetry: finished with a result; failed, by category
        with self._lock:
            for row, result in zip(rows, results, strict=True):
                record = self._pending.pop(row.id, None)
                if record is None:  # finished already (e.g. a restart raced a late result)
                    continue
                if row.category is None:
                    complete += 1
                else:
                    failed[row.category] = failed.get(row.category, 0) + 1
                record.status, record.error, record.category = row.status, row.error, row.category
                record.result = result
                self._done[row.id] = record
                waiters += record._waiters
                record._waiters = []
            while len(self._done) > self._retained:
                self._done.popitem(last=False)
            if self._telemetry is not None:  # with the outcomes: whoever sees one done sees it counted
                self._telemetry.record_outcomes(complete, failed)
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_resolve, waiter)
        return recorded

    def pending_count(self) -> int:
        """Futures not finished yet."""
        with self._lock:
            return len(self._pending)

    def get(self, future_id: str, tenant: str) -> FutureRecord:
        """A future of `tenant` (NotFoundError for unknown ids and other tenants' futures alike)."""
        record = self._in_memory(future_id) or self._load(future_id)
        return self._owned(record, future_id, tenant)

    async def wait(self, future_id: str, tenant: str, timeout_s: float) -> FutureRecord:
        """The future once done, or still pending after `timeout_s` (the long-poll). A future no longer in
        memory is read from the database on a worker thread, never on the event loop."""
        record = self._in_memory(future_id) or await asyncio.to_thread(self._load, future_id)
        record = self._owned(record, future_id, tenant)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if record.is_done:
                return record
            record._waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            with self._lock:
                if (loop, waiter) in record._waiters:
                    record._waiters.remove((loop, waiter))
        return record

    def _owned(self, record: FutureRecord | None, future_id: str, tenant: str) -> FutureRecord:
        if record is None or record.tenant != tenant:
            raise NotFoundError(
                f"future {future_id!r} not found: unknown, another tenant's, or finished more than "
                f"{self._retention_s:g} s ago (this server keeps results that long)"
            )
        return record

    def _in_memory(self, future_id: str) -> FutureRecord | None:
        with self._lock:
            return self._pending.get(future_id) or self._done.get(future_id)

    def _load(self, future_id: str) -> FutureRecord | None:
        row = self._store.get_future(future_id)
        if row is None:
            return None
        return FutureRecord(
            id=row.id,
            tenant=row.tenant,
            request_type=row.request_type,
            status=row.status,
            result=decode_result(row.result) if row.result is not None else None,
            error=row.error,
            category=row.category,
        )


def _outcome_row(future_id: str, outcome: Result | BaseException) -> FutureOutcome:
    """What finishing a future writes: its encoded result, or its error and category."""
    if not isinstance(outcome, BaseException):
        encoded = encode_result(outcome) if outcome is not None else None
        return FutureOutcome(future_id, COMPLETE, encoded, None, None)
    category = error_category(outcome)
    message = str(outcome) or type(outcome).__name__
    if category == "server":
        log.error("request %s failed: %r", future_id, outcome, exc_info=outcome)
        if not isinstance(
            outcome, LoraplexError
        ):  # an unexpected error's text may hold paths: the log has it
            message = f"internal server error (request {future_id}; the server log has the details)"
    return FutureOutcome(future_id, FAILED, None, message, category)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
