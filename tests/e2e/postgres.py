"""A throwaway PostgreSQL cluster for tests: initdb into a temp dir, served on a free loopback port.

Debian's PostgreSQL refuses to run as root, so as root the cluster is owned and run by `postgres`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.conftest import free_port


def _as_cluster_owner(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


def _program(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, or where Debian's packages put it."""
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def postgres_available() -> bool:
    """Whether initdb and pg_ctl can be found."""
    return _program("initdb") is not None and _program("pg_ctl") is not None


class PostgresCluster:
    """A cluster in `root` on a free loopback port, which a test may stop and start again (an outage)."""

    def __init__(self, root: Path) -> None:
        self.root, self.data, self.port = root, root / "data", free_port()
        self.url_prefix = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}"
        self.is_running = False

    def create(self) -> None:
        self._run([_program("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root}"
        log = str(self.root / "log")
        self._run([_program("pg_ctl"), "-D", str(self.data), "-o", options, "-l", log, "-w", "start"])
        self.is_running = True

    def stop(self) -> None:
        """Stop at once, as a crash would: open connections are cut."""
        self._run([_program("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        self.is_running = False

    @staticmethod
    def _run(args: list[str | None]) -> None:
        subprocess.run(_as_cluster_owner([str(a) for a in args]), check=True, capture_output=True)


@contextmanager
def running_cluster() -> Iterator[PostgresCluster]:
    """A fresh cluster, started; stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    root.chmod(0o777)  # the cluster owner must be able to write here
    cluster = PostgresCluster(root)
    try:
        cluster.create()
        cluster.start()
        try:
            yield cluster
        finally:
            if cluster.is_running:
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Yield a SQLAlchemy URL prefix `postgresql+psycopg://postgres@127.0.0.1:PORT` for a fresh cluster."""
    with running_cluster() as cluster:
        yield cluster.url_prefix


def create_database(url_prefix: str, name: str) -> str:
    """Create database `name` in the cluster and return its URL."""
    import psycopg

    with psycopg.connect(url_prefix.replace("postgresql+psycopg", "postgresql") + "/postgres") as conn:
        conn.autocommit = True
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{url_prefix}/{name}"
