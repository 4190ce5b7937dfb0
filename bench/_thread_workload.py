"""A LangGraph chat thread: `turns` user turns through a two-node graph on `CheckpointSaver`.

The graph's state is a `messages` channel reduced with `add_messages`; each turn adds a user
message, then the two nodes (`agent`, `review`) each add one of their own. Every message's text
is `MESSAGE_CHARS` long and depends only on its turn, so two runs store the same bytes. The
feed-size test and `bench.bench_feed_size` run it with the change feed on and off and measure
what it holds (`redis_thread_bytes`, `sqlite_thread_bytes`).
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from agenticstate import RedisBackend, SQLiteBackend, StateManager
from agenticstate.langgraph import CheckpointSaver

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate import FeedRetention

__all__ = [
    "MESSAGE_CHARS",
    "WHOLE_VALUES",
    "chat_graph",
    "message_text",
    "redis_thread_bytes",
    "run_thread",
    "sqlite_thread_bytes",
    "user_message",
]

MESSAGE_CHARS = 800

WHOLE_VALUES: dict[str, Any] = {"delta_chain": 1, "compress_above": None}
"""`CheckpointSaver` options that store every channel value whole and uncompressed: the thread
then writes large values (its growing `messages` list), which the feed holds by reference."""


class _Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]


def message_text(kind: str, turn: int) -> str:
    head = f"{kind} {turn}: "
    return head + "".join(chr(97 + (turn * 7 + i) % 26) for i in range(MESSAGE_CHARS - len(head)))


def chat_graph(saver: Any) -> Any:
    """The two-node chat graph on any LangGraph checkpointer."""

    def agent(state: _Chat) -> dict[str, Any]:
        turn = len(state["messages"]) // 3
        return {"messages": [AIMessage(message_text("agent", turn), id=f"a{turn}")]}

    def review(state: _Chat) -> dict[str, Any]:
        turn = len(state["messages"]) // 3
        return {"messages": [AIMessage(message_text("review", turn), id=f"r{turn}")]}

    builder = StateGraph(_Chat)
    builder.add_node("agent", agent)
    builder.add_node("review", review)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "review")
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


async def run_thread(
    state: StateManager, turns: int, thread: str = "t1", **saver_options: Any
) -> None:
    """Run `turns` turns of one thread on `state` (opened by the caller); `saver_options` go to
    `CheckpointSaver` (the feed-size figures store every value whole: `WHOLE_VALUES`)."""
    graph = chat_graph(CheckpointSaver(state, **saver_options))
    config: Any = {"configurable": {"thread_id": thread}}
    for turn in range(turns):
        await graph.ainvoke(user_message(turn), config)


def user_message(turn: int) -> dict[str, Any]:
    """The graph input of turn `turn`: one user message."""
    return {"messages": [HumanMessage(message_text("user", turn), id=f"u{turn}")]}


async def redis_thread_bytes(
    url: str, db: int, feed: FeedRetention | None, turns: int, **saver_options: Any
) -> int:
    """The bytes a `turns`-turn thread takes in Redis database `db` (emptied before and after):
    the MEMORY USAGE of every key, the feed's streams and reference hashes included."""
    import redis.asyncio as aioredis

    async with aioredis.Redis.from_url(url, db=db) as admin:
        await admin.flushdb()
        async with StateManager(backend=RedisBackend(url=url, db=db, feed=feed)) as state:
            await run_thread(state, turns, **saver_options)
        total = 0
        async for name in admin.scan_iter(count=1000):
            total += await admin.memory_usage(name, samples=0) or 0
        await admin.flushdb()
    return total


async def sqlite_thread_bytes(path: Path, turns: int, **saver_options: Any) -> tuple[int, int]:
    """The bytes of a SQLite file holding a `turns`-turn thread, with its change rows and
    without them (the feed cannot be off on SQLite: its rows are deleted to compare)."""
    async with StateManager(backend=SQLiteBackend(path)) as state:
        await run_thread(state, turns, **saver_options)
    with_feed = _file_bytes(path)
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM changes")
    conn.close()
    return with_feed, _file_bytes(path)


def _file_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    return int(pages) * int(size)
