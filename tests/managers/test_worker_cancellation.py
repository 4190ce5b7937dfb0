"""A cancelled worker never leaves a task in progress with no holder, wherever it is cancelled.

A cancellation that landed while `claim_task` was awaiting the store (SQLite's worker thread, a
Redis round trip) used to lose the claim: the store committed it, `run_worker` never saw it,
and the task stayed in progress, held by nobody, until its lease ran out (41-51 of 150-200
random cancels). The same can happen to any store call of the loop: the claim, a heartbeat,
the completion or failure, the give-back. So the sweep cancels a worker at every point of one
task's round, one loop iteration later each time, on every backend, with a handler that
returns and one that raises; a seeded run of random cancels in real time adds the cancels
that land inside a store call's thread or round trip.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest

from agenticstate import OrchestrationStateManager, TaskItem, TaskStatus, TeamState

if TYPE_CHECKING:
    from agenticstate import StateManager

TEAM = "crew"
LEASE = timedelta(seconds=60)  # far longer than the test: only a give-back frees a task
SWEEP_LIMIT = 5000  # loop iterations; a round of one task takes far fewer on every backend


async def _stranded(orch: OrchestrationStateManager, state: StateManager) -> list[str]:
    """Tasks in progress (by record or by index): with no worker running, nobody holds them."""
    queue = await orch.get_queue_status(TEAM)
    index = [member for member, _ in await state.index_range(f"teams:{{{TEAM}}}:in-progress")]
    return [task.task_id for task in queue.in_progress] + index


async def _cancel_after(iterations: int, scope: anyio.CancelScope) -> None:
    for _ in range(iterations):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def _handler_returns(task: TaskItem) -> str:
    await anyio.lowlevel.checkpoint()
    return "done"


async def _handler_raises(task: TaskItem) -> None:
    await anyio.lowlevel.checkpoint()
    raise RuntimeError("fails")


@pytest.mark.slow
@pytest.mark.parametrize("handler", [_handler_returns, _handler_raises], ids=["returns", "raises"])
async def test_a_worker_cancelled_at_any_point_leaves_no_task_in_progress(
    state: StateManager, handler: object
) -> None:
    """Cancel a one-task worker after 0, 1, 2, ... loop iterations, until one round runs out
    uncancelled: after each cancel the task is pending, completed or failed, never in progress."""
    orch = OrchestrationStateManager(state_manager=state, sync_interval=0.05)
    await orch.create_team(TeamState(team_id=TEAM))
    outcomes: set[str] = set()
    for iterations in range(SWEEP_LIMIT):
        task = await orch.enqueue_task(TEAM, {"id": f"t{iterations}", "max_retries": 5})
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_after, iterations, scope)
                    await orch.run_worker(TEAM, "w", handler, lease=LEASE, max_tasks=1)  # type: ignore[arg-type]
                tg.cancel_scope.cancel()
        assert await _stranded(orch, state) == [], f"cancelled after {iterations} iterations"
        after = await orch.delete_task(TEAM, task.task_id)  # the next round's is alone
        outcomes.add(
            "finished" if after.status is TaskStatus.COMPLETED or after.failures else "not"
        )
        if not scope.cancel_called:
            break  # one whole round ran before the cancel: every point was swept
    else:
        pytest.fail(f"a round took more than {SWEEP_LIMIT} loop iterations")
    # The sweep reached both ends: cancels before the outcome was recorded, and after.
    assert outcomes == {"finished", "not"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, 11])
async def test_random_cancels_of_a_worker_leave_no_task_in_progress(
    state: StateManager, seed: int
) -> None:
    """Seeded random cancels in real time (60 per seed) land inside store calls too (a thread,
    a round trip): none leaves a task in progress."""
    rng = random.Random(seed)
    orch = OrchestrationStateManager(state_manager=state, sync_interval=0.05)
    await orch.create_team(TeamState(team_id=TEAM))
    for i in range(60):
        await orch.enqueue_task(TEAM, {"id": f"t{i}"})

    async def handler(task: TaskItem) -> str:
        await anyio.sleep(rng.uniform(0, 0.005))
        return "done"

    for round_ in range(60):
        with anyio.move_on_after(rng.uniform(0, 0.02)):
            await orch.run_worker(TEAM, "w", handler, lease=LEASE)
        assert await _stranded(orch, state) == [], f"round {round_}"
