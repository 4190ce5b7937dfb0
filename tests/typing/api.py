"""Type-checked usage of the public API (mypy checks this file; pytest never runs it)."""

from __future__ import annotations

from typing import assert_type

from pydantic import BaseModel

from agenticstate import (
    AgentSnapshot,
    AgentStateStore,
    StateChange,
    StateConfig,
    StateEntry,
    StateManager,
    Subscription,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)


class Record(BaseModel):
    name: str


async def typed_reads(state: StateManager) -> None:
    assert_type(await state.get("k", model=Record), Record | None)
    assert_type(await state.get("k", Record(name="x"), model=Record), Record)
    assert_type(await state.save("k", Record(name="x")), int)
    assert_type(await state.get_entry("k"), StateEntry | None)
    assert_type(await state.list_keys("agent:*"), list[str])
    assert_type(await state.delete("k"), bool)
    async with state.watch("agent:*") as changes:
        async for change in changes:
            assert_type(change, StateChange)


async def feed_and_history(state: StateManager) -> None:
    assert_type(await state.get("k", model=Record, version=2), Record | None)
    assert_type(await state.get_entry("k", version=2), StateEntry | None)
    assert_type(await state.history("k", limit=5), list[StateEntry])
    assert_type(await state.revert("k", to_version=1), int)
    cursor = await state.feed_cursor()
    assert_type(cursor, str | None)
    async with state.changes("agent:*", since=cursor, on_gap="resync") as changes:
        async for change in changes:
            assert_type(change.cursor, str | None)
        assert_type(changes.cursor, str | None)
    scope = state.scope("u1:")
    assert_type(await scope.history("k", model=Record), list[StateEntry])


async def subscriptions(state: StateManager) -> None:
    def on_change(key: str, old: object, new: object) -> None: ...

    async def on_change_async(key: str, old: object, new: object) -> None: ...

    assert_type(state.subscribe("agent:*", on_change), Subscription)  # the seed's plain call
    live = await state.subscribe("agent:*", on_change_async)
    assert_type(live, Subscription)
    assert_type(live.is_live, bool)
    await live.wait_live()
    assert_type(live.unsubscribe(), bool)


async def managers() -> None:
    store = AgentStateStore(persistence="memory")
    assert_type(await store.list_snapshots("a"), list[AgentSnapshot])
    workflows = WorkflowStateManager(state_manager=StateManager(StateConfig()))
    assert_type(await workflows.get("w"), WorkflowState | None)
    assert_type(await workflows.get_status("w"), WorkflowStatus)
