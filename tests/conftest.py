"""Fixtures: the `backend` fixture every contract test takes, and a real redis-server."""

from __future__ import annotations

import os
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest

from agenticstate import (
    FileBackend,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    StateConfig,
    StateManager,
)
from tests._redis_cluster import RedisClusterServers
from tests._redis_server import RedisServer, require_redis

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from agenticstate.backends import Backend

    BackendMaker = Callable[[pytest.FixtureRequest, Path], AbstractAsyncContextManager[Backend]]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server for the session (or AGENTICSTATE_TEST_REDIS_URL)."""
    existing = os.environ.get("AGENTICSTATE_TEST_REDIS_URL")
    if existing:
        yield existing
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        if require_redis():
            pytest.fail(f"AGENTICSTATE_REQUIRE_REDIS=1 but no redis-server: {exc}")
        pytest.skip(f"no redis-server: {exc}")
    try:
        yield server.unix_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real 3-primary Redis Cluster on loopback for the session (or
    AGENTICSTATE_TEST_REDIS_CLUSTER_URL)."""
    existing = os.environ.get("AGENTICSTATE_TEST_REDIS_CLUSTER_URL")
    if existing:
        yield existing
        return
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"), primaries=3)
    try:
        cluster.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        if require_redis():
            pytest.fail(f"AGENTICSTATE_REQUIRE_REDIS=1 but no Redis Cluster could start: {exc}")
        pytest.skip(f"no Redis Cluster: {exc}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


@asynccontextmanager
async def _memory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with MemoryBackend() as backend:
        yield backend


@asynccontextmanager
async def _redis(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_url")
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        yield backend


@asynccontextmanager
async def _redis_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_cluster_url")
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        yield backend


@asynccontextmanager
async def _file(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with FileBackend(base_path=tmp_path / "store") as backend:
        yield backend


@asynccontextmanager
async def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with SQLiteBackend(tmp_path / "store" / "state.db") as backend:
        yield backend


# Each backend module adds its maker here; the contract suite runs against every one.
BACKEND_MAKERS: dict[str, BackendMaker] = {
    "memory": _memory,
    "file": _file,
    "sqlite": _sqlite,
    "redis": _redis,
    "redis-cluster": _redis_cluster,
}
REDIS_BACKENDS = {"redis", "redis-cluster"}


def _backend_params() -> list[object]:
    return [
        pytest.param(name, marks=pytest.mark.redis) if name in REDIS_BACKENDS else name
        for name in BACKEND_MAKERS
    ]


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture(params=_backend_params())
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A fresh, empty backend of each kind (a fresh namespace on shared servers)."""
    async with BACKEND_MAKERS[request.param](request, tmp_path) as made:
        yield made


@pytest.fixture
async def state(backend: Backend) -> AsyncIterator[StateManager]:
    """A StateManager over each backend."""
    manager = StateManager(StateConfig(), backend=backend, close_backend=False)
    try:
        yield manager
    finally:
        await manager.aclose()
