"""The subscriber process for the latency benchmark.

`python -m bench._subscriber URL PREFIX COUNT`: watch `lat:*`, and for each change compute the
delay between the writer's timestamp (in the value) and its arrival; print the delays as JSON
once COUNT changes arrived. With `count` after COUNT: watch `*` on a backend with a long feed
and print the changes per second once COUNT came (the throughput benchmark).
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from agenticstate import FeedRetention, RedisBackend, StateConfig, StateManager


async def count(url: str, prefix: str, wanted: int) -> None:
    """Watch `*` on a backend with a long feed; print the changes per second once `wanted` came."""
    feed = FeedRetention(max_changes=1_000_000)
    backend = RedisBackend(url=url, key_prefix=prefix, feed=feed)
    async with backend, backend.changes("*", max_buffer=1_000_000) as changes:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        seen, first = 0, 0.0
        async for _ in changes:
            seen += 1
            if seen == 1:
                first = time.perf_counter()
            if seen == wanted:
                break
    sys.stdout.write(json.dumps(wanted / (time.perf_counter() - first)) + "\n")
    sys.stdout.flush()


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
    if sys.argv[4:] == ["count"]:
        anyio.run(count, sys.argv[1], sys.argv[2], int(sys.argv[3]))
    else:
        anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
