"""OrchestrationStateManager on every backend: teams, the queue, claims, leases, dead letters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import anyio
import anyio.lowlevel
import pytest

from agenticstate import (
    AgentCoordinationState,
    AgentStatus,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    OrchestrationStateManager,
    StateManager,
    TaskItem,
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


async def test_agent_outside_the_team_has_no_capabilities(
    orch: OrchestrationStateManager,
) -> None:
    """A stranger never claims a task that needs a capability, with or without capability=."""
    await orch.enqueue_task("research_team", {"id": "write", "capability": "writing"})
    assert await orch.claim_task("research_team", "stranger") is None
    assert await orch.claim_task("research_team", "stranger", capability="writing") is None
    await orch.enqueue_task("research_team", {"id": "open"})
    claim = await orch.claim_task("research_team", "stranger")
    assert claim is not None
    assert claim.task_id == "open"
    assert (await orch.get_task("research_team", "write")).status is TaskStatus.PENDING


async def test_capability_argument_narrows_never_grants(orch: OrchestrationStateManager) -> None:
    """capability= passes over other capabilities' tasks and gives none the agent lacks."""
    await orch.enqueue_task("research_team", {"id": "analyse", "capability": "analysis"})
    await orch.enqueue_task("research_team", {"id": "edit", "capability": "editing"})
    await orch.enqueue_task("research_team", {"id": "research", "capability": "research"})
    assert await orch.claim_task("research_team", "researcher", capability="editing") is None
    claim = await orch.claim_task("research_team", "researcher", capability="research")
    assert claim is not None
    assert claim.task_id == "research"
    claim = await orch.claim_task("research_team", "writer")
    assert claim is not None
    assert claim.task_id == "edit"


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
    """If a pending task drops out of the index, a reaper in a new process puts it back."""
    await orch.enqueue_task("research_team", {"id": "t"})
    await orch.state.index_remove("teams:{research_team}:pending", ["t"])
    assert await orch.claim_task("research_team", "w") is None
    restarted = OrchestrationStateManager(state_manager=orch.state)
    await restarted.reap_expired("research_team")
    claim = await orch.claim_task("research_team", "w")
    assert claim is not None


async def test_indexes_are_checked_again_every_60_sync_intervals(state: StateManager) -> None:
    """The reaper checks the task records against the indexes again after 60 sync_intervals."""
    orch = OrchestrationStateManager(state_manager=state, sync_interval=0.005)  # every 0.3 s
    await orch.create_team(TeamState(team_id="t"))
    await orch.enqueue_task("t", {"id": "p"})
    await orch.enqueue_task("t", {"id": "c"})
    claim = await orch.claim_task("t", "w", lease=timedelta(milliseconds=50))
    assert claim is not None
    await orch.reap_expired("t")
    # A crash between a task's write and its index write leaves it out of the index.
    await state.index_remove("teams:{t}:pending", ["c"])
    await state.index_remove("teams:{t}:in-progress", [f"p:{claim.lease_token}"])
    await anyio.sleep(0.35)  # past the lease and the check interval: wall-clock time
    assert await orch.reap_expired("t") == ["p"]
    queue = await orch.get_queue_status("t")
    assert [t.task_id for t in queue.pending] == ["p", "c"]


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


def _index(state: StateManager, team_id: str, name: str) -> Any:
    return state.index_range(f"teams:{{{team_id}}}:{name}")


async def test_claims_index_their_lease_and_leave_no_entry_behind(
    orch: OrchestrationStateManager,
) -> None:
    """Each claim is indexed by lease expiry while held; finished tasks move to the finished
    index, and claims that lost a race leave no entry."""
    for n in range(30):
        await orch.enqueue_task("research_team", {"id": f"t{n}"})
    claim = await orch.claim_task("research_team", "w0", lease=timedelta(minutes=5))
    assert claim is not None
    held = await _index(orch.state, "research_team", "in-progress")
    assert held == [(f"t0:{claim.lease_token}", pytest.approx(claim.lease_expires_at.timestamp()))]
    await orch.complete_task("research_team", "t0", lease_token=claim.lease_token)

    async def worker(name: str) -> None:
        while (got := await orch.claim_task("research_team", name)) is not None:
            await orch.complete_task("research_team", got.task_id, lease_token=got.lease_token)

    async with anyio.create_task_group() as tg:
        for n in range(10):
            tg.start_soon(worker, f"w{n}")
    assert await _index(orch.state, "research_team", "in-progress") == []
    assert await _index(orch.state, "research_team", "pending") == []
    finished = await _index(orch.state, "research_team", "finished")
    assert sorted(task_id for task_id, _ in finished) == sorted(f"t{n}" for n in range(30))


async def test_assign_indexes_the_task_and_a_refused_assign_leaves_no_entry(
    orch: OrchestrationStateManager,
) -> None:
    """An assigned task (no lease) is listed in progress; a refused assign leaves no entry."""
    await orch.enqueue_task("research_team", {"id": "t"})
    task = await orch.assign_task("research_team", "t", "researcher")
    with pytest.raises(ConflictError):
        await orch.assign_task("research_team", "t", "writer")
    with pytest.raises(NotFoundError):
        await orch.assign_task("research_team", "missing", "writer")
    held = await _index(orch.state, "research_team", "in-progress")
    assert [member for member, _ in held] == [f"t:{task.lease_token}"]
    assert await orch.reap_expired("research_team") == []  # no lease: never expires
    queue = await orch.get_queue_status("research_team")
    assert [t.task_id for t in queue.in_progress] == ["t"]


async def test_reaper_moves_an_extended_lease_instead_of_reaping_it(
    orch: OrchestrationStateManager,
) -> None:
    """A heartbeat leaves the index alone; when the old expiry comes due, the reaper finds the
    lease extended and moves the entry to the new expiry."""
    await orch.enqueue_task("research_team", {"id": "t"})
    claim = await orch.claim_task("research_team", "w", lease=timedelta(milliseconds=50))
    assert claim is not None
    task = await orch.heartbeat("research_team", "t", claim.lease_token, lease=timedelta(minutes=5))
    assert task.lease_expires_at is not None
    await anyio.sleep(0.1)  # past the first expiry: wall-clock time
    assert await orch.reap_expired("research_team") == []
    held = await _index(orch.state, "research_team", "in-progress")
    assert held == [(f"t:{claim.lease_token}", pytest.approx(task.lease_expires_at.timestamp()))]
    done = await orch.complete_task("research_team", "t", lease_token=claim.lease_token)
    assert done.status is TaskStatus.COMPLETED


async def test_reap_and_live_queue_status_do_not_read_finished_tasks(
    orch: OrchestrationStateManager,
) -> None:
    """With 40 finished tasks, reap_expired reads no task record and get_queue_status
    without finished tasks reads only the live ones."""
    for n in range(42):
        await orch.enqueue_task("research_team", {"id": f"t{n:02d}"})
    for _ in range(40):
        claim = await orch.claim_task("research_team", "w")
        assert claim is not None
        await orch.complete_task("research_team", claim.task_id, lease_token=claim.lease_token)
    held = await orch.claim_task("research_team", "w")
    assert held is not None
    await orch.reap_expired("research_team")  # the first call checks every record once

    reads = orch.state.stats().reads
    assert await orch.reap_expired("research_team") == []
    assert orch.state.stats().reads == reads
    queue = await orch.get_queue_status("research_team", include_finished=False)
    assert orch.state.stats().reads == reads + 2
    assert ([t.task_id for t in queue.pending], [t.task_id for t in queue.in_progress]) == (
        ["t41"],
        ["t40"],
    )
    assert queue.completed == queue.dead_letter == []
    full = await orch.get_queue_status("research_team")
    assert len(full.completed) == 40


async def test_finished_tasks_expire_after_finished_task_ttl(state: StateManager) -> None:
    """Completed and dead-lettered tasks get finished_task_ttl; retried ones keep none."""
    orch = OrchestrationStateManager(
        state_manager=state, max_retries=1, finished_task_ttl=timedelta(seconds=1)
    )
    await orch.create_team(TeamState(team_id="t"))
    await orch.enqueue_task("t", {"id": "done"})
    await orch.enqueue_task("t", {"id": "flaky"})
    claim = await orch.claim_task("t", "w")
    assert claim is not None
    await orch.complete_task("t", "done", {"ok": 1}, lease_token=claim.lease_token)
    claim = await orch.claim_task("t", "w")
    assert claim is not None
    retried = await orch.fail_task("t", "flaky", "boom", lease_token=claim.lease_token)
    assert retried.status is TaskStatus.PENDING
    entry = await state.get_entry("teams:{t}:tasks:flaky")
    assert entry is not None
    assert entry.expires_at is None
    claim = await orch.claim_task("t", "w")
    assert claim is not None
    dead = await orch.fail_task("t", "flaky", "boom", lease_token=claim.lease_token)
    assert dead.status is TaskStatus.DEAD_LETTER
    for task_id in ("done", "flaky"):
        entry = await state.get_entry(f"teams:{{t}}:tasks:{task_id}")
        assert entry is not None
        assert entry.ttl is not None
        assert entry.ttl <= timedelta(milliseconds=1001)  # expiry is kept to the ms
    queue = await orch.get_queue_status("t")
    assert ([t.task_id for t in queue.completed], [t.task_id for t in queue.dead_letter]) == (
        ["done"],
        ["flaky"],
    )
    await anyio.sleep(1.1)  # wall-clock expiry (1 s: long enough for a loaded machine)
    assert await state.list_keys("teams:{t}:tasks:*") == []
    await orch.reap_expired("t")  # tidies the finished index
    assert await _index(state, "t", "finished") == []
    queue = await orch.get_queue_status("t")
    assert queue == TaskQueueState()


async def test_finished_task_ttl_is_validated(state: StateManager) -> None:
    """finished_task_ttl must be a positive timedelta or None."""
    for bad in (timedelta(0), timedelta(seconds=-1), 5):
        with pytest.raises(InvalidArgumentError):
            OrchestrationStateManager(state_manager=state, finished_task_ttl=bad)  # type: ignore[arg-type]


async def test_delete_task_in_any_status(orch: OrchestrationStateManager) -> None:
    """delete_task removes a pending, an in-progress or a finished task and its index entries;
    the holder of a deleted task is set idle and can no longer complete it."""
    for task_id in ("done", "held", "pending"):
        await orch.enqueue_task("research_team", {"id": task_id})
    done = await orch.claim_task("research_team", "writer")
    assert done is not None
    assert done.task_id == "done"
    await orch.complete_task("research_team", done.task_id, lease_token=done.lease_token)
    held = await orch.claim_task("research_team", "researcher")
    assert held is not None
    assert held.task_id == "held"

    deleted = await orch.delete_task("research_team", "held")
    assert (deleted.task_id, deleted.status) == ("held", TaskStatus.IN_PROGRESS)
    assert (await orch.get_agent("research_team", "researcher")).status is AgentStatus.IDLE
    with pytest.raises(NotFoundError):
        await orch.complete_task("research_team", "held", lease_token=held.lease_token)
    assert (await orch.delete_task("research_team", "pending")).status is TaskStatus.PENDING
    assert (await orch.delete_task("research_team", "done")).status is TaskStatus.COMPLETED
    with pytest.raises(NotFoundError):
        await orch.delete_task("research_team", "done")
    with pytest.raises(NotFoundError):
        await orch.delete_task("nope", "done")
    assert await orch.state.list_keys("teams:{research_team}:tasks:*") == []
    for name in ("pending", "in-progress", "finished"):
        assert await _index(orch.state, "research_team", name) == []
    assert await orch.claim_task("research_team", "w") is None
    assert await orch.get_queue_status("research_team") == TaskQueueState()


async def test_purge_finished_oldest_first(orch: OrchestrationStateManager) -> None:
    """purge_finished deletes completed and dead-lettered tasks (older_than: only the older
    ones) and leaves pending and in-progress tasks alone."""
    await orch.enqueue_task("research_team", {"id": "old", "max_retries": 0})
    await orch.enqueue_task("research_team", {"id": "older"})
    for expected in ("old", "older"):
        claim = await orch.claim_task("research_team", "w")
        assert claim is not None
        assert claim.task_id == expected
        if expected == "old":
            await orch.fail_task("research_team", "old", "boom", lease_token=claim.lease_token)
        else:
            await orch.complete_task("research_team", "older", lease_token=claim.lease_token)
    await anyio.sleep(0.2)  # finished times are wall-clock times
    for task_id in ("new", "held", "waiting"):
        await orch.enqueue_task("research_team", {"id": task_id})
    claim = await orch.claim_task("research_team", "w")
    assert claim is not None
    await orch.complete_task("research_team", "new", lease_token=claim.lease_token)
    assert await orch.claim_task("research_team", "w") is not None  # "held"

    assert await orch.purge_finished("research_team", older_than=timedelta(seconds=0.1)) == 2
    queue = await orch.get_queue_status("research_team")
    assert [t.task_id for t in queue.completed] == ["new"]
    assert queue.dead_letter == []
    assert await orch.purge_finished("research_team") == 1
    assert await orch.purge_finished("research_team") == 0
    queue = await orch.get_queue_status("research_team")
    assert ([t.task_id for t in queue.pending], [t.task_id for t in queue.in_progress]) == (
        ["waiting"],
        ["held"],
    )
    assert await _index(orch.state, "research_team", "finished") == []
    with pytest.raises(NotFoundError):
        await orch.purge_finished("nope")
    with pytest.raises(InvalidArgumentError):
        await orch.purge_finished("research_team", older_than=timedelta(seconds=-1))


async def test_delete_team_removes_every_record_and_index(
    orch: OrchestrationStateManager,
) -> None:
    """delete_team removes the team, its agents, tasks, sequence and indexes, and no other
    team's; the id can be used again."""
    await orch.create_team(TeamState(team_id="other"))
    await orch.enqueue_task("other", {"id": "keep"})
    for task_id in ("a", "b", "c", "d"):
        await orch.enqueue_task("research_team", {"id": task_id})
    claim = await orch.claim_task("research_team", "w")
    assert claim is not None
    await orch.complete_task("research_team", "a", lease_token=claim.lease_token)
    assert await orch.claim_task("research_team", "w") is not None
    await orch.assign_task("research_team", "c", "writer")

    # team + 2 agents + 4 tasks + sequence
    assert await orch.delete_team("research_team") == 8
    assert await orch.state.list_keys("teams:{research_team}:*") == []
    for name in ("pending", "in-progress", "finished"):
        assert await _index(orch.state, "research_team", name) == []
    assert await orch.list_teams() == ["other"]
    with pytest.raises(NotFoundError):
        await orch.get_team("research_team")
    with pytest.raises(NotFoundError):
        await orch.enqueue_task("research_team", {"id": "late"})
    with pytest.raises(NotFoundError):
        await orch.delete_team("research_team")
    assert [t.task_id for t in (await orch.get_queue_status("other")).pending] == ["keep"]

    await orch.create_team(TeamState(team_id="research_team"))
    task = await orch.enqueue_task("research_team", {"id": "a"})
    assert task.sequence == 1


async def test_delete_team_finishes_an_interrupted_deletion(
    orch: OrchestrationStateManager,
) -> None:
    """When only the team record was deleted (an interrupted delete_team), a second call
    removes the rest."""
    await orch.enqueue_task("research_team", {"id": "a"})
    await orch.state.delete("teams:{research_team}:team")
    assert await orch.delete_team("research_team") == 4  # 2 agents, 1 task, the sequence
    assert await orch.state.list_keys("teams:{research_team}:*") == []
    assert await _index(orch.state, "research_team", "pending") == []


async def test_create_team_indexes_given_tasks(state: StateManager) -> None:
    """Tasks given in progress are reaped when their lease is over; finished ones get the
    finished TTL."""
    token = uuid4().hex
    orch = OrchestrationStateManager(state_manager=state, finished_task_ttl=timedelta(hours=1))
    past = datetime.now(UTC) - timedelta(seconds=1)
    await orch.create_team(
        TeamState(
            team_id="t",
            task_queue=TaskQueueState(
                in_progress=[TaskItem(task_id="i", lease_token=token, lease_expires_at=past)],
                dead_letter=[TaskItem(task_id="d", error="boom")],
            ),
        )
    )
    entry = await state.get_entry("teams:{t}:tasks:d")
    assert entry is not None
    assert entry.expires_at is not None
    assert [member for member, _ in await _index(state, "t", "in-progress")] == [f"i:{token}"]
    assert await orch.reap_expired("t") == ["i"]
    assert await _index(state, "t", "in-progress") == []


async def test_a_new_process_restores_the_indexes_of_an_older_store(state: StateManager) -> None:
    """Tasks written without index entries (a store from before the indexes, or a crash) are
    listed and reaped again after a process's first get_queue_status or reap_expired."""
    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(TeamState(team_id="t"))
    for task_id in ("done", "held"):
        await orch.enqueue_task("t", {"id": task_id})
    claim = await orch.claim_task("t", "w")
    assert claim is not None
    await orch.complete_task("t", "done", lease_token=claim.lease_token)
    held = await orch.claim_task("t", "w", lease=timedelta(milliseconds=30))
    assert held is not None
    for name in ("in-progress", "finished"):
        members = [member for member, _ in await _index(state, "t", name)]
        await state.index_remove(f"teams:{{t}}:{name}", members)
    await anyio.sleep(0.05)  # the lease runs out: wall-clock time

    restarted = OrchestrationStateManager(state_manager=state)
    queue = await restarted.get_queue_status("t")
    assert ([t.task_id for t in queue.completed], [t.task_id for t in queue.in_progress]) == (
        ["done"],
        ["held"],
    )
    assert await restarted.reap_expired("t") == ["held"]


async def test_queue_status_counts_every_task_while_workers_churn(
    orch: OrchestrationStateManager,
) -> None:
    """Each status read while tasks move between indexes counts every task exactly once.

    A task moving between the pending, in-progress and finished indexes must never be in
    none of them for a reader (the new entry goes in before the old one goes, and pending is
    read again last).
    """
    tasks = 40
    for n in range(tasks):
        await orch.enqueue_task("research_team", {"id": f"t{n:03d}", "type": "x", "data": {}})
    done = anyio.Event()
    reads: list[int] = []

    async def worker(name: str) -> None:
        turn = 0
        while (claim := await orch.claim_task("research_team", name)) is not None:
            turn += 1
            task_id = claim.task.task_id
            if turn % 3 == 0:  # a retry (back to pending) or, after max_retries, a dead letter
                await orch.fail_task(
                    "research_team", task_id, "boom", lease_token=claim.lease_token
                )
            else:
                await orch.complete_task(
                    "research_team", task_id, {"ok": True}, lease_token=claim.lease_token
                )

    async def reader() -> None:
        while not done.is_set():
            queue = await orch.get_queue_status("research_team")
            seen = [
                task.task_id
                for group in (queue.pending, queue.in_progress, queue.completed, queue.dead_letter)
                for task in group
            ]
            assert sorted(seen) == sorted(set(seen))
            reads.append(len(seen))
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            async with anyio.create_task_group() as workers:
                for name in ("w1", "w2", "w3"):
                    workers.start_soon(worker, name)
            done.set()
    assert len(reads) >= 2
    assert set(reads) == {tasks}


async def test_single_steps_follow_changes_made_elsewhere(
    orch: OrchestrationStateManager, state: StateManager
) -> None:
    """A claim, heartbeat, completion and failure stay exact when the agent's record or the task
    changed meanwhile through another manager (the versions this one remembers are stale)."""
    other = OrchestrationStateManager(state_manager=state)
    for n in range(3):
        await orch.enqueue_task("research_team", {"id": f"t{n}", "max_retries": 0})
    claim = await orch.claim_task("research_team", "researcher")
    assert claim is not None
    # The agent's record changes elsewhere: the completion redoes its step with it.
    await other.update_agent_status("research_team", "researcher", "working", "elsewhere")
    task = await orch.heartbeat("research_team", claim.task_id, claim.lease_token)
    await orch.complete_task("research_team", task.task_id, 1, lease_token=claim.lease_token)
    agent = (await orch.get_team("research_team")).agents["researcher"]
    assert (agent.status, agent.current_task) == (AgentStatus.IDLE, None)

    # A claim made by another manager is completed here by the multi-call path.
    elsewhere = await other.claim_task("research_team", "writer")
    assert elsewhere is not None
    wrong = elsewhere.lease_token[::-1]
    with pytest.raises(ConflictError):
        await orch.complete_task("research_team", elsewhere.task_id, 1, lease_token=wrong)
    await orch.complete_task(
        "research_team", elsewhere.task_id, 2, lease_token=elsewhere.lease_token
    )

    # The remembered version goes stale (a heartbeat elsewhere): the failure still lands, and
    # one that comes after the task finished elsewhere is refused.
    last = await orch.claim_task("research_team", "researcher")
    assert last is not None
    await other.heartbeat("research_team", last.task_id, last.lease_token)
    failed = await orch.fail_task(
        "research_team", last.task_id, "boom", lease_token=last.lease_token
    )
    assert failed.status is TaskStatus.DEAD_LETTER
    with pytest.raises(ConflictError, match="is dead_letter"):
        await orch.fail_task("research_team", last.task_id, "boom", lease_token=last.lease_token)
    queue = await orch.get_queue_status("research_team")
    assert [t.task_id for t in queue.completed] == ["t0", "t1"]
    assert [t.task_id for t in queue.dead_letter] == ["t2"]
    assert queue.pending == queue.in_progress == []
    team = await orch.get_team("research_team")
    assert {a.status for a in team.agents.values()} == {AgentStatus.IDLE}


async def test_a_claim_on_a_deleted_and_enqueued_again_task_is_refused(
    orch: OrchestrationStateManager, state: StateManager
) -> None:
    """A task deleted and enqueued anew under the same id starts its versions again; a holder
    of the old claim can neither heartbeat nor complete nor fail the new one."""
    other = OrchestrationStateManager(state_manager=state)
    await orch.enqueue_task("research_team", {"id": "t"})
    old = await orch.claim_task("research_team", "w1")
    assert old is not None
    await other.delete_task("research_team", "t")
    await other.enqueue_task("research_team", {"id": "t"})
    new = await other.claim_task("research_team", "w2")
    assert new is not None
    assert new.task_id == "t"
    with pytest.raises(ConflictError):
        await orch.heartbeat("research_team", "t", old.lease_token)
    with pytest.raises(ConflictError):
        await orch.complete_task("research_team", "t", 1, lease_token=old.lease_token)
    with pytest.raises(ConflictError):
        await orch.fail_task("research_team", "t", "boom", lease_token=old.lease_token)
    task = await orch.get_task("research_team", "t")
    assert (task.status, task.assigned_to, task.lease_token) == (
        TaskStatus.IN_PROGRESS,
        "w2",
        new.lease_token,
    )
    await other.complete_task("research_team", "t", 2, lease_token=new.lease_token)
    assert (await orch.get_task("research_team", "t")).result == 2


@pytest.mark.parametrize("removal", ["purge_finished", "delete_task", "finished_task_ttl"])
async def test_a_reaped_worker_cannot_touch_a_task_enqueued_again(
    state: StateManager, removal: str
) -> None:
    """Issue #32: worker 1 claims x and stalls past its lease, the reaper puts x back, worker 2
    claims and completes it, x is removed and enqueued again, worker 3 claims it: worker 1's
    complete, heartbeat and fail with its old token are refused, worker 3's accepted."""
    ttl = timedelta(milliseconds=60) if removal == "finished_task_ttl" else None
    # One manager per worker, as in three processes: each remembers its own claims.
    w1, w2, w3, reaper = (
        OrchestrationStateManager(state_manager=state, finished_task_ttl=ttl) for _ in range(4)
    )
    await reaper.create_team(TeamState(team_id="crew"))
    await reaper.enqueue_task("crew", {"id": "x"})
    # A lease marker lived twice the lease: the stale steps below came within it.
    first = await w1.claim_task("crew", "w1", lease=timedelta(milliseconds=300))
    assert first is not None
    marker = f"teams:{{crew}}:leases:x:{first.lease_token}"  # set where there is transact
    await anyio.sleep(0.32)  # let the lease run out: wall-clock expiry
    assert await reaper.reap_expired("crew") == ["x"]
    assert not await state.exists(marker), "the reaper ends the old claim's lease marker"
    second = await w2.claim_task("crew", "w2")
    assert second is not None
    await w2.complete_task("crew", "x", {"by": "w2"}, lease_token=second.lease_token)
    if removal == "purge_finished":
        assert await reaper.purge_finished("crew") == 1
    elif removal == "delete_task":
        await reaper.delete_task("crew", "x")
    else:
        await anyio.sleep(0.1)  # let the finished task expire: wall-clock expiry
    await reaper.enqueue_task("crew", {"id": "x"})
    third = await w3.claim_task("crew", "w3")
    assert third is not None
    assert third.task.attempts == first.task.attempts  # a new life: attempts restart too
    for stale in (
        w1.complete_task("crew", "x", {"by": "w1"}, lease_token=first.lease_token),
        w1.heartbeat("crew", "x", first.lease_token),
        w1.fail_task("crew", "x", "stale", lease_token=first.lease_token),
    ):
        with pytest.raises(ConflictError):
            await stale
    held = await reaper.get_task("crew", "x")
    assert (held.status, held.assigned_to, held.lease_token) == (
        TaskStatus.IN_PROGRESS,
        "w3",
        third.lease_token,
    )
    await w3.heartbeat("crew", "x", third.lease_token)
    done = await w3.complete_task("crew", "x", {"by": "w3"}, lease_token=third.lease_token)
    assert (done.status, done.assigned_to, done.result) == (
        TaskStatus.COMPLETED,
        "w3",
        {"by": "w3"},
    )
