"""A writer process for the crash tests: `python -m tests.backends._file_writer DIR START [DEPTH]`.

Four concurrent tasks write `k{n % 40}` = n for n = START, START+1, ... (task `w` takes the n
with `n % 4 == w`, so each key has one writer and its values only grow), with fsync durability,
printing "ack n" after each write is acknowledged, until the process is killed. Concurrent
writers share log frames and fsyncs, so kills land inside multi-write batches too. With DEPTH,
every key keeps DEPTH versions of history and the feed keeps `FEED` changes (all of a test's).

`python -m tests.backends._file_writer --fork` serves the crash tests that kill a writer many
times: it imports once, then for each line `DIR START [DEPTH]` (tab-separated) on stdin forks a
writer, which prints "pid N" and then runs as above; on the line `reap` it waits for the
writer (the test has killed it) and prints "reaped", after every line the writer printed. A
round then costs a fork instead of an interpreter's start and imports (100 rounds took a
minute). The writer is a whole process all the same, killed by the test with SIGKILL.
"""

from __future__ import annotations

import os
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


def serve() -> None:
    """Fork a writer per request line; reap it on `reap` (see the module's docstring)."""
    child = 0
    for line in sys.stdin:
        request = line.rstrip("\n")
        if request == "reap":
            os.waitpid(child, 0)
            sys.stdout.write("reaped\n")
            sys.stdout.flush()
            continue
        sys.stdout.flush()
        child = os.fork()
        if child == 0:  # the writer: never returns to the loop
            try:
                sys.stdout.write(f"pid {os.getpid()}\n")
                sys.stdout.flush()
                anyio.run(main, *request.split("\t"))
            except BaseException as exc:  # noqa: BLE001  # a line no test takes for an ack
                sys.stdout.write(f"ended {exc!r}\n")
                sys.stdout.flush()
            finally:
                os._exit(1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork"]:
        serve()
    else:
        anyio.run(main, *sys.argv[1:])
