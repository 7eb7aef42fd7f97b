"""Console sign-ins: a key is traded for a token once; tokens expire, are bounded in number, and end with
their key. An admin key is marked in the database, and a database made before that column existed gets
it on start, its keys kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from loraplex.errors import AuthenticationError
from loraplex.runtime.control.keys import (
    LOCAL_TENANT,
    ConsoleLogins,
    Viewer,
    create_key,
    key_digest,
    list_keys,
)
from loraplex.runtime.control.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_a_token_names_the_keys_tenant_and_whether_it_is_an_admins(store: Store) -> None:
    logins = ConsoleLogins(store, "keys")
    alice, ops = create_key(store, "alice"), create_key(store, "ops", admin=True)
    alice_token, alice_viewer = logins.sign_in(alice)
    ops_token, _ = logins.sign_in(ops)
    assert alice_viewer == Viewer("alice", is_admin=False) == logins.viewer(alice_token)
    assert logins.viewer(ops_token) == Viewer("ops", is_admin=True)
    assert alice not in alice_token and key_digest(alice) not in alice_token
    assert [(k.tenant, k.admin) for k in list_keys(store)] == [("alice", False), ("ops", True)]


def test_a_viewer_sees_its_own_tenants_objects_and_an_admin_every_tenants() -> None:
    assert Viewer("alice").may_see("alice") and not Viewer("alice").may_see("bob")
    assert Viewer("ops", is_admin=True).may_see("bob")
    assert Viewer("alice").scope == "alice" and Viewer("ops", is_admin=True).scope is None


@pytest.mark.parametrize("key", ["", "tml-unknown"])
def test_a_missing_or_unknown_key_signs_nobody_in(store: Store, key: str) -> None:
    with pytest.raises(AuthenticationError):
        ConsoleLogins(store, "keys").sign_in(key)


def test_an_expired_a_signed_out_and_a_made_up_token_are_refused(store: Store) -> None:
    key = create_key(store, "alice")
    expired = ConsoleLogins(store, "keys", lifetime_s=0.0)
    token, _ = expired.sign_in(key)
    with pytest.raises(AuthenticationError):
        expired.viewer(token)
    logins = ConsoleLogins(store, "keys")
    token, _ = logins.sign_in(key)
    logins.sign_out(token)
    for refused in (token, "made-up", None):
        with pytest.raises(AuthenticationError):
            logins.viewer(refused)


def test_tokens_are_bounded_the_oldest_going_first(store: Store) -> None:
    logins = ConsoleLogins(store, "keys", max_tokens=3)
    key = create_key(store, "alice")
    tokens = [logins.sign_in(key)[0] for _ in range(4)]
    with pytest.raises(AuthenticationError):
        logins.viewer(tokens[0])
    assert all(logins.viewer(t) == Viewer("alice") for t in tokens[1:])


def test_with_auth_none_any_key_signs_in_as_the_local_tenant(store: Store) -> None:
    logins = ConsoleLogins(store, "none")
    token, viewer = logins.sign_in("tml-anything")
    assert viewer == logins.viewer(token) == Viewer(LOCAL_TENANT)


def test_a_database_from_before_admin_keys_gains_the_column_and_keeps_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:  # api_keys and training_runs as the first release made them
        old.execute(
            "CREATE TABLE api_keys (digest VARCHAR(64) PRIMARY KEY, key_id VARCHAR(32) UNIQUE, "
            "tenant VARCHAR(128), created_at DATETIME, revoked_at DATETIME)"
        )
        old.execute(
            "CREATE TABLE training_runs (id VARCHAR(200) PRIMARY KEY, session_id VARCHAR(64), "
            "tenant VARCHAR(128), base_model VARCHAR(300), lora_config JSON, user_metadata JSON, "
            "status VARCHAR(16), created_at DATETIME, last_request_at DATETIME)"
        )
        old.execute(
            "INSERT INTO api_keys VALUES (?, 'key-old', 'alice', '2025-01-01 00:00:00', NULL)",
            (key_digest("tml-old"),),
        )
    store = Store(f"sqlite:///{path}")
    _, viewer = ConsoleLogins(store, "keys").sign_in("tml-old")
    assert viewer == Viewer("alice", is_admin=False)
    _, admin = ConsoleLogins(store, "keys").sign_in(create_key(store, "ops", admin=True))
    assert admin.is_admin
    assert store.list_runs(None, 10, 0) == ([], 0)  # last_step was added too
