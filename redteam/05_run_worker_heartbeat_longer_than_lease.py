"""run_worker accepts a heartbeat_interval at or above the lease (here 2 s against a 0.5 s
lease): every task that runs longer than the lease is then taken back by another worker's
claim while its handler is still running, and this worker's outcome is dropped (the task runs
twice). The docs promise "a handler may run far longer than its lease" and the API refuses
other durations that cannot work (a zero lease, docs/concepts/state-manager.md); expected:
InvalidArgumentError for heartbeat_interval >= lease (or a clamp below it). Exits 1 while the
bug shows, 0 once fixed. About 3 s."""
import sys
from datetime import timedelta

import anyio

from agenticstate import OrchestrationStateManager, TeamState
from agenticstate.exceptions import InvalidArgumentError


async def main() -> int:
    orch = OrchestrationStateManager(sync_interval=0.1)
    await orch.create_team(TeamState(team_id="h"))
    await orch.enqueue_task("h", {"id": "x"})
    stolen = []

    async def handler(task):
        await anyio.sleep(1.5)
        return "done"

    async def other_worker():
        await anyio.sleep(0.2)
        for _ in range(40):
            if await orch.claim_task("h", "other", lease=timedelta(seconds=10)):
                stolen.append(True)
                return
            await anyio.sleep(0.05)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_worker)
            await orch.run_worker(
                "h", "w", handler, lease=timedelta(seconds=0.5), heartbeat_interval=2.0, max_tasks=1
            )
    except ExceptionGroup as group:  # raised in a task group's body: grouped (anyio 4)
        refused, rest = group.split(InvalidArgumentError)
        if refused is None or rest is not None:
            raise
        print("refused:", refused.exceptions[0])
        return 0
    except InvalidArgumentError as exc:
        print("refused:", exc)
        return 0
    print("accepted heartbeat_interval=2.0 with lease=0.5;",
          "another worker took the task while the handler ran" if stolen else "task kept")
    return 1 if stolen else 0


sys.exit(anyio.run(main))
