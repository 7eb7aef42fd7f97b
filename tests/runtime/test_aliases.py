"""Model aliases: per tenant, validated names, kept across restarts in the data directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.errors import NotFoundError, UserError
from loraplex.runtime.control.aliases import ALIASES_FILE, AliasTable

PATH = "tinker://s1:train:0/sampler_weights/final"


def test_an_alias_belongs_to_its_tenant_and_survives_a_restart(tmp_path: Path) -> None:
    table = AliasTable(tmp_path)
    table.set("alice", "sft/latest", PATH)
    table.set("bob", "sft/latest", PATH.replace("final", "other"))
    again = AliasTable(tmp_path)
    assert again.target("alice", "sft/latest") == PATH
    assert again.of("bob") == {"sft/latest": PATH.replace("final", "other")}
    assert again.target("carol", "sft/latest") is None
    assert json.loads((tmp_path / ALIASES_FILE).read_text())["alice"] == {"sft/latest": PATH}
    assert [p.name for p in tmp_path.iterdir()] == [ALIASES_FILE]  # no staging file left behind


def test_setting_an_alias_again_moves_it_and_deleting_forgets_it(tmp_path: Path) -> None:
    table = AliasTable(tmp_path)
    table.set("alice", "latest", PATH)
    table.set("alice", "latest", PATH.replace("final", "next"))
    assert table.of("alice") == {"latest": PATH.replace("final", "next")}
    table.delete("alice", "latest")
    assert AliasTable(tmp_path).of("alice") == {}
    with pytest.raises(NotFoundError, match="alias 'latest' not found"):
        table.delete("alice", "latest")


@pytest.mark.parametrize("alias", ["", "tinker://x/y/z", "a:b", "-lead", "x" * 129, "two words"])
def test_an_alias_is_1_to_128_path_safe_characters_without_colons(tmp_path: Path, alias: str) -> None:
    with pytest.raises(UserError, match="invalid alias"):
        AliasTable(tmp_path).set("alice", alias, PATH)
