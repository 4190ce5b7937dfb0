"""A child process for `test_commits_processes.py`: commits of one scope racing other processes.

`python -m tests.integration._commit_worker URL PREFIX WORKER ROUNDS [RETENTION]` opens a
StateManager over the backend, prints `ready`, waits for a line on stdin, then ROUNDS times saves
`p:wWORKER` (the round) and `p:shared`, commits scope `p:` and prints the commit id; then prints
`done`. With RETENTION (a small one), the values come back round after round (the round modulo
3), so blobs are dropped and needed again while other processes prune the same scope.
"""

from __future__ import annotations

import sys

import anyio
import anyio.to_thread

from agenticstate import StateConfig, StateManager
from agenticstate.backends import Backend, RedisBackend, SQLiteBackend

SCOPE = "p:"
RETENTION = 10_000  # keep every commit: the test checks the whole chain


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make(url: str, prefix: str) -> Backend:
    if url.startswith("sqlite://"):
        return SQLiteBackend(url.removeprefix("sqlite://"))
    return RedisBackend(url=url, key_prefix=prefix)


async def main(url: str, prefix: str, worker: int, rounds: int, retention: int) -> None:
    config = StateConfig(commit_retention=retention)
    cycle = rounds if retention == RETENTION else 3
    async with StateManager(config, backend=make(url, prefix)) as state:
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for round_ in range(rounds):
            await state.save(f"{SCOPE}w{worker}", round_ % cycle)
            await state.save(f"{SCOPE}shared", [worker % 2, round_ % cycle])
            info = await state.commit(SCOPE, message=f"{worker}:{round_}")
            say(f"commit {info.id}")
        say("done")


if __name__ == "__main__":
    retention = int(sys.argv[5]) if len(sys.argv) > 5 else RETENTION
    anyio.run(
        main,
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        retention,
        backend="asyncio",
    )
