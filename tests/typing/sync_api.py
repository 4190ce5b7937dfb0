"""Type-checked usage of agenticstate.sync and the session API (mypy checks it; never run)."""

from __future__ import annotations

from typing import Any, assert_type

from pydantic import BaseModel

from agenticstate import (
    ScopedState,
    Session,
    SessionDeletion,
    SessionManager,
    SessionMessage,
    SessionSummary,
    StateManager,
    sync,
)


class Record(BaseModel):
    name: str


def blocking_usage() -> None:
    with sync.StateManager() as state:
        state.save("k", {"a": 1})
        value: Any = state.get("k")
        assert value == {"a": 1}
        assert_type(state.run(lambda s: s.get("k", model=Record)), Record | None)
        assert_type(state.run(lambda s: s.save("k", Record(name="x"))), int)
        assert_type(state.async_object, StateManager)
        scope = state.scope("u1:")
        scope.save("cart", ["milk"])
        sessions = sync.SessionManager(state_manager=state, default_state={"items": []})
        assert_type(sessions.async_object, SessionManager)
        session = sessions.run(lambda m: m.create_session("u1"))
        assert_type(session, Session)
        sessions.add_message(session.session_id, "user", "hi")


async def async_usage(state: StateManager, sessions: SessionManager) -> None:
    assert_type(state.scope("u1:"), ScopedState)
    assert_type(await state.scope("u1:").get("k", model=Record), Record | None)
    assert_type(await state.scope("u1:").get_all(), dict[str, Any])
    assert_type(await state.scope("u1:").clear(), int)
    session = await sessions.create_session("u1", state={"a": 1}, ttl=3600)
    assert_type(session, Session)
    assert_type(await sessions.get_session(session.session_id), Session | None)
    assert_type(await sessions.list_sessions("u1", limit=10), list[Session])
    assert_type(await sessions.get_state(session.session_id), dict[str, Any])
    assert_type(await sessions.update_state(session.session_id, {"a": 2}), dict[str, Any])
    message = await sessions.add_message(session.session_id, "user", "hi", lang="en")
    assert_type(message, SessionMessage)
    history = await sessions.get_messages(session.session_id, last=50, max_tokens=1000)
    assert_type(history, list[SessionMessage])

    async def summarizer(previous: str | None, messages: list[SessionMessage]) -> str:
        return "summary"

    summary = await sessions.summarize(session.session_id, summarizer, keep_last=10)
    assert_type(summary, SessionSummary | None)
    assert_type(await sessions.render(session.session_id, "{a}"), str)
    assert_type(await sessions.delete_user("u1"), SessionDeletion)
