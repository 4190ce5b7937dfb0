"""A separate process for the workflow tests: `python -m tests.integration._workflow_worker MODE`.

Modes:
    run       create the workflow and run 20 steps, honouring pause/resume (prints JSON events);
              after step 5 it holds until a line arrives on stdin
    pause     pause the workflow and exit
    resume    resume the workflow and exit
    crashy    create and run 20 steps, printing "done N" after each acknowledged step
    continue  resume_from the latest checkpoint and run the remaining steps
    steps     record steps K*10+1 .. K*10+10 of an existing workflow (K is the 4th argument)
"""

from __future__ import annotations

import json
import logging
import sys

import anyio
import structlog

from agenticstate import (
    StateConfig,
    StateManager,
    StepState,
    WorkflowState,
    WorkflowStateManager,
)

WORKFLOW = "proc-pipeline"
STEPS = 20


def emit(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def manager(url: str, prefix: str) -> WorkflowStateManager:
    if url.startswith("sqlite://"):  # the same roles on one SQLite file (test_sqlite_processes)
        config = StateConfig(backend="sqlite", sqlite_path=url.removeprefix("sqlite://"))
        state = StateManager(config.model_copy(update={"key_prefix": prefix}))
    else:
        state = StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=prefix))
    return WorkflowStateManager(state_manager=state, checkpoint_interval=3)


async def run_steps(workflows: WorkflowStateManager, first: int, hold_after: int = 0) -> None:
    for number in range(first, STEPS + 1):
        async with workflows.step(WORKFLOW, number, f"step-{number}") as step:
            await anyio.sleep(0.005)  # the step's work
            step.result = number
            step.context_update = {f"r{number}": number * number}
        emit("done", step=number)
        if number == hold_after:
            # Hold here until the test says go, so the pause is sure to land mid-workflow.
            emit("holding", step=number)
            await anyio.to_thread.run_sync(sys.stdin.readline)
    await workflows.complete(WORKFLOW)
    emit("completed")


async def main(mode: str, url: str, prefix: str) -> None:
    # The library's log events as JSON lines on stdout (docs/operations.md's ProcessorFormatter
    # recipe), so the test can see "workflow_waiting" as it happens.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ]
        )
    )
    logging.getLogger("agenticstate").addHandler(handler)
    logging.getLogger("agenticstate").setLevel(logging.DEBUG)
    workflows = manager(url, prefix)
    try:
        if mode in ("run", "crashy"):
            await workflows.create(WorkflowState(workflow_id=WORKFLOW, total_steps=STEPS))
            emit("created")
            await run_steps(workflows, 1, hold_after=5 if mode == "run" else 0)
        elif mode == "pause":
            await workflows.pause(WORKFLOW)
            emit("paused")
        elif mode == "resume":
            await workflows.resume(WORKFLOW)
            emit("resumed")
        elif mode == "continue":
            state = await workflows.resume_from(WORKFLOW, "latest")
            emit("resumed_from", step=state.current_step)
            await run_steps(workflows, state.current_step + 1)
        elif mode == "steps":
            base = int(sys.argv[4]) * 10
            for number in range(base + 1, base + 11):
                await workflows.update_step(WORKFLOW, StepState(step_number=number, result=number))
            emit("recorded")
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        await workflows.state.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
