"""A throwaway PostgreSQL server for the benchmarks' AsyncPostgresSaver baseline.

`postgres_server()` runs `initdb` and `pg_ctl` (on PATH) in a temporary directory and serves on
a unix socket in it only (no TCP listener), on a private port number; it yields the connection
URL and stops the server and removes the directory afterwards. PostgreSQL refuses to run as
root, so as root it runs as the `postgres` system user (`runuser`). The server keeps its
durability defaults (`fsync=on`, `synchronous_commit=on`): each commit is on disk before it
returns, as the other durable savers in the comparison.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["postgres_server"]

_USER = "postgres"


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", _USER, "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str]) -> None:
    done = subprocess.run(_as_server_user(command), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed:\n{done.stdout}{done.stderr}")


@contextmanager
def postgres_server(port: int = 54329) -> Iterator[str]:
    """Start a PostgreSQL server in a temporary directory; yield its `postgresql://` URL."""
    for tool in ("initdb", "pg_ctl"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not on PATH: install PostgreSQL to run this baseline")
    directory = Path(tempfile.mkdtemp(prefix="agenticstate-pg-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(directory, _USER, _USER)
        data = directory / "data"
        _run(["initdb", "-D", str(data), "-A", "trust", "-U", _USER, "--no-sync", "-E", "UTF8"])
        options = f"-p {port} -k {directory} -c listen_addresses=''"
        log = str(directory / "log")
        _run(["pg_ctl", "-D", str(data), "-l", log, "-w", "-o", options, "start"])
        try:
            yield f"postgresql://{_USER}@/postgres?host={directory}&port={port}"
        finally:
            _run(["pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
