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

import sys
import tempfile
from pathlib import Path

import anyio

from agenticstate import FeedRetention
from bench._thread_workload import WHOLE_VALUES, redis_thread_bytes, sqlite_thread_bytes
from bench._util import publish, redis_server, table

TURNS = 200


async def _sqlite(turns: int) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as directory:
        return await sqlite_thread_bytes(Path(directory) / "thread.db", turns, **WHOLE_VALUES)


async def run(url: str, turns: int = TURNS) -> str:
    rows = []
    on = await redis_thread_bytes(url, 1, FeedRetention(), turns, **WHOLE_VALUES)
    off = await redis_thread_bytes(url, 2, None, turns, **WHOLE_VALUES)
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
