"""Start and stop real redis-server processes for the tests (no fakes).

A server listens on a unix socket in a temporary directory and on a free loopback TCP port, keeps
nothing on disk, and is ready when it prints "Ready to accept connections". The binary is
`$AGENTICSTATE_REDIS_SERVER` when set (a Valkey or older Redis build: `make compat`), else the
`redis-server` on PATH.
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
    tls_files: tuple[Path, Path, Path] | None = None  # (cert, key, ca): serve TLS on `port`
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
        scheme = "rediss" if self.tls_files else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        binary = server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        ports = ["--port", str(self.port)]
        if self.tls_files is not None:
            cert, key, ca = self.tls_files
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            ports += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
            ports += ["--tls-auth-clients", "no"]
        self.process = subprocess.Popen(
            [
                binary,
                *ports,
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
        accepting = [False]

        def read() -> None:
            assert process.stdout is not None
            with process.stdout:
                for line in process.stdout:
                    output.append(line)
                    if b"Ready to accept connections" in line:
                        accepting[0] = True
                        ready.set()
            ready.set()  # the process ended: stop waiting

        process = self.process
        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        # Only the "Ready" line means it runs: a server that died at start closes its output
        # (which also ends the wait) before its exit status can be seen, so poll() alone could
        # take it for a running one.
        if not ready.wait(timeout) or not accepting[0] or self.process.poll() is not None:
            self.stop()
            raise RuntimeError(f"{binary} did not start:\n" + b"".join(output).decode())

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


SERVER_VARIABLE = "AGENTICSTATE_REDIS_SERVER"
"""The redis-server binary the tests start (`make compat` points it at Valkey or Redis 6.2)."""


def server_binary() -> str:
    """The server binary: `$AGENTICSTATE_REDIS_SERVER` if set, else `redis-server` on PATH."""
    chosen = os.environ.get(SERVER_VARIABLE)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise FileNotFoundError(f"{SERVER_VARIABLE}={chosen} is not an executable")
        return chosen
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make test installs it)")
    return binary


def require_redis() -> bool:
    return os.environ.get("AGENTICSTATE_REQUIRE_REDIS") == "1"


def make_test_ca(directory: Path) -> tuple[Path, Path, Path]:
    """Create a throwaway CA and a server certificate for 127.0.0.1 with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    new_key = ["-newkey", "rsa:2048", "-nodes", "-keyout"]
    run("req", "-x509", *new_key, str(ca_key), "-out", str(ca_crt), "-days", "1", "-subj", "/CN=ca")
    run("req", *new_key, str(key), "-out", str(csr), "-subj", "/CN=localhost")
    signing = ["-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1"]
    run("x509", "-req", "-in", str(csr), *signing, "-out", str(crt), "-extfile", str(ext))
    return crt, key, ca_crt
