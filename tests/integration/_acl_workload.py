"""Every operation of the library, once, on one `StateManager`: what an ACL recipe must allow.

`workload(state)` runs the core API (save, get, update, delete, list_keys, usage, transact,
indexes, subscribe, watch, the feed's replay, history and revert, a local view, commits with log,
checkout, diff and rollback), the inspector's listing queries, every manager's basic operations
(the demo pipeline: a team with its leased queue, a workflow with checkpoints, the tool cache and
retries, a knowledge base, a speech session, agent checkpoints and recovery; then sessions with
messages), and the LangGraph checkpointer and store. It asserts what each step returns, so an
operation that the server refused cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
import io
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate import EARLIEST, SessionManager, StateManager
from agenticstate.txn import Exists, Get, IndexIncr, Put, Version

if TYPE_CHECKING:
    from agenticstate.events import StateChange

TIMEOUT = 30


async def _take(changes: Any, count: int) -> list[StateChange]:
    taken: list[StateChange] = []
    with anyio.fail_after(TIMEOUT):
        async for change in changes:
            taken.append(change)
            if len(taken) == count:
                break
    return taken


async def core(state: StateManager) -> None:
    """The StateManager's own operations (history is kept for `agent:*`)."""
    seen: list[str] = []
    heard = anyio.Event()

    def on_change(key: str, old: Any, new: Any) -> None:
        seen.append(key)
        heard.set()

    state.subscribe("agent:*", on_change)
    async with state.watch("agent:*") as changes:
        assert await state.save("agent:1", {"a": 1}, ttl=600) == 1
        await state.update("agent:1", {"b": 2})
        await state.update("agent:1", lambda value: {**value, "c": 3})
        taken = await _take(changes, 3)
    assert [change.version for change in taken] == [1, 2, 3]
    with anyio.fail_after(TIMEOUT):
        await heard.wait()
    assert state.unsubscribe("agent:*", on_change)
    assert seen[0] == "agent:1"
    await state.save_many({"agent:2": [1, 2], "note:x": "text"})
    # Values the feed holds by reference (large, no TTL), overwritten and deleted, replayed.
    big = await state.feed_cursor()
    await state.save("doc:big", "x" * 2000)
    await state.save("doc:big", "y" * 2000)
    await state.delete("doc:big")
    async with state.changes("doc:*", since=big) as doc_changes:
        values = [(change.old_value, change.new_value) for change in await _take(doc_changes, 3)]
    assert values == [(None, "x" * 2000), ("x" * 2000, "y" * 2000), ("y" * 2000, None)]
    assert (await state.usage("*")).feed is not None
    assert await state.get_many(["agent:1", "agent:2", "missing"]) == {
        "agent:1": {"a": 1, "b": 2, "c": 3},
        "agent:2": [1, 2],
    }
    assert await state.exists("note:x")
    entry = await state.get_entry("agent:1")
    assert entry is not None
    assert entry.version == 3
    assert await state.list_keys("agent:*") == ["agent:1", "agent:2"]
    assert (await state.usage("*")).keys == 3
    assert await state.backend.value_sizes(["agent:1", "missing"]) != [None, None]
    stats = await state.backend.stat_many(["agent:1"])
    assert stats[0] is not None
    assert stats[0].version == 3
    result = await state.transact(
        compare=[Exists("cache:{q1}")],
        then=[Get("cache:{q1}"), IndexIncr("cache:{q1}:counters", "hits", 1)],
        orelse=[Put("cache:{q1}", {"answer": 42})],
    )
    assert not result.succeeded
    result = await state.transact(
        compare=[Version("cache:{q1}", 1)],
        then=[Get("cache:{q1}"), IndexIncr("cache:{q1}:counters", "hits", 1)],
    )
    assert result.succeeded
    await state.index_add("board", {"a": 1.0, "b": 2.0})
    assert await state.index_range("board") == [("a", 1.0), ("b", 2.0)]
    assert await state.index_remove("board", ["a"]) == 1
    # The feed: a replay from the start, then history and revert.
    assert await state.feed_cursor() is not None
    async with state.changes("agent:*", since=EARLIEST) as replay:
        replayed = await _take(replay, 4)  # agent:1's three writes and agent:2's one
    # In key order per key (on a cluster, keys of different slots may interleave either way).
    assert [c.version for c in replayed if c.key == "agent:1"] == [1, 2, 3]
    versions = await state.history("agent:1")
    assert [v.version for v in versions] == [3, 2, 1]
    assert await state.get("agent:1", version=1) == {"a": 1}
    await state.revert("agent:1", to_version=1)
    assert await state.get("agent:1") == {"a": 1}
    # A local view (a replica kept current by the feed and the live changes).
    async with state.view("agent:*") as view:
        await state.save("agent:3", "three")
        with anyio.fail_after(TIMEOUT):
            await view.wait_until(lambda v: v.get("agent:3") == "three")
    # Commits of a scope.
    scoped = state.scope("team:")
    await scoped.save("plan", {"step": 1})
    first = await state.commit("team:", message="one")
    await scoped.save("plan", {"step": 2})
    second = await state.commit("team:", message="two")
    assert [c.id for c in await state.log("team:")] == [second.id, first.id]
    checkout = await state.checkout(first.id)
    assert await checkout.get("team:plan") == {"step": 1}
    assert (await state.diff(first.id, second.id)).changed
    await state.rollback("team:", first.id)
    assert await scoped.get("plan") == {"step": 1}
    assert await state.delete("note:x", expected_version=1)


async def managers(state: StateManager) -> None:
    """Every manager's basic operations: the demo's pipeline, then sessions."""
    from agenticstate.demo import pipeline

    with contextlib.redirect_stdout(io.StringIO()):
        await pipeline(state)
    sessions = SessionManager(state_manager=state)
    session = await sessions.create_session("u1", state={"items": []})
    await sessions.update_state(session.session_id, lambda s: {**s, "items": ["tea"]})
    await sessions.add_message(session.session_id, "user", "hello")
    await sessions.add_message(session.session_id, "assistant", "hi")
    assert [m.content for m in await sessions.get_messages(session.session_id)] == [
        "hello",
        "hi",
    ]
    assert session.session_id in await sessions.list_session_ids()
    assert await sessions.get_state(session.session_id) == {"items": ["tea"]}


async def langgraph(state: StateManager) -> None:
    """The LangGraph checkpointer (a graph paused and resumed) and store."""
    from agenticstate.langgraph import CheckpointSaver, Store
    from tests.langgraph._graph_worker import counter_graph

    saver = CheckpointSaver(state)
    config: Any = {"configurable": {"thread_id": "t1"}}
    await counter_graph(saver).ainvoke({"count": 0}, config)
    done = await counter_graph(saver).ainvoke(None, config)
    assert done["count"] == 3
    assert len([c async for c in saver.alist(config)]) >= 3
    store = Store(state)
    await store.aput(("users", "u1"), "prefs", {"tea": True})
    item = await store.aget(("users", "u1"), "prefs")
    assert item is not None
    assert item.value == {"tea": True}
    assert [i.key for i in await store.asearch(("users",))] == ["prefs"]
    await store.adelete(("users", "u1"), "prefs")


async def workload(state: StateManager) -> None:
    """Every operation above, in order."""
    await core(state)
    await managers(state)
    await langgraph(state)
