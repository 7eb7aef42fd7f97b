"""Where vLLM servers read snapshots from: the data dir itself, or copies for servers that cannot see it.

By default a server loads a snapshot from its directory under `--data-dir`, which it must see at the same
path (the server loraplex starts does; one on another machine needs a shared filesystem). With
`--vllm-snapshot-dir LOCAL[:REMOTE]`, each snapshot is first copied into LOCAL (a directory the servers
see, e.g. a network mount or a volume synced to them) and loaded from REMOTE, the same directory as the
servers name it (default: LOCAL). A copy is written once per adapter name, under a temporary name then
renamed, so a server never reads a half-written one; it is deleted when retention deletes its snapshot.
Blocking file work: the sampler runs it on a worker thread. No tensors.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

from loraplex.errors import UserError


class SnapshotStaging:
    """Gives each snapshot the path vLLM loads it from."""

    def __init__(self, spec: str | None = None) -> None:
        self.local: Path | None = None
        self.remote = ""
        if spec is not None:
            local, _, remote = spec.partition(":")
            if not local:
                raise UserError(f"--vllm-snapshot-dir {spec!r}: give LOCAL or LOCAL:REMOTE")
            self.local, self.remote = Path(local), remote or local
            self.local.mkdir(parents=True, exist_ok=True)
        self._copies: dict[Path, set[str]] = {}  # snapshot -> the names it was copied under
        self._lock = threading.Lock()

    def path_for(self, snapshot: Path, name: str) -> str:
        """The path a vLLM server loads `snapshot` (loaded as `name`) from, copying it there first if it
        has to be."""
        if self.local is None:
            return str(snapshot.resolve())
        copy = self.local / name
        if not copy.is_dir():
            partial = self.local / f".{name}.{uuid.uuid4().hex}"
            shutil.copytree(snapshot, partial)
            try:
                partial.rename(copy)
            except OSError:  # another server's copy got there first: the same files
                shutil.rmtree(partial, ignore_errors=True)
                if not copy.is_dir():
                    raise
        with self._lock:
            self._copies.setdefault(snapshot, set()).add(name)
        return f"{self.remote.rstrip('/')}/{name}"

    def drop(self, snapshot: Path) -> None:
        """Delete the copies of a snapshot retention deleted (nothing to do without staging)."""
        with self._lock:
            names = self._copies.pop(snapshot, set())
        if self.local is not None:
            for name in names:
                shutil.rmtree(self.local / name, ignore_errors=True)
