"""A writer for the cluster benchmark: `python -m bench._cluster_worker URL PREFIX COUNT`.

Prints "ready", waits for a line on stdin, then does COUNT saves of 1,000 distinct keys
(spread over every slot) with 16 concurrent tasks, and prints the count it did.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import StateConfig, StateManager

VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
TASKS = 16


async def main(url: str, prefix: str, count: str) -> None:
    total = int(count)
    config = StateConfig(backend="redis", redis_url=url, key_prefix=prefix)
    async with StateManager(config) as state:
        await state.save("warm", VALUE)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await anyio.to_thread.run_sync(sys.stdin.readline)

        async def writer(first: int) -> None:
            for n in range(first, total, TASKS):
                await state.save(f"k{n % 1000}", VALUE)

        async with anyio.create_task_group() as tg:
            for first in range(TASKS):
                tg.start_soon(writer, first)
    sys.stdout.write(f"{total}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
