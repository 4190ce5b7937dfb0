"""Start and stop a real PostgreSQL server for the tests (no fakes): a private cluster.

`initdb` makes a throwaway cluster in a temporary directory and `postgres` serves it on a unix
socket in that directory and on a free loopback TCP port, with trust authentication for the
`postgres` role (nothing listens beyond loopback). It runs without fsync: a killed server
loses no committed transaction that way (only a crash of the machine would), and the tests'
many small commits and schema changes do not wait on the disk.

PostgreSQL refuses to run as root, so when the tests run as root (CI) the cluster belongs to
the `postgres` system user and both programs run as it (`setpriv`, which execs: the process
started is the server itself, stopped by its pid). The binaries are the ones on PATH, else the
newest in Debian's `/usr/lib/postgresql/*/bin` (`scripts/install-postgres.sh` installs them).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests._redis_server import free_port

REQUIRE_VARIABLE = "AGENTICSTATE_REQUIRE_POSTGRES"
"""`1` (what `make test` sets): a server that cannot start fails the run instead of skipping."""


def require_postgres() -> bool:
    return os.environ.get(REQUIRE_VARIABLE) == "1"


def binary(name: str) -> str:
    """The PostgreSQL program `name`: on PATH, else in the newest versioned Debian bin dir."""
    found = shutil.which(name)
    if found is not None:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    for directory in reversed(versions):
        if (directory / name).exists():
            return str(directory / name)
    raise FileNotFoundError(f"{name} is not installed (make test installs PostgreSQL)")


def _as_server_user() -> tuple[list[str], int | None]:
    """The command prefix that runs a program as the cluster's owner, and that owner's uid."""
    if os.geteuid() != 0:
        return [], None
    try:
        owner = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root and there is no 'postgres' user to run as") from None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise FileNotFoundError("setpriv is not installed (util-linux)")
    return [
        setpriv,
        f"--reuid={owner.pw_uid}",
        f"--regid={owner.pw_gid}",
        "--init-groups",
        "--reset-env",
    ], owner.pw_uid


@dataclass
class PostgresServer:
    """One private PostgreSQL cluster, serving on a unix socket and a loopback port."""

    port: int = field(default_factory=free_port)
    directory: Path | None = None
    fsync: bool = False  # the benchmarks turn it on: durable commits, as a user runs it
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    output: list[bytes] = field(default_factory=list)

    @property
    def socket_dir(self) -> Path:
        assert self.directory is not None
        return self.directory

    @property
    def url(self) -> str:
        """A `postgresql://` URL over the unix socket (the `postgres` database and role)."""
        return f"postgresql://postgres@/postgres?host={self.socket_dir}&port={self.port}"

    @property
    def tcp_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 60.0) -> None:
        prefix, uid = _as_server_user()
        initdb, postgres = binary("initdb"), binary("postgres")
        if self.directory is None:
            # Not under pytest's tmp dir: that one is private to the user running the tests, and
            # the server may run as another.
            self.directory = Path(tempfile.mkdtemp(prefix="agenticstate-pg-"))
            if uid is not None:
                os.chown(self.directory, uid, -1)
        data = self.directory / "data"
        made = subprocess.run(
            [
                *prefix,
                initdb,
                "-D",
                str(data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "--no-sync",  # the cluster is thrown away with the run
            ],
            capture_output=True,
            check=False,
        )
        if made.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{made.stdout.decode()}{made.stderr.decode()}")
        self.process = subprocess.Popen(
            [
                *prefix,
                postgres,
                "-D",
                str(data),
                "-k",
                str(self.directory),
                "-p",
                str(self.port),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "log_min_messages=warning",
                # A process crash (kill -9, `pg_ctl stop -m immediate`) loses no committed
                # transaction without fsync: the WAL is in the kernel's page cache. Only a crash
                # of the machine would, and the cluster is thrown away with the run.
                "-c",
                f"fsync={'on' if self.fsync else 'off'}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        ready = threading.Event()
        accepting = [False]
        process = self.process

        def read() -> None:
            assert process.stdout is not None
            with process.stdout:
                for line in process.stdout:
                    self.output.append(line)
                    if b"ready to accept connections" in line:
                        accepting[0] = True
                        ready.set()
            ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not ready.wait(timeout) or not accepting[0] or process.poll() is not None:
            self.stop()
            raise RuntimeError("postgres did not start:\n" + b"".join(self.output).decode())

    def stop(self) -> None:
        """Fast shutdown (SIGINT) of the server by its pid, then remove its directory."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.reader is not None:
            self.reader.join(10)
        self.process = None
        self.reader = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
