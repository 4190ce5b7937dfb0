"""OrchestrationStateManager on every backend: teams, the queue, claims, leases, dead letters."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from agenticstate import (
    AgentCoordinationState,
    AgentStatus,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    OrchestrationStateManager,
    StateManager,
    TaskQueueState,
    TaskStatus,
    TeamState,
)


@pytest.fixture
async def orch(state: StateManager) -> OrchestrationStateManager:
    manager = OrchestrationStateManager(state_manager=state, sync_interval=1.0)
    await manager.create_team(
        TeamState(
            team_id="research_team",
            agents={
                "researcher": AgentCoordinationState(
                    agent_id="researcher",
                    status="idle",  # the seed passes strings
                    capabilities=["research", "analysis"],
                    current_task=None,
                ),
                "writer": AgentCoordinationState(
                    agent_id="writer",
                    status="idle",
                    capabilities=["writing", "editing"],
                    current_task=None,
                ),
            },
            task_queue=TaskQueueState(pending=[], in_progress=[], completed=[]),
        )
    )
    return manager


async def test_seed_team_and_queue_example(orch: OrchestrationStateManager) -> None:
    """The seed page's team, coordination and task queue examples, as written."""
    await orch.update_agent_status(
        team_id="research_team", agent_id="researcher", status="working", current_task="task_001"
    )
    team = await orch.get_team("research_team")
    assert {agent_id: a.status for agent_id, a in team.agents.items()} == {
        "researcher": AgentStatus.WORKING,
        "writer": AgentStatus.IDLE,
    }
    available = await orch.get_available_agents(team_id="research_team", capability="research")
    assert available == []
    await orch.update_agent_status("research_team", "researcher", "idle")
    available = await orch.get_available_agents(team_id="research_team", capability="research")
    assert [a.agent_id for a in available] == ["researcher"]

    await orch.enqueue_task(
        team_id="research_team",
        task={
            "id": "task_002",
            "type": "analysis",
            "priority": "high",
            "data": {"topic": "AI trends"},
        },
    )
    await orch.assign_task(team_id="research_team", task_id="task_002", agent_id="researcher")
    await orch.complete_task(
        team_id="research_team", task_id="task_002", result={"analysis": "..."}
    )
    queue = await orch.get_queue_status("research_team")
    assert (len(queue.pending), len(queue.in_progress), len(queue.completed)) == (0, 0, 1)
    assert queue.completed[0].result == {"analysis": "..."}
    assert (await orch.get_agent("research_team", "researcher")).status is AgentStatus.IDLE


async def test_priority_then_fifo(orch: OrchestrationStateManager) -> None:
    """Claims take high before normal before low, and the oldest first within a priority."""
    for task_id, priority in [
        ("n1", "normal"),
        ("l1", "low"),
        ("h1", "high"),
        ("n2", "normal"),
        ("h2", "high"),
    ]:
        await orch.enqueue_task("research_team", {"id": task_id, "priority": priority})
    queue = await orch.get_queue_status("research_team")
    assert [t.task_id for t in queue.pending] == ["h1", "h2", "n1", "n2", "l1"]
    claimed = []
    for _ in range(5):
        claim = await orch.claim_task("research_team", "worker-1", capability=None)
        assert claim is not None
        claimed.append(claim.task_id)
        await orch.complete_task("research_team", claim.task_id, lease_token=claim.lease_token)
    assert claimed == ["h1", "h2", "n1", "n2", "l1"]
    assert await orch.claim_task("research_team", "worker-1") is None


async def test_duplicate_task_ids_rejected(orch: OrchestrationStateManager) -> None:
    """Enqueuing a task id twice raises ConflictError and keeps the first task."""
    await orch.enqueue_task("research_team", {"id": "dup", "data": {"v": 1}})
    with pytest.raises(ConflictError):
        await orch.enqueue_task("research_team", {"id": "dup", "data": {"v": 2}})
    assert (await orch.get_task("research_team", "dup")).data == {"v": 1}


async def test_assign_is_once_only(orch: OrchestrationStateManager) -> None:
    """A second assignment of the same task raises ConflictError."""
    await orch.enqueue_task("research_team", {"id": "t"})
    await orch.assign_task("research_team", "t", "researcher")
    with pytest.raises(ConflictError):
        await orch.assign_task("research_team", "t", "writer")
    assert (await orch.get_task("research_team", "t")).assigned_to == "researcher"


async def test_concurrent_claims_take_each_task_once(orch: OrchestrationStateManager) -> None:
    """20 concurrent workers claiming 60 tasks: every task is claimed exactly once."""
    for n in range(60):
        await orch.enqueue_task("research_team", {"id": f"t{n}"})
    claimed: list[str] = []

    async def worker(name: str) -> None:
        while (claim := await orch.claim_task("research_team", name)) is not None:
            claimed.append(claim.task_id)
            await orch.complete_task("research_team", claim.task_id, lease_token=claim.lease_token)

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(worker, f"w{n}")
    assert sorted(claimed) == sorted(f"t{n}" for n in range(60))
    assert len((await orch.get_queue_status("research_team")).completed) == 60


async def test_capability_filter(orch: OrchestrationStateManager) -> None:
    """Tasks needing a capability go only to agents that have it."""
    await orch.enqueue_task("research_team", {"id": "write", "capability": "writing"})
    await orch.enqueue_task("research_team", {"id": "any"})
    claim = await orch.claim_task("research_team", "researcher")
    assert claim is not None
    assert claim.task_id == "any"
    assert await orch.claim_task("research_team", "researcher") is None
    claim = await orch.claim_task("research_team", "writer")
    assert claim is not None
    assert claim.task_id == "write"


async def test_failures_retry_then_dead_letter(orch: OrchestrationStateManager) -> None:
    """A failing task is retried max_retries times, then moves to the dead-letter list."""
    await orch.enqueue_task("research_team", {"id": "flaky", "max_retries": 2})
    for attempt in range(3):
        claim = await orch.claim_task("research_team", "researcher")
        assert claim is not None
        task = await orch.fail_task(
            "research_team", "flaky", f"boom {attempt}", lease_token=claim.lease_token
        )
    assert task.status is TaskStatus.DEAD_LETTER
    assert task.failures == 3
    queue = await orch.get_queue_status("research_team")
    assert [t.task_id for t in queue.dead_letter] == ["flaky"]
    assert queue.pending == []
    assert await orch.claim_task("research_team", "researcher") is None


async def test_expired_lease_is_reaped_and_late_completion_refused(
    orch: OrchestrationStateManager,
) -> None:
    """A lease that expires sends the task back; the old holder can no longer complete it."""
    await orch.enqueue_task("research_team", {"id": "t"})
    first = await orch.claim_task("research_team", "w1", lease=timedelta(milliseconds=50))
    assert first is not None
    assert await orch.reap_expired("research_team") == []
    await anyio.sleep(0.1)  # let the lease run out: wall-clock expiry
    assert await orch.reap_expired("research_team") == ["t"]
    second = await orch.claim_task("research_team", "w2")
    assert second is not None
    assert second.lease_token != first.lease_token
    with pytest.raises(ConflictError):
        await orch.complete_task(
            "research_team", "t", {"late": True}, lease_token=first.lease_token
        )
    with pytest.raises(ConflictError):
        await orch.heartbeat("research_team", "t", first.lease_token)
    done = await orch.complete_task("research_team", "t", {"ok": 1}, lease_token=second.lease_token)
    assert done.result == {"ok": 1}
    assert done.attempts == 2


async def test_heartbeat_extends_lease(orch: OrchestrationStateManager) -> None:
    """A heartbeat moves the lease's expiry forward, so the reaper leaves the task alone."""
    await orch.enqueue_task("research_team", {"id": "t"})
    claim = await orch.claim_task("research_team", "w1", lease=timedelta(milliseconds=200))
    assert claim is not None
    task = await orch.heartbeat("research_team", "t", claim.lease_token, lease=timedelta(minutes=5))
    assert task.lease_expires_at is not None
    assert task.lease_expires_at > claim.lease_expires_at
    assert await orch.reap_expired("research_team") == []


async def test_lost_index_entry_is_restored_by_reaper(orch: OrchestrationStateManager) -> None:
    """If a pending task drops out of the index, the reaper puts it back so it can be claimed."""
    await orch.enqueue_task("research_team", {"id": "t"})
    await orch.state.index_remove("teams:{research_team}:pending", ["t"])
    assert await orch.claim_task("research_team", "w") is None
    await orch.reap_expired("research_team")
    claim = await orch.claim_task("research_team", "w")
    assert claim is not None


async def test_agents_add_remove_and_errors(orch: OrchestrationStateManager) -> None:
    """Agents can be added and removed; unknown teams, agents and tasks raise NotFoundError."""
    await orch.add_agent(
        "research_team", AgentCoordinationState(agent_id="critic", capabilities=["review"])
    )
    with pytest.raises(ConflictError):
        await orch.add_agent("research_team", AgentCoordinationState(agent_id="critic"))
    assert [a.agent_id for a in await orch.get_available_agents("research_team", "review")] == [
        "critic"
    ]
    assert await orch.remove_agent("research_team", "critic") is True
    with pytest.raises(NotFoundError):
        await orch.update_agent_status("research_team", "critic", "idle")
    with pytest.raises(InvalidArgumentError):
        await orch.update_agent_status("research_team", "writer", "dancing")
    with pytest.raises(NotFoundError):
        await orch.get_team("nope")
    with pytest.raises(NotFoundError):
        await orch.enqueue_task("nope", {"id": "x"})
    with pytest.raises(NotFoundError):
        await orch.assign_task("research_team", "missing", "writer")
    with pytest.raises(ConflictError):
        await orch.create_team(TeamState(team_id="research_team"))
    assert await orch.list_teams() == ["research_team"]


async def test_bad_tasks_are_refused(orch: OrchestrationStateManager) -> None:
    """A task with an unknown priority or a non-dict shape raises InvalidArgumentError."""
    bad: list[Any] = [{"id": "x", "priority": "urgent"}, "just a string"]
    for task in bad:
        with pytest.raises(InvalidArgumentError):
            await orch.enqueue_task("research_team", task)
    assert (await orch.get_queue_status("research_team")).pending == []


async def test_create_team_keeps_the_status_of_given_tasks(state: StateManager) -> None:
    """Tasks passed in a TeamState's queue keep their list's status; only pending ones queue."""
    from agenticstate import TaskItem

    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(
        TeamState(
            team_id="t",
            task_queue=TaskQueueState(
                pending=[TaskItem(task_id="p")],
                in_progress=[TaskItem(task_id="i", assigned_to="a")],
                completed=[TaskItem(task_id="c", result=1)],
            ),
        )
    )
    queue = await orch.get_queue_status("t")
    assert [t.task_id for t in queue.pending] == ["p"]
    assert [t.task_id for t in queue.in_progress] == ["i"]
    assert [(t.task_id, t.result) for t in queue.completed] == [("c", 1)]
    claim = await orch.claim_task("t", "a")
    assert claim is not None
    assert claim.task_id == "p"
    assert await orch.claim_task("t", "a") is None
