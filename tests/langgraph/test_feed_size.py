"""The change feed does not double the store: a LangGraph thread with the feed on holds at most
1.15x what it holds with the feed off (Redis: the keys' MEMORY USAGE; SQLite: the file's pages).

The thread is `bench._thread_workload` (a two-node chat graph whose `messages` channel grows
every turn), 30 turns here; `bench.bench_feed_size` reports the 200-turn figure.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("langgraph")

import redis.asyncio as aioredis

from agenticstate import FeedRetention, RedisBackend, SQLiteBackend, StateManager
from bench._thread_workload import run_thread

if TYPE_CHECKING:
    from pathlib import Path

TURNS = 30
BOUND = 1.15
DBS = (9, 10)  # the plain Redis databases the test owns (feed on, feed off)


async def _redis_bytes(url: str, db: int, feed: FeedRetention | None) -> int:
    async with aioredis.Redis.from_url(url, db=db) as admin:
        await admin.flushdb()
        async with StateManager(backend=RedisBackend(url=url, db=db, feed=feed)) as state:
            await run_thread(state, TURNS)
        total = 0
        async for name in admin.scan_iter(count=1000):
            total += await admin.memory_usage(name, samples=0) or 0
        await admin.flushdb()
    return total


def _pages(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
    conn.close()
    return int(pages)


@pytest.mark.redis
async def test_a_langgraph_thread_with_the_feed_on_redis_holds_at_most_115x(redis_url: str) -> None:
    """Redis: the thread's keys, streams and reference hashes with the feed on take at most
    1.15x the memory of the same thread with the feed off."""
    on = await _redis_bytes(redis_url, DBS[0], FeedRetention())
    off = await _redis_bytes(redis_url, DBS[1], None)
    assert on <= BOUND * off, f"feed on {on} bytes, off {off} bytes: {on / off:.3f}x"


async def test_a_langgraph_thread_with_the_feed_on_sqlite_holds_at_most_115x(
    tmp_path: Path,
) -> None:
    """SQLite: the file with the thread's changes holds at most 1.15x the pages of the same
    file without them (the feed cannot be off on SQLite: its rows are deleted to compare)."""
    path = tmp_path / "thread.db"
    async with StateManager(backend=SQLiteBackend(path)) as state:
        await run_thread(state, TURNS)
    with_feed = _pages(path)
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM changes")
    conn.close()
    without = _pages(path)
    assert with_feed <= BOUND * without, f"{with_feed} pages, {without} without the feed"
