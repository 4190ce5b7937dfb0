"""Atomic updates: many tasks increment one counter and nothing is lost.

Install: `pip install .` (from a checkout; see the README).
"""

import anyio

from agenticstate import StateManager


async def main() -> None:
    async with StateManager() as state:

        async def worker() -> None:
            for _ in range(100):
                await state.update("stats:runs", lambda n: n + 1, default=0)

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(worker)

        total = await state.get("stats:runs")
        print(f"runs: {total}")
        assert total == 2000


if __name__ == "__main__":
    anyio.run(main)
