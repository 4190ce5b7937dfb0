"""run_worker cancelled while its claim_task is in flight strands the claimed task.

docs/managers/orchestration.md (Workers): "the worker's scope is cancelled | cancels the
handler, gives the task back at once (release_task ...)". When the cancellation lands while
claim_task is awaiting the store (SQLite's worker thread, a Redis round trip), the claim
commits but run_worker never sees it: nothing gives the task back, and it stays in_progress,
held by nobody, until its lease runs out (here 60 s; by default 30 x sync_interval).

Cancels a SQLite run_worker at random points 150 times (seeded); after each, counts the tasks
left in progress. Exits 1 while any cancel strands a task, 0 once fixed. About 10 s.
"""
import random
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import anyio

from agenticstate import OrchestrationStateManager, StateManager, TeamState
from agenticstate.backends import open_backend

ROUNDS = 150


async def main() -> int:
    random.seed(7)
    with tempfile.TemporaryDirectory() as tmp:
        state = StateManager(backend=open_backend(f"sqlite://{Path(tmp) / 's.db'}"))
        orch = OrchestrationStateManager(state_manager=state, sync_interval=0.05)
        await state.open()
        await orch.create_team(TeamState(team_id="c"))
        for i in range(ROUNDS * 3):
            await orch.enqueue_task("c", {"id": f"t{i}"})

        async def handler(task):
            await anyio.sleep(random.uniform(0, 0.01))
            return {"ok": True}

        stranded = 0
        for _ in range(ROUNDS):
            with anyio.move_on_after(random.uniform(0, 0.03)):
                await orch.run_worker("c", "w", handler, lease=timedelta(seconds=60))
            queue = await orch.get_queue_status("c")
            stranded += len(queue.in_progress)
            for task in queue.in_progress:  # clean up by hand, go on
                await orch.release_task("c", task.task_id)
        await state.aclose()
    print(f"{stranded} of {ROUNDS} cancelled workers left a task in progress (expected 0)")
    return 1 if stranded else 0


sys.exit(anyio.run(main))
