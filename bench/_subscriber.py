"""The subscriber process for the latency benchmark.

`python -m bench._subscriber URL PREFIX COUNT`: watch `lat:*`, and for each change compute the
delay between the writer's timestamp (in the value) and its arrival; print the delays as JSON
once COUNT changes arrived.
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from agenticstate import StateConfig, StateManager


async def main(url: str, prefix: str, count: str) -> None:
    config = StateConfig(
        backend="redis", redis_url=url, key_prefix=prefix, subscriber_buffer=100_000
    )
    delays: list[float] = []
    async with StateManager(config) as state, state.watch("lat:*") as changes:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        async for change in changes:
            delays.append(time.time() - change.new_value["sent"])
            if len(delays) == int(count):
                break
    sys.stdout.write(json.dumps(delays) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
