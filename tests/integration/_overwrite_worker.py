"""A subscriber process for the feed-by-reference test: it checks each change's values.

python -m tests.integration._overwrite_worker URL PREFIX COUNT [CURSOR]
    follow `doc:*` (live, or from CURSOR) until COUNT changes came; print "live" once
    subscribed, then one JSON line per change: [key, op, version, old ok, new ok], where "ok"
    says the value is exactly `text(key, n)` for its version n (or None when absent).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

from agenticstate import StateManager
from agenticstate.backends import open_backend

SIZE = 3000  # bytes of text per value: above the feed's inline limit


def text(key: str, version: int) -> str:
    """The value the writer stores at `key`'s version `version`."""
    unit = f"{key}#{version}|"
    return (unit * (SIZE // len(unit) + 1))[:SIZE]


def _ok(key: str, version: int, value: Any) -> bool | None:
    if value is None:
        return None
    return bool(value == {"v": version, "text": text(key, version)})


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(url: str, prefix: str, count: int, cursor: str | None) -> None:
    async with StateManager(backend=open_backend(url, key_prefix=prefix)) as state:
        changes = state.changes("doc:*", since=cursor) if cursor else state.watch("doc:*")
        async with changes as stream:
            say("live")
            seen = 0
            async for change in stream:
                version = change.version
                old_version = version - 1 if change.op.value == "set" else version
                say(
                    json.dumps(
                        [
                            change.key,
                            change.op.value,
                            version,
                            _ok(change.key, old_version, change.old_value),
                            _ok(change.key, version, change.new_value),
                        ]
                    )
                )
                seen += 1
                if seen >= count:
                    return


if __name__ == "__main__":
    anyio.run(
        main, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if sys.argv[4:] else None
    )
