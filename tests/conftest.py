"""Fixtures: the `backend` fixture every contract test takes, and a real redis-server.

Shared helpers that are not fixtures (`unique_prefix`, `BACKEND_MAKERS`, child processes) live
in `tests/helpers.py`; test files import them from there, never from here.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

import pytest

from agenticstate import StateConfig, StateManager
from tests._postgres_server import PostgresServer, require_postgres
from tests._redis_cluster import RedisClusterServers
from tests._redis_server import RedisServer, require_redis
from tests.helpers import BACKEND_MAKERS, backend_params

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from agenticstate.backends import Backend, FeedRetention


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
def postgres_url() -> Iterator[str]:
    """A private PostgreSQL cluster for the session (or AGENTICSTATE_TEST_POSTGRES_URL)."""
    existing = os.environ.get("AGENTICSTATE_TEST_POSTGRES_URL")
    if existing:
        yield existing
        return
    server = PostgresServer()
    try:
        server.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        if require_postgres():
            pytest.fail(f"AGENTICSTATE_REQUIRE_POSTGRES=1 but no PostgreSQL server: {exc}")
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server.url
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


@pytest.fixture(params=backend_params())
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A fresh, empty backend of each kind (a fresh namespace on shared servers)."""
    async with BACKEND_MAKERS[request.param](request, tmp_path) as made:
        yield made


@pytest.fixture
def feed_backend(
    request: pytest.FixtureRequest, tmp_path: Path, backend: Backend
) -> Callable[[FeedRetention | None], AbstractAsyncContextManager[Backend]]:
    """Build another backend of the test's kind with a given `FeedRetention` (the contract's
    retention tests); each call gets a fresh store."""
    kind = request.node.callspec.params["backend"]
    made = itertools.count()

    def make(retention: FeedRetention | None) -> AbstractAsyncContextManager[Backend]:
        return BACKEND_MAKERS[kind](request, tmp_path / f"feed{next(made)}", feed=retention)

    return make


@pytest.fixture
async def state(backend: Backend) -> AsyncIterator[StateManager]:
    """A StateManager over each backend."""
    manager = StateManager(StateConfig(), backend=backend, close_backend=False)
    try:
        yield manager
    finally:
        await manager.aclose()
