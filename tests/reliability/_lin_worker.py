"""A worker process for the linearizability test: mixed calls on a few keys, one line each.

python -m tests.reliability._lin_worker URL PREFIX PROCESS COUNT SEED TIMEOUT KEY...

Connects (with `socket_timeout=TIMEOUT` seconds), prints "ready", waits for a line on stdin (so
every worker starts at once), then makes COUNT calls on the KEYs through a StateManager over
RedisBackend and prints one JSON line per call as it completes, then "done":

    {"p": 0, "k": "a", "kind": "cas", "value": "p0-7", "expected": 3,
     "t0": <monotonic ns at invocation>, "t1": <monotonic ns at response>,
     "status": "ok" | "conflict" | "unknown" | "failed", "result": ...}

Calls: `get_entry` (read: result [version, value id]), `save` (write: the new version),
`save(expected_version=)` (cas: the new version, or the actual version on a conflict) and
`update` (read-modify-write: the id of the value it replaced). Every stored value is
`{"id": <this call's id>, "prev": <the id it replaced, for update>}`, so each is unique.
A write whose reply was lost (`WriteOutcomeUnknownError`) is "unknown"; one the library says was
not applied (`BackendUnavailableError`, `BackendTimeoutError`, an update that lost every race) is
"failed".
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from typing import Any

import anyio

from agenticstate import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConflictError,
    RedisBackend,
    StateConfig,
    StateManager,
    WriteOutcomeUnknownError,
)

WEIGHTS = {"read": 35, "write": 15, "cas": 30, "update": 20}


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def call(
    state: StateManager, kind: str, key: str, value: str, expected: int
) -> tuple[str, Any]:
    """Make one call; return its status and result."""
    try:
        if kind == "read":
            entry = await state.get_entry(key)
            return "ok", [0, None] if entry is None else [entry.version, entry.value["id"]]
        if kind == "write":
            return "ok", await state.save(key, {"id": value, "prev": None})
        if kind == "cas":
            try:
                saved = await state.save(
                    key, {"id": value, "prev": None}, expected_version=expected
                )
            except ConflictError as exc:
                return "conflict", ["conflict", exc.actual]
            return "ok", saved
        new = await state.update(
            key, lambda current: {"id": value, "prev": current["id"]}, default={"id": None}
        )
        return "ok", new["prev"]
    except WriteOutcomeUnknownError:
        return "unknown", None
    except (BackendUnavailableError, BackendTimeoutError, ConflictError):
        return "failed", None


async def main(
    url: str,
    prefix: str,
    process: int,
    count: int,
    seed: int,
    socket_timeout: float,
    keys: list[str],
) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    rng = random.Random(seed)
    known = dict.fromkeys(keys, 0)  # the last version this process saw for each key
    backend = RedisBackend(
        url=url, key_prefix=prefix, socket_timeout=socket_timeout, connect_timeout=socket_timeout
    )
    async with StateManager(StateConfig(), backend=backend) as state:
        await state.get("warm-up")  # connect before the start line
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for n in range(count):
            kind = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
            key = rng.choice(keys)
            value = f"p{process}-{n}"
            expected = known[key]
            t0 = time.monotonic_ns()
            status, result = await call(state, kind, key, value, expected)
            t1 = time.monotonic_ns()
            if kind == "read" and status == "ok":
                known[key] = result[0]
            elif kind in ("write", "cas") and status == "ok":
                known[key] = result
            elif status == "conflict":
                known[key] = result[1]
            line = {"p": process, "k": key, "kind": kind, "value": value, "expected": expected}
            line |= {"t0": t0, "t1": t1, "status": status, "result": result}
            say(json.dumps(line))
    say("done")


if __name__ == "__main__":
    url, prefix, process, count, seed, timeout, *keys = sys.argv[1:]
    anyio.run(main, url, prefix, int(process), int(count), int(seed), float(timeout), keys)
