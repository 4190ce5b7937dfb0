"""Processes for the LocalView cross-process tests (SQLite, Redis, Redis Cluster).

python -m tests.integration._view_worker write KIND TARGET PREFIX COUNT
    save agent:I = {"i": I} for I < COUNT, then delete agent:0; print "done"
python -m tests.integration._view_worker count KIND TARGET PREFIX COUNT
    open a view of "counter:*", print "ready", wait for a line on stdin, then COUNT x
    `view.update("counter:x", n + 1, default=0)`; print "done CONFLICTS"

KIND is sqlite (TARGET: the database file) or redis (TARGET: a redis:// or redis+cluster:// URL).
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import StateConfig, StateManager


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def manager(kind: str, target: str, prefix: str) -> StateManager:
    """A manager over the shared store the test names."""
    if kind == "sqlite":
        return StateManager(StateConfig(backend="sqlite", sqlite_path=target, key_prefix=prefix))
    return StateManager(StateConfig(backend="redis", redis_url=target, key_prefix=prefix))


async def write(state: StateManager, count: int) -> None:
    for i in range(count):
        await state.save(f"agent:{i}", {"i": i})
    await state.delete("agent:0")
    say("done")


async def count(state: StateManager, count: int) -> None:
    async with state.view("counter:*") as view:
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for _ in range(count):
            await view.update("counter:x", lambda n: n + 1, default=0)
    say(f"done {state.stats().conflicts}")


async def main(command: str, kind: str, target: str, prefix: str, number: int) -> None:
    async with manager(kind, target, prefix) as state:
        await (write if command == "write" else count)(state, number)


if __name__ == "__main__":
    command, kind, target, prefix, number = sys.argv[1:]
    anyio.run(main, command, kind, target, prefix, int(number))
