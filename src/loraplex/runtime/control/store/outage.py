"""Riding out a database outage: a store call that finds the database unreachable waits and tries again,
with backoff, for up to `--database-outage-s`; past it the call fails with DatabaseUnavailableError, a
503 with Retry-After, which the SDK backs off from and resends (never a 500, which would read as a bug).

Every store call is one transaction (connection.py), so trying it again runs it whole from the start: a
transaction that failed was rolled back. One case stays ambiguous, as for any client of a database: a
connection lost during COMMIT may have committed. Tried again, a write keyed by its request (a future, a
run, a checkpoint, a session) then fails on its unique key rather than count twice, and an update sets
the value it set already; only a metric record (keyed by an autoincrement) could be written twice, one
chart point, in that window of a few microseconds per outage.

While calls fail, and until the watch's probe or a call succeeds again, the database is reported down:
healthz answers 503 with the cause, /metrics has `loraplex_database_up` 0. No tensors, no HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from loraplex.errors import CapacityError

log = logging.getLogger(__name__)

T = TypeVar("T")

_FIRST_WAIT_S = 0.05
_LONGEST_WAIT_S = 2.0
# SQLite reports a missing table or a syntax error as an OperationalError too: those are bugs, not outages.
_SQLITE_OUTAGES = ("database is locked", "disk i/o error", "unable to open database", "disk is full")


class DatabaseUnavailableError(CapacityError):
    """The database stayed unreachable for longer than --database-outage-s (HTTP 503 with Retry-After)."""

    retry_after_s = 5


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the database cannot be reached now (worth waiting for), not that a statement
    is wrong."""
    if not isinstance(error, DBAPIError):
        return False
    if error.connection_invalidated or isinstance(error, InterfaceError):
        return True
    if not isinstance(error, OperationalError):
        return False
    message = str(error.orig).lower()
    is_sqlite = type(error.orig).__module__.startswith("sqlite3")
    return not is_sqlite or any(cause in message for cause in _SQLITE_OUTAGES)


class Reachability:
    """Whether the database answers, and the waiting of calls that find it does not."""

    def __init__(
        self,
        outage_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.outage_s = outage_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._cause = ""

    def call(self, operation: Callable[[], T]) -> T:
        """`operation()`, tried again with backoff while the database is unreachable, for up to outage_s."""
        started, wait = self._clock(), _FIRST_WAIT_S
        while True:
            try:
                result = operation()
            except Exception as error:
                if not is_outage(error):
                    raise
                self._record_failure(error)
                waited = self._clock() - started
                if waited >= self.outage_s:
                    raise DatabaseUnavailableError(
                        f"the database has been unreachable for {waited:.0f} s (--database-outage-s "
                        f"{self.outage_s:g}); try again shortly. Cause: {self._cause}"
                    ) from error
                self._sleep(min(wait, self.outage_s - waited))
                wait = min(2 * wait, _LONGEST_WAIT_S)
            else:
                self._record_success()
                return result

    def down_report(self) -> str | None:
        """None while the database answers; else how long it has not, and why."""
        with self._lock:
            if self._down_since is None:
                return None
            return f"database unreachable for {self._clock() - self._down_since:.0f} s: {self._cause}"

    @property
    def is_up(self) -> bool:
        with self._lock:
            return self._down_since is None

    def probe(self, ping: Callable[[], object]) -> None:
        """Try `ping` once (no waiting) and record what it found."""
        try:
            ping()
        except Exception as error:
            if not is_outage(error):
                raise
            self._record_failure(error)
        else:
            self._record_success()

    def _record_failure(self, error: BaseException) -> None:
        cause = str(getattr(error, "orig", error)).strip().splitlines()[0][:300]
        with self._lock:
            if self._down_since is None:
                self._down_since = self._clock()
                log.warning("the database is unreachable; requests wait for it: %s", cause)
            self._cause = cause

    def _record_success(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            log.warning("the database answers again after %.1f s", self._clock() - self._down_since)
            self._down_since = None


class DatabaseWatch:
    """A thread that probes the database every `period_s`, so healthz notices an outage no request hit."""

    def __init__(self, reachability: Reachability, ping: Callable[[], object], period_s: float = 2.0) -> None:
        self.reachability, self.ping, self.period_s = reachability, ping, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loraplex-db-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.reachability.probe(self.ping)
            except Exception:  # not an outage: a bug in the probe; say so, keep watching
                log.exception("database probe failed")
