"""A redis-server of a test's own, for the fault tests (skips, or fails when Redis is required)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

from tests._redis_server import RedisServer, require_redis

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["running_server"]


@contextmanager
def running_server(directory: Path) -> Iterator[RedisServer]:
    """Start a redis-server on loopback TCP and a unix socket in `directory`; stop it after."""
    server = RedisServer(directory)
    try:
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        if require_redis():
            pytest.fail(f"AGENTICSTATE_REQUIRE_REDIS=1 but no redis-server: {exc}")
        pytest.skip(f"no redis-server: {exc}")
    try:
        yield server
    finally:
        server.stop()
