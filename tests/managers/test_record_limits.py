"""A result that fits `max_value_size` alone but not in the record that holds it never leaves
the record running: every manager encodes the whole record before it writes.

Table: each manager call that stores a result, given one that fits alone and not with the
record's other fields. Each raises `TooLargeError` and leaves its record in its documented end
state (failed), never running or in progress. A call that is not legal in the record's state
refuses first (`InvalidTransitionError`) and changes nothing, whatever the result.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    InvalidTransitionError,
    OrchestrationStateManager,
    StateConfig,
    StateManager,
    TeamState,
    TooLargeError,
    ToolExecution,
    ToolStateManager,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.managers.workflows import StepState

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

LIMIT = 10_000
FITS_ALONE = "x" * (LIMIT - 200)
SIDE = "y" * 400  # the record's other fields: together with FITS_ALONE, over the limit


@pytest.fixture
async def small() -> AsyncIterator[StateManager]:
    state = StateManager(StateConfig(max_value_size=LIMIT))
    try:
        yield state
    finally:
        await state.aclose()


async def _complete_execution(state: StateManager) -> str:
    tools = ToolStateManager(state_manager=state)
    run = await tools.start_execution(ToolExecution(tool_name="t", parameters={"q": SIDE}))
    with pytest.raises(TooLargeError):
        await tools.complete_execution(run.execution_id, FITS_ALONE)
    execution = await tools.get_execution(run.execution_id)
    assert execution is not None
    assert execution.error == "TooLargeError at $.result"
    assert (await tools.get_tool_stats("t")).failed_executions == 1
    return execution.status.value


async def _cached_call(state: StateManager) -> str:
    tools = ToolStateManager(state_manager=state)

    async def tool() -> str:
        return FITS_ALONE

    with pytest.raises(TooLargeError):
        await tools.cached_call("t", {"q": SIDE}, tool)
    (execution,) = await tools.get_execution_history("t")
    return execution.status.value


async def _update_step(state: StateManager) -> str:
    flows = WorkflowStateManager(state_manager=state)
    await flows.create(WorkflowState(workflow_id="W", context={"doc": SIDE}))
    await flows.start("W")
    await flows.update_step("W", StepState(step_number=1, result="z" * (LIMIT // 2)))
    with pytest.raises(TooLargeError):
        await flows.update_step("W", StepState(step_number=2, result="z" * (LIMIT // 2)))
    return (await _get(flows, "W")).steps[2].status.value


async def _step_block(state: StateManager) -> str:
    flows = WorkflowStateManager(state_manager=state)
    await flows.create(WorkflowState(workflow_id="W"))
    await flows.start("W")
    await flows.update_step("W", StepState(step_number=1, result="z" * (LIMIT // 2)))
    with pytest.raises(TooLargeError):
        async with flows.step("W", 2, "second") as step:
            step.result = "z" * (LIMIT // 2)
    return (await _get(flows, "W")).steps[2].status.value


async def _workflow_complete(state: StateManager) -> str:
    flows = WorkflowStateManager(state_manager=state)
    await flows.create(WorkflowState(workflow_id="W", context={"doc": SIDE}))
    await flows.start("W")
    with pytest.raises(TooLargeError):
        await flows.complete("W", result=FITS_ALONE)
    return (await _get(flows, "W")).status.value


async def _complete_task(state: StateManager) -> str:
    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(TeamState(team_id="T"))
    await orch.enqueue_task("T", {"id": "a", "data": {"d": SIDE}, "max_retries": 0})
    claim = await orch.claim_task("T", "w")
    assert claim is not None
    with pytest.raises(TooLargeError):
        await orch.complete_task("T", "a", FITS_ALONE, lease_token=claim.lease_token)
    task = await orch.get_task("T", "a")
    assert task.error == "TooLargeError at $.result"
    return task.status.value


async def _get(flows: WorkflowStateManager, workflow_id: str) -> WorkflowState:
    found = await flows.get(workflow_id)
    assert found is not None
    return found


CASES: dict[str, tuple[Callable[[StateManager], Awaitable[str]], str]] = {
    "ToolStateManager.complete_execution": (_complete_execution, "failed"),
    "ToolStateManager.cached_call": (_cached_call, "failed"),
    "WorkflowStateManager.update_step": (_update_step, "failed"),
    "WorkflowStateManager.step": (_step_block, "failed"),
    "WorkflowStateManager.complete": (_workflow_complete, "failed"),
    "OrchestrationStateManager.complete_task": (_complete_task, "dead_letter"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_result_that_does_not_fit_its_record_fails_it(
    small: StateManager, case: str
) -> None:
    """The call raises TooLargeError and its record ends failed, never running."""
    run, end = CASES[case]
    assert await run(small) == end


async def test_an_automatic_checkpoint_that_does_not_fit_is_skipped_not_raised(
    small: StateManager, caplog: pytest.LogCaptureFixture
) -> None:
    """A step recorded completed is not raised for its automatic checkpoint (which holds the
    context twice and may not fit): the checkpoint is skipped with a warning."""
    flows = WorkflowStateManager(state_manager=small, checkpoint_interval=1)
    await flows.create(WorkflowState(workflow_id="A", context={"doc": "x" * (LIMIT * 55 // 100)}))
    await flows.start("A")
    with caplog.at_level(logging.WARNING, logger="agenticstate"):
        async with flows.step("A", 1, "first") as step:
            step.result = "ok"
    assert (await _get(flows, "A")).steps[1].status.value == "completed"
    assert await flows.list_checkpoints("A") == []
    assert [r.message for r in caplog.records if "checkpoint_skipped" in r.message]


NOT_RUNNING = [
    WorkflowStatus.PENDING,
    WorkflowStatus.PAUSED,
    WorkflowStatus.COMPLETED,
    WorkflowStatus.FAILED,
    WorkflowStatus.CANCELLED,
]


async def _into(flows: WorkflowStateManager, status: WorkflowStatus) -> None:
    await flows.create(WorkflowState(workflow_id="W"))
    moves: dict[WorkflowStatus, list[Callable[[], Awaitable[Any]]]] = {
        WorkflowStatus.PENDING: [],
        WorkflowStatus.PAUSED: [lambda: flows.start("W"), lambda: flows.pause("W")],
        WorkflowStatus.COMPLETED: [lambda: flows.start("W"), lambda: flows.complete("W")],
        WorkflowStatus.FAILED: [lambda: flows.start("W"), lambda: flows.fail("W", "e")],
        WorkflowStatus.CANCELLED: [lambda: flows.cancel("W")],
    }
    for move in moves[status]:
        await move()


@pytest.mark.parametrize("status", NOT_RUNNING, ids=lambda s: s.value)
@pytest.mark.parametrize("result", [{1, 2}, FITS_ALONE * 2], ids=["a set", "too large"])
async def test_complete_where_it_is_not_legal_refuses_whatever_the_result(
    small: StateManager, status: WorkflowStatus, result: object
) -> None:
    """complete(result=<unstorable>) on a workflow that is not running raises
    InvalidTransitionError and changes nothing (it never fails the workflow instead)."""
    flows = WorkflowStateManager(state_manager=small)
    await _into(flows, status)
    before = await flows.get("W")
    with pytest.raises(InvalidTransitionError):
        await flows.complete("W", result=result)
    assert await flows.get("W") == before
