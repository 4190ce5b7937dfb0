"""Open an SQLite store as an unprivileged user, for the permission tests.

python -m tests.backends._sqlite_as_user PATH [OPTIONS_JSON]
    (as root, first become `nobody`: root reads and writes any file), open
    `SQLiteBackend(PATH, **OPTIONS)`, `get("k")` then `set("k2", b"v")`, and print one JSON
    line: for each step, {"ok": ...} or {"error": type name, "message": ...}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio

from agenticstate import SQLiteBackend

NOBODY = 65534


def _step(result: Any) -> dict[str, Any]:
    return {"ok": result}


async def main(path: str, options: dict[str, Any]) -> None:
    report: dict[str, Any] = {}
    backend = SQLiteBackend(path, **options)
    try:
        for name in ("get", "set"):
            try:
                if name == "get":
                    entry = await backend.get("k")
                    report[name] = _step(None if entry is None else entry.value.decode())
                else:
                    change = await backend.set("k2", b"v")
                    report[name] = _step(change.version)
            except Exception as exc:  # noqa: BLE001  # reported to the test
                report[name] = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        await backend.aclose()
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    # Everything is imported before privileges go: the interpreter may live where nobody reads.
    import anyio._backends._asyncio
    import anyio.to_thread

    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    anyio.run(main, sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
