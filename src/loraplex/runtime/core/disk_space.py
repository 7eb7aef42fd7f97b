"""Free space in the data dir, treated as a resource: a write that would leave less than the reserve
(--min-free-bytes) is refused with a user error that names the data dir and the space it needs, before a
byte is written, so the database beside the checkpoints (SQLite's file and journal live in the data dir)
can still commit, and other tenants' training and sampling go on. A write that runs out of space anyway
(the disk filled by someone else meanwhile, or a first save larger than its estimate) gets the same error,
and its partial files are gone (durable.py removes a failed write's temp directory). No tensors, no SQL.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

from loraplex.errors import UserError

# The reserve when --min-free-bytes is not given: this much, or 5 % of the data dir's filesystem if less.
DEFAULT_RESERVE_BYTES = 4 << 30
DEFAULT_RESERVE_FRACTION = 0.05


_OUT_OF_SPACE_MESSAGES = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class DiskFullError(UserError):
    """A write refused (or failed) for want of free space in the data dir; the same request succeeds once
    space is freed."""


class DiskSpace:
    """The data dir's free space and the reserve no write may take."""

    def __init__(self, data_dir: Path, min_free_bytes: int | None = None) -> None:
        self.data_dir = data_dir
        self._min_free_bytes = min_free_bytes

    @cached_property
    def reserve_bytes(self) -> int:
        """--min-free-bytes, or the default: 4 GiB or 5 % of the filesystem, whichever is less."""
        if self._min_free_bytes is not None:
            return self._min_free_bytes
        total = shutil.disk_usage(self.data_dir).total
        return min(DEFAULT_RESERVE_BYTES, int(total * DEFAULT_RESERVE_FRACTION))

    def free_bytes(self) -> int:
        """Bytes free for this process in the data dir's filesystem now."""
        return shutil.disk_usage(self.data_dir).free

    def check(self, what: str, needed: int) -> None:
        """Refuse `what` (e.g. "save checkpoint tinker://…") if writing `needed` bytes would leave less
        than the reserve."""
        free = self.free_bytes()
        if free - needed < self.reserve_bytes:
            raise self.refusal(what, needed, free)

    @contextmanager
    def writing(self, what: str, needed: int) -> Iterator[None]:
        """Around a write of about `needed` bytes: refused before it starts if it would cross the reserve
        (`check`), and running out of space during it raised as the same user error."""
        self.check(what, needed)
        try:
            yield
        except Exception as exc:
            if is_out_of_space(exc):
                raise self.refusal(what, needed) from exc
            raise

    def refusal(self, what: str, needed: int, free: int | None = None) -> DiskFullError:
        """The error of `what`, refused or failed for want of space."""
        free = self.free_bytes() if free is None else free
        return DiskFullError(
            f"not enough free space to {what}: the data dir {self.data_dir} has {_size(free)} free, the "
            f"write needs about {_size(needed)} and the server keeps {_size(self.reserve_bytes)} free "
            "(--min-free-bytes) so that its database can still commit; try again once space is freed "
            "(deleting checkpoints no longer needed frees it)"
        )


def is_out_of_space(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is the filesystem saying it is full (or the user's
    quota is). safetensors reports it as a SafetensorError whose message carries the OS error."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(error) for sign in _OUT_OF_SPACE_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def tree_bytes(directory: Path) -> int:
    """Bytes of the files under `directory`."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:,.2f} GiB"
