"""Commits of one scope from several processes: one chain, every commit a state that existed.

On SQLite, Redis and Redis Cluster (where the scope's keys are spread over slots and its commits
share one): 4 processes each save their own key and a shared one, then commit, 15 times.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest

from agenticstate import RedisBackend, SQLiteBackend, StateConfig, StateManager
from agenticstate.commits import MANIFEST_EVERY
from tests.helpers import LineProcess
from tests.integration._commit_worker import RETENTION, SCOPE

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend

PROCESSES, ROUNDS = 4, 15


def _race(url: str, prefix: str, *retention: str) -> set[str]:
    procs = [
        LineProcess(
            "tests.integration._commit_worker", url, prefix, str(worker), str(ROUNDS), *retention
        )
        for worker in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert proc.wait_until(lambda lines: "ready" in lines), proc.errors
        for proc in procs:  # start them together
            assert proc.process.stdin is not None
            proc.process.stdin.write("go\n")
            proc.process.stdin.flush()
        for proc in procs:
            assert proc.wait_until(lambda lines: "done" in lines, 180), "\n".join(proc.errors)
        return {
            line.split()[1] for proc in procs for line in proc.lines if line.startswith("commit ")
        }
    finally:
        for proc in procs:
            proc.stop()


async def _check(backend: Backend, ids: set[str]) -> None:
    async with StateManager(
        StateConfig(commit_retention=RETENTION), backend=backend, close_backend=False
    ) as state:
        log = await state.log(SCOPE)
        assert {c.id for c in log} == ids
        assert len(ids) == PROCESSES * ROUNDS
        # One linear chain, newest first.
        assert [c.parent for c in log[:-1]] == [c.id for c in log[1:]]
        assert log[-1].parent is None
        # Each worker's key only moves forward along the chain, and each commit holds the
        # round its own worker had just saved (or later).
        seen = dict.fromkeys(range(PROCESSES), -1)
        for info in reversed(log):
            values = await (await state.checkout(info.id)).items()
            worker, round_ = map(int, info.message.split(":"))
            assert values[f"{SCOPE}w{worker}"] >= round_
            for other in range(PROCESSES):
                value = values.get(f"{SCOPE}w{other}", -1)
                assert value >= seen[other]
                seen[other] = value
        assert seen == dict.fromkeys(range(PROCESSES), ROUNDS - 1)
        # And the scope rolls back to the first commit, from here.
        first = log[-1]
        await state.rollback(SCOPE, first.id)
        now = await state.commit(SCOPE)
        assert (await state.diff(first.id, now.id)).model_dump() == {
            "added": [],
            "removed": [],
            "changed": [],
        }


async def _check_pruned(backend: Backend) -> None:
    # Every kept commit still reads whole: no process dropped a blob another one counted on.
    async with StateManager(
        StateConfig(commit_retention=3), backend=backend, close_backend=False
    ) as state:
        log = await state.log(SCOPE)
        assert 3 <= len(log) < 3 + MANIFEST_EVERY
        for info in log:
            values = await (await state.checkout(info.id)).items()
            assert set(values) == {f"{SCOPE}w{w}" for w in range(PROCESSES)} | {f"{SCOPE}shared"}


async def test_processes_prune_one_scope_on_sqlite(tmp_path: Path) -> None:
    """4 processes commit and prune one scope (retention 3, values coming back): all readable."""
    db = tmp_path / "state.db"
    _race(f"sqlite://{db}", "", "3")
    async with SQLiteBackend(db) as backend:
        await _check_pruned(backend)


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
async def test_processes_prune_one_scope_on_redis(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """4 processes commit and prune one scope on Redis and Redis Cluster: all readable."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    _race(url, prefix, "3")
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await _check_pruned(backend)


async def test_processes_commit_one_scope_on_sqlite(tmp_path: Path) -> None:
    """4 processes commit one scope of one SQLite database: one chain, each commit sound."""
    db = tmp_path / "state.db"
    ids = _race(f"sqlite://{db}", "")
    async with SQLiteBackend(db) as backend:
        await _check(backend, ids)


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
async def test_processes_commit_one_scope_on_redis(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """4 processes commit one scope on Redis and Redis Cluster: one chain, each commit sound."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    ids = _race(url, prefix)
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await _check(backend, ids)
