"""LocalView across processes (issue 21, point 3): SQLite, Redis and Redis Cluster.

A view converges on writes made by another process, and 4 processes, each updating one counter
through a view of its own, lose no update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from tests.helpers import LineProcess, unique_prefix
from tests.integration._view_worker import manager

if TYPE_CHECKING:
    from pathlib import Path

WORKER = "tests.integration._view_worker"


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, str]:
    """(kind, target, prefix) of a store several processes share."""
    if request.param == "sqlite":
        return ("sqlite", str(tmp_path / "state.db"), "")
    name = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return ("redis", str(request.getfixturevalue(name)), unique_prefix())


async def _lines(proc: LineProcess, wanted: str) -> None:
    """Wait (in a thread: the view must keep running) until the process printed `wanted`."""

    def seen(lines: list[str]) -> bool:
        return any(line.startswith(wanted) for line in lines)

    found = await anyio.to_thread.run_sync(proc.wait_until, seen, 120)
    assert found, proc.errors


async def test_view_converges_on_writes_from_another_process(store: tuple[str, str, str]) -> None:
    """Keys created, rewritten and deleted by another process arrive in the view."""
    async with manager(*store) as state:
        await state.save("agent:0", {"i": "old"})
        await state.save("agent:7", {"i": "old"})
        async with state.view("agent:*") as view:
            writer = LineProcess(WORKER, "write", *store, "50")
            try:
                await _lines(writer, "done")
            finally:
                writer.stop()
            expected = {f"agent:{i}" for i in range(1, 50)}
            with anyio.fail_after(30):
                await view.wait_until(lambda v: set(v.keys()) == expected and _at(v, "agent:7", 2))
            assert all(view.get(f"agent:{i}") == {"i": i} for i in range(1, 50))


def _at(view: object, key: str, version: int) -> bool:
    entry = view.entry(key)  # type: ignore[attr-defined]
    return entry is not None and bool(entry.version == version)


async def test_four_processes_each_with_a_view_lose_no_update(
    store: tuple[str, str, str],
) -> None:
    """4 processes x 150 `view.update` on one counter: exactly 600, every one a conditional
    write (the views are often stale: each conflict costs a read and a retry, never an update)."""
    procs = [LineProcess(WORKER, "count", *store, "150") for _ in range(4)]
    try:
        for proc in procs:
            await _lines(proc, "ready")
        for proc in procs:  # start them together
            assert proc.process.stdin is not None
            proc.process.stdin.write("go\n")
            proc.process.stdin.flush()
        for proc in procs:
            await _lines(proc, "done")
    finally:
        for proc in procs:
            proc.stop()
    async with manager(*store) as state:
        entry = await state.get_entry("counter:x")
        assert entry is not None
        assert (entry.value, entry.version) == (600, 600)
        async with state.view("counter:*") as view:
            assert view.get("counter:x") == 600
