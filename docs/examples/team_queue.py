"""A team works through a priority queue with two workers: a failure retried, then dead-lettered.

Install: `pip install .` (from a checkout; see the README).
"""

import logging

import anyio

from agenticstate import (
    AgentCoordinationState,
    OrchestrationStateManager,
    TaskItem,
    TeamState,
)


async def main() -> None:
    # The library logs through `logging`; show its warnings as labelled lines.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    async with OrchestrationStateManager(persistence="memory", max_retries=1) as orch:
        await orch.create_team(
            TeamState(
                team_id="research_team",
                agents={
                    "researcher": AgentCoordinationState(
                        agent_id="researcher", capabilities=["research"]
                    ),
                    "writer": AgentCoordinationState(agent_id="writer", capabilities=["writing"]),
                },
            )
        )
        await orch.enqueue_task("research_team", {"id": "survey", "priority": "low"})
        await orch.enqueue_task("research_team", {"id": "draft", "capability": "writing"})
        await orch.enqueue_task("research_team", {"id": "urgent", "priority": "high"})
        await orch.enqueue_task("research_team", {"id": "broken", "data": {"fails": True}})
        print("the task 'broken' fails on purpose: it is retried once, then dead-lettered")

        async def handle(task: TaskItem) -> dict[str, str | None]:
            # The lease is renewed while this runs, however long it takes.
            if task.data.get("fails"):
                raise RuntimeError("source unavailable")  # fails the task: retried, then dead
            print(f"{task.assigned_to} did {task.task_id}")
            return {"by": task.assigned_to}  # completes the task with this result

        # Each worker claims tasks (highest priority first, only those its capabilities allow)
        # until the queue has none left for it. A worker that dies mid-task stops renewing its
        # lease: once the lease runs out, the next claim of any worker takes the task back.
        async with anyio.create_task_group() as tg:
            for agent_id in ("researcher", "writer"):
                tg.start_soon(
                    lambda agent_id=agent_id: orch.run_worker(
                        "research_team", agent_id, handle, until_empty=True
                    )
                )

        queue = await orch.get_queue_status("research_team")
        print("completed:", [t.task_id for t in queue.completed])
        print("dead letter:", [(t.task_id, t.error) for t in queue.dead_letter])
        assert {t.task_id for t in queue.completed} == {"survey", "draft", "urgent"}
        assert [t.task_id for t in queue.dead_letter] == ["broken"]
        draft = await orch.get_task("research_team", "draft")
        assert draft.result == {"by": "writer"}


if __name__ == "__main__":
    anyio.run(main)
