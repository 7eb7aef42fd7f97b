"""Imports only point down the layers: api -> runtime -> engine -> model (docs/ARCHITECTURE.md)."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "loraplex"

# Per layer: top-level modules it must never import (third-party and our own upper layers).
FORBIDDEN = {
    "model": {
        "fastapi",
        "starlette",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "loraplex.engine",
        "loraplex.runtime",
        "loraplex.api",
    },
    "engine": {
        "fastapi",
        "starlette",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "loraplex.runtime",
        "loraplex.api",
    },
    "runtime": {"torch", "fastapi", "starlette", "uvicorn", "loraplex.api", "loraplex.model"},
    "api": {"torch", "sqlalchemy", "alembic", "loraplex.model"},
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(layer: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in _imported_modules(path):
            for banned in FORBIDDEN[layer]:
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_point_down(layer: str) -> None:
    assert _violations(layer) == []


def test_the_check_catches_a_forbidden_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "loraplex"
    (fake / "runtime").mkdir(parents=True)
    (fake / "runtime" / "bad.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations("runtime") == ["runtime/bad.py imports torch"]
