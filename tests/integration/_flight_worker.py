"""A process making identical cached_calls.

Run as `python -m tests.integration._flight_worker URL PREFIX N [HITS]`.

It waits for a line on stdin (the start signal), makes N concurrent identical calls, then (with
HITS) HITS more from 10 concurrent tasks (cache hits by then), and prints how many times it ran
the tool itself.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import StateConfig, StateManager, ToolStateManager


async def main(url: str, prefix: str, count: str, hits: str = "0") -> None:
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
    results.clear()

    async def calls(times: int) -> None:
        for _ in range(times):
            await call()

    async with anyio.create_task_group() as tg:
        for n in range(10):
            tg.start_soon(calls, int(hits) // 10 + (n < int(hits) % 10))
    assert results == [{"answer": 42}] * int(hits)
    sys.stdout.write(f"ran {ran}\n")
    sys.stdout.flush()
    await state.aclose()


if __name__ == "__main__":
    url, prefix, count, *more = sys.argv[1:]
    anyio.run(main, url, prefix, count, more[0] if more else "0")
