"""The task queue's inputs and outputs: a worker's claim is its own, a refused team leaves nothing.

- What `claim_task`, `complete_task`, `fail_task`, `heartbeat` and `enqueue_task` hand back is
  the caller's: changing it (a worker consuming its input) never changes what the queue writes
  next, on the single-step path (this process remembers the record) or the multi-call one.
- `create_team` checks everything before it writes: a team refused for its input leaves no key,
  and the corrected call goes through.
- A wrongly typed `error` or `current_task` is refused and the queue stays readable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    AgentCoordinationState,
    ConflictError,
    InvalidArgumentError,
    OrchestrationStateManager,
    TeamState,
)
from agenticstate.managers.orchestration import TaskItem, TaskQueueState

if TYPE_CHECKING:
    from agenticstate import StateManager


@pytest.fixture
async def orch(state: StateManager) -> OrchestrationStateManager:
    manager = OrchestrationStateManager(state_manager=state)
    await manager.create_team(TeamState(team_id="T"))
    return manager


async def test_a_claims_data_is_the_workers_own(orch: OrchestrationStateManager) -> None:
    """A worker that changes its claim's data (pops its input) and fails the task leaves the
    stored task as enqueued: the next worker gets the whole input."""
    given: dict[str, Any] = {"payload": ["the input"], "n": 1}
    await orch.enqueue_task("T", {"id": "a", "data": given})
    given["payload"].append("changed after enqueue")  # the caller's dict, not the queue's
    claim = await orch.claim_task("T", "w1")
    assert claim is not None
    claim.task.data.pop("payload")
    claim.task.data["n"] = 999
    beat = await orch.heartbeat("T", "a", claim.lease_token)
    beat.data["n"] = 1000
    failed = await orch.fail_task("T", "a", "transient", lease_token=claim.lease_token)
    failed.data.clear()
    again = await orch.claim_task("T", "w2")
    assert again is not None
    assert again.task.data == {"payload": ["the input"], "n": 1}
    again.task.data["result"] = "mine"
    done = await orch.complete_task("T", "a", {"ok": [1]}, lease_token=again.lease_token)
    done.result["ok"].append(2)
    stored = await orch.get_task("T", "a")
    assert stored.data == {"payload": ["the input"], "n": 1}
    assert stored.result == {"ok": [1]}


async def test_a_claim_in_another_manager_is_isolated_too(state: StateManager) -> None:
    """The multi-call path (a manager that does not know the record) writes what it read."""
    first = OrchestrationStateManager(state_manager=state)
    await first.create_team(TeamState(team_id="T"))
    await first.enqueue_task("T", {"id": "a", "data": {"payload": "x"}})
    claim = await first.claim_task("T", "w1")
    assert claim is not None
    claim.task.data.pop("payload")
    other = OrchestrationStateManager(state_manager=state)  # another process
    await other.fail_task("T", "a", "e", lease_token=claim.lease_token)
    again = await first.claim_task("T", "w2")
    assert again is not None
    assert again.task.data == {"payload": "x"}


BAD_TEAMS = {
    "agent key differs": TeamState(team_id="A", agents={"a": AgentCoordinationState(agent_id="b")}),
    "two tasks, one id": TeamState(
        team_id="B",
        task_queue=TaskQueueState(pending=[TaskItem(task_id="t"), TaskItem(task_id="t")]),
    ),
    "the same id pending and finished": TeamState(
        team_id="C",
        task_queue=TaskQueueState(
            pending=[TaskItem(task_id="t")], completed=[TaskItem(task_id="t")]
        ),
    ),
    "a brace in a task id": TeamState(
        team_id="D",
        task_queue=TaskQueueState(pending=[TaskItem(task_id="ok"), TaskItem(task_id="b}")]),
    ),
    "a brace in an agent id": TeamState(
        team_id="E", agents={"x}": AgentCoordinationState(agent_id="x}")}
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TEAMS))
async def test_create_team_refuses_bad_input_before_writing(state: StateManager, case: str) -> None:
    """A team refused for its input (InvalidArgumentError) leaves no key, so the corrected
    create_team goes through."""
    orch = OrchestrationStateManager(state_manager=state)
    team = BAD_TEAMS[case]
    with pytest.raises(InvalidArgumentError):
        await orch.create_team(team)
    assert await state.list_keys(f"teams:{{{team.team_id}}}:*") == []
    assert team.team_id not in await orch.list_teams()
    created = await orch.create_team(TeamState(team_id=team.team_id))
    assert created.team_id == team.team_id


async def test_a_wrongly_typed_failure_is_refused_and_the_queue_stays_readable(
    orch: OrchestrationStateManager,
) -> None:
    """fail_task(error=42) and update_agent_status(current_task=7) raise InvalidArgumentError,
    write nothing, and every worker can still claim."""
    await orch.add_agent("T", AgentCoordinationState(agent_id="ag"))
    await orch.enqueue_task("T", {"id": "a"})
    await orch.enqueue_task("T", {"id": "b"})
    claim = await orch.claim_task("T", "w1")
    assert claim is not None
    with pytest.raises(InvalidArgumentError):
        await orch.fail_task("T", "a", 42, lease_token=claim.lease_token)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await orch.update_agent_status("T", "ag", "working", 7)  # type: ignore[arg-type]
    assert (await orch.get_task("T", "a")).status.value == "in_progress"
    other = await orch.claim_task("T", "w2")
    assert other is not None
    assert other.task_id == "b"
    assert len((await orch.get_queue_status("T")).in_progress) == 2
    assert (await orch.get_team("T")).agents["ag"].current_task is None
    await orch.fail_task("T", "a", "a str", lease_token=claim.lease_token)


def test_max_retries_is_checked_when_set() -> None:
    """The max_retries setter refuses what the constructor refuses."""
    orch = OrchestrationStateManager()
    for bad in (-1, True, 1.5, "3", None):
        with pytest.raises(InvalidArgumentError):
            orch.max_retries = bad  # type: ignore[assignment]
    orch.max_retries = 0
    assert orch.max_retries == 0


async def test_a_duplicate_task_id_in_a_later_enqueue_is_still_a_conflict(
    orch: OrchestrationStateManager,
) -> None:
    """Enqueueing an id the team holds is a ConflictError (a stored task, not bad input)."""
    await orch.enqueue_task("T", {"id": "a"})
    with pytest.raises(ConflictError):
        await orch.enqueue_task("T", {"id": "a"})
