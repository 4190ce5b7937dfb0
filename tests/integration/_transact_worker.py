"""A child process for `test_transact.py`: transactions racing other processes on one store.

`python -m tests.integration._transact_worker URL PREFIX ROUNDS` opens the backend, prints
`ready`, waits for a line on stdin, then makes ROUNDS Version-guarded Puts of a counter (each
with an IndexIncr of `ok`, or of `lost` when the compare failed) and an IndexIncr of `calls` per
attempt, and prints `done`.
"""

from __future__ import annotations

import sys

import anyio
import anyio.to_thread

from agenticstate.backends import Backend, Get, IndexIncr, Put, RedisBackend, SQLiteBackend, Version

KEY, INDEX = "{t}:counter", "{t}:stats"


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make(url: str, prefix: str) -> Backend:
    if url.startswith("sqlite://"):
        return SQLiteBackend(url.removeprefix("sqlite://"))
    return RedisBackend(url=url, key_prefix=prefix)


async def race(backend: Backend, rounds: int) -> None:
    done = 0
    while done < rounds:
        read = await backend.transact([], [Get(KEY)])
        entry = read.results[0]
        version = entry.version if entry is not None else 0
        value = int(entry.value) if entry is not None else 0
        result = await backend.transact(
            [Version(KEY, version)],
            [Put(KEY, b"%d" % (value + 1)), IndexIncr(INDEX, "ok", 1)],
            [IndexIncr(INDEX, "lost", 1)],
        )
        done += result.succeeded
        await backend.transact([], [IndexIncr(INDEX, "calls", 1)])


async def main(url: str, prefix: str, rounds: int) -> None:
    async with make(url, prefix) as backend:
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        await race(backend, rounds)
        say("done")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), backend="asyncio")
