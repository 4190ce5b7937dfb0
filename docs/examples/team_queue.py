"""A team works through a priority queue: claims with leases, a failure retried, a dead letter."""

from datetime import timedelta

import anyio

from agenticstate import (
    AgentCoordinationState,
    OrchestrationStateManager,
    TeamState,
)


async def main() -> None:
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

        async def work(agent_id: str) -> None:
            lease = timedelta(seconds=30)
            while claim := await orch.claim_task("research_team", agent_id, lease=lease):
                if claim.task.data.get("fails"):
                    await orch.fail_task(
                        "research_team",
                        claim.task_id,
                        "source unavailable",
                        lease_token=claim.lease_token,
                    )
                    continue
                await orch.heartbeat("research_team", claim.task_id, claim.lease_token)
                print(f"{agent_id} did {claim.task_id}")
                await orch.complete_task(
                    "research_team", claim.task_id, {"by": agent_id}, lease_token=claim.lease_token
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(work, "researcher")
            tg.start_soon(work, "writer")

        queue = await orch.get_queue_status("research_team")
        print("completed:", [t.task_id for t in queue.completed])
        print("dead letter:", [(t.task_id, t.error) for t in queue.dead_letter])
        assert {t.task_id for t in queue.completed} == {"survey", "draft", "urgent"}
        assert [t.task_id for t in queue.dead_letter] == ["broken"]
        draft = await orch.get_task("research_team", "draft")
        assert draft.result == {"by": "writer"}


if __name__ == "__main__":
    anyio.run(main)
