"""Riding out a database outage (control/store/outage.py): calls wait and try again while the database is
unreachable, give up with a 503-class error past --database-outage-s, never wait on a statement that is
simply wrong; the down report healthz serves follows what calls and probes found."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from loraplex.errors import CapacityError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.outage import DatabaseUnavailableError, Reachability, is_outage


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _unreachable() -> OperationalError:
    return OperationalError("SELECT 1", {}, sqlite3.OperationalError("disk I/O error"))


class Flaky:
    """Fails with an outage `failures` times, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise _unreachable()
        return "answer"


def test_a_call_waits_with_growing_backoff_and_succeeds_when_the_database_returns() -> None:
    clock = FakeClock()
    reachability = Reachability(60.0, clock, clock.sleep)
    seen: list[str | None] = []
    flaky = Flaky(failures=8)

    def operation() -> str:
        seen.append(reachability.down_report())
        return flaky()

    assert reachability.call(operation) == "answer"
    assert flaky.calls == 9
    assert clock.sleeps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]  # doubling, capped at 2 s
    assert seen[0] is None and all("disk I/O error" in report for report in seen[1:])  # type: ignore[operator]
    assert reachability.down_report() is None and reachability.is_up


def test_past_the_outage_limit_a_call_fails_with_a_retryable_error_naming_the_flag() -> None:
    clock = FakeClock()
    reachability = Reachability(5.0, clock, clock.sleep)
    with pytest.raises(DatabaseUnavailableError, match=r"unreachable for 5 s \(--database-outage-s 5\)"):
        reachability.call(Flaky(failures=10**6))
    assert clock.now == pytest.approx(5.0)  # the last wait is cut to the limit
    assert isinstance(DatabaseUnavailableError("x"), CapacityError)  # a 503, which the SDK retries
    assert not reachability.is_up and "unreachable for 5 s" in (reachability.down_report() or "")
    reachability.probe(lambda: None)  # the watch's probe finds it back
    assert reachability.is_up


def test_statements_that_are_wrong_are_not_waited_for(tmp_path: Path) -> None:
    clock = FakeClock()
    reachability = Reachability(60.0, clock, clock.sleep)
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")

    def wrong() -> None:
        with store._engine.connect() as connection:
            connection.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(OperationalError, match="no such table"):
        reachability.call(wrong)
    duplicate = IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))
    with pytest.raises(IntegrityError):
        reachability.call(lambda: (_ for _ in ()).throw(duplicate))
    assert clock.sleeps == [] and reachability.is_up
    store.close()


def test_what_counts_as_an_outage() -> None:
    assert is_outage(_unreachable())
    assert is_outage(OperationalError("x", {}, sqlite3.OperationalError("database is locked")))
    assert not is_outage(OperationalError("x", {}, sqlite3.OperationalError("no such column: y")))
    assert not is_outage(ValueError("not a database error"))


def test_every_store_call_is_guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store method that meets an outage twice still answers: the guard wraps the assembled Store's
    public methods (connection.py time_calls)."""
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}", outage_s=10.0)
    connect = store._session
    failures = iter([_unreachable(), _unreachable()])

    def flaky_session(*args: object, **kwargs: object) -> object:
        if (error := next(failures, None)) is not None:
            raise error
        return connect(*args, **kwargs)

    monkeypatch.setattr(store, "_session", flaky_session)
    assert store.get_session("nobody") is None
    assert store.reachability.is_up
    store.close()
