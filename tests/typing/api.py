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
