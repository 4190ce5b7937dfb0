"""WorkflowStateManager on every backend: the state machine, steps, checkpoints, pause."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import (
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
    StateManager,
    StepState,
    WorkflowCancelledError,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.managers.workflows import TRANSITIONS, StepStatus

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


@pytest.fixture
def workflows(state: StateManager) -> WorkflowStateManager:
    return WorkflowStateManager(state_manager=state, checkpoint_interval=5)


async def _new(workflows: WorkflowStateManager, workflow_id: str = "wf", total: int = 10) -> None:
    await workflows.create(WorkflowState(workflow_id=workflow_id, total_steps=total))


async def test_seed_workflow_example(workflows: WorkflowStateManager) -> None:
    """The seed page's tracking example: create, update_step, get."""
    state = WorkflowState(
        workflow_id="research_pipeline",
        status=WorkflowStatus.PENDING,
        total_steps=10,
        current_step=0,
        context={},
    )
    await workflows.create(state)
    await workflows.update_step(
        workflow_id="research_pipeline",
        step=StepState(
            step_number=1,
            name="data_collection",
            status="completed",  # the seed passes a plain string; pydantic coerces it
            result={"documents": 150},
            duration_ms=5400,
        ),
    )
    current = await workflows.get("research_pipeline")
    assert current is not None
    assert (current.current_step, current.total_steps) == (1, 10)
    assert current.status is WorkflowStatus.RUNNING
    assert current.steps[1].result == {"documents": 150}
    assert current.steps[1].status is StepStatus.COMPLETED


async def test_create_twice_conflicts(workflows: WorkflowStateManager) -> None:
    """A second create with the same id raises ConflictError."""
    await _new(workflows)
    with pytest.raises(ConflictError):
        await _new(workflows)


async def test_every_illegal_move_raises_and_changes_nothing(
    workflows: WorkflowStateManager,
) -> None:
    """For each status, every move outside TRANSITIONS raises and leaves the record as it was."""
    moves = {
        WorkflowStatus.RUNNING: workflows.start,
        WorkflowStatus.PAUSED: workflows.pause,
        WorkflowStatus.CANCELLED: workflows.cancel,
        WorkflowStatus.COMPLETED: workflows.complete,
    }
    paths: dict[WorkflowStatus, list[Callable[[str], Awaitable[WorkflowState]]]] = {
        WorkflowStatus.PENDING: [],
        WorkflowStatus.RUNNING: [workflows.start],
        WorkflowStatus.PAUSED: [workflows.pause],
        WorkflowStatus.COMPLETED: [workflows.start, workflows.complete],
        WorkflowStatus.CANCELLED: [workflows.cancel],
    }
    for status, path in paths.items():
        workflow_id = f"wf-{status.value}"
        await _new(workflows, workflow_id)
        for step in path:
            await step(workflow_id)
        assert await workflows.get_status(workflow_id) is status
        for target, move in moves.items():
            if target in TRANSITIONS[status] or (status, target) == (
                WorkflowStatus.PENDING,
                WorkflowStatus.RUNNING,
            ):
                continue
            before = await workflows.state.get_entry(workflows._key(workflow_id))
            with pytest.raises(InvalidTransitionError):
                await move(workflow_id)
            after = await workflows.state.get_entry(workflows._key(workflow_id))
            assert before is not None
            assert after is not None
            assert (after.version, after.value) == (before.version, before.value)


async def test_resume_only_from_paused(workflows: WorkflowStateManager) -> None:
    """resume() of a workflow that is not paused is an illegal move."""
    await _new(workflows)
    with pytest.raises(InvalidTransitionError):
        await workflows.resume("wf")
    await workflows.pause("wf")
    assert (await workflows.resume("wf")).status is WorkflowStatus.RUNNING


async def test_seed_pause_resume_cancel(workflows: WorkflowStateManager) -> None:
    """The seed page's pause/resume/cancel example."""
    await _new(workflows, "research_pipeline")
    await workflows.start("research_pipeline")
    await workflows.pause("research_pipeline")
    status = await workflows.get_status("research_pipeline")
    assert status is WorkflowStatus.PAUSED
    await workflows.resume("research_pipeline")
    await workflows.cancel(workflow_id="research_pipeline", reason="User requested cancellation")
    cancelled = await workflows.get("research_pipeline")
    assert cancelled is not None
    assert cancelled.status is WorkflowStatus.CANCELLED
    assert cancelled.cancel_reason == "User requested cancellation"
    assert cancelled.finished_at is not None


async def test_unknown_workflow_raises_not_found(workflows: WorkflowStateManager) -> None:
    """Calls on an unknown id raise NotFoundError; get returns None."""
    assert await workflows.get("nope") is None
    for call in (workflows.get_status, workflows.pause, workflows.resume, workflows.start):
        with pytest.raises(NotFoundError):
            await call("nope")
    with pytest.raises(NotFoundError):
        await workflows.update_step("nope", StepState(step_number=1))


async def test_current_step_only_advances(workflows: WorkflowStateManager) -> None:
    """Running and failed steps do not advance current_step; it never goes backwards."""
    await _new(workflows)
    await workflows.update_step("wf", StepState(step_number=3, status=StepStatus.COMPLETED))
    await workflows.update_step("wf", StepState(step_number=4, status=StepStatus.RUNNING))
    await workflows.update_step("wf", StepState(step_number=2, status=StepStatus.COMPLETED))
    await workflows.update_step("wf", StepState(step_number=4, status=StepStatus.FAILED))
    state = await workflows.require("wf")
    assert state.current_step == 3
    assert sorted(state.steps) == [2, 3, 4]


async def test_steps_refused_once_finished(workflows: WorkflowStateManager) -> None:
    """No steps after completion; after cancellation the runner gets WorkflowCancelledError."""
    await _new(workflows, "done")
    await workflows.start("done")
    await workflows.complete("done", result={"ok": True})
    with pytest.raises(InvalidTransitionError):
        await workflows.update_step("done", StepState(step_number=1))
    await _new(workflows, "stopped")
    await workflows.cancel("stopped", reason="because")
    with pytest.raises(WorkflowCancelledError) as caught:
        await workflows.update_step("stopped", StepState(step_number=1))
    assert caught.value.reason == "because"


async def test_automatic_checkpoints_every_interval(workflows: WorkflowStateManager) -> None:
    """update_step writes a checkpoint every checkpoint_interval completed steps."""
    await _new(workflows, total=12)
    for number in range(1, 13):
        await workflows.update_step("wf", StepState(step_number=number, name=f"s{number}"))
    checkpoints = await workflows.list_checkpoints("wf")
    assert [c.checkpoint_id for c in checkpoints] == ["auto-step-10", "auto-step-5"]
    assert all(c.automatic for c in checkpoints)
    assert checkpoints[0].state["current_step"] == 10


async def test_seed_checkpoint_and_resume_from(workflows: WorkflowStateManager) -> None:
    """The seed page's checkpoint example, then resume_from restores step and context."""
    await _new(workflows, "research_pipeline")
    for number in range(1, 6):
        await workflows.update_step("research_pipeline", StepState(step_number=number))
    current_state = await workflows.get("research_pipeline")
    workflow_context = {"topic": "AI", "found": 5}
    checkpoint = WorkflowCheckpoint(
        workflow_id="research_pipeline",
        checkpoint_id="step_5_complete",
        step=5,
        state=current_state,
        context=workflow_context,
        timestamp=datetime.now(),  # noqa: DTZ005  # the seed page's own call
    )
    await workflows.checkpoint(checkpoint)
    checkpoints = await workflows.list_checkpoints("research_pipeline")
    assert "step_5_complete" in [c.checkpoint_id for c in checkpoints]
    for number in range(6, 9):
        await workflows.update_step("research_pipeline", StepState(step_number=number))
    await workflows.fail("research_pipeline", "crashed at 8")
    resumed = await workflows.resume_from(
        workflow_id="research_pipeline", checkpoint_id="step_5_complete"
    )
    assert resumed.current_step == 5
    assert resumed.context == workflow_context
    assert sorted(resumed.steps) == [1, 2, 3, 4, 5]
    assert resumed.status is WorkflowStatus.RUNNING
    with pytest.raises(NotFoundError):
        await workflows.resume_from("research_pipeline", "missing")


async def test_step_context_manager_records_outcomes(workflows: WorkflowStateManager) -> None:
    """step() records running then completed with result and duration, or failed."""
    await _new(workflows)
    async with workflows.step("wf", 1, "collect") as step:
        step.result = {"docs": 3}
        step.context_update = {"docs": 3}
    with pytest.raises(RuntimeError):
        async with workflows.step("wf", 2, "analyze"):
            raise RuntimeError("model down")
    state = await workflows.require("wf")
    assert state.steps[1].status is StepStatus.COMPLETED
    assert state.steps[1].result == {"docs": 3}
    assert state.steps[1].duration_ms is not None
    assert state.context == {"docs": 3}
    assert state.steps[2].status is StepStatus.FAILED
    assert state.steps[2].error == "RuntimeError"
    assert state.current_step == 1


async def test_wait_if_paused_waits_for_resume(workflows: WorkflowStateManager) -> None:
    """A runner blocked by a pause continues when another task resumes the workflow."""
    await _new(workflows)
    await workflows.start("wf")
    await workflows.pause("wf")
    resumed: list[WorkflowStatus] = []

    async def runner() -> None:
        state = await workflows.wait_if_paused("wf")
        resumed.append(state.status)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            await anyio.wait_all_tasks_blocked()
            assert resumed == []
            await workflows.resume("wf")
    assert resumed == [WorkflowStatus.RUNNING]


async def test_cancel_while_paused_raises_in_runner(workflows: WorkflowStateManager) -> None:
    """A paused runner gets WorkflowCancelledError when the workflow is cancelled."""
    await _new(workflows)
    await workflows.pause("wf")
    errors: list[BaseException] = []

    async def runner() -> None:
        try:
            async with workflows.step("wf", 1):
                pass
        except WorkflowCancelledError as exc:
            errors.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            await anyio.wait_all_tasks_blocked()
            await workflows.cancel("wf", reason="stop")
    assert len(errors) == 1
    assert (await workflows.require("wf")).steps == {}


async def test_concurrent_step_updates_lose_nothing(workflows: WorkflowStateManager) -> None:
    """Many tasks recording different steps at once: every step is kept."""
    await _new(workflows, total=40)

    async def record(number: int) -> None:
        await workflows.update_step("wf", StepState(step_number=number, name=str(number)))

    async with anyio.create_task_group() as tg:
        for number in range(1, 41):
            tg.start_soon(record, number)
    state = await workflows.require("wf")
    assert sorted(state.steps) == list(range(1, 41))
    assert state.current_step == 40


async def test_bad_arguments(workflows: WorkflowStateManager, state: StateManager) -> None:
    """Wrong types and bad ids raise InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError):
        await workflows.create({"workflow_id": "x"})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await workflows.create(WorkflowState(workflow_id="a{b}"))
    with pytest.raises(InvalidArgumentError):
        WorkflowStateManager(state_manager=state, checkpoint_interval=-1)


async def test_list_and_delete(workflows: WorkflowStateManager) -> None:
    """list_workflows returns every workflow; delete removes it and its checkpoints."""
    for workflow_id in ("b", "a"):
        await _new(workflows, workflow_id)
    for number in range(1, 6):
        await workflows.update_step("a", StepState(step_number=number))
    assert [w.workflow_id for w in await workflows.list_workflows()] == ["a", "b"]
    assert await workflows.delete("a") is True
    assert await workflows.list_checkpoints("a") == []
    keys: list[Any] = await workflows.state.list_keys("workflows:*")
    assert keys == ["workflows:{b}:state"]


async def _run_steps(workflows: WorkflowStateManager, first: int, last: int, line: str) -> None:
    for number in range(first, last + 1):
        async with workflows.step("wf", number, f"s{number}") as step:
            step.result = {"n": number, "line": line}
            step.context_update = {"last": number, "line": line}


async def test_resume_latest_after_rewind_stays_on_the_live_line(
    workflows: WorkflowStateManager,
) -> None:
    """After a rewind to step 5, "latest" is that checkpoint, not the abandoned step 10 one."""
    await _new(workflows)
    await _run_steps(workflows, 1, 10, "first")
    await workflows.fail("wf", "boom")
    await workflows.resume_from("wf", "auto-step-5")
    assert [c.checkpoint_id for c in await workflows.list_checkpoints("wf")] == ["auto-step-5"]
    await _run_steps(workflows, 6, 6, "second")
    await workflows.fail("wf", "boom again")
    resumed = await workflows.resume_from("wf")
    assert resumed.current_step == 5
    assert resumed.context == {"last": 5, "line": "first"}
    assert sorted(resumed.steps) == [1, 2, 3, 4, 5]
    with pytest.raises(NotFoundError):
        await workflows.resume_from("wf", "auto-step-10")  # retired with the abandoned line
    await _run_steps(workflows, 6, 10, "third")
    state = await workflows.require("wf")
    assert state.current_step == 10
    assert state.context == {"last": 10, "line": "third"}
    latest = await workflows.get_latest_checkpoint("wf")
    assert latest is not None
    assert (latest.checkpoint_id, latest.context["line"]) == ("auto-step-10", "third")


async def test_rewind_retires_a_later_checkpoint_of_the_same_step(
    workflows: WorkflowStateManager,
) -> None:
    """Two checkpoints at one step: rewinding to the earlier retires the later one."""
    await _new(workflows)
    await _run_steps(workflows, 1, 5, "first")
    await workflows.update_context("wf", {"note": "after the checkpoint"})
    await workflows.checkpoint(
        WorkflowCheckpoint(
            workflow_id="wf", checkpoint_id="manual", step=5, context={"note": "late"}
        )
    )
    assert (await workflows.get_latest_checkpoint("wf")).checkpoint_id == "manual"  # type: ignore[union-attr]
    resumed = await workflows.resume_from("wf", "auto-step-5")
    assert resumed.context == {"last": 5, "line": "first"}
    assert await workflows.get_checkpoint("wf", "manual") is None


async def test_cancel_ends_a_step_in_flight(workflows: WorkflowStateManager) -> None:
    """A step running when the workflow is cancelled ends cancelled; its result is refused."""
    await _new(workflows)

    async def run() -> None:
        async with workflows.step("wf", 1, "slow") as step:
            await workflows.cancel("wf", reason="stop")
            step.result = {"late": True}

    with pytest.raises(WorkflowCancelledError):
        await run()
    state = await workflows.require("wf")
    assert state.status is WorkflowStatus.CANCELLED
    assert state.steps[1].status is StepStatus.CANCELLED
    assert state.steps[1].result is None
    assert state.steps[1].completed_at is not None
    assert state.current_step == 0


async def test_cancel_ends_a_failing_step_in_flight(workflows: WorkflowStateManager) -> None:
    """A step that raises after the cancel stays cancelled (not running, not failed)."""
    await _new(workflows)

    async def run() -> None:
        async with workflows.step("wf", 1, "slow"):
            await workflows.cancel("wf")
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        await run()
    assert (await workflows.require("wf")).steps[1].status is StepStatus.CANCELLED


@pytest.mark.parametrize("stop", ["complete", "fail"])
async def test_complete_or_fail_ends_a_step_in_flight(
    workflows: WorkflowStateManager, stop: str
) -> None:
    """Completing or failing the workflow under a running step ends that step cancelled."""
    await _new(workflows)

    async def run() -> None:
        async with workflows.step("wf", 1, "slow"):
            if stop == "complete":
                await workflows.complete("wf")
            else:
                await workflows.fail("wf", "stopped elsewhere")

    with pytest.raises(InvalidTransitionError):
        await run()
    state = await workflows.require("wf")
    assert state.steps[1].status is StepStatus.CANCELLED
    assert not [s for s in state.steps.values() if s.status is StepStatus.RUNNING]


async def test_a_step_a_rewind_dropped_cannot_skip_steps(workflows: WorkflowStateManager) -> None:
    """A step running when the workflow is rewound is refused: current_step stays rewound."""
    await _new(workflows)
    await _run_steps(workflows, 1, 7, "first")

    async def run() -> None:
        async with workflows.step("wf", 8, "slow") as step:
            await workflows.resume_from("wf", "auto-step-5")  # from another task or process
            step.result = {"late": True}
            step.context_update = {"line": "abandoned"}

    with pytest.raises(InvalidTransitionError, match="rewind"):
        await run()
    state = await workflows.require("wf")
    assert state.current_step == 5
    assert sorted(state.steps) == [1, 2, 3, 4, 5]
    assert state.context == {"last": 5, "line": "first"}


async def test_a_cancelled_runner_leaves_no_step_running(workflows: WorkflowStateManager) -> None:
    """The runner's own task cancelled mid-step: the step ends failed, never stays running."""
    await _new(workflows)
    inside = anyio.Event()

    async def runner() -> None:
        async with workflows.step("wf", 1, "slow"):
            inside.set()
            await anyio.sleep_forever()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            await inside.wait()
            tg.cancel_scope.cancel()
    step = (await workflows.require("wf")).steps[1]
    assert step.status is StepStatus.FAILED
    assert step.error is not None
    assert "Cancel" in step.error
