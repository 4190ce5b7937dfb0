"""Single-flight across real processes on Redis: 4 processes x 25 identical calls, one run."""

from __future__ import annotations

import anyio
import pytest

from agenticstate import StateConfig, StateManager, ToolStateManager, ToolStats
from tests.helpers import start_module, unique_prefix

pytestmark = pytest.mark.redis


def _race(url: str, prefix: str, *args: str, timeout: float) -> int:
    """Start 4 flight workers, let them go at once, and return how often the tool ran in all."""
    procs = [start_module("tests.integration._flight_worker", url, prefix, *args) for _ in range(4)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:  # start them all at once
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        runs = 0
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err
            runs += int(out.strip().split()[-1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return runs


async def test_identical_calls_from_four_processes_run_the_tool_once(redis_url: str) -> None:
    """100 identical cached_calls spread over 4 processes run the tool exactly once."""
    prefix = unique_prefix()
    assert _race(redis_url, prefix, "25", timeout=60) == 1
    async with StateManager(
        StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
    ) as sm:
        stats = await ToolStateManager(state_manager=sm).get_tool_stats("oracle")
    assert stats.total_executions == 1
    assert (stats.cache_misses, stats.cache_hits) == (1, 99)


@pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url"])
def test_cache_hits_from_four_processes_are_counted_exactly(
    request: pytest.FixtureRequest, server: str
) -> None:
    """4 processes x (25 identical calls, then 200 hits from 10 tasks each): every hit counted
    (each hit is one atomic step reading the entry and counting it, from any process)."""
    url: str = request.getfixturevalue(server)
    prefix = unique_prefix()
    assert _race(url, prefix, "25", "200", timeout=120) == 1

    async def stats() -> ToolStats:
        config = StateConfig(backend="redis", redis_url=url, key_prefix=prefix)
        async with StateManager(config) as sm:
            return await ToolStateManager(state_manager=sm).get_tool_stats("oracle")

    found = anyio.run(stats)
    assert found.total_executions == 1
    assert (found.cache_misses, found.cache_hits) == (1, 99 + 4 * 200)
