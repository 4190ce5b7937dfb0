"""Processes for the exact-delivery test (Redis).

python -m tests.integration._exact_worker subscribe URL PREFIX COUNT WHEN
    subscribe a callback to each of `process_patterns(COUNT)`, before or after opening the
    store (WHEN: before_open, after_open); print "live" once every one is live, then one JSON
    line per call: [pattern, key, seq]
python -m tests.integration._exact_worker write URL PREFIX COUNT WRITES
    save `process_writes(COUNT, WRITES)` in order, value {"seq": seq}; print "done"
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

from agenticstate import StateConfig, StateManager


def process_patterns(count: int) -> list[str]:
    """Literal-prefix patterns, and a tenth with a wildcard up front (they overlap the others)."""
    prefixed = [f"agent:{i}:*" for i in range(count - count // 10)]
    return prefixed + [f"*:{i}:x" for i in range(count // 10)]


def process_writes(count: int, writes: int) -> list[tuple[str, int]]:
    """The writer's (key, seq) in order; seq counts the key's writes, so it is its version."""
    done: dict[str, int] = {}
    out = []
    for j in range(writes):
        key = f"agent:{(j * 7) % count}:x"
        done[key] = done.get(key, 0) + 1
        out.append((key, done[key]))
    return out


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _config(url: str, prefix: str) -> StateConfig:
    return StateConfig(backend="redis", redis_url=url, key_prefix=prefix, subscriber_buffer=10_000)


async def subscribe(url: str, prefix: str, count: int, when: str) -> None:
    state = StateManager(_config(url, prefix))

    def recorder(pattern: str) -> Any:
        def record(key: str, old: Any, new: Any) -> None:
            say(json.dumps([pattern, key, new["seq"]]))

        return record

    patterns = process_patterns(count)
    if when == "before_open":
        handles = [state.subscribe(pattern, recorder(pattern)) for pattern in patterns]
        await state.open()
    else:
        await state.open()
        handles = [state.subscribe(pattern, recorder(pattern)) for pattern in patterns]
    for handle in handles:
        await handle.wait_live()
    say("live")
    await anyio.sleep_forever()  # the test kills this process once it has read what it needs


async def write(url: str, prefix: str, count: int, writes: int) -> None:
    async with StateManager(_config(url, prefix)) as state:
        for key, seq in process_writes(count, writes):
            await state.save(key, {"seq": seq})
    say("done")


def main() -> None:
    command, url, prefix, *rest = sys.argv[1:]
    if command == "subscribe":
        anyio.run(subscribe, url, prefix, int(rest[0]), rest[1])
    else:
        anyio.run(write, url, prefix, int(rest[0]), int(rest[1]))


if __name__ == "__main__":
    main()
