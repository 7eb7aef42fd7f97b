"""Checkpoint names, `tinker://` paths, and where checkpoints live on disk.

Names become directory names, so they are validated here once: one path segment, no traversal.
Knows nothing of the engine's file format. No tensors.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from loraplex.durable import recover_unfinished_writes
from loraplex.errors import UserError

# tinker path segment -> Tinker checkpoint_type. external_weights: a downloadable PEFT export.
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,200}")


def is_run_id(text: str) -> bool:
    """Whether `text` has the shape of a training run id (`{session}:train:{n}`, or a sampler id)."""
    return _ID_RE.fullmatch(text) is not None


def validate_name(name: str, what: str = "checkpoint name") -> str:
    """Return `name` if it is one safe path segment; else a UserError saying what is allowed."""
    if not _NAME_RE.fullmatch(name) or ".." in name:
        raise UserError(
            f"invalid {what} {name!r}: use 1-128 characters from A-Z a-z 0-9 _ . -, "
            "not starting with '.' or '-', and no '..' or '/'"
        )
    return name


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed `tinker://{run_id}/{kind}/{name}`."""

    run_id: str
    kind: str  # a key of CHECKPOINT_KINDS
    name: str

    @classmethod
    def parse(cls, path: str) -> CheckpointPath:
        """Parse and validate a tinker path (UserError naming the path if it is not one of ours)."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3:
            raise UserError(f"invalid checkpoint path {path!r}: expected tinker://<run>/<kind>/<name>")
        run_id, kind, name = parts
        if kind not in CHECKPOINT_KINDS:
            raise UserError(
                f"invalid checkpoint path {path!r}: kind must be one of {sorted(CHECKPOINT_KINDS)}"
            )
        if not is_run_id(run_id):
            raise UserError(f"invalid checkpoint path {path!r}: bad training run id")
        return cls(run_id, kind, validate_name(name))

    @property
    def checkpoint_id(self) -> str:
        """The id REST routes and the SDK use: `{kind}/{name}`."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        """Tinker's checkpoint_type: training, sampler or external."""
        return CHECKPOINT_KINDS[self.kind]

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def owner_digest(tenant: str) -> str:
    """A stable digest of the tenant id, stamped into checkpoints (the engine verifies it on load)."""
    return hashlib.sha256(b"loraplex-owner\0" + tenant.encode()).hexdigest()


@dataclass(frozen=True)
class DiskLayout:
    """Directories under the data dir: named checkpoints, unnamed sampler snapshots, parked runs."""

    data_dir: Path

    def checkpoint_dir(self, path: CheckpointPath) -> Path:
        """Directory of a named checkpoint."""
        return self.data_dir / "checkpoints" / path.run_id / path.kind / path.name

    def snapshot_dir(self, sampler_id: str) -> Path:
        """Directory of the snapshot behind an unnamed save_weights_for_sampler."""
        return self.data_dir / "snapshots" / sampler_id

    def parked_dir(self, run_id: str) -> Path:
        """Where a run's live state goes when its lease expires, to be loaded back on its next request."""
        return self.data_dir / "parked" / run_id

    def remove_staging(self) -> int:
        """Finish or undo the directory writes a crash interrupted (see `recover_unfinished_writes`) under
        every area of the data dir; return how many leftovers were dealt with. Run at start-up."""
        return sum(
            recover_unfinished_writes(self.data_dir / area) for area in ("checkpoints", "snapshots", "parked")
        )

    def usage(self) -> dict[str, tuple[int, int]]:
        """Files and bytes under the data dir by kind: training and sampler checkpoints, sampler snapshots,
        parked runs, models, the SQLite database, logs, and anything else."""
        kinds: dict[str, tuple[int, int]] = {}
        for path in self.data_dir.rglob("*"):
            if path.is_file() and not path.is_symlink():
                kind = self._kind_of(path.relative_to(self.data_dir))
                files, size = kinds.get(kind, (0, 0))
                kinds[kind] = (files + 1, size + path.stat().st_size)
        return kinds

    @staticmethod
    def _kind_of(relative: Path) -> str:
        parts = relative.parts
        if parts[0] == "checkpoints" and len(parts) > 2:
            return f"checkpoints ({CHECKPOINT_KINDS.get(parts[2], parts[2])})"
        if parts[0] in ("snapshots", "parked", "models"):
            return parts[0]
        if relative.name.startswith("loraplex.db"):
            return "database"
        if relative.suffix == ".log":
            return "logs"
        return "other"
