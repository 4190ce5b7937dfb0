"""A process making identical cached_calls.

Run as `python -m tests.integration._flight_worker URL PREFIX N`.

It waits for a line on stdin (the start signal), makes N concurrent identical calls, and prints
how many times it ran the tool itself.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import StateConfig, StateManager, ToolStateManager


async def main(url: str, prefix: str, count: str) -> None:
    state = StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=prefix))
    tools = ToolStateManager(state_manager=state)
    ran = 0

    async def expensive() -> dict[str, int]:
        nonlocal ran
        ran += 1
        await anyio.sleep(0.5)  # the tool's slow work, long enough for every process to ask
        return {"answer": 42}

    await state.open()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await anyio.to_thread.run_sync(sys.stdin.readline)
    results: list[object] = []

    async def call() -> None:
        results.append(await tools.cached_call("oracle", {"question": "life"}, expensive))

    async with anyio.create_task_group() as tg:
        for _ in range(int(count)):
            tg.start_soon(call)
    assert results == [{"answer": 42}] * int(count)
    sys.stdout.write(f"ran {ran}\n")
    sys.stdout.flush()
    await state.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
