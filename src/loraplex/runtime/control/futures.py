"""Futures: one per submitted request; given its outcome by the writer once durable, long-polled by the API.

Pending futures live in memory. The writer (writer.py) writes each outcome to the database and only then
settles the future here, waking its waiters, so a result a client has seen is one a restart keeps. An
outcome the database refused stays in memory, never evicted, until the writer has written it (a request
never reads as pending again while the database is down). Older finished futures are read back from the
database. Settling may come from any thread; waiting is asyncio. No tensors, no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loraplex.errors import LoraplexError, NotFoundError, UnavailableError, UserError
from loraplex.ids import random_hex
from loraplex.runtime.control.store import FutureOutcome, Store
from loraplex.runtime.control.store.results import decode_result, encode_result
from loraplex.runtime.control.store.schema import FutureRow
from loraplex.runtime.core.journal import Outcome, Result
from loraplex.runtime.observability.telemetry import Telemetry
from loraplex.timestamps import utcnow

log = logging.getLogger(__name__)

PENDING, COMPLETE, FAILED = "pending", "complete", "failed"
RETRYABLE = "retryable"  # the category of a future that failed with UnavailableError


@dataclass
class FutureRecord:
    """A future as the API reads it."""

    id: str
    tenant: str
    request_type: str
    status: str = PENDING
    result: Result | None = None
    error: str | None = None
    category: str | None = None  # "user" | "server" | "retryable" once failed
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list, repr=False
    )

    @property
    def is_done(self) -> bool:
        """Completed or failed."""
        return self.status != PENDING


def error_category(error: BaseException) -> str:
    """The category a failed future keeps: user for UserError (Tinker's), retryable for UnavailableError
    (sent to the client as Tinker's server category, with HTTP 410: send it again), server for the rest."""
    if isinstance(error, UnavailableError):
        return RETRYABLE
    return "user" if isinstance(error, UserError) else "server"


def outcome_row(future_id: str, outcome: Outcome) -> FutureOutcome:
    """What finishing a future writes: its encoded result, or its error and category."""
    if not isinstance(outcome, BaseException):
        encoded = encode_result(outcome) if outcome is not None else None
        return FutureOutcome(future_id, COMPLETE, encoded, None, None)
    category = error_category(outcome)
    message = str(outcome) or type(outcome).__name__
    if category == RETRYABLE:
        log.warning("request %s failed and may be sent again: %s", future_id, outcome)
    if category == "server":
        log.error("request %s failed: %r", future_id, outcome, exc_info=outcome)
        if not isinstance(
            outcome, LoraplexError
        ):  # an unexpected error's text may hold paths: the log has it
            message = f"internal server error (request {future_id}; the server log has the details)"
    return FutureOutcome(future_id, FAILED, None, message, category)


class FutureTable:
    """All futures of the service, keyed by request id."""

    def __init__(
        self,
        store: Store,
        retention_s: float,
        long_poll_s: float = 30.0,
        retained: int = 4096,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._telemetry = telemetry
        self._retention_s = retention_s  # how long finished futures stay in the database (retention.py)
        self._long_poll_s = long_poll_s
        self._retained = retained  # finished records kept in memory; older ones are read from the DB
        self._lock = threading.Lock()
        self._pending: dict[str, FutureRecord] = {}
        self._unwritten: dict[str, FutureRecord] = {}  # settled, outcome not in the database yet
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
        self._store.add_futures([_pending_row(record, run_id, seq_id) for record, run_id, seq_id in entries])

    def persist_sample(self, record: FutureRecord, sampler_id: str, seq_id: int) -> None:
        """Write a `new` sampling future's row and stamp its sampler's last use, in one transaction;
        SamplerGoneError if retention deleted the sampler meanwhile, SeqIdTakenError if a copy of the
        request wrote its row first (store/repository.py)."""
        self._store.add_sample_future(_pending_row(record, sampler_id, seq_id))

    def drop(self, future_id: str) -> None:
        """Forget a `new` future whose row could not be written (nobody was given its id)."""
        with self._lock:
            self._pending.pop(future_id, None)

    def is_pending(self, future_id: str) -> bool:
        """Whether the future has no outcome yet."""
        with self._lock:
            return future_id in self._pending

    def settle(self, outcomes: Iterable[tuple[FutureOutcome, Result | None]], is_written: bool) -> None:
        """Give futures their outcome and wake their waiters (the writer, once the outcomes are durable; or,
        is_written False, once it knows they cannot be written now: then they stay in memory until
        `mark_written`). A future that already has an outcome keeps its first."""
        waiters = []
        complete, failed = 0, dict[str, int]()  # for telemetry: finished with a result; failed, by category
        with self._lock:
            for row, result in outcomes:
                record = self._pending.pop(row.id, None)
                if record is None:  # finished already (a late error of work whose outcome was recorded)
                    continue
                if row.category is None:
                    complete += 1
                else:
                    failed[row.category] = failed.get(row.category, 0) + 1
                record.status, record.error, record.category = row.status, row.error, row.category
                record.result = result
                if is_written:
                    self._remember(record)
                else:
                    self._unwritten[row.id] = record
                waiters += record._waiters
                record._waiters = []
            if self._telemetry is not None:  # with the outcomes: whoever sees one done sees it counted
                self._telemetry.record_outcomes(complete, failed)
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_resolve, waiter)

    def mark_written(self, future_ids: Iterable[str]) -> None:
        """Outcomes that were settled unwritten are in the database now: they may be evicted like others."""
        with self._lock:
            for future_id in future_ids:
                if (record := self._unwritten.pop(future_id, None)) is not None:
                    self._remember(record)

    def _remember(self, record: FutureRecord) -> None:
        self._done[record.id] = record
        while len(self._done) > self._retained:
            self._done.popitem(last=False)

    def pending_count(self) -> int:
        """Futures not finished yet."""
        with self._lock:
            return len(self._pending)

    def get(self, future_id: str, tenant: str) -> FutureRecord:
        """A future of `tenant` (NotFoundError for unknown ids and other tenants' futures alike)."""
        record = self._in_memory(future_id) or self._load(future_id)
        return self._owned(record, future_id, tenant)

    async def retrieve(self, tenant: str, future_id: str) -> FutureRecord:
        """Long-poll a future: its outcome, or the still-pending record after the long-poll time."""
        return await self.wait(future_id, tenant, self._long_poll_s)

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
            return self._pending.get(future_id) or self._unwritten.get(future_id) or self._done.get(future_id)

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


def _pending_row(record: FutureRecord, run_id: str | None, seq_id: int | None) -> FutureRow:
    return FutureRow(
        id=record.id,
        tenant=record.tenant,
        request_type=record.request_type,
        run_id=run_id,
        seq_id=seq_id,
        status=PENDING,
        created_at=utcnow(),
    )


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
