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


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Yield a SQLAlchemy URL prefix `postgresql+psycopg://postgres@127.0.0.1:PORT` for a fresh cluster."""
    root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    root.chmod(0o777)  # the cluster owner must be able to write here
    data, port = root / "data", free_port()
    run = lambda args: subprocess.run(_as_cluster_owner(args), check=True, capture_output=True)  # noqa: E731
    try:
        run([_program("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root}"
        run([_program("pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"])
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
        finally:
            run([_program("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def create_database(url_prefix: str, name: str) -> str:
    """Create database `name` in the cluster and return its URL."""
    import psycopg

    with psycopg.connect(url_prefix.replace("postgresql+psycopg", "postgresql") + "/postgres") as conn:
        conn.autocommit = True
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{url_prefix}/{name}"
