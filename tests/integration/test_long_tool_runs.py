"""Single-flight across real processes when the tool runs longer than `flight_timeout`.

A live holder renews its lock while its tool runs, so a waiter in another process never runs the
tool beside it, however long it takes; `flight_timeout` bounds only a dead holder: one SIGKILLed
mid-run lets the waiter take over once its lock has lapsed. On Redis and on SQLite (two
processes on one database file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import StateManager, ToolStateManager
from agenticstate.backends import open_backend
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
WORKER = "tests.integration._long_flight_worker"
FLIGHT_TIMEOUT = "1.5"


def _redis(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    url: str = request.getfixturevalue("redis_url")
    return url


def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tools.db'}"


@pytest.fixture(
    params=[
        pytest.param(_redis, id="redis", marks=pytest.mark.redis),
        pytest.param(_sqlite, id="sqlite"),
    ]
)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store two processes open at once."""
    url: str = request.param(request, tmp_path)
    return url


def _spawn(role: str, url: str, prefix: str) -> LineProcess:
    return LineProcess(WORKER, role, url, prefix, FLIGHT_TIMEOUT)


def _stop(*processes: LineProcess | None) -> None:
    for process in processes:
        if process is not None:
            process.close()


async def _executions(url: str, prefix: str) -> tuple[int, int]:
    async with StateManager(backend=open_backend(url, key_prefix=prefix)) as state:
        stats = await ToolStateManager(state_manager=state).get_tool_stats("oracle")
    return stats.total_executions, stats.successful_executions


def test_a_tool_running_past_flight_timeout_runs_once(shared_url: str) -> None:
    """The holder's tool runs through three of the waiter's waits of flight_timeout (the lock
    would have lapsed twice without renewal); the waiter never runs it, and gets its result."""
    prefix = unique_prefix()
    holder = _spawn("holder", shared_url, prefix)
    waiter: LineProcess | None = None
    try:
        assert holder.wait_until(lambda lines: "running" in lines), holder.errors
        waiter = _spawn("waiter", shared_url, prefix)
        # Each "waiting" is one more flight_timeout the waiter found the lock held.
        assert waiter.wait_until(lambda lines: lines.count("waiting") >= 3 or "ran" in lines)
        assert "ran" not in waiter.lines, "the waiter ran the tool beside the live holder"
        assert holder.process.stdin is not None
        holder.process.stdin.write("finish\n")
        holder.process.stdin.flush()
        assert waiter.wait_until(lambda lines: "answered by the holder" in lines), waiter.errors
        assert holder.wait_until(lambda lines: "answered by the holder" in lines), holder.errors
        assert "ran" not in waiter.lines
    finally:
        _stop(holder, waiter)
    assert anyio.run(_executions, shared_url, prefix) == (1, 1)


def test_a_killed_holder_lets_a_waiter_run_the_tool(shared_url: str) -> None:
    """A holder SIGKILLed mid-run stops renewing: its lock lapses within flight_timeout and the
    waiting process runs the tool itself."""
    prefix = unique_prefix()
    holder = _spawn("holder", shared_url, prefix)
    waiter: LineProcess | None = None
    try:
        assert holder.wait_until(lambda lines: "running" in lines), holder.errors
        waiter = _spawn("waiter", shared_url, prefix)
        assert waiter.wait_until(lambda lines: "waiting" in lines), waiter.errors
        holder.process.kill()
        holder.process.wait()
        assert waiter.wait_until(lambda lines: "answered by the waiter" in lines), waiter.errors
        assert "ran" in waiter.lines
    finally:
        _stop(holder, waiter)
    done: Any = anyio.run(_executions, shared_url, prefix)
    assert done == (1, 1)  # the killed holder's execution never finished: only the waiter's
