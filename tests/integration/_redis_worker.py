"""Separate processes for the Redis tests.

python -m tests.integration._redis_worker increment URL PREFIX COUNT
    do COUNT update() increments of the key "counter", print "done"
python -m tests.integration._redis_worker subscribe URL PREFIX PATTERN
    watch PATTERN; print "ready", then one JSON line per change: key, op, version, value
"""

from __future__ import annotations

import json
import logging
import sys

import anyio

from agenticstate import StateConfig, StateManager


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def increment(state: StateManager, count: int) -> None:
    for _ in range(count):
        await state.update("counter", lambda n: n + 1, default=0)
    say("done")


async def subscribe(state: StateManager, pattern: str) -> None:
    async with state.watch(pattern) as changes:
        say("ready")
        async for change in changes:
            say(
                json.dumps(
                    {
                        "key": change.key,
                        "op": change.op.value,
                        "version": change.version,
                        "value": change.new_value,
                    }
                )
            )


async def main(mode: str, url: str, prefix: str, arg: str) -> None:
    # Stdout carries the events; the library's logs go to stderr.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    config = StateConfig(
        backend="redis", redis_url=url, key_prefix=prefix, subscriber_buffer=100_000
    )
    async with StateManager(config) as state:
        if mode == "increment":
            await increment(state, int(arg))
        elif mode == "subscribe":
            await subscribe(state, arg)
        else:
            raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
