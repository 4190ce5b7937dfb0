"""A child process for `test_commits_processes.py`: commits of one scope racing other processes.

`python -m tests.integration._commit_worker URL PREFIX WORKER ROUNDS` opens a StateManager over
the backend, prints `ready`, waits for a line on stdin, then ROUNDS times saves `p:wWORKER` (the
round) and `p:shared`, commits scope `p:` and prints the commit id; then prints `done`.
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


async def main(url: str, prefix: str, worker: int, rounds: int) -> None:
    config = StateConfig(commit_retention=RETENTION)
    async with StateManager(config, backend=make(url, prefix)) as state:
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for round_ in range(rounds):
            await state.save(f"{SCOPE}w{worker}", round_)
            await state.save(f"{SCOPE}shared", [worker, round_])
            info = await state.commit(SCOPE, message=f"{worker}:{round_}")
            say(f"commit {info.id}")
        say("done")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), backend="asyncio")
