"""A task deleted and enqueued again under its id is a new task: removing the old one never
touches it.

Each test sweeps every storage call of a removing call (`_interleave.at_call`): just before it,
another process deletes the finished task and enqueues a new one under the same id. The new task
stays pending and the next claim gets it, whatever point the other process came in at.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import NotFoundError, OrchestrationStateManager, TeamState
from tests.managers._interleave import at_call, points

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager

REMOVERS: dict[str, Callable[[OrchestrationStateManager, str], Awaitable[Any]]] = {
    "purge_finished": lambda orch, team: orch.purge_finished(team),
    "purge_finished(older_than=0)": lambda orch, team: orch.purge_finished(
        team, older_than=timedelta(0)
    ),
}


async def _finished(orch: OrchestrationStateManager, team: str) -> None:
    """A team whose tasks `job` and `other` are completed."""
    await orch.create_team(TeamState(team_id=team))
    for task_id in ("job", "other"):
        await orch.enqueue_task(team, {"id": task_id, "data": {"life": 1}})
        claim = await orch.claim_task(team, "w1")
        assert claim is not None
        await orch.complete_task(team, claim.task_id, {"ok": 1}, lease_token=claim.lease_token)


@pytest.mark.parametrize("remover", sorted(REMOVERS))
async def test_removing_finished_tasks_never_removes_a_new_life(
    state: StateManager, remover: str
) -> None:
    """At every storage call of the remover, a delete and re-enqueue of `job` in between leaves
    the new `job` pending, claimable with its own data."""
    victim = REMOVERS[remover]
    orch = OrchestrationStateManager(state_manager=state)
    other = OrchestrationStateManager(state_manager=state)  # another process
    await _finished(orch, "probe")
    total = await points(state, lambda: victim(orch, "probe"))
    assert total > 1
    problems: list[str] = []
    for at in range(total):
        team = f"t{at}"
        await _finished(orch, team)

        async def again(team: str = team) -> None:
            with contextlib.suppress(NotFoundError):  # purged already
                await other.delete_task(team, "job")
            await other.enqueue_task(team, {"id": "job", "data": {"life": 2}})

        _, outcome = await at_call(state, functools.partial(victim, orch, team), at, again)
        if isinstance(outcome, Exception):
            problems.append(f"at call {at}: raised {outcome!r}")
            continue
        claim = await other.claim_task(team, "w2")
        if claim is None or claim.task.data != {"life": 2}:
            problems.append(f"at call {at}: the new job was not claimable ({claim})")
    assert problems == []
