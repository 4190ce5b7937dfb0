"""The Redis backend's wire: redis-py's clients, held connections, and its errors mapped.

This is the only module of the package that imports redis-py, and the only one that touches
its internals (`tests/backends/test_redis_internals.py` holds both, and fails by name when an
upgrade removes one):

- the connection class: `connection_pool.make_connection()`, `connect()`, `is_connected`,
  `can_read()`, `send_packed_command()`, `read_response()`, `disconnect(nowait=True)`; a pub/sub
  object's `connect()`, `connection` and `send_command()` (the server clock read on it); that
  connection's stream reader and writer and its hiredis reader (`PubSubLink`);
- for a cluster: `RedisCluster.initialize()`, `get_nodes()` and `get_connection_kwargs()`,
  `ClusterNode(...).acquire_connection()` (a node's connections, made with the cluster client's
  settings), and `MovedError`/`AskError` with their `slot_id`, `host` and `port`;
- the names of the functions that connect (`_CONNECT_FRAMES`): redis-py raises the same
  exception types for a failed connect and for a lost reply, so a traceback through one of them
  is how a write is known not to have been sent.

Commands on a single server go through `Connections` (see "Commands" in `backends/redis.py`):
packed here (`pack`), sent on a connection held by the backend, the reply read back. On a
cluster, `Cluster` routes each command by its key's slot to the `Connections` of that slot's
primary, and follows redirections. Every failure of redis-py, the socket or a timeout becomes
one of our exceptions in `translate`, the one place this backend maps foreign errors (as httpx's
`map_httpcore_exceptions` maps httpcore's).
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import os
import socket
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from agenticstate.config import hide_url_secrets, redact_url
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    ForeignRecordError,
    MissingDependencyError,
    WriteOutcomeUnknownError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import redis.asyncio as aioredis
    from redis.asyncio.client import PubSub
    from redis.asyncio.connection import AbstractConnection

__all__ = [
    "SLOTS",
    "Attempt",
    "Cluster",
    "Connections",
    "Node",
    "PubSubLink",
    "cluster_options",
    "command_key",
    "connect_pubsub",
    "key_slot",
    "make_client",
    "node_client",
    "pack",
    "require_asyncio",
    "require_redis",
    "translate",
    "translated",
    "unknown_script",
]


def require_redis() -> None:
    """Raise `MissingDependencyError` unless redis-py is installed."""
    try:
        import redis.asyncio  # noqa: F401  # optional dependency
    except ImportError:
        raise MissingDependencyError("redis", "redis") from None


def require_asyncio() -> None:
    """Raise `ConfigurationError` unless an asyncio event loop runs (not trio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            "RedisBackend runs under asyncio only (redis-py's client is asyncio-only); "
            "use the memory or file backend under trio"
        ) from None


# clients


def cluster_options(url: str) -> dict[str, Any]:
    """RedisCluster's arguments from a `redis+cluster://[user:password@]h:p,h:p` URL."""
    from urllib.parse import unquote, urlsplit

    from redis.asyncio.cluster import ClusterNode

    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for host_port in filter(None, hosts.split(",")):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"cluster URL {redact_url(url)!r}: each node must be host:port"
            )
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    if not nodes:
        raise ConfigurationError(f"cluster URL {redact_url(url)!r} names no node")
    options: dict[str, Any] = {"startup_nodes": nodes}
    if userinfo:
        user, _, password = userinfo.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) if password else None
    if parts.scheme.lower().startswith("rediss"):
        options["ssl"] = True
    return options


def make_client(
    url: str,
    *,
    cluster: bool,
    db: int | None,
    pool_size: int,
    connect_timeout: float,
    options: dict[str, Any],
) -> aioredis.Redis:
    """The backend's client: a `Redis` on a pool from the URL, or a `RedisCluster`.

    redis-py's own retries are off: retries are ours to decide, and a write whose outcome is
    unknown is never resent.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    if cluster:
        from redis.asyncio.cluster import RedisCluster

        try:
            made: Any = RedisCluster(
                **cluster_options(url),
                socket_timeout=None,
                socket_connect_timeout=connect_timeout,
                max_connections=pool_size + 2,
                retry=Retry(NoBackoff(), 0),
                **options,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"invalid Redis Cluster URL {redact_url(url)!r}: {hide_url_secrets(str(exc), url)}"
            ) from None
        return cast("aioredis.Redis", made)

    settings: dict[str, Any] = {
        # Reply timeouts are enforced around each call with asyncio.timeout (cheap);
        # redis-py's own socket timeout starts a task per read.
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout,
        # Commands are limited to pool_size at once by `Connections`; the pool keeps room for
        # the pub/sub connection on top.
        "max_connections": pool_size + 2,
        **options,
    }
    if db is not None:
        settings["db"] = db
    try:
        pool = aioredis.ConnectionPool.from_url(url, **settings)
        return aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"invalid Redis URL {redact_url(url)!r}: {hide_url_secrets(str(exc), url)}"
        ) from None


def node_client(
    url: str, node: Any, *, connect_timeout: float, options: dict[str, Any]
) -> aioredis.Redis:
    """A plain client to one cluster `node` (for the pub/sub connection)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    settings = cluster_options(url)
    settings.pop("startup_nodes")
    return aioredis.Redis(
        host=node.host,
        port=node.port,
        socket_connect_timeout=connect_timeout,
        # No silent reconnects: the reader must see every drop, to resync after it.
        retry=Retry(NoBackoff(), 0),
        **settings,
        **options,
    )


async def connect_pubsub(pubsub: PubSub, head_key: str | None = None) -> tuple[int, bytes | None]:
    """Connect `pubsub`; read the server's clock (milliseconds) and `head_key` on it.

    Read before subscribing, on the pub/sub connection itself (before it enters subscribed
    mode): every write after the subscription is stamped at or after the clock, and `head_key`
    (the change feed's counter, if given) holds the id of the last change before it.
    """
    await pubsub.connect()  # type: ignore[no-untyped-call]
    connection: Any = pubsub.connection
    await connection.send_command("TIME")
    seconds, micros = await connection.read_response()
    head = None
    if head_key is not None:
        await connection.send_command("GET", head_key)
        head = await connection.read_response()
    return int(seconds) * 1000 + int(micros) // 1000, head


class PubSubLink:
    """The pub/sub connection's commands and replies, sent and read here, not by `PubSub`.

    redis-py's `get_message` spends tens of microseconds of bookkeeping on every message (a
    health check, observability hooks, a retry wrapper, a timeout, a debug string of the whole
    message, a dict). Here every reply already received is parsed in one go by the connection's
    own hiredis reader (`gets()` until it needs more bytes) and handed over as it came:
    `[b"pmessage", pattern, channel, data]`, `[b"psubscribe", pattern, count]`, ...; a PING's
    answer is `[b"pong", data]` while subscribed, its bare `data` otherwise. Commands are
    written at once, without waiting: two commands sent one after the other reach the server in
    that order, whatever task sent them. Without hiredis (or if redis-py's connection no longer
    has what this needs) replies are read one at a time through `read_response`.
    """

    __slots__ = ("_connection", "_feed", "_gets", "_stream", "_waiting", "_writer")

    def __init__(self, pubsub: PubSub) -> None:
        connection: Any = pubsub.connection
        self._connection = connection
        self._gets: Any = None
        self._feed: Any = None
        self._waiting: object = None
        try:
            from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser

            self._stream: asyncio.StreamReader = connection._reader
            self._writer: asyncio.StreamWriter = connection._writer
            parser = connection._parser
            if isinstance(parser, _AsyncHiredisParser):
                reader: Any = parser._reader
                self._gets, self._feed, self._waiting = reader.gets, reader.feed, NOT_ENOUGH_DATA
        except (ImportError, AttributeError):  # pragma: no cover  # another redis-py
            pass

    def close(self) -> None:
        """Close the connection: the reader's next read ends, and it reconnects."""
        self._writer.transport.close()

    def send(self, *args: str | bytes) -> None:
        """Write one command (dropped if the connection is closing: the reader reconnects)."""
        transport = self._writer.transport
        if not transport.is_closing():
            transport.write(pack(args))

    async def read(self) -> list[Any]:
        """The replies waiting, at least one (run it under a timeout to wait less).

        Raises `ConnectionError` when the server closed the connection, and a reply that is an
        error.
        """
        gets = self._gets
        if gets is None:  # pragma: no cover  # without hiredis
            # No timeout (our clients' socket_timeout is None): the caller's bounds the wait.
            reply = await self._connection.read_response(
                disconnect_on_error=False, push_request=True
            )
            return [reply]
        replies = self._take(gets)
        while not replies:
            data = await self._stream.read(65536)
            if not data:
                raise ConnectionError("the server closed the pub/sub connection")
            self._feed(data)
            replies = self._take(gets)
        return replies

    def _take(self, gets: Any) -> list[Any]:
        replies = []
        waiting = self._waiting
        reply = gets()
        while reply is not waiting:
            if isinstance(reply, Exception):
                raise reply
            replies.append(reply)
            reply = gets()
        return replies


# commands on held connections


def pack(args: tuple[str | bytes | int | float, ...]) -> bytes:
    """One command in the Redis protocol (RESP), ready to send.

    ASCII text and ints are framed as one str and encoded once; only other values (bytes,
    non-ASCII text, scores) are encoded apart, and a value's bytes are copied once, by the join.
    """
    out: list[bytes] = []
    text = [f"*{len(args)}\r\n"]
    for arg in args:
        if type(arg) is str and arg.isascii():
            text.append(f"${len(arg)}\r\n{arg}\r\n")
            continue
        if type(arg) is int:
            digits = str(arg)
            text.append(f"${len(digits)}\r\n{digits}\r\n")
            continue
        if type(arg) is bytes:
            data = arg
        elif type(arg) is str:
            data = arg.encode()
        else:
            data = repr(float(arg)).encode()  # scores
        text.append(f"${len(data)}\r\n")
        out += ("".join(text).encode(), data)
        text = ["\r\n"]
    out.append("".join(text).encode())
    return b"".join(out)


class Attempt:
    """A command in flight, as the error mapping needs to know it.

    `write_key`: the key of a write (None for a read); `sent`: whether the command may have
    reached the server.
    """

    __slots__ = ("sent", "write_key")

    def __init__(self, write_key: str | None, *, sent: bool) -> None:
        self.write_key = write_key
        self.sent = sent


class Connections:
    """Connections held for commands: a free list, and callers waiting in order when all are busy.

    At most `size` exist. Each is made from redis-py's pool settings (address, TLS, credentials,
    database) but owned here, connected lazily under the calling command's timeout, and closed
    when the backend closes. Taking a connection never fails and never does I/O, so a waiter is
    only ever handed a connection.
    """

    __slots__ = ("closed", "free", "made", "make", "reply_error", "size", "waiters")

    def __init__(self, size: int, make: Callable[[], AbstractConnection] | None = None) -> None:
        self.size = size
        self.make = make  # makes a connection (by default, from the client's pool settings)
        from redis.exceptions import ResponseError  # bound once: an import per call costs

        self.reply_error = ResponseError
        self.made: list[AbstractConnection] = []
        self.free: list[AbstractConnection] = []
        self.waiters: deque[asyncio.Future[AbstractConnection]] = deque()
        self.closed = False

    async def call(
        self,
        client: aioredis.Redis,
        args: tuple[str | bytes | int | float, ...],
        attempt: Attempt,
        *,
        asking: bool = False,
    ) -> Any:
        """Send one command on a held connection and return its reply.

        Run it under a timeout: everything it waits for, a free connection, connecting and the
        reply, counts against it. `attempt.sent` turns true just before the command goes out, so a
        failure before it is never an unknown outcome. Failures are redis-py's, the socket's or
        `TimeoutError` (see `translate`). `asking`: send ASKING first, on the same connection (a
        cluster's ASK redirect).
        """
        ResponseError = self.reply_error  # noqa: N806  # the class, under its name
        connection: AbstractConnection | None = None
        try:
            connection = await self.take(client)
            if connection.is_connected and await connection.can_read():
                await connection.disconnect()  # end of file or stray data: reconnect
            if not connection.is_connected:
                await connection.connect()  # type: ignore[no-untyped-call]
            attempt.sent = True
            if asking:
                await connection.send_packed_command(_ASKING + pack(args), check_health=False)
                try:
                    await connection.read_response()  # +OK
                except ResponseError:
                    await connection.disconnect(nowait=True)  # the command's reply is unread
                    raise
            else:
                await connection.send_packed_command(pack(args), check_health=False)
            return await connection.read_response()
        except BaseException as exc:
            if connection is not None and not isinstance(exc, ResponseError):
                # The reply may still be on its way: never reuse the connection as it is.
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
            raise
        finally:
            if connection is not None:
                if self.closed:
                    with contextlib.suppress(Exception):
                        await connection.disconnect(nowait=True)
                else:
                    self.give(connection)

    async def take(self, client: aioredis.Redis) -> AbstractConnection:
        if self.free:
            return self.free.pop()
        if len(self.made) < self.size:
            connection: AbstractConnection = (
                self.make() if self.make is not None else client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
            )
            self.made.append(connection)
            return connection
        waiter: asyncio.Future[AbstractConnection] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give(waiter.result())  # handed over just as we were cancelled
            raise

    def give(self, connection: AbstractConnection) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self.free.append(connection)

    async def close(self) -> None:
        """Disconnect every connection (in use ones are dropped when they come back)."""
        self.closed = True
        made, self.made, self.free = self.made, [], []
        for connection in made:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)


# commands on a cluster

SLOTS = 16384
_MAX_REDIRECTS = 5  # MOVED or ASK replies followed for one command
_ASKING = pack(("ASKING",))


async def _close_discovery(cluster: Any) -> None:
    """Disconnect the nodes a `RedisCluster.initialize()` made before it failed."""
    await cluster.nodes_manager.aclose()
    await cluster.nodes_manager.aclose("startup_nodes")


def key_slot(key: str | bytes) -> int:
    """The cluster slot of `key`: CRC16 of its hash tag (`{...}`, if any) modulo 16384."""
    data = key.encode() if type(key) is str else cast("bytes", key)
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % SLOTS


def command_key(args: tuple[str | bytes | int | float, ...]) -> str | bytes | None:
    """The key a command is routed by: a script's first key, else the first argument."""
    if args[0] in ("EVALSHA", "EVAL"):
        return cast("str | bytes", args[3]) if int(args[2]) else None
    return cast("str | bytes", args[1]) if len(args) > 1 else None


class Node:
    """A cluster node: its address and the connections held to it.

    Connections are made with the settings of the backend's `RedisCluster` client
    (credentials, TLS, protocol).
    """

    __slots__ = ("connections", "host", "name", "port")

    def __init__(self, host: str, port: int, connections: Connections) -> None:
        self.host = host
        self.port = port
        self.name = f"{host}:{port}"
        self.connections = connections

    def __repr__(self) -> str:
        return f"Node({self.name})"


class Cluster:
    """A Redis Cluster's slot map and the connections held to each node, for commands.

    Commands go out as on a single server (`Connections.call`), to the node that owns their
    key's slot. The map is read with CLUSTER SLOTS on first use and again after a MOVED reply
    (the slot is repointed at once) or a failed connection (a failover): the next command
    reads it first. An ASK reply (a slot being migrated) sends the command once to the named
    node, after ASKING on the same connection. A redirect reply means the command did not
    run, so it is sent again, write or not.
    """

    __slots__ = (
        "closed",
        "errors",
        "generation",
        "lock",
        "nodes",
        "primaries",
        "size",
        "slots",
        "stale",
        "try_again",
        "url",
    )

    def __init__(self, size: int, url: str) -> None:
        from redis.exceptions import AskError, MovedError, ResponseError, TryAgainError

        self.errors = (MovedError, AskError, ResponseError)  # bound once, for `call`
        self.try_again = TryAgainError
        self.closed = False  # `close` was called: the map is never read again
        self.size = size
        self.url = url  # redacted, for messages
        self.nodes: dict[str, Node] = {}
        self.slots: list[Node | None] = [None] * SLOTS
        self.primaries: list[Node] = []
        self.stale = True
        self.generation = 0  # maps read so far
        self.lock = asyncio.Lock()

    def node(self, client: aioredis.Redis, host: str, port: int) -> Node:
        """The node at `host:port`, with connections made on first use."""
        name = f"{host}:{port}"
        node = self.nodes.get(name)
        if node is None:
            from redis.asyncio.cluster import ClusterNode

            cluster: Any = client
            settings = {**cluster.get_connection_kwargs(), "max_connections": self.size}
            made = ClusterNode(host, port, **settings)
            connections = Connections(self.size, made.acquire_connection)
            connections.closed = self.closed
            node = self.nodes[name] = Node(host, port, connections)
        return node

    async def call(
        self,
        client: aioredis.Redis,
        args: tuple[str | bytes | int | float, ...],
        attempt: Attempt,
        node: Node | None = None,
    ) -> Any:
        """Send one command to the node owning its key (or to `node`) and return its reply.

        Follows MOVED and ASK replies; run it under a timeout, as `Connections.call`.
        """
        MovedError, AskError, ResponseError = self.errors  # noqa: N806  # classes, by name
        if self.stale:
            await self.refresh(client)
        if node is None:
            key = command_key(args)
            node = self.slots[key_slot(key)] if key is not None else self.primaries[0]
            if node is None:
                self.stale = True
                raise BackendUnavailableError(
                    f"no node of the Redis Cluster at {self.url} serves slot {key_slot(key or '')}"
                )
        asking = False
        owner = node
        redirects = waits = 0
        while redirects < _MAX_REDIRECTS:
            try:
                return await node.connections.call(client, args, attempt, asking=asking)
            except self.try_again:
                # A command on several keys of a slot being migrated, while they are split
                # between the two nodes (a write with its change feed's stream): it did not
                # run. Redis asks to try again shortly; the caller's timeout bounds the waits.
                waits += 1
                await asyncio.sleep(min(0.002 * waits, 0.05))
                node, asking, redirects = owner, False, 0
                attempt.sent = False
                continue
            except MovedError as exc:
                node = owner = self.slots[exc.slot_id] = self.node(client, exc.host, exc.port)
                self.stale = True  # more slots may have moved: read the map before the next
                asking = False
            except AskError as exc:
                node = self.node(client, exc.host, exc.port)
                asking = True
            except ResponseError:
                raise
            except BaseException:
                self.stale = True  # the node may be gone (a failover): read the map again
                raise
            attempt.sent = False  # a redirect reply: the command did not run
            redirects += 1
        self.stale = True
        raise BackendUnavailableError(
            f"the Redis Cluster at {self.url} redirected a command {_MAX_REDIRECTS} times"
        )

    async def refresh(self, client: aioredis.Redis) -> None:
        """Read the slot map (CLUSTER SLOTS) from the first node that answers."""
        if self.closed:
            # A call that began before the close must not bring redis-py's client back to life.
            raise BackendUnavailableError(
                f"the connection to the Redis Cluster at {self.url} is closed"
            )
        seen = self.generation
        async with self.lock:
            if self.generation != seen and not self.stale:
                return  # read by another caller meanwhile
            cluster: Any = client
            try:
                await cluster.initialize()  # redis-py's discovery, once: the startup nodes
            except BaseException:
                # Cut short (cancelled): redis-py's own cleanup is cancelled with it, and its
                # aclose() skips a client that never finished: close its nodes, shielded.
                await asyncio.shield(_close_discovery(cluster))
                raise
            candidates = [*self.primaries]
            candidates += [self.node(client, n.host, int(n.port)) for n in cluster.get_nodes()]
            candidates += list(self.nodes.values())
            failure: BaseException | None = None
            tried: set[str] = set()
            for node in candidates:
                if node.name in tried:
                    continue
                tried.add(node.name)
                try:
                    reply = await node.connections.call(
                        client, ("CLUSTER", "SLOTS"), Attempt(None, sent=False)
                    )
                except Exception as exc:  # noqa: BLE001  # try the next node
                    failure = exc
                    continue
                if reply:
                    self._apply(client, reply, node.host)
                    return
            raise BackendUnavailableError(
                f"no node of the Redis Cluster at {self.url} answered with its slot map"
                + (f": {_reason(failure)}" if failure is not None else "")
            ) from failure

    def _apply(self, client: aioredis.Redis, reply: list[Any], queried: str) -> None:
        slots: list[Node | None] = [None] * SLOTS
        primaries: dict[str, Node] = {}
        for start, end, primary, *_ in reply:
            host = _text(primary[0])
            node = self.node(client, host if host not in ("", "?") else queried, int(primary[1]))
            primaries.setdefault(node.name, node)
            slots[int(start) : int(end) + 1] = [node] * (int(end) - int(start) + 1)
        self.slots = slots
        self.primaries = list(primaries.values())
        self.generation += 1
        self.stale = False

    async def close(self) -> None:
        """Disconnect every node's connections.

        A discovery in progress (another task's first call) finishes first, and a node met
        after the close disconnects each connection once it has been used.
        """
        self.closed = True
        async with self.lock:
            pass
        for node in self.nodes.values():
            await node.connections.close()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# errors


@contextlib.contextmanager
def translate(url: str, write_key: str | None = None, *, sent: bool = True) -> Iterator[Attempt]:
    """Raise the failures of the commands inside as our exceptions (see `translated`).

    `url` is the one shown in messages (redacted). For a write, `write_key` names its key; with
    `sent=False` the command counts as sent only once the code inside sets `attempt.sent`.
    """
    attempt = Attempt(write_key, sent=sent)
    try:
        yield attempt
    except Exception as exc:
        ours = translated(exc, url, attempt.write_key if attempt.sent else None)
        if ours is exc:
            raise
        raise ours from exc


def translated(exc: Exception, url: str, write_key: str | None) -> Exception:
    """Our exception for a failed command (redis-py's, OSError or a timeout), in one place.

    A failure of the connection during a write (`write_key`) is `WriteOutcomeUnknownError`,
    unless it happened while connecting, before anything was sent. Anything else not redis-py's
    is returned as it is.
    """
    from redis import exceptions as rexc

    if isinstance(exc, rexc.AuthenticationError):
        return BackendUnavailableError(f"Redis refused the credentials for {url}")
    if "db index is out of range" in str(exc).lower():  # SELECT, as the connection opens
        return BackendError(
            f"the server at {url} has no such database: name one it has in the URL "
            "(/0 to /15 with Redis's default `databases 16`)"
        )
    unserved = (
        rexc.ClusterDownError,
        rexc.TryAgainError,
        rexc.MasterDownError,
        rexc.MaxConnectionsError,
        rexc.RedisClusterException,
    )
    if isinstance(exc, unserved):
        # The cluster refused the command without running it (reconfiguring, no coverage).
        return BackendUnavailableError(
            f"the Redis Cluster at {url} is not serving this key now: {type(exc).__name__}"
        )
    if isinstance(exc, (TimeoutError, rexc.ConnectionError, rexc.TimeoutError, OSError)):
        before_send = _failed_to_connect(exc)
        if write_key is not None and not before_send:
            return WriteOutcomeUnknownError(
                write_key,
                f"the connection to Redis failed during the write to {write_key!r}; "
                "it may or may not have been applied",
            )
        if _chain_has(exc, (rexc.TimeoutError, TimeoutError)):
            return BackendTimeoutError(
                f"Redis at {url} did not answer in time{_tls_hint(url, exc, timed_out=True)}"
            )
        return BackendUnavailableError(
            f"cannot reach Redis at {url}: {_reason(exc)}{_tls_hint(url, exc, timed_out=False)}"
        )
    reply = str(exc).lower().replace("`", "'")  # Redis 5 and 6 quote with backticks
    if isinstance(exc, rexc.ResponseError) and "unknown command 'hello'" in reply:
        # Redis before 6.0 has no HELLO, so it cannot speak RESP3.
        return BackendError(
            f"the server at {url} is not supported: it rejected the RESP3 handshake "
            "(HELLO), so it is older than Redis 6.0; agenticstate needs Redis 6.0 or newer "
            "(or Valkey)"
        )
    if isinstance(exc, rexc.ResponseError) and "is not an agenticstate key index" in reply:
        # Another client wrote over the store's key index: the script stopped before writing.
        index = str(exc).split("WRONGTYPE ", 1)[-1].split(" is not an agenticstate", 1)[0]
        return ForeignRecordError(
            index,
            f"the store's key index {index!r} holds a Redis value of another type (another "
            "client wrote over it); nothing was written: delete that key, then call "
            "RedisBackend.reindex() to build the index again",
        )
    if isinstance(exc, rexc.ResponseError) and "wrongtype" in reply:
        # A key of another application (a list, a hash, ...) where the command needs a record.
        name = write_key if write_key is not None else "a key of the command"
        return ForeignRecordError(
            name,
            f"{name if write_key is None else repr(name)} holds a Redis value of another type "
            "than agenticstate's records (another application's key under the prefix)",
        )
    if isinstance(exc, rexc.RedisError):
        return BackendError(f"Redis error: {type(exc).__name__}: {exc}")
    return exc


def unknown_script(exc: BaseException) -> bool:
    """Whether `exc` (from `translate`) was a NOSCRIPT reply: the script did not run."""
    from redis.exceptions import NoScriptError

    return isinstance(exc.__cause__, NoScriptError)


def no_permission(exc: BaseException) -> bool:
    """Whether `exc` (from `translate`) was a NOPERM reply: the ACL user may not do that."""
    from redis.exceptions import NoPermissionError

    cause = exc.__cause__
    return isinstance(cause, NoPermissionError) or "NOPERM" in str(cause or "")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _chain_has(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    return any(isinstance(link, kinds) for link in _chain(exc))


# The functions of redis-py's connection classes that connect (a failure inside one of them
# sent nothing). tests/backends/test_redis_internals.py checks they still exist.
_CONNECT_FRAMES = frozenset({"connect", "_connect", "on_connect", "on_connect_check_health"})


def _failed_to_connect(exc: BaseException) -> bool:
    """Whether the failure happened while connecting, before any command was sent.

    redis-py raises the same exception types for a failed connect and for a lost reply, so the
    traceback decides: a failure inside the connection's connect step sent nothing.
    """
    for link in _chain(exc):
        if isinstance(link, (ConnectionRefusedError, FileNotFoundError)):
            return True
        frame = link.__traceback__
        while frame is not None:
            code = frame.tb_frame.f_code
            if code.co_name in _CONNECT_FRAMES and "redis" in code.co_filename:
                return True
            frame = frame.tb_next
    return False


def _tls_hint(url: str, exc: BaseException, *, timed_out: bool) -> str:
    """What to check when the failure looks like TLS on one side only, or `""`.

    A `rediss://` client on a port that serves plain Redis sends its TLS hello and waits: the
    server reads it as the start of a command and never answers, so the connection times out.
    A `redis://` client on a port that serves only TLS has its connection reset.
    """
    scheme = url.partition("://")[0].lower()
    if not _failed_to_connect(exc):
        return ""
    if timed_out and scheme.startswith("rediss"):
        return (
            "; a rediss:// (TLS) URL waits like this on a port that serves plain Redis: check "
            "that the port is the server's TLS port (tls-port), or use redis://"
        )
    reset = any(
        isinstance(link, ConnectionResetError) or "closed by server" in str(link).lower()
        for link in _chain(exc)
    )
    if reset and scheme in ("redis", "redis+cluster"):
        return "; if that port serves TLS only (tls-port), use rediss://"
    return ""


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in words: "connection refused", "host name not resolved"."""
    for link in _chain(exc):
        if isinstance(link, socket.gaierror):
            return f"host name not resolved ({link.strerror})"
        if isinstance(link, OSError) and link.errno:
            return os.strerror(link.errno).lower()
    text = str(exc)
    if "connecting to" in text:  # redis-py names the host and port it parsed: say less
        return f"{type(exc).__name__} while connecting"
    return text or type(exc).__name__
