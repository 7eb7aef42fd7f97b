"""The Store's connection: the SQLAlchemy engine (SQLite in WAL mode, or PostgreSQL), the schema brought
to the newest revision as it opens (migrations/), short transactions, and the guard of every call.

`StoreBase` is what the query classes of the store share (future_rows.py, metric_rows.py, repository.py);
`time_calls` makes every public method of the assembled `Store` ride out a database outage (outage.py)
and report its duration. No tensors, no HTTP.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.orm import Session, sessionmaker

from loraplex.runtime.control.store import migrations
from loraplex.runtime.control.store.outage import Reachability
from loraplex.runtime.control.store.schema import Base

# How long a SQLite connection waits for another's write lock before "database is locked".
_SQLITE_LOCK_WAIT_S = 30.0


def connect(url: str) -> SqlEngine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": _SQLITE_LOCK_WAIT_S})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        # WAL lets the API read while the engine worker writes results; NORMAL sync is durable
        # across a process kill (only an OS crash may lose the last transactions).
        cursor = dbapi_connection.cursor()
        _enter_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def _enter_wal(cursor: Any, wait_s: float = _SQLITE_LOCK_WAIT_S) -> None:
    """Put the database file in WAL mode (it stays so: later connections find it there). Switching a new
    file's journal mode needs it to itself, and SQLite answers "database is locked" at once, without its
    busy wait, while another connection is opening it too (several processes or Stores starting on one new
    file): tried again until the lock wait a write would get has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class StoreBase:
    """A database opened and migrated, and the transaction helpers every query class uses. Each public
    method of the assembled Store reports its duration to `observe` (method name, seconds) when set: the
    one place database latency is measured (runtime/observability/telemetry.py)."""

    observe: Callable[[str, float], None] | None = None

    def __init__(self, url: str, outage_s: float = 60.0) -> None:
        self.url = url
        # How long a call waits for an unreachable database before giving up (--database-outage-s).
        self.reachability = Reachability(outage_s)
        self._engine = connect(url)
        migrations.upgrade(self._engine)
        self._session = sessionmaker(self._engine, expire_on_commit=False)
        # SQLite lets one connection write at a time and makes the others poll for the lock, sleeping 1,
        # 2, 5, 10 ... ms between tries; writers queue on a lock of ours instead and wake the moment it is
        # free. PostgreSQL locks rows, so its writers go in parallel.
        self._writer: AbstractContextManager[Any] = (
            threading.Lock() if self._engine.dialect.name == "sqlite" else nullcontext()
        )

    @property
    def display_url(self) -> str:
        """The database URL with any password hidden, for logs."""
        return self._engine.url.render_as_string(hide_password=True)

    def close(self) -> None:
        """Release pooled connections."""
        self._engine.dispose()

    def ping(self) -> None:
        """One round trip to the database, without waiting out an outage (the watch's probe)."""
        with self._engine.connect() as connection:
            connection.execute(select(1))

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """An ORM session in a write transaction, committed on exit."""
        with self._writer, self._session.begin() as s:
            yield s

    @contextmanager
    def _writing_core(self) -> Iterator[Connection]:
        """A Core connection in a write transaction (the request path's prebuilt statements)."""
        with self._writer, self._engine.begin() as connection:
            yield connection

    def _add(self, row: Base) -> None:
        with self._writing() as s:
            s.add(row)

    def _get(self, cls: type, key: Any) -> Any:
        with self._session() as s:
            return s.get(cls, key)

    def _all(self, query: Any) -> list[Any]:
        with self._session() as s:
            return list(s.scalars(query))

    def _page(self, query: Any, limit: int, offset: int) -> tuple[list[Any], int]:
        with self._session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            return list(s.scalars(query.limit(limit).offset(offset))), total


def _guarded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, waiting out a database outage (tried again whole: it is one transaction) and reporting how
    long each call took, waits included, to its store's `observe`, if set."""

    @functools.wraps(method)
    def guarded(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(method, self, *args, **kwargs)
        observe = self.observe
        if observe is None:
            return self.reachability.call(call)
        start = time.perf_counter()
        try:
            return self.reachability.call(call)
        finally:
            observe(name, time.perf_counter() - start)

    return guarded


def time_calls(store_class: type[StoreBase]) -> None:
    """Make every public method `store_class` has, its query classes' included, ride out outages and report
    its duration."""
    for klass in store_class.__mro__:
        if klass is StoreBase or not issubclass(klass, StoreBase):
            continue
        for name, method in list(vars(klass).items()):
            if not name.startswith("_") and name not in ("close", "ping") and callable(method):
                setattr(klass, name, _guarded(name, method))
