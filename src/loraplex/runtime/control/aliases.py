"""Model aliases: short names a tenant gives its checkpoints, for the OpenAI endpoints' `model` field.

Each tenant has its own names (two tenants may both call something "latest"). They live in the database
(the aliases table), one row per name; earlier releases kept them in `data_dir/aliases.json`, which
`import_alias_file` moves into the database once. Knows nothing of what a name points at; inference.py
checks the target. No tensors, no HTTP.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from loraplex.errors import FieldError, NotFoundError, UserError
from loraplex.runtime.control.store import Store
from loraplex.runtime.control.store.schema import AliasRow
from loraplex.timestamps import utcnow

log = logging.getLogger(__name__)

ALIASES_FILE = "aliases.json"  # where releases before the aliases table kept them: {tenant: {alias: model}}
_IMPORTED_SUFFIX = ".imported"  # the file's new name once its aliases are in the database
# No ':' so that no alias can look like a tinker:// path or a base model name with a :suffix.
_ALIAS_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,127}")


def validate_alias(alias: str) -> str:
    """Return `alias` if it is a valid name; else a FieldError naming `alias` and saying what is allowed."""
    if not _ALIAS_RE.fullmatch(alias):
        raise FieldError(
            "alias",
            f"{alias!r} is invalid: use 1-128 characters from A-Z a-z 0-9 _ . - /, "
            "starting with a letter, digit or '_'",
        )
    return alias


class AliasTable:
    """tenant -> alias -> model (a tinker:// path), kept in the Store."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def target(self, tenant: str, alias: str) -> str | None:
        """What the tenant's `alias` names, if it is one."""
        return self._store.alias_target(tenant, alias)

    def of(self, tenant: str) -> dict[str, str]:
        """The tenant's aliases, by name."""
        return self._store.tenant_aliases(tenant)

    def set(self, tenant: str, alias: str, model: str) -> None:
        """Point the tenant's `alias` at `model` (an existing alias is moved)."""
        self._store.set_alias(tenant, validate_alias(alias), model)

    def delete(self, tenant: str, alias: str) -> None:
        """Forget one of the tenant's aliases (NotFoundError if it has no such alias)."""
        if not self._store.delete_alias(tenant, alias):
            raise NotFoundError(f"alias {alias!r} not found")


def import_alias_file(store: Store, data_dir: Path) -> int:
    """Move the aliases of an earlier release's `data_dir/aliases.json` into the database, then rename the
    file to aliases.json.imported; return how many were added. An alias the database already has keeps
    its target, so importing again (after a crash before the rename) changes nothing. A file that is not
    such a table, or names an invalid alias, raises UserError and imports nothing."""
    path = data_dir / ALIASES_FILE
    if not path.is_file():
        return 0
    rows = _rows(path)
    added = store.add_aliases(rows)
    path.rename(path.with_name(ALIASES_FILE + _IMPORTED_SUFFIX))
    log.info("imported %d of the %d aliases in %s into the database", added, len(rows), path)
    return added


def _rows(path: Path) -> list[AliasRow]:
    """The aliases of an aliases.json file, checked whole before any is stored."""
    try:
        table = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not JSON ({exc}): fix or remove it, then start again") from exc
    if not isinstance(table, dict) or not all(isinstance(names, dict) for names in table.values()):
        raise UserError(f"{path} is not an object of tenant -> {{alias: model}}: fix or remove it")
    now = utcnow()
    rows = []
    for tenant, names in table.items():
        for alias, model in names.items():
            if not isinstance(model, str):
                raise UserError(f"{path}: tenant {tenant!r} alias {alias!r} names {model!r}, not a path")
            try:
                validate_alias(alias)
            except UserError as exc:
                raise UserError(f"{path}: tenant {tenant!r}: {exc}") from exc
            rows.append(AliasRow(tenant=tenant, alias=alias, model=model, created_at=now, updated_at=now))
    return rows
