"""The change feed does not double the store: a LangGraph thread with the feed on holds at most
1.15x what it holds with the feed off (Redis: the keys' MEMORY USAGE; SQLite: the file's size).

The thread is `bench._thread_workload` (a two-node chat graph whose `messages` channel grows
every turn), 30 turns here; `bench.bench_feed_size` reports the 200-turn figure. The saver stores
every value whole (`WHOLE_VALUES`), so the thread writes the large values the feed holds by
reference: with its default deltas the store is several times smaller and holds small values,
which the feed keeps inline (tests/langgraph/test_saver_storage.py bounds that store).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

pytest.importorskip("langgraph")


from agenticstate import FeedRetention
from bench._thread_workload import WHOLE_VALUES, redis_thread_bytes, sqlite_thread_bytes

if TYPE_CHECKING:
    from pathlib import Path

TURNS = 30
BOUND = 1.15
DBS = (9, 10)  # the plain Redis databases the test owns (feed on, feed off)


@pytest.mark.redis
async def test_a_langgraph_thread_with_the_feed_on_redis_holds_at_most_115x(redis_url: str) -> None:
    """Redis: the thread's keys, streams and reference hashes with the feed on take at most
    1.15x the memory of the same thread with the feed off."""
    on = await redis_thread_bytes(redis_url, DBS[0], FeedRetention(), TURNS, **WHOLE_VALUES)
    off = await redis_thread_bytes(redis_url, DBS[1], None, TURNS, **WHOLE_VALUES)
    assert on <= BOUND * off, f"feed on {on} bytes, off {off} bytes: {on / off:.3f}x"


async def test_a_langgraph_thread_with_the_feed_on_sqlite_holds_at_most_115x(
    tmp_path: Path,
) -> None:
    """SQLite: the file with the thread's changes holds at most 1.15x the bytes of the same
    file without them (the feed cannot be off on SQLite: its rows are deleted to compare)."""
    with_feed, without = await sqlite_thread_bytes(tmp_path / "thread.db", TURNS, **WHOLE_VALUES)
    assert with_feed <= BOUND * without, f"{with_feed} bytes, {without} without the feed"
