"""A workflow runner that honours pause, resume and cancel from elsewhere.

Install: `pip install .` (from a checkout; see the README).
"""

import anyio

from agenticstate import (
    StateManager,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)


async def runner(workflows: WorkflowStateManager, paused_at_3: anyio.Event) -> None:
    for number in range(1, 7):
        # Each step waits here while the workflow is paused (from any process).
        async with workflows.step("research_pipeline", number, f"step-{number}") as step:
            step.result = {"items": number * 10}
        if number == 3:
            paused_at_3.set()
    await workflows.complete("research_pipeline")


async def main() -> None:
    async with StateManager() as state:
        workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=2)
        await workflows.create(WorkflowState(workflow_id="research_pipeline", total_steps=6))
        await workflows.start("research_pipeline")
        await workflows.pause("research_pipeline")  # the runner will wait before step 1

        step_three_done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner, workflows, step_three_done)
            await anyio.wait_all_tasks_blocked()
            print("status:", await workflows.get_status("research_pipeline"))
            await workflows.resume("research_pipeline")

        final = await workflows.require("research_pipeline")
        print(f"{final.status.value}: {final.current_step}/{final.total_steps} steps")
        print(
            "checkpoints:",
            [c.checkpoint_id for c in await workflows.list_checkpoints("research_pipeline")],
        )
        assert final.status is WorkflowStatus.COMPLETED
        assert step_three_done.is_set()


if __name__ == "__main__":
    anyio.run(main)
