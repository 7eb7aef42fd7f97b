"""Model aliases: per tenant, validated names, kept across restarts in the database; an earlier release's
aliases.json is imported once, at the first start."""

from __future__ import annotations

import json
import shutil
import uuid
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from loraplex.config import ServerConfig
from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.aliases import ALIASES_FILE, AliasTable, import_alias_file
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import AliasRow
from loraplex.timestamps import as_utc
from tests.e2e.postgres import create_database
from tests.fakes import FakeEngine
from tests.runtime.legacy_store import rows

PATH = "tinker://s1:train:0/sampler_weights/final"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    prefix = request.getfixturevalue("postgres_url_prefix")
    return create_database(prefix, f"aliases_{uuid.uuid4().hex}")


def test_an_alias_belongs_to_its_tenant_and_survives_a_restart(tmp_path: Path, url: str) -> None:
    table = AliasTable(Store(url))
    table.set("alice", "sft/latest", PATH)
    table.set("bob", "sft/latest", PATH.replace("final", "other"))
    again = AliasTable(Store(url))
    assert again.target("alice", "sft/latest") == PATH
    assert again.of("bob") == {"sft/latest": PATH.replace("final", "other")}
    assert again.target("carol", "sft/latest") is None
    assert Store(url).tenant_aliases("alice") == {"sft/latest": PATH}
    assert not (tmp_path / ALIASES_FILE).exists()  # the database holds them, no file


def test_setting_an_alias_again_moves_it_and_deleting_forgets_it(url: str) -> None:
    table = AliasTable(Store(url))
    table.set("alice", "latest", PATH)
    table.set("alice", "latest", PATH.replace("final", "next"))
    assert table.of("alice") == {"latest": PATH.replace("final", "next")}
    table.delete("alice", "latest")
    assert AliasTable(Store(url)).of("alice") == {}
    with pytest.raises(NotFoundError, match="alias 'latest' not found"):
        table.delete("alice", "latest")


def test_moving_an_alias_keeps_when_it_was_made_and_stamps_when_it_moved(url: str) -> None:
    table = AliasTable(Store(url))
    table.set("alice", "latest", PATH)
    (made,) = _stamps(url)
    table.set("alice", "latest", PATH.replace("final", "next"))
    (moved,) = _stamps(url)
    assert moved[0] == made[0] == made[1] < moved[1]


def _stamps(url: str) -> list[tuple[datetime, datetime]]:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        found = connection.execute(sa.select(AliasRow.created_at, AliasRow.updated_at)).all()
    engine.dispose()
    return [(as_utc(created), as_utc(updated)) for created, updated in found]


def test_a_tenants_aliases_list_in_code_point_order_on_every_database(url: str) -> None:
    table = AliasTable(Store(url))
    for alias in ("b", "a_x", "B", "a/x", "_z", "a-x"):
        table.set("alice", alias, PATH)
    assert list(table.of("alice")) == [
        "B",
        "_z",
        "a-x",
        "a/x",
        "a_x",
        "b",
    ]  # ASCII: B=66 _=95 a=97; -=45 /=47


@pytest.mark.parametrize("alias", ["", "tinker://x/y/z", "a:b", "-lead", "x" * 129, "two words"])
def test_an_alias_is_1_to_128_path_safe_characters_without_colons(url: str, alias: str) -> None:
    with pytest.raises(UserError, match=r"alias .* is invalid: use 1-128"):
        AliasTable(Store(url)).set("alice", alias, PATH)


# --- aliases.json of earlier releases
def test_an_earlier_releases_alias_file_is_imported_once_then_renamed(tmp_path: Path, url: str) -> None:
    shutil.copyfile(Path(__file__).parent / "legacy_store" / ALIASES_FILE, tmp_path / ALIASES_FILE)
    store = Store(url)
    assert import_alias_file(store, tmp_path) == 2
    table = AliasTable(store)
    assert {tenant: table.of(tenant) for tenant in rows.ALIASES} == rows.ALIASES
    assert not (tmp_path / ALIASES_FILE).exists()
    assert json.loads((tmp_path / "aliases.json.imported").read_text()) == rows.ALIASES
    assert import_alias_file(store, tmp_path) == 0


def test_importing_a_file_again_keeps_the_aliases_the_database_has(tmp_path: Path, url: str) -> None:
    store = Store(url)
    AliasTable(store).set("alice", "sft/latest", PATH)
    (tmp_path / ALIASES_FILE).write_text(json.dumps(rows.ALIASES))  # a crash before the rename, say
    assert import_alias_file(store, tmp_path) == 1  # bob's
    assert AliasTable(store).of("alice") == {"sft/latest": PATH}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ('["alice"]', "is not an object of tenant -> {alias: model}"),
        (
            '{"alice": {"ok": "tinker://a/sampler_weights/b", "a:b": "tinker://x"}}',
            "tenant 'alice': alias 'a:b' is invalid",
        ),
        ('{"alice": {"ok": 3}}', "alias 'ok' names 3, not a path"),
    ],
)
def test_an_alias_file_that_is_not_a_table_of_valid_aliases_imports_nothing(
    tmp_path: Path, url: str, content: str, message: str
) -> None:
    (tmp_path / ALIASES_FILE).write_text(content)
    store = Store(url)
    with pytest.raises(UserError, match=message):
        import_alias_file(store, tmp_path)
    assert store.tenant_aliases("alice") == {}
    assert (tmp_path / ALIASES_FILE).read_text() == content


def test_a_runtime_opening_a_data_dir_of_an_earlier_release_serves_its_aliases(tmp_path: Path) -> None:
    shutil.copyfile(Path(__file__).parent / "legacy_store" / ALIASES_FILE, tmp_path / ALIASES_FILE)
    runtime = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path))
    try:
        assert runtime.inference.aliases.of("alice") == rows.ALIASES["alice"]
    finally:
        runtime.stop()
