"""Single flight under cancellation, generated (hypothesis).

Up to six identical `cached_call`s, spread over two managers (so that some wait on the other's
lock, as in another process, and some on an in-process event), start together while the tool
blocks; any of them, the runner included, may be cancelled, in any order; then the tool
is let go. Whatever was cancelled: every caller that was not gets the one result; no execution
stays running, each run is completed or cancelled, the statistics count every run once; the
lock is gone.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import ToolExecutionStatus, ToolStateManager
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate import StateManager

PLANS = st.integers(1, 6).flatmap(
    lambda callers: st.tuples(
        st.just(callers),
        st.lists(st.integers(0, callers - 1), unique=True, max_size=callers),  # who is cancelled
    )
)


async def _run(state: StateManager, tool: str, callers: int, cancelled: list[int]) -> None:
    managers = [ToolStateManager(state_manager=state, flight_timeout=60) for _ in range(2)]
    gate = anyio.Event()
    runs = 0

    async def search() -> dict[str, int]:
        nonlocal runs
        runs += 1
        await gate.wait()
        return {"run": runs}

    results: dict[int, Any] = {}
    scopes = [anyio.CancelScope() for _ in range(callers)]

    async def call(n: int) -> None:
        with scopes[n]:
            results[n] = await managers[n % 2].cached_call(tool, {"q": 1}, search)

    with anyio.fail_after(20):  # far below flight_timeout: no waiter may wait it out
        async with anyio.create_task_group() as tg:
            for n in range(callers):
                tg.start_soon(call, n)
            await anyio.wait_all_tasks_blocked()  # one runs the tool, the others wait on it
            for n in cancelled:
                scopes[n].cancel()
                await anyio.wait_all_tasks_blocked()
            gate.set()
    survivors = sorted(set(range(callers)) - set(cancelled))
    assert sorted(results) == survivors
    assert len({repr(value) for value in results.values()}) <= 1  # one result for everybody
    history = await managers[0].get_execution_history(tool, limit=None)
    statuses = sorted(execution.status for execution in history)
    assert ToolExecutionStatus.RUNNING not in statuses
    assert statuses.count(ToolExecutionStatus.COMPLETED) == (1 if survivors else 0)
    # Every run of the tool is an execution; a caller cancelled while its execution's start
    # was being recorded adds one that never reached the tool (and ends cancelled too).
    assert runs <= len(history)
    assert statuses.count(ToolExecutionStatus.CANCELLED) == len(history) - (1 if survivors else 0)
    stats = await managers[0].get_tool_stats(tool)
    assert stats.total_executions == len(history)
    assert stats.cancelled_executions == statuses.count(ToolExecutionStatus.CANCELLED)
    assert await state.list_keys(f"tools:{{{tool}}}:flight:*") == []


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_cancelled_callers_never_strand_the_others(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Any set of cancelled callers: the others get the result, no run stays running."""
    ids = itertools.count()
    with open_state(backend_name, request, tmp_path) as (portal, state):

        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(plan=PLANS)
        def check(plan: tuple[int, list[int]]) -> None:
            callers, cancelled = plan
            portal.call(_run, state, f"tool-{next(ids)}", callers, cancelled)

        check()
