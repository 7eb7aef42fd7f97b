"""Session search and checkpoint storage usage, on SQLite and PostgreSQL: a tenant finds only its own
sessions, newest first, a page at a time, by id or display name, metadata, owner and status; byte counts are
those of the checkpoint files on disk."""

from __future__ import annotations

import shutil
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.session_search import SessionQuery, SessionSearch, SessionStatus, StatusFilter
from loraplex.runtime.control.store import Store
from loraplex.runtime.core.checkpoints import CheckpointPath
from loraplex.runtime.core.commands import SaveState
from tests.e2e.postgres import create_database
from tests.runtime.conftest import create_run, result_of
from tests.runtime.legacy_store import rows

LEGACY_STORE = Path(__file__).parent / "legacy_store"


@pytest.fixture(params=["sqlite", "postgresql"])
def service(request: pytest.FixtureRequest, service_factory: Callable[..., Runtime]) -> Runtime:
    if request.param == "sqlite":
        return service_factory()
    url = create_database(request.getfixturevalue("postgres_url_prefix"), f"search_{uuid.uuid4().hex[:12]}")
    return service_factory(database_url=url)


def _ids(service: Runtime, tenant: str = "alice", **query: object) -> list[str]:
    page = service.session_search.search(tenant, SessionQuery(**query))  # type: ignore[arg-type]
    assert page.next_after is None
    return [summary.session_id for summary in page.sessions]


def test_a_tenant_pages_through_its_own_sessions_newest_first_and_never_sees_anothers(
    service: Runtime,
) -> None:
    mine = [service.sessions.create("alice", {}) for _ in range(5)]
    theirs = service.sessions.create("bob", {})
    seen, after = [], None
    while True:
        page = service.session_search.search("alice", SessionQuery(limit=2, after=after))
        seen += [summary.session_id for summary in page.sessions]
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == mine[::-1]
    assert _ids(service, "bob") == [theirs]
    assert _ids(service, session_id=theirs) == []


def test_search_matches_id_or_every_display_name_word_every_metadata_pair_the_owner_and_a_status(
    service: Runtime,
) -> None:
    create = service.sessions.create
    a = create("alice", {"team": "rl", "n": "3"}, display_name="Nightly SFT qwen")
    b = create("alice", {}, display_name="nightly eval")
    c = create("alice", {"team": "rl"})
    d = create("alice", {})
    service.sessions.finish(c, "alice", "errored")
    service.sessions.finish(d, "alice", "success")

    assert _ids(service, display_name="sft NIGHTLY") == [a]
    assert _ids(service, display_name="nightly") == [b, a]
    assert _ids(service, session_id=c) == [c]
    assert _ids(service, session_id=c, display_name="eval") == [c, b]  # either one matches
    assert _ids(service, user_metadata={"team": "rl"}) == [c, a]
    assert _ids(service, user_metadata={"team": "rl", "n": "3"}) == [a]
    assert _ids(service, owners=frozenset({"alice", "carol"})) == [d, c, b, a]
    assert _ids(service, owners=frozenset({"carol"})) == []
    assert _ids(service, statuses=(StatusFilter("client_finished"),)) == [d, c]
    assert _ids(service, statuses=(StatusFilter("client_finished", frozenset({"errored"})),)) == [c]
    assert _ids(service, statuses=(StatusFilter("active"), StatusFilter("failed"))) == [b, a]
    summary = service.session_search.search("alice", SessionQuery(session_id=c)).sessions[0]
    assert summary.owner == "alice" and summary.status == SessionStatus("client_finished", "errored")
    assert summary.user_metadata == {"team": "rl"} and summary.display_name is None


def test_checkpoint_counts_and_bytes_are_those_of_the_files_on_disk(service: Runtime) -> None:
    run = create_run(service, "alice")
    for seq_id, name in enumerate(["first", "second"], start=1):
        assert (
            result_of(service, service.training.submit("alice", run, seq_id, SaveState(name)), "alice").error
            is None
        )
    on_disk = sum(
        f.stat().st_size
        for name in ("first", "second")
        for f in _files(service.layout.checkpoint_dir(CheckpointPath(run, "weights", name)))
    )
    assert on_disk > 0
    (summary,) = service.session_search.search("alice", SessionQuery()).sessions
    assert (summary.checkpoints_count, summary.checkpoint_bytes) == (2, on_disk)
    assert service.catalog.checkpoint_usage("alice") == (2, on_disk)
    assert service.catalog.checkpoint_usage("bob") == (0, 0)


def _files(directory: Path) -> list[Path]:
    return [f for f in directory.rglob("*") if f.is_file()]


def test_a_database_from_before_display_names_gains_the_column_and_keeps_its_sessions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    shutil.copyfile(LEGACY_STORE / rows.SQLITE_FILE, tmp_path / "old.db")  # made before migrations
    with sqlite3.connect(tmp_path / "old.db") as old:  # as the release before display names left it
        old.execute("DELETE FROM sessions")
        old.execute("ALTER TABLE sessions DROP COLUMN display_name")
        old.execute(
            "INSERT INTO sessions (id, tenant, created_at, last_heartbeat_at, user_metadata)"
            " VALUES ('s1', 'alice', '2025-01-01 00:00:00', '2025-01-01 00:00:00', '{}')"
        )
    store = Store(url)
    (summary,) = SessionSearch(store, is_live=lambda _: False).search("alice", SessionQuery()).sessions
    assert (summary.session_id, summary.display_name, summary.status) == ("s1", None, None)
    store.close()
