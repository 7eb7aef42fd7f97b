"""Key lookups are bounded: a key is read from the database once per period whether it exists or not,
reads of keys remembered neither way are rate-limited (a retryable 503 past the budget, never a 401 for
a key that may be valid), and valid keys keep resolving. For the API's keys and the console's sign-ins."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplex.errors import AuthenticationError
from loraplex.runtime.control.keys import (
    ConsoleLogins,
    KeyLookups,
    KeyReadLimitError,
    KeyReadLimits,
    TenantResolver,
    Viewer,
    create_key,
    key_digest,
)
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import ApiKeyRow
from loraplex.timestamps import utcnow

DEFAULTS = KeyReadLimits()


class _Counted:
    """A store read that counts its calls."""

    def __init__(self, read: Callable[[str], object]) -> None:
        self.read, self.calls = read, 0

    def __call__(self, digest: str) -> object:
        self.calls += 1
        return self.read(digest)


class _Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'db.sqlite'}")


@pytest.fixture(params=["tenants", "logins"])
def counted(request: pytest.FixtureRequest, store: Store, monkeypatch: pytest.MonkeyPatch):
    """(a key check of the API or of the console with the default limits, its counted store reads)."""
    if request.param == "tenants":
        reads = _Counted(store.tenant_for_digest)
        monkeypatch.setattr(store, "tenant_for_digest", reads)
        return TenantResolver(store, "keys").tenant_for, reads
    reads = _Counted(store.get_key)
    monkeypatch.setattr(store, "get_key", reads)
    return ConsoleLogins(store, "keys").sign_in, reads


def _refusals(check: Callable[[str], object], keys: list[str]) -> list[str]:
    """How each key was refused: 401, 503, or "ok"."""
    outcomes = []
    for key in keys:
        try:
            check(key)
            outcomes.append("ok")
        except KeyReadLimitError:
            outcomes.append("503")
        except AuthenticationError:
            outcomes.append("401")
    return outcomes


def test_the_same_unknown_key_sent_again_costs_one_database_read(counted) -> None:
    check, reads = counted
    assert _refusals(check, ["tml-made-up"] * 50) == ["401"] * 50
    assert reads.calls == 1


def test_distinct_unknown_keys_cost_at_most_the_read_budget_and_past_it_are_a_retryable_503(
    counted, store: Store
) -> None:
    check, reads = counted
    start = time.monotonic()
    outcomes = _refusals(check, [f"tml-made-up-{i}" for i in range(3 * DEFAULTS.burst)])
    elapsed_s = time.monotonic() - start
    assert reads.calls <= DEFAULTS.burst + DEFAULTS.reads_per_s * elapsed_s + 1
    assert outcomes.count("401") == reads.calls and outcomes.count("503") == len(outcomes) - reads.calls
    valid = create_key(store, "alice")
    time.sleep(2 / DEFAULTS.reads_per_s)  # the budget refills: a valid key retried gets through
    assert _refusals(check, [valid]) == ["ok"]


def test_a_remembered_key_resolves_without_reads_while_the_read_budget_is_spent(store: Store) -> None:
    reads = _Counted(store.tenant_for_digest)
    clock = _Clock()
    lookups = KeyLookups(reads, KeyReadLimits(reads_per_s=2.0, burst=3), clock)
    alice = key_digest(create_key(store, "alice"))
    assert lookups.resolve(alice) == "alice"
    for i in range(2):
        with pytest.raises(AuthenticationError, match="unknown or revoked API key"):
            lookups.resolve(key_digest(f"tml-made-up-{i}"))
    with pytest.raises(KeyReadLimitError, match="more than 2 a second"):
        lookups.resolve(key_digest("tml-made-up-2"))
    assert lookups.resolve(alice) == "alice" and reads.calls == 3
    bob = key_digest(create_key(store, "bob"))
    with pytest.raises(KeyReadLimitError):
        lookups.resolve(bob)
    clock.now += 0.5  # one read's worth of budget
    assert lookups.resolve(bob) == "bob" and reads.calls == 4


def test_a_key_presented_before_it_existed_works_once_its_unknown_period_ends(store: Store) -> None:
    reads = _Counted(store.tenant_for_digest)
    clock = _Clock()
    lookups = KeyLookups(reads, KeyReadLimits(unknown_s=5.0), clock)
    key = "tml-early"
    with pytest.raises(AuthenticationError):
        lookups.resolve(key_digest(key))
    digest = key_digest(key)  # as if `keys create` had made exactly this key
    store.add_key(ApiKeyRow(digest=digest, key_id=f"key-{digest[:12]}", tenant="alice", created_at=utcnow()))
    clock.now += 4.9
    with pytest.raises(AuthenticationError):
        lookups.resolve(key_digest(key))
    clock.now += 0.2
    assert lookups.resolve(key_digest(key)) == "alice" and reads.calls == 2


def test_a_new_key_resolves_at_once_and_a_revoked_one_stops_after_its_known_period(store: Store) -> None:
    clock = _Clock()
    lookups = KeyLookups(store.tenant_for_digest, KeyReadLimits(known_s=10.0), clock)
    key = create_key(store, "alice")
    assert lookups.resolve(key_digest(key)) == "alice"
    (row,) = store.list_keys()
    store.revoke_key(row.key_id)
    clock.now += 9.9
    assert lookups.resolve(key_digest(key)) == "alice"
    clock.now += 0.2
    with pytest.raises(AuthenticationError):
        lookups.resolve(key_digest(key))


def test_unknown_keys_remembered_are_bounded_by_the_reads_that_found_them(store: Store) -> None:
    clock = _Clock()
    limits = KeyReadLimits(unknown_s=1.0, reads_per_s=10.0, burst=10)
    lookups = KeyLookups(store.tenant_for_digest, limits, clock)
    for second in range(5):  # ten made-up keys a second, each read once
        for i in range(10):
            with pytest.raises(AuthenticationError):
                lookups.resolve(key_digest(f"tml-{second}-{i}"))
        clock.now += 1.0
    assert len(lookups._unknown) <= limits.reads_per_s * limits.unknown_s + 1


def test_the_console_checks_a_signed_in_viewers_key_through_the_same_lookups(store: Store) -> None:
    logins = ConsoleLogins(store, "keys", limits=KeyReadLimits(reads_per_s=0.001, burst=2))
    token, viewer = logins.sign_in(create_key(store, "alice"))
    with pytest.raises(AuthenticationError):
        logins.sign_in("tml-made-up")
    with pytest.raises(KeyReadLimitError):
        logins.sign_in("tml-made-up-too")
    assert logins.viewer(token) == viewer == Viewer("alice")
