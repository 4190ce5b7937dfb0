"""The processes of the feed resume test (`test_feed_resume.py`), on any backend URL.

python -m tests.integration._feed_proc writer URL PREFIX SEED COUNT CHUNKS
    print "ready"; then CHUNKS times: wait for a line on stdin, make COUNT / CHUNKS writes (set
    or update, from 4 tasks, on KEYS shared keys, never a delete) and print "chunk N"; at the
    end print "done"
python -m tests.integration._feed_proc consumer URL PREFIX FILE SINCE
    read `changes("*", since=SINCE)`; print "ready" once subscribed; for each change append
    "key version cursor" to FILE (flushed each time), then print the same line; after an
    overflow, subscribe again from the last cursor read
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from agenticstate import SubscriptionClosedError, open_backend
from agenticstate.backends import FeedRetention

if TYPE_CHECKING:
    from agenticstate.backends import Backend, Entry

KEYS = 40
RETENTION = FeedRetention(max_changes=100_000)  # more than the test writes: nothing is trimmed


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def connect(url: str, prefix: str) -> Backend:
    return open_backend(url, key_prefix=prefix, feed=RETENTION)


async def writer(url: str, prefix: str, seed: int, count: int, chunks: int) -> None:
    rng = random.Random(seed)
    async with connect(url, prefix) as backend:
        await backend.open()
        say("ready")
        made = 0
        for chunk in range(chunks):
            await anyio.to_thread.run_sync(sys.stdin.readline)
            goal = count * (chunk + 1) // chunks
            plan = [(f"k{rng.randrange(KEYS)}", rng.random() < 0.5) for _ in range(goal - made)]
            made = goal

            async def write(part: list[tuple[str, bool]]) -> None:
                for key, is_update in part:
                    if is_update:
                        await backend.update(key, _bump)
                    else:
                        await backend.set(key, b"set")

            async with anyio.create_task_group() as tg:
                for task in range(4):
                    tg.start_soon(write, plan[task::4])
            say(f"chunk {chunk}")
        say("done")


def _bump(entry: Entry | None) -> bytes:
    return b"%d" % (int(entry.value) + 1 if entry is not None and entry.value.isdigit() else 1)


async def consumer(url: str, prefix: str, path: str, since: str) -> None:
    async with connect(url, prefix) as backend:
        with open(path, "a", encoding="utf-8") as out:  # a local file, flushed per line
            cursor = since
            said_ready = False
            while True:
                try:
                    async with backend.changes("*", since=cursor, max_buffer=10_000) as changes:
                        if not said_ready:
                            say("ready")
                            said_ready = True
                        async for change in changes:
                            assert change.cursor is not None
                            line = f"{change.key} {change.version} {change.cursor}"
                            out.write(line + "\n")
                            out.flush()
                            say(line)
                            cursor = change.cursor
                except SubscriptionClosedError as exc:
                    if exc.reason != "overflow":
                        raise


def main(argv: list[str]) -> None:
    mode, url, prefix, *rest = argv
    if mode == "writer":
        anyio.run(writer, url, prefix, int(rest[0]), int(rest[1]), int(rest[2]))
    elif mode == "consumer":
        anyio.run(consumer, url, prefix, rest[0], rest[1])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
