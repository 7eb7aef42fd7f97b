"""Every document the code, tests, scripts and docs cite is in the repository: someone who clones
loraplex can read all of it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("src", "tests", "bench", "docs", ".ci")
TOP_LEVEL = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ""}

DOC_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")  # docs/X.md, README.md, X.md
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")  # [text](relative/path.md#anchor)


def _texts() -> list[Path]:
    files = [REPO / name for name in TOP_LEVEL]
    for top in SOURCES:
        files += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return [
        p
        for p in files
        if p.is_file() and not any(part.endswith(".egg-info") for part in p.parts) and p != Path(__file__)
    ]


def _exists(reference: str, cited_in: Path) -> bool:
    """A cited name resolves from the citing file's folder, the repository root or docs/."""
    return any((base / reference).is_file() for base in (cited_in.parent, REPO, REPO / "docs"))


def test_every_cited_document_is_in_the_repository() -> None:
    missing = []
    for path in _texts():
        text = path.read_text(errors="replace")
        references = set(DOC_PATH.findall(text)) | set(MD_LINK.findall(text))
        missing += [
            f"{path.relative_to(REPO)}: {ref}" for ref in sorted(references) if not _exists(ref, path)
        ]
    assert missing == []


def test_nothing_points_outside_the_repository_for_documentation() -> None:
    outside = [
        str(path.relative_to(REPO)) for path in _texts() if "shared/docs" in path.read_text(errors="replace")
    ]
    assert outside == []


def test_the_checker_finds_a_missing_document(tmp_path: Path) -> None:
    citing = tmp_path / "module.py"
    citing.write_text('"""See docs/NOT_THERE.md and [the walk](WALKTHROUGH.md)."""')
    text = citing.read_text()
    references = set(DOC_PATH.findall(text)) | set(MD_LINK.findall(text))
    assert references == {"docs/NOT_THERE.md", "WALKTHROUGH.md"}
    assert not _exists("docs/NOT_THERE.md", citing) and _exists("WALKTHROUGH.md", citing)
