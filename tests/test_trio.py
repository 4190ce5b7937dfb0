"""The core, the memory and file backends and subscriptions run under trio as well as asyncio."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import ConfigurationError, StateConfig, StateManager

if TYPE_CHECKING:
    from pathlib import Path


def test_core_runs_under_trio() -> None:
    """save/get/update/delete/list_keys, watch and callbacks work on trio (via anyio.run)."""
    pytest.importorskip("trio")
    results: dict[str, Any] = {}

    async def main() -> None:
        async with StateManager(StateConfig(backend="memory")) as state:
            seen = anyio.Event()
            calls: list[tuple[str, Any, Any]] = []

            def on_change(key: str, old: Any, new: Any) -> None:
                calls.append((key, old, new))
                seen.set()

            state.subscribe("agent:*", on_change)
            async with state.watch("agent:*") as changes:
                await state.save("agent:1", {"status": "idle"})
                await state.update("agent:1", {"status": "busy"})
                async with anyio.create_task_group() as tg:
                    for _ in range(10):
                        tg.start_soon(partial(state.update, "n", lambda n: n + 1, default=0))
                with anyio.fail_after(5):
                    first = await changes.__anext__()
                    await seen.wait()
            results["first"] = (first.key, first.new_value)
            results["value"] = await state.get("agent:1")
            results["n"] = await state.get("n")
            results["keys"] = await state.list_keys("*")
            results["calls"] = calls[0]

    anyio.run(main, backend="trio")
    assert results == {
        "first": ("agent:1", {"status": "idle"}),
        "value": {"status": "busy"},
        "n": 10,
        "keys": ["agent:1", "n"],
        "calls": ("agent:1", None, {"status": "idle"}),
    }


def test_callbacks_outside_async_with_need_asyncio_under_trio() -> None:
    """Under trio, subscribing a callback without entering the manager is a clear error."""
    pytest.importorskip("trio")

    async def main() -> None:
        state = StateManager()
        with pytest.raises(ConfigurationError, match="async with"):
            state.subscribe("*", lambda k, o, n: None)
        await state.aclose()

    anyio.run(main, backend="trio")


def test_file_backend_runs_under_trio(tmp_path: Path) -> None:
    """The file backend (its fsync agent, group commit and snapshots) works on trio."""
    pytest.importorskip("trio")
    results: dict[str, Any] = {}

    async def main() -> None:
        config = StateConfig(backend="file", file_path=tmp_path / "state.json")
        async with StateManager(config) as state, state.watch("n") as changes:
            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(partial(state.update, "n", lambda n: n + 1, default=0))
            with anyio.fail_after(5):
                first = await changes.__anext__()
            await state.save("agent:1", {"status": "idle"})
            results["first"] = (first.key, first.new_value)
        async with StateManager(config) as state:
            results["n"] = await state.get("n")
            results["agent"] = await state.get("agent:1")

    anyio.run(main, backend="trio")
    assert results == {"first": ("n", 1), "n": 50, "agent": {"status": "idle"}}


def test_sqlite_backend_runs_under_trio(tmp_path: Path) -> None:
    """The SQLite backend (its writer, reader and notifier threads) works on trio."""
    pytest.importorskip("trio")
    results: dict[str, Any] = {}

    async def main() -> None:
        config = StateConfig(backend="sqlite", sqlite_path=tmp_path / "state.db")
        async with StateManager(config) as state, state.watch("n") as changes:
            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(partial(state.update, "n", lambda n: n + 1, default=0))
            with anyio.fail_after(5):
                first = await changes.__anext__()
            await state.save("agent:1", {"status": "idle"})
            results["first"] = (first.key, first.new_value)
            results["keys"] = await state.list_keys("agent:*")
        async with StateManager(config) as state:
            results["n"] = await state.get("n")
            results["agent"] = await state.get("agent:1")

    anyio.run(main, backend="trio")
    assert results == {
        "first": ("n", 1),
        "keys": ["agent:1"],
        "n": 50,
        "agent": {"status": "idle"},
    }
