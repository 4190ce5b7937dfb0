"""Start and stop real redis-server processes for the tests (no fakes).

A server listens on a unix socket in a temporary directory and on a free loopback TCP port, keeps
nothing on disk, and is ready when it prints "Ready to accept connections".
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class RedisServer:
    """One redis-server process on a unix socket and a loopback port."""

    directory: Path
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (make test installs it)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--unixsocket",
                str(self.socket_path),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        ready = threading.Event()
        output: list[bytes] = []

        def read() -> None:
            assert process.stdout is not None
            with process.stdout:
                for line in process.stdout:
                    output.append(line)
                    if b"Ready to accept connections" in line:
                        ready.set()
            ready.set()  # the process ended: stop waiting

        process = self.process
        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not ready.wait(timeout) or self.process.poll() is not None:
            self.stop()
            raise RuntimeError("redis-server did not start:\n" + b"".join(output).decode())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.reader is not None:
            self.reader.join(10)
        self.process = None
        self.reader = None

    def restart(self) -> None:
        self.stop()
        self.start()


def require_redis() -> bool:
    return os.environ.get("AGENTICSTATE_REQUIRE_REDIS") == "1"
