"""A process that lists a store whose key index is not built yet, for the build-lock tests.

python -m tests.integration._keyindex_build_worker URL PREFIX
    open the store, print "ready", wait for a line on stdin, then list every key; print
    "building" the moment this process starts a build (so the parent can SIGKILL it there),
    and at the end one JSON line: {"keys": how many were listed, "built": builds finished here}.
"""

from __future__ import annotations

import json
import logging
import sys

import anyio

from agenticstate import RedisBackend


class _Builds(logging.Handler):
    """Counts this process's finished builds; says when one starts."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.finished = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "key_index_build_started" in message:
            sys.stdout.write("building\n")
            sys.stdout.flush()
        elif "key_index_built" in message:
            self.finished += 1


async def main(url: str, prefix: str) -> None:
    builds = _Builds()
    logger = logging.getLogger("agenticstate")
    logger.addHandler(builds)
    logger.setLevel(logging.INFO)
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await backend.get("warm")  # connected before the start
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await anyio.to_thread.run_sync(sys.stdin.readline)
        keys = [key async for key in backend.scan("*")]
    sys.stdout.write(json.dumps({"keys": len(keys), "built": builds.finished}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
