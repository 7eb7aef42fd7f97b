"""Durable directory writes: a directory appears whole or not at all, also across a crash.

Every directory loraplex writes (checkpoints, snapshots, parked runs, exports, the built-in model) is
filled under a hidden temporary name beside its target, fsynced, and renamed into place; start-up puts
back or removes what a crash interrupted (`recover_unfinished_writes`). Shared by every layer, like
errors.py: no torch, no HTTP, no SQL.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

# A hidden leftover of an interrupted write of directory NAME: its temp copy or the old version set aside.
# (`.staging-` is what loraplex 0.1's runtime used for the same purpose.)
_LEFTOVER = re.compile(r"\.(.+)\.(?:tmp|old|staging)-[^.]+")


def write_directory_atomically(directory: Path, write: Callable[[Path], None], replace: bool = True) -> int:
    """Let `write` fill a hidden temp directory beside `directory`, then swap it in; return bytes written.

    replace False keeps an existing `directory` instead (then nothing is written and 0 returned): for a
    directory written once, where racing writers all write the same and the first rename wins.

    A crash leaves the old version or the new one whole under `directory`: the new one is complete and
    fsynced before any rename; an existing one is renamed aside, the new one renamed in, then the old one
    deleted. If the process dies between those two renames, the next save or load of that name puts the
    aside copy back (`tidy`). A failed write removes its temp directory and changes nothing.
    """
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not replace:  # several processes may be writing it right now: their temp directories are not stale
        if directory.is_dir():
            return 0
    else:
        tidy(directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=parent))
    aside = parent / f".{directory.name}.old-{tmp.name.rsplit('-', 1)[1]}"
    try:
        write(tmp)
        size = _sync_tree(tmp)
        if directory.exists() and replace:
            os.rename(directory, aside)
        os.rename(tmp, directory)
        _fsync(parent)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not replace and directory.is_dir():  # another writer's rename won the race
            return 0
        if aside.exists() and not directory.exists():
            os.rename(aside, directory)
        raise
    except BaseException:
        if aside.exists() and not directory.exists():
            os.rename(aside, directory)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return size


def write_files_atomically(directory: Path, files: Mapping[str, bytes]) -> int:
    """Write `files` (name -> contents, already in memory) as the flat directory `directory`, atomically
    (`write_directory_atomically`); return bytes written."""

    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_bytes(data)

    return write_directory_atomically(directory, write)


def tidy(directory: Path) -> None:
    """Undo what a crashed `write_directory_atomically` left: restore an aside copy, drop temp dirs."""
    pattern = str(directory.parent / f".{glob.escape(directory.name)}")
    asides = sorted(glob.glob(f"{pattern}.old-*"))
    if asides and not directory.exists():
        os.rename(asides.pop(), directory)
    for stale in asides + glob.glob(f"{pattern}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def recover_unfinished_writes(root: Path) -> int:
    """Deal with what crashed `write_directory_atomically` calls left anywhere under `root`: an aside copy
    whose replacement never arrived is put back, other leftovers are deleted. Return how many there were."""
    if not root.is_dir():
        return 0
    leftovers = [p for p in root.rglob(".*") if p.is_dir() and _LEFTOVER.fullmatch(p.name)]
    for target in {p.parent / _LEFTOVER.fullmatch(p.name).group(1) for p in leftovers}:  # type: ignore[union-attr]
        tidy(target)
    for leftover in leftovers:  # what tidy does not know
        shutil.rmtree(leftover, ignore_errors=True)
    return len(leftovers)


def _sync_tree(directory: Path) -> int:
    """fsync every file of a flat directory and the directory itself; return their total size."""
    size = 0
    for path in directory.iterdir():
        _fsync(path)
        size += path.stat().st_size
    _fsync(directory)
    return size


def _fsync(path: Path) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
