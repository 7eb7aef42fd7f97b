"""Model aliases: short names a tenant gives its checkpoints, for the OpenAI endpoints' `model` field.

Each tenant has its own names (two tenants may both call something "latest"). They are kept in one JSON
file in the data directory, replaced atomically on every change: a handful of names per tenant, written
rarely, so the database schema stays the runtime store's own. Knows nothing of what a name points at;
inference.py checks the target. No tensors, no HTTP.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from pathlib import Path

from loraplex.errors import NotFoundError, UserError

ALIASES_FILE = "aliases.json"
# No ':' so that no alias can look like a tinker:// path or a base model name with a :suffix.
_ALIAS_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,127}")


def validate_alias(alias: str) -> str:
    """Return `alias` if it is a valid name; else a UserError saying what is allowed."""
    if not _ALIAS_RE.fullmatch(alias):
        raise UserError(
            f"invalid alias {alias!r}: use 1-128 characters from A-Z a-z 0-9 _ . - /, "
            "starting with a letter, digit or '_'"
        )
    return alias


class AliasTable:
    """tenant -> alias -> model (a tinker:// path), persisted in `data_dir/aliases.json`."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / ALIASES_FILE
        self._lock = threading.Lock()
        self._aliases: dict[str, dict[str, str]] = (
            json.loads(self._path.read_text()) if self._path.is_file() else {}
        )

    def target(self, tenant: str, alias: str) -> str | None:
        """What the tenant's `alias` names, if it is one."""
        with self._lock:
            return self._aliases.get(tenant, {}).get(alias)

    def of(self, tenant: str) -> dict[str, str]:
        """The tenant's aliases, by name."""
        with self._lock:
            return dict(sorted(self._aliases.get(tenant, {}).items()))

    def set(self, tenant: str, alias: str, model: str) -> None:
        """Point the tenant's `alias` at `model` (an existing alias is moved)."""
        validate_alias(alias)
        with self._lock:
            self._aliases.setdefault(tenant, {})[alias] = model
            self._save()

    def delete(self, tenant: str, alias: str) -> None:
        """Forget one of the tenant's aliases (NotFoundError if it has no such alias)."""
        with self._lock:
            if alias not in self._aliases.get(tenant, {}):
                raise NotFoundError(f"alias {alias!r} not found")
            del self._aliases[tenant][alias]
            self._save()

    def _save(self) -> None:
        """Write the whole table to a temporary file and rename it over the old one (atomic)."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".aliases-", dir=self._path.parent)
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(self._aliases, file, sort_keys=True, indent=2)
            os.replace(staging, self._path)
        finally:
            Path(staging).unlink(missing_ok=True)
