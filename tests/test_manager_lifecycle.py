"""StateManager lifecycle: lazy opening, async with, and what close delivers."""

from __future__ import annotations

from typing import Any

import anyio

from agenticstate import MemoryBackend, StateManager


async def test_close_delivers_changes_committed_before_it() -> None:
    """Closing a manager that owns its backend first delivers every committed change."""
    seen: list[Any] = []
    state = StateManager()
    state.subscribe("*", lambda key, old, new: seen.append(new))
    for i in range(50):
        await state.save("k", i)
    await state.aclose()
    assert seen == list(range(50))


async def test_async_with_opens_and_closes() -> None:
    """async with delivers callbacks in the manager's task group and closes the backend."""
    backend = MemoryBackend()
    seen: list[str] = []
    async with StateManager(backend=backend) as state:
        state.subscribe("a:*", lambda key, old, new: seen.append(key))
        await state.save("a:1", 1)
        await state.save("b:1", 1)
    assert seen == ["a:1"]
    async with backend.changes("*") as changes:
        assert [change async for change in changes] == []  # closed: iteration ends at once


async def test_shared_backend_is_left_open() -> None:
    """With close_backend=False the backend stays usable after the manager closes."""
    backend = MemoryBackend()
    first = StateManager(backend=backend, close_backend=False)
    await first.save("k", 1)
    await first.aclose()
    async with StateManager(backend=backend) as second:
        assert await second.get("k") == 1


async def test_watch_without_async_with_subscribes_on_first_next() -> None:
    """Iterating a watch directly subscribes lazily and unsubscribes when it stops."""
    async with StateManager() as state:
        watch = state.watch("x")
        got: list[Any] = []

        async def consume() -> None:
            async for change in watch:
                got.append(change.new_value)
                break

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()  # the consumer is subscribed and waiting
                await state.save("x", "hello")
        assert got == ["hello"]
