"""A fault-injecting TCP proxy for the reliability tests (asyncio, in the test's own event loop).

```python
async with FaultProxy("127.0.0.1", server.port, seed=1) as proxy:
    backend = RedisBackend(url=proxy.url, socket_timeout=0.2)
    proxy.faults = Faults(latency=(0.0, 0.05), drop=0.02, reset_reply=0.02)
    ...
    proxy.faults = Faults()  # healthy again
```

It listens on 127.0.0.1 (a free port) and forwards every accepted connection to the upstream
address, chunk by chunk, in both directions, in order. What it does to the traffic is
`proxy.faults`, which the test may replace at any time; each chunk draws its fate from the
faults in force when it arrives:

- `latency`: each chunk waits a random time in `(low, high)` seconds before it is forwarded
  (chunks of one direction stay in order, so delays add up behind a slow one).
- `stall`: with this probability a chunk waits `stall_delay` seconds more: longer than the
  client waits, so a request stalled this way reaches the server after the client gave up.
- `drop`: with this probability a chunk is not forwarded and the connection is closed on both
  sides (the client sees end of file; a request dropped so never reached the server).
- `reset_reply`: with this probability a reply (a chunk from the server) is cut: a random
  prefix of it (possibly nothing) is forwarded, then the client connection is reset (RST). The
  server did run the command; the client loses its reply.
- `blackhole`: new connections are accepted but never connected upstream (nothing is forwarded,
  ever); on existing connections nothing is forwarded while it lasts (data waits in the proxy).
- `refuse`: with this probability a new connection is closed at once, before anything is sent.

`cut_reply(after=n)` cuts one particular reply: the one after the next `n` replies.

`silence()` makes every open connection half-open: the upstream side is closed (the server
sees the client go) while the client's side stays open and hears nothing, ever, as after a NAT
or load balancer silently forgets an idle connection.

`sever()` closes every connection (both sides) and cancels everything still waiting in the
proxy, so that afterwards nothing more can reach the server through it: the tests' barrier
before they resolve unknown outcomes. `stats` counts what was injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, TypeVar

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from types import TracebackType

__all__ = ["FaultProxy", "Faults", "ProxyStats", "ProxyThread"]

T = TypeVar("T")

_CHUNK = 65536


@dataclass(frozen=True)
class Faults:
    """What the proxy does to the traffic; the default forwards everything at once."""

    latency: tuple[float, float] = (0.0, 0.0)
    stall: float = 0.0
    stall_delay: float = 0.0
    drop: float = 0.0
    reset_reply: float = 0.0
    blackhole: bool = False
    refuse: float = 0.0


@dataclass
class ProxyStats:
    """What the proxy has seen and injected since it started."""

    connections: int = 0
    chunks: int = 0
    delayed: int = 0
    stalled: int = 0
    dropped: int = 0
    reset: int = 0
    refused: int = 0
    blackholed: int = 0
    severed: int = 0
    silenced: int = 0

    def injected(self) -> int:
        """Faults injected that break a connection (latency excluded)."""
        broken = self.dropped + self.reset + self.refused + self.blackholed
        return broken + self.severed + self.silenced


@dataclass(eq=False)
class _Link:
    """One client connection and, unless it is blackholed, its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False
    silent: bool = False  # half-open: upstream closed, the client side kept open and mute


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) rather than FIN: the peer's pending reads fail."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Forward 127.0.0.1:`port` to `host`:`upstream_port`, injecting `faults`.

    Args:
        host: The upstream host.
        upstream_port: The upstream port.
        seed: Seeds the random draws, so a failing run can be replayed.
    """

    def __init__(self, host: str, upstream_port: int, *, seed: int = 0) -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.faults = Faults()
        self.stats = ProxyStats()
        self._random = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._cut_countdown: int | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """A redis:// URL that reaches the upstream server through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def set_faults(self, faults: Faults) -> None:
        """Switch to `faults` now (new chunks and connections draw from them)."""
        self.faults = faults
        if faults.blackhole:
            self._flowing.clear()
        else:
            self._flowing.set()

    def cut_reply(self, *, after: int = 0) -> None:
        """Let `after` replies through, then cut the next one as `reset_reply` does."""
        self._cut_countdown = after

    def _cut_now(self) -> bool:
        if self._cut_countdown is not None:
            if self._cut_countdown == 0:
                self._cut_countdown = None
                return True
            self._cut_countdown -= 1
        return bool(self.faults.reset_reply) and self._random.random() < self.faults.reset_reply

    async def sever(self) -> int:
        """Close every connection on both sides and drop what waits in the proxy.

        Returns:
            How many connections were open.
        """
        links = list(self._links)
        for link in links:
            self._close(link, reset=True, force=True)
        tasks = [task for link in links for task in link.tasks] + list(self._handlers)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.stats.severed += len(links)
        return len(links)

    async def silence(self) -> int:
        """Close the upstream side of every open connection; leave the client side open, mute.

        Returns:
            How many connections were silenced.
        """
        links = [link for link in self._links if not link.silent]
        for link in links:
            link.silent = True
        tasks = [task for link in links for task in link.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            if link.upstream is not None:
                link.upstream.transport.abort()
        self.stats.silenced += len(links)
        return len(links)

    async def aclose(self) -> None:
        """Stop listening and sever every connection."""
        if self._server is not None:
            self._server.close()
        await self.sever()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # the forwarding

    def _close(self, link: _Link, *, reset: bool = False, force: bool = False) -> None:
        if link.closed or (link.silent and not force):
            return
        link.closed = True
        self._links.discard(link)
        for writer in (link.client, link.upstream):
            if writer is None:
                continue
            if reset:
                _reset(writer)
            else:
                writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # Only sever() cancels a handler, after closing its connections; asyncio would log
            # a cancelled handler as an error.
            writer.transport.abort()
        finally:
            self._handlers.discard(handler)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        faults = self.faults
        link = _Link(client=writer)
        self._links.add(link)
        if faults.blackhole:
            # Accepted, never connected upstream: the client waits for replies that never come.
            self.stats.blackholed += 1
            with contextlib.suppress(Exception):
                while await reader.read(_CHUNK):
                    pass  # swallow what the client sends
            self._close(link)
            return
        if faults.refuse and self._random.random() < faults.refuse:
            self.stats.refused += 1
            self._close(link, reset=True)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            self._close(link, reset=True)
            return
        link.upstream = up_writer
        if link.closed:  # severed while connecting
            up_writer.transport.abort()
            return
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer, reply=False)),
            asyncio.create_task(self._pump(link, up_reader, writer, reply=True)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._close(link)

    async def _pump(
        self,
        link: _Link,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        *,
        reply: bool,
    ) -> None:
        """Forward `source` to `sink` chunk by chunk, injecting faults; close both at the end."""
        try:
            while not link.closed:
                data = await source.read(_CHUNK)
                if not data:
                    break
                self.stats.chunks += 1
                await self._flowing.wait()  # the blackhole holds existing connections
                faults = self.faults
                low, high = faults.latency
                delay = self._random.uniform(low, high) if high > 0 else 0.0
                if faults.stall and self._random.random() < faults.stall:
                    self.stats.stalled += 1
                    delay += faults.stall_delay
                if delay > 0:
                    self.stats.delayed += 1
                    # The injected fault itself, not a synchronisation: the chunk is late.
                    await asyncio.sleep(delay)
                    await self._flowing.wait()
                if link.closed:
                    break
                if faults.drop and self._random.random() < faults.drop:
                    self.stats.dropped += 1
                    self._close(link)
                    break
                if reply and self._cut_now():
                    self.stats.reset += 1
                    cut = self._random.randrange(len(data))
                    if cut:
                        sink.write(data[:cut])
                        with contextlib.suppress(Exception):
                            await sink.drain()
                    self._close(link, reset=True)
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._close(link)


class ProxyThread:
    """A `FaultProxy` on an event loop of its own, in a thread: for tests that are not async
    (the proxied clients are other processes).

    ```python
    with ProxyThread("127.0.0.1", server.port, faults=Faults(drop=0.01)) as proxy:
        run_workers(proxy.url)
    ```
    """

    def __init__(self, host: str, upstream_port: int, *, faults: Faults, seed: int = 0) -> None:
        self.proxy = FaultProxy(host, upstream_port, seed=seed)
        self.proxy.set_faults(faults)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        """The proxy's redis:// URL."""
        return self.proxy.url

    def __enter__(self) -> Self:
        self._thread.start()
        self._run(self.proxy.start())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._run(self.proxy.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def set_faults(self, faults: Faults) -> None:
        """Switch faults (from the test's thread)."""
        self._loop.call_soon_threadsafe(self.proxy.set_faults, faults)

    def sever(self) -> int:
        """`FaultProxy.sever`, from the test's thread."""
        return self._run(self.proxy.sever())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)
