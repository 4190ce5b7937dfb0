"""Workflows across real processes on Redis: cooperative pause, and resume after SIGKILL."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from agenticstate import (
    StateConfig,
    StateManager,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.managers.workflows import StepStatus
from tests.helpers import json_events as events
from tests.helpers import run_workflow_worker as run_to_end
from tests.helpers import spawn_workflow_worker as spawn
from tests.helpers import stop_process as stop
from tests.helpers import unique_prefix
from tests.helpers import wait_for_event as wait_for
from tests.integration._workflow_worker import STEPS, WORKFLOW

pytestmark = pytest.mark.redis


async def stored(url: str, prefix: str) -> Any:
    async with StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=prefix)) as sm:
        return await WorkflowStateManager(state_manager=sm).require(WORKFLOW)


async def test_second_process_pauses_and_resumes_a_runner(redis_url: str) -> None:
    """A runner doing 20 steps waits at a step boundary while another process pauses it."""
    prefix = unique_prefix()
    runner = spawn("run", redis_url, prefix)
    seen: list[dict[str, Any]] = []
    try:
        stream = events(runner)
        wait_for(stream, "holding", seen)  # 5 steps done: the runner is mid-workflow
        assert run_to_end("pause", redis_url, prefix)[-1]["event"] == "paused"
        assert runner.stdin is not None
        runner.stdin.write("go\n")
        runner.stdin.flush()
        wait_for(stream, "workflow_waiting", seen)
        paused_state = await stored(redis_url, prefix)
        assert paused_state.status is WorkflowStatus.PAUSED
        steps_before_resume = paused_state.current_step
        assert run_to_end("resume", redis_url, prefix)[-1]["event"] == "resumed"
        after_wait = next(stream)
        assert after_wait["event"] == "workflow_continuing"  # nothing ran while paused
        wait_for(stream, "completed", seen)
        assert runner.wait(timeout=60) == 0
    finally:
        stop(runner)
    final = await stored(redis_url, prefix)
    assert final.status is WorkflowStatus.COMPLETED
    assert sorted(final.steps) == list(range(1, STEPS + 1))
    assert all(step.status is StepStatus.COMPLETED for step in final.steps.values())
    assert steps_before_resume == 5


async def test_runner_killed_mid_workflow_is_resumed_by_a_new_process(redis_url: str) -> None:
    """After SIGKILL, every acknowledged step is stored and a new process finishes the job."""
    prefix = unique_prefix()
    runner = spawn("crashy", redis_url, prefix)
    seen: list[dict[str, Any]] = []
    try:
        stream = events(runner)
        for _ in range(11):
            wait_for(stream, "done", seen)
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=10)
    finally:
        stop(runner)
    acknowledged = [event["step"] for event in seen if event["event"] == "done"]
    crashed = await stored(redis_url, prefix)
    assert crashed.status is WorkflowStatus.RUNNING
    for number in acknowledged:
        assert crashed.steps[number].status is StepStatus.COMPLETED  # nothing acknowledged lost
        assert crashed.context[f"r{number}"] == number * number
    assert crashed.current_step >= max(acknowledged)

    resumed = run_to_end("continue", redis_url, prefix)
    start = next(event for event in resumed if event["event"] == "resumed_from")
    assert start["step"] % 3 == 0  # an automatic checkpoint (interval 3)
    assert start["step"] >= max(acknowledged) - 3
    assert resumed[-1]["event"] == "completed"
    final = await stored(redis_url, prefix)
    assert final.status is WorkflowStatus.COMPLETED
    assert sorted(final.steps) == list(range(1, STEPS + 1))
    assert final.context == {f"r{n}": n * n for n in range(1, STEPS + 1)}


async def test_step_updates_from_four_processes_lose_nothing(redis_url: str) -> None:
    """4 processes recording 10 different steps each at once: all 40 steps are kept."""
    prefix = unique_prefix()
    async with StateManager(
        StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
    ) as sm:
        workflows = WorkflowStateManager(state_manager=sm)
        await workflows.create(WorkflowState(workflow_id=WORKFLOW, total_steps=40))
    processes = [spawn("steps", redis_url, prefix, str(k)) for k in range(4)]
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert json.loads(out.splitlines()[-1])["event"] == "recorded"
    final = await stored(redis_url, prefix)
    assert sorted(final.steps) == list(range(1, 41))
    assert {n: s.result for n, s in final.steps.items()} == {n: n for n in range(1, 41)}
    assert final.current_step == 40
