"""A writer process for the crash tests: `python -m tests.backends._file_writer DIR START [DEPTH]`.

Four concurrent tasks write `k{n % 40}` = n for n = START, START+1, ... (task `w` takes the n
with `n % 4 == w`, so each key has one writer and its values only grow), with fsync durability,
printing "ack n" after each write is acknowledged, until the process is killed. Concurrent
writers share log frames and fsyncs, so kills land inside multi-write batches too. With DEPTH,
every key keeps DEPTH versions of history and the feed keeps `FEED` changes (all of a test's).
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import FileBackend
from agenticstate.backends import FeedRetention

WRITERS = 4
FEED = FeedRetention(max_changes=1_000_000)


async def main(*args: str) -> None:
    directory, start, *depth = args
    if not depth:
        backend = FileBackend(base_path=directory, format="msgpack")
    else:
        backend = FileBackend(
            base_path=directory, format="msgpack", feed=FEED, history={"k*": int(depth[0])}
        )
    await backend.open()
    sys.stdout.write("open\n")
    sys.stdout.flush()

    async def writer(first: int) -> None:
        n = first
        while True:
            await backend.set(f"k{n % 40}", str(n).encode())
            sys.stdout.write(f"ack {n}\n")
            sys.stdout.flush()
            n += WRITERS

    async with anyio.create_task_group() as tg:
        for w in range(WRITERS):
            tg.start_soon(writer, int(start) + w)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
