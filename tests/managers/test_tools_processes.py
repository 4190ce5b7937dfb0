"""Single-flight across real processes when the lock holder's run fails (issue 16, point 6).

A holder process takes the lock and its tool blocks; a waiter process waits on that lock; then
the holder's tool raises (or its call is cancelled). The waiter must learn of it at once and
run the tool itself, not wait out `flight_timeout` (60 s here).
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import StateConfig, StateManager, ToolStateManager
from agenticstate.backends import open_backend
from tests.helpers import start_module, unique_prefix

if TYPE_CHECKING:
    import subprocess


def _line(proc: subprocess.Popen[str], timeout: float = 20) -> str:
    """The process's next line of output, or fail after `timeout` seconds without one."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the worker within {timeout} s"
    return proc.stdout.readline().strip()


def _spawn(role: str, url: str, prefix: str) -> subprocess.Popen[str]:
    return start_module("tests.managers._flight_failure_worker", role, url, prefix)


@pytest.mark.parametrize(
    "server",
    [
        pytest.param("redis_url", marks=pytest.mark.redis),
        pytest.param("redis_cluster_url", marks=pytest.mark.redis),
        pytest.param("postgres_url", marks=pytest.mark.postgres),
    ],
)
@pytest.mark.parametrize("failure", ["holder-raises", "holder-cancelled"])
def test_a_waiting_process_runs_the_tool_when_the_holder_fails(
    request: pytest.FixtureRequest, server: str, failure: str
) -> None:
    """The waiter process gets its own result at once after the holder's run raised."""
    url: str = request.getfixturevalue(server)
    prefix = unique_prefix()
    holder = _spawn(failure, url, prefix)
    waiter: subprocess.Popen[str] | None = None
    try:
        assert _line(holder) == "running"
        waiter = _spawn("waiter", url, prefix)
        assert _line(waiter) == "waiting"
        assert holder.stdin is not None
        holder.stdin.write("now\n")
        holder.stdin.flush()
        # Far below the 60 s flight_timeout: the release of the lock wakes the waiter.
        out, err = waiter.communicate(timeout=20)
        assert waiter.returncode == 0, err
        assert out.strip() == "answered by the waiter"
        out, err = holder.communicate(timeout=20)
        assert holder.returncode == 0, err
        assert out.strip() == "done"
    finally:
        for proc in (holder, waiter):
            if proc is not None:
                proc.kill()
                proc.wait()

    async def stats() -> tuple[int, int, int, int]:
        async with StateManager(StateConfig(), backend=open_backend(url, key_prefix=prefix)) as sm:
            found = await ToolStateManager(state_manager=sm).get_tool_stats("oracle")
        return (
            found.total_executions,
            found.successful_executions,
            found.failed_executions,
            found.cancelled_executions,
        )

    expected = (2, 1, 1, 0) if failure == "holder-raises" else (2, 1, 0, 1)
    assert anyio.run(stats) == expected
