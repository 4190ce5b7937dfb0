"""Redis-compatible servers: an unsupported one is named as such, connection failures say why,
and the test fixture only takes a server that is running (see `make compat`)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from agenticstate import StateConfig, StateManager
from agenticstate.exceptions import BackendError, BackendUnavailableError
from tests._redis_server import SERVER_VARIABLE, RedisServer, free_port, server_binary

if TYPE_CHECKING:
    from pathlib import Path


def test_the_fixture_refuses_a_server_that_died_at_start(tmp_path: Path) -> None:
    """A redis-server that exits at start (a bad directive) is an error, not a running server."""
    server = RedisServer(tmp_path / "bad", extra_args=("--no-such-directive", "yes"))
    with pytest.raises(RuntimeError, match="did not start") as caught:
        server.start()
    assert "no-such-directive" in str(caught.value)  # the server's own words are shown
    assert server.process is None


def test_the_server_binary_comes_from_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """AGENTICSTATE_REDIS_SERVER picks the binary; one that is not there is named."""
    monkeypatch.setenv(SERVER_VARIABLE, sys.executable)
    assert server_binary() == sys.executable
    monkeypatch.setenv(SERVER_VARIABLE, str(tmp_path / "missing-server"))
    with pytest.raises(FileNotFoundError, match="missing-server is not an executable"):
        server_binary()
    # A binary that is not a Redis server never prints "Ready": refused too.
    monkeypatch.setenv(SERVER_VARIABLE, "/bin/true")
    with pytest.raises(RuntimeError, match="/bin/true did not start"):
        RedisServer(tmp_path / "true").start()


@pytest.mark.redis
async def test_a_server_without_resp3_is_named_unsupported(tmp_path: Path) -> None:
    """A server that rejects HELLO (Redis before 6.0; here a real redis-server with HELLO
    disabled, which answers exactly as Redis 5 does) is reported as unsupported, not as
    unreachable."""
    server = RedisServer(tmp_path / "old", extra_args=("--rename-command", "HELLO", ""))
    server.start()
    try:
        state = StateManager(StateConfig(backend="redis", redis_url=server.tcp_url))
        with pytest.raises(BackendError, match="not supported") as caught:
            await state.get("k")
        await state.aclose()
        message = str(caught.value)
        assert not isinstance(caught.value, BackendUnavailableError)
        assert "rejected the RESP3 handshake (HELLO)" in message
        assert "agenticstate needs Redis 6.0 or newer" in message
        assert "cannot reach" not in message
        shown = subprocess.run(
            [sys.executable, "-m", "agenticstate", "--url", server.tcp_url, "set", "k", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert shown.returncode == 3
        assert "is not supported" in shown.stderr
        watched = subprocess.run(
            [sys.executable, "-m", "agenticstate", "--url", server.tcp_url, "watch", "*"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert watched.returncode == 3
        assert watched.stderr.splitlines()[-1].startswith(
            f"agenticstate: the server at {server.tcp_url} is not supported"
        )
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"redis://127.0.0.1:{free_port()}/0", "connection refused"),
        ("redis://no-such-host.invalid:6379/0", "host name not resolved"),
        ("unix:///nonexistent/redis.sock", "no such file or directory"),
    ],
    ids=["refused", "unresolved", "no-socket"],  # not the port: the same in every process
)
async def test_unreachable_says_why(url: str, reason: str) -> None:
    """Refused, not resolved and a missing socket each say so (they all read ConnectionError)."""
    state = StateManager(StateConfig(backend="redis", redis_url=url))
    with pytest.raises(BackendUnavailableError) as caught:
        await state.get("k")
    await state.aclose()
    assert str(caught.value).startswith(f"cannot reach Redis at {url}: {reason}")
