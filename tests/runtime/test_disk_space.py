"""DiskSpace: the reserve a data dir keeps, the refusal that names the data dir and the sizes, and which
errors mean the disk is full (safetensors reports ENOSPC in its own exception's message)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

from loraplex.runtime.core.disk_space import DiskFullError, DiskSpace, is_out_of_space

GiB = 2**30


class _Usage(NamedTuple):
    total: int
    used: int
    free: int


def _disk(monkeypatch: pytest.MonkeyPatch, total: int, free: int, reserve: int | None = None) -> DiskSpace:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: _Usage(total, total - free, free))
    return DiskSpace(Path("/data"), reserve)


@pytest.mark.parametrize(("total", "reserve"), [(1000 * GiB, 4 * GiB), (40 * GiB, 2 * GiB)])
def test_the_default_reserve_is_4_gib_or_5_percent_whichever_is_less(
    monkeypatch: pytest.MonkeyPatch, total: int, reserve: int
) -> None:
    assert _disk(monkeypatch, total, total).reserve_bytes == reserve


def test_a_write_that_would_cross_the_reserve_is_refused_naming_the_data_dir_and_the_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    disk = _disk(monkeypatch, 100 * GiB, 5 * GiB + 2**20, reserve=5 * GiB)
    disk.check("save checkpoint tinker://r/weights/a", 2**20)  # lands exactly on the reserve
    with pytest.raises(DiskFullError) as refused:
        disk.check("save checkpoint tinker://r/weights/b", 2**20 + 1)
    assert str(refused.value) == (
        "not enough free space to save checkpoint tinker://r/weights/b: the data dir /data has 5.00 GiB "
        "free, the write needs about 1.0 MiB and the server keeps 5.00 GiB free (--min-free-bytes) so that "
        "its database can still commit; try again once space is freed (deleting checkpoints no longer "
        "needed frees it)"
    )


def test_out_of_space_is_read_from_os_errors_from_messages_and_through_causes() -> None:
    safetensors_style = RuntimeError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert is_out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_out_of_space(safetensors_style)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("a rank's save failed") from inner
    except RuntimeError as outer:
        assert is_out_of_space(outer)
    assert not is_out_of_space(OSError(errno.EACCES, "Permission denied"))
    assert not is_out_of_space(ValueError("bad checkpoint"))
