"""Type-checked usage of commits of a scope (mypy checks this file; pytest never runs it)."""

from __future__ import annotations

from typing import assert_type

from pydantic import BaseModel

from agenticstate import Checkout, CommitDiff, CommitInfo, StateManager, sync


class Plan(BaseModel):
    steps: list[str]


async def typed_commits(state: StateManager) -> None:
    info = await state.commit("agent:1:", message="planned")
    assert_type(info, CommitInfo)
    assert_type(await state.log("agent:1:", limit=5), list[CommitInfo])
    view = await state.checkout(info.id)
    assert_type(view, Checkout)
    assert_type(view.keys(), list[str])
    assert_type(len(view), int)
    assert_type(await state.diff(info.id, info.id), CommitDiff)
    assert_type(await state.rollback("agent:1:", info.id), int)
    assert_type(await state.pin(info.id), CommitInfo)
    assert_type(await state.unpin(info.id), bool)
    assert_type(await state.scope("agent:1:").commit(), CommitInfo)


def typed_sync_commits(state: sync.StateManager) -> None:
    view = state.checkout("0123abcd")
    assert isinstance(view, sync.Checkout)
