"""What the change feed costs in storage: a LangGraph thread with the feed on and off.

Run: `python -m bench.bench_feed_size [TURNS]` (200 turns by default; starts its own
redis-server). The thread is `bench._thread_workload`: a two-node chat graph on
`CheckpointSaver` whose `messages` channel grows every turn. Redis: the sum of every key's
`MEMORY USAGE` (the state keys, the feed's stream, counter and hashes of references) in a
database of its own, feed on (`FeedRetention()`) against feed off. SQLite (whose feed cannot be
off): the file's pages after a checkpoint and VACUUM, against the same file with its `changes`
rows deleted. Target: at most 1.15x.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path

import anyio
import redis.asyncio as aioredis

from agenticstate import FeedRetention, RedisBackend, SQLiteBackend, StateManager
from bench._thread_workload import run_thread
from bench._util import publish, redis_server, table

TURNS = 200


async def _redis(url: str, db: int, feed: FeedRetention | None, turns: int) -> int:
    async with aioredis.Redis.from_url(url, db=db) as admin:
        await admin.flushdb()
        async with StateManager(backend=RedisBackend(url=url, db=db, feed=feed)) as state:
            await run_thread(state, turns)
        total = 0
        async for name in admin.scan_iter(count=1000):
            total += await admin.memory_usage(name, samples=0) or 0
        await admin.flushdb()
    return total


def _sqlite_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    return int(pages) * int(size)


async def _sqlite(turns: int) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "thread.db"
        async with StateManager(backend=SQLiteBackend(path)) as state:
            await run_thread(state, turns)
        on = _sqlite_bytes(path)
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM changes")
        conn.close()
        return on, _sqlite_bytes(path)


async def run(url: str, turns: int = TURNS) -> str:
    rows = []
    on = await _redis(url, 1, FeedRetention(), turns)
    off = await _redis(url, 2, None, turns)
    rows.append(
        ["Redis (MEMORY USAGE)", f"{on / 1e6:.1f} MB", f"{off / 1e6:.1f} MB", f"{on / off:.3f}x"]
    )
    on, off = await _sqlite(turns)
    rows.append(
        ["SQLite (file pages)", f"{on / 1e6:.1f} MB", f"{off / 1e6:.1f} MB", f"{on / off:.3f}x"]
    )
    notes = [
        f"One LangGraph thread of {turns} turns (two nodes per turn, a `messages` channel with "
        "`add_messages`), written once with the feed on and once with it off (SQLite: its "
        "`changes` rows deleted). Target: at most 1.15x.",
        "A change holds a large value (1 KiB or more, no TTL) by reference: the key while it "
        "still holds that value, then the key's next change, which carries it as its old value.",
    ]
    return table(
        "Change feed: storage of a LangGraph thread, feed on against feed off",
        ["store", "feed on", "feed off", "ratio"],
        rows,
        notes,
    )


async def _main(turns: int) -> str:
    with redis_server() as url:
        return await run(url, turns)


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    publish("feed_size", anyio.run(_main, turns))


if __name__ == "__main__":
    main()
