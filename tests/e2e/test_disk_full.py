"""A full data disk on a real `loraplex serve` whose data dir is a small tmpfs: a save that would take
the space the server keeps free (--min-free-bytes) fails for the saving client alone, with a user error
that names the data dir and the space; a neighbour's training steps all succeed meanwhile; healthz and
/metrics show the free space; the same save succeeds once space is freed."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.runtime.core.disk_space import tree_bytes
from tests.e2e.conftest import Server
from tests.e2e.sdk import client, new_run, sft_steps

RESERVE = 32 * 2**20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB tmpfs: a disk the test can fill."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"this test mounts a tmpfs, which needs root: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_save_past_the_reserve_fails_alone_and_succeeds_once_space_is_freed(small_disk: Path) -> None:
    server = Server(small_disk / "data", ["--min-free-bytes", str(RESERVE)]).start()
    try:
        alice, bob = new_run(client(server), server, seed=1), new_run(client(server), server, seed=2)
        sft_steps(alice, 1)
        first = alice.save_state("first").result()
        size = tree_bytes(server.data_dir / "checkpoints" / alice.model_id / "weights" / "first")
        assert first.path.endswith("/weights/first") and size > 0

        # The disk fills (another program's file) until less than one more checkpoint fits above the reserve.
        filler = small_disk / "filler"
        with open(filler, "wb") as out:
            os.posix_fallocate(out.fileno(), 0, shutil.disk_usage(small_disk).free - RESERVE - size // 2)
        health = httpx.get(f"{server.base_url}/api/v1/healthz").json()
        assert health["status"] == "ok" and health["data_dir_reserve_bytes"] == RESERVE
        assert RESERVE <= health["data_dir_free_bytes"] < RESERVE + size
        metrics = httpx.get(f"{server.base_url}/metrics", headers={"X-API-Key": "tml-local"}).text
        gauges = {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name.startswith("loraplex_data_dir_")
        }
        assert gauges["loraplex_data_dir_reserve_bytes"] == RESERVE
        assert RESERVE <= gauges["loraplex_data_dir_free_bytes"] < RESERVE + size

        with pytest.raises(Exception, match="not enough free space") as refused:
            alice.save_state("second").result()
        message = str(refused.value)
        assert str(server.data_dir) in message and "(--min-free-bytes)" in message, message
        assert not (server.data_dir / "checkpoints" / alice.model_id / "weights" / "second").exists()
        losses = sft_steps(bob, 3)  # the neighbour trains on, its steps committed to the database
        assert len(losses) == 3 and all(loss > 0 for loss in losses)
        sft_steps(alice, 1)  # and so does the saving client

        filler.unlink()
        second = alice.save_state("second").result()
        assert second.path.endswith("/weights/second")
    finally:
        server.stop()


def test_a_save_that_runs_out_of_space_while_it_writes_fails_with_the_same_error_and_leaves_nothing(
    small_disk: Path,
) -> None:
    """Without a reserve, a run's first save (no earlier one to size it by) runs into the full disk as it
    writes: the client gets the disk-space error rather than an internal one, and no partial files stay."""
    server = Server(small_disk / "data", ["--min-free-bytes", "0"]).start()
    try:
        alice, bob = new_run(client(server), server, seed=1), new_run(client(server), server, seed=2)
        sft_steps(alice, 1)
        alice.save_state("sizer").result()
        size = tree_bytes(server.data_dir / "checkpoints" / alice.model_id / "weights" / "sizer")
        filler = small_disk / "filler"
        with open(filler, "wb") as out:
            os.posix_fallocate(out.fileno(), 0, shutil.disk_usage(small_disk).free - size // 2)
        with pytest.raises(Exception, match="not enough free space") as failed:
            bob.save_state("first").result()
        assert str(server.data_dir) in str(failed.value)
        weights = server.data_dir / "checkpoints" / bob.model_id / "weights"
        assert not weights.exists() or list(weights.iterdir()) == []  # no partial checkpoint, no temp dir
        filler.unlink()
        sft_steps(bob, 1)
        assert bob.save_state("first").result().path.endswith("/weights/first")
    finally:
        server.stop()
