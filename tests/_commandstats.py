"""Count the commands a block of code sends to a real Redis, from the server's own figures.

`INFO commandstats` is read on every primary before and after the block, and the per-command call
deltas, summed over the primaries, are `calls`. Redis counts there every command it runs, the ones
a Lua script runs included: a `save` (one EVALSHA) shows up with the GET, SET, PUBLISH and TIME
inside its script. To tell what clients sent, a MONITOR connection per primary watches the same
block, and `sent` is what it shows coming from a client rather than from `lua`. The helper's own
commands (INFO, and the ECHO that marks the end of the block on each MONITOR stream) are left out
of both. There are no sleeps: the block is over on a primary when its ECHO comes out of its
MONITOR stream.

Counts are server-wide: run nothing else against the server meanwhile (the tests run one at a
time; a subscriber's keep-alive PING after two seconds of silence would show, so keep blocks
short).

    async with command_counts(url) as counts:
        await state.get("k")
    assert counts.sent == {"get": 1}
"""

from __future__ import annotations

import uuid
from collections import Counter
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import redis.asyncio as aioredis

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from redis.asyncio.client import Monitor

_HELPER_COMMANDS = frozenset({"info"})  # the INFO calls are the helper's own
MARKER_TIMEOUT = 20.0  # seconds for a primary's end marker to come out of its MONITOR stream


@dataclass
class CommandCounts:
    """What one block cost on the server, filled in when the block ends."""

    calls: dict[str, int] = field(default_factory=dict)
    """`INFO commandstats` call deltas (commands run inside scripts included), by name."""
    sent: dict[str, int] = field(default_factory=dict)
    """The commands clients sent (a script call counts once, not its inner commands), by name."""

    @property
    def total(self) -> int:
        """How many commands were sent: the round trips, for code that sends one at a time."""
        return sum(self.sent.values())

    def describe(self) -> str:
        """One line for a failure message: `3 (get 1, evalsha 2)`."""
        parts = ", ".join(f"{name} {count}" for name, count in sorted(self.sent.items()))
        return f"{self.total} ({parts})"


def _is_cluster(url: str) -> bool:
    return urlsplit(url).scheme.endswith("+cluster")


async def _primaries(url: str) -> list[str]:
    """A URL per primary: the server itself, or each primary of the cluster the URL names."""
    if not _is_cluster(url):
        return [url]
    scheme = "rediss" if url.startswith("rediss") else "redis"
    first = urlsplit(url).netloc.split(",")[0]
    async with aioredis.Redis.from_url(f"{scheme}://{first}") as seed:
        # redis-py parses CLUSTER NODES into {"host:port": {"flags": "myself,master", ...}}.
        nodes: dict[str, dict[str, Any]] = await seed.execute_command("CLUSTER NODES")  # type: ignore[no-untyped-call]
    primaries = []
    for address, node in nodes.items():
        flags = set(str(node["flags"]).split(","))
        if "master" in flags and not {"fail", "fail?", "noaddr"} & flags:
            host_port = address.split("@")[0].split(",")[0]
            primaries.append(f"{scheme}://{host_port}")
    if not primaries:
        raise RuntimeError(f"no primary found in the cluster at {first}")
    return primaries


async def _commandstats(client: aioredis.Redis) -> Counter[str]:
    info: dict[str, Any] = await client.info("commandstats")
    return Counter(
        {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}
    )


async def _sent_until(monitor: Monitor, marker: str) -> Counter[str]:
    """The client commands on a MONITOR stream up to the ECHO carrying `marker`."""
    sent: Counter[str] = Counter()
    while True:
        seen = await monitor.next_command()
        name, _, rest = seen["command"].partition(" ")
        name = name.lower()
        if name == "echo" and rest == marker:
            return sent
        if seen["client_type"] != "lua" and name not in _HELPER_COMMANDS:
            sent[name] += 1


@asynccontextmanager
async def command_counts(url: str) -> AsyncIterator[CommandCounts]:
    """Count the commands the block sends to the Redis (or every primary of the cluster) at `url`.

    The yielded `CommandCounts` is empty inside the block and filled in when it ends.
    """
    counts = CommandCounts()
    async with AsyncExitStack() as stack:
        urls = await _primaries(url)
        # Two clients per primary (each its own connection pool): one for INFO and the ECHO,
        # one for MONITOR. Each connects before the primary's MONITOR starts (the first with an
        # INFO, the second with the MONITOR itself), so their handshakes (HELLO) and the
        # MONITORs stay out of both counts.
        clients = [aioredis.Redis.from_url(address) for address in urls]
        watchers = [aioredis.Redis.from_url(address) for address in urls]
        for client in [*clients, *watchers]:
            stack.push_async_callback(client.aclose)
        for client in clients:
            await _commandstats(client)
        monitors = [await stack.enter_async_context(watcher.monitor()) for watcher in watchers]
        before = [await _commandstats(client) for client in clients]
        yield counts
        marker = f"commandstats-{uuid.uuid4().hex}"
        sent: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for client, monitor, earlier in zip(clients, monitors, before, strict=True):
            await client.echo(marker)
            with anyio.fail_after(MARKER_TIMEOUT):
                sent += await _sent_until(monitor, marker)
            after = await _commandstats(client)
            after["echo"] -= 1  # the marker
            after.subtract(earlier)
            calls += Counter(
                {name: n for name, n in after.items() if n > 0 and name not in _HELPER_COMMANDS}
            )
        counts.calls = dict(calls)
        counts.sent = dict(sent)


async def count_commands(url: str, block: Callable[[], Awaitable[object]]) -> CommandCounts:
    """Run `block()` under `command_counts(url)` and return its counts."""
    async with command_counts(url) as counts:
        await block()
    return counts
