"""A queue worker for the benchmark: claim and complete tasks until the queue is empty.

`python -m bench._queue_worker URL PREFIX NAME` prints how many tasks it completed.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import OrchestrationStateManager, StateConfig, StateManager


async def main(url: str, prefix: str, name: str) -> None:
    config = StateConfig(backend="redis", redis_url=url, key_prefix=prefix)
    async with StateManager(config) as state:
        orch = OrchestrationStateManager(state_manager=state)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await anyio.to_thread.run_sync(sys.stdin.readline)
        done = 0
        while (claim := await orch.claim_task("bench", name)) is not None:
            await orch.complete_task(
                "bench", claim.task_id, {"ok": True}, lease_token=claim.lease_token
            )
            done += 1
    sys.stdout.write(f"{done}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
