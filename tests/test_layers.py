"""Imports only point down the layers, api -> runtime -> engine -> model, and inside the runtime the rooms
keep their rules (docs/ARCHITECTURE.md): the engine-facing core sees no database and no other room but
the telemetry and progress it feeds; the control plane does not serve; observability's feeds stand alone.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "loraplex"

# Per layer or room (a path under src/loraplex): modules it must never import, third-party and our own.
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
    # The engine thread's room: no SQL, and of the other rooms only what it feeds.
    "runtime/core": {
        "sqlalchemy",
        "alembic",
        "prometheus_client",
        "loraplex.runtime.control",
        "loraplex.runtime.serving",
        "loraplex.runtime.observability.history",
        "loraplex.runtime.observability.console",
        "loraplex.runtime.assembly",
    },
    "runtime/control": {
        "loraplex.runtime.serving",
        "loraplex.runtime.observability.history",
        "loraplex.runtime.observability.console",
        "loraplex.runtime.assembly",
    },
    "runtime/serving": {"sqlalchemy", "alembic", "loraplex.runtime.assembly"},
    "runtime/observability/telemetry.py": {"loraplex.runtime.control", "loraplex.runtime.serving"},
    "runtime/observability/progress.py": {"loraplex.runtime.control", "loraplex.runtime.serving"},
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


def _violations(part: str) -> list[str]:
    found = []
    root = PACKAGE / part
    for path in sorted([root] if root.is_file() else root.rglob("*.py")):
        for name in _imported_modules(path):
            for banned in FORBIDDEN[part]:
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_only_point_down_and_rooms_keep_their_rules(part: str) -> None:
    assert _violations(part) == []


def test_the_check_catches_a_forbidden_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "loraplex"
    (fake / "runtime" / "core").mkdir(parents=True)
    (fake / "runtime" / "bad.py").write_text("import torch\n")
    (fake / "runtime" / "core" / "loop.py").write_text("from loraplex.runtime.control.store import Store\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations("runtime") == ["runtime/bad.py imports torch"]
    assert _violations("runtime/core") == ["runtime/core/loop.py imports loraplex.runtime.control.store"]
