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


async def managers() -> None:
    store = AgentStateStore(persistence="memory")
    assert_type(await store.list_snapshots("a"), list[AgentSnapshot])
    workflows = WorkflowStateManager(state_manager=StateManager(StateConfig()))
    assert_type(await workflows.get("w"), WorkflowState | None)
    assert_type(await workflows.get_status("w"), WorkflowStatus)
