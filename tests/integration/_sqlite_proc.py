"""Separate processes sharing one SQLite database, for the cross-process tests.

python -m tests.integration._sqlite_proc update DB COUNT
    print "ready", wait for a line on stdin, then COUNT x `update("counter", +1)`; print "done"
python -m tests.integration._sqlite_proc subscribe DB COUNT [SINCE]
    subscribe to "*" (from cursor SINCE if given), print "ready", then one JSON line per change
    (seq, key, op, old, new as hex, version) until COUNT changes arrived; print "expired" if
    the changes after SINCE are no longer retained
python -m tests.integration._sqlite_proc writer DB NAME
    8 tasks save NAME:T:N for N = 0, 1, ...; print "ack NAME:T:N" once each save returned;
    run until killed
python -m tests.integration._sqlite_proc worker|reaper|indexer DB PREFIX [ARG]
    the task queue and indexing roles of `_queue_worker`, on the SQLite database
python -m tests.integration._sqlite_proc flight DB PREFIX COUNT
    the single-flight role of `_flight_worker`, on the SQLite database
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import anyio

from agenticstate import (
    CursorExpiredError,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SQLiteBackend,
    StateConfig,
    StateManager,
    ToolStateManager,
)
from tests.integration._queue_worker import indexer, reaper, worker

if TYPE_CHECKING:
    from agenticstate.backends.sqlite import SQLiteChangeStream


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_at(path: str, prefix: str = "") -> StateManager:
    return StateManager(StateConfig(backend="sqlite", sqlite_path=path, key_prefix=prefix))


async def update(path: str, count: int) -> None:
    async with state_at(path) as state:
        await state.open()
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for _ in range(count):
            await state.update("counter", lambda n: n + 1, default=0)
        say("done")


async def subscribe(path: str, count: int, since: str | None) -> None:
    async with SQLiteBackend(path) as backend:
        try:
            async with backend.changes("*", since=since) as changes:
                await _print_changes(changes, count)
        except CursorExpiredError:
            say("expired")


async def _print_changes(changes: SQLiteChangeStream, count: int) -> None:
    say(f"ready {changes.cursor}")
    seen = 0
    async for change in changes:
        seen += 1
        say(
            json.dumps(
                {
                    "seq": changes.cursor,
                    "key": change.key,
                    "op": change.op.value,
                    "old": change.old.hex() if change.old is not None else None,
                    "new": change.new.hex() if change.new is not None else None,
                    "version": change.version,
                }
            )
        )
        if seen >= count:
            return


async def writer(path: str, name: str) -> None:
    async with state_at(path) as state:

        async def one(task: int) -> None:
            n = 0
            while True:
                key = f"{name}:{task}:{n}"
                await state.save(key, {"key": key, "pad": "x" * 200})
                say(f"ack {key}")
                n += 1

        async with anyio.create_task_group() as tg:
            for task in range(8):
                tg.start_soon(one, task)


async def flight(path: str, prefix: str, count: int) -> None:
    state = state_at(path, prefix)
    tools = ToolStateManager(state_manager=state)
    ran = 0

    async def expensive() -> dict[str, int]:
        nonlocal ran
        ran += 1
        await anyio.sleep(0.5)  # the tool's slow work, long enough for every process to ask
        return {"answer": 42}

    await state.open()
    say("ready")
    await anyio.to_thread.run_sync(sys.stdin.readline)
    results: list[object] = []

    async def call() -> None:
        results.append(await tools.cached_call("oracle", {"question": "life"}, expensive))

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(call)
    assert results == [{"answer": 42}] * count
    say(f"ran {ran}")
    await state.aclose()


async def role(mode: str, path: str, prefix: str, arg: str) -> None:
    state = state_at(path, prefix)
    try:
        if mode == "worker":
            await worker(OrchestrationStateManager(state_manager=state), arg)
        elif mode == "reaper":
            await reaper(OrchestrationStateManager(state_manager=state))
        else:
            await indexer(KnowledgeStateManager(state_manager=state), int(arg))
    finally:
        await state.aclose()


def main(argv: list[str]) -> None:
    mode, path, *rest = argv
    if mode == "update":
        anyio.run(update, path, int(rest[0]))
    elif mode == "subscribe":
        anyio.run(subscribe, path, int(rest[0]), rest[1] if len(rest) > 1 else None)
    elif mode == "writer":
        anyio.run(writer, path, rest[0])
    elif mode == "flight":
        anyio.run(flight, path, rest[0], int(rest[1]))
    elif mode in ("worker", "reaper", "indexer"):
        anyio.run(role, mode, path, rest[0], rest[1] if len(rest) > 1 else "")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
