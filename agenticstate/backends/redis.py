"""RedisBackend: shared state across processes and machines, with change events over pub/sub.

Layout. Each state key is one Redis string, `{key_prefix}{key}`, holding a fixed 65-byte ASCII
header (version, created, updated and expiry times in milliseconds) followed by the value bytes,
so `get` is one GET and `get_many` one MGET. A non-empty prefix ends with `:`, so that no other
prefix starts with it (`app1:` and `app12:` never meet). Each change is published on the channel
`__agenticstate__:{key_prefix}{key}`.

Writes. Every write is one Lua script run on the server (loaded once by SHA, re-loaded after
NOSCRIPT): it checks `expected_version`, stores the value, bumps the version, applies the TTL
and PUBLISHes the change with the exact old and new bytes and the key's expiry, all in one
atomic step. Clock readings come from the server (`TIME`), so every client agrees on
timestamps and expiry.

Delivery. One pub/sub connection per backend, with one PSUBSCRIBE for every change under the
prefix, serves all its subscriptions: the reader matches each change against the subscribed
patterns through an index on their literal prefixes (a few dict lookups per change however many
patterns there are), with the same glob rules as Redis. A subscription is live when `changes()`
is entered: the PSUBSCRIBE is confirmed and a barrier on the connection has come back (a PING;
in a cluster, a marker published on every primary), so every change committed after entry is
delivered and none from before it.

Redis pub/sub is at-most-once: a message published while a subscriber is disconnected is lost.
When the connection drops (or Redis restarts), the backend reconnects by itself with backoff,
subscribes again, then **resyncs**: it scans the subscribed keys and emits a `RESYNC` change (old
value unknown, `None`) for every key whose version or value differs from what it delivered, for
every key written since the last change it read that it never delivered, and for every key it
delivered that is gone (`new=None`). A key that existed before the subscription and did not
change is not a change. Each subscription remembers, per key still alive, the version it got,
so a live change that a resync already covered is not delivered twice; a key's memory goes with
its delete or its expiry (the published change carries the expiry), so a key written again after
it expired starts over at version 1 and is delivered. The resync hands changes over only as
fast as the subscriptions take them. A connection that dies without a word (a NAT forgets it) is
found out too: after two seconds of silence the reader sends a PING, and no answer within
`socket_timeout` counts as a drop. `aclose()` first drains the connection (a barrier), so
subscriptions get every change committed before it.

Faults. Reads and scans are retried (bounded, with backoff) when the connection fails or times
out, then raise `BackendUnavailableError` or `BackendTimeoutError`. Writes are never retried
blindly: a write that fails before it is sent raises `BackendUnavailableError`; one whose reply
was lost raises `WriteOutcomeUnknownError` (read the key's version to find out what happened).
redis-py's own exceptions never leak.

Commands. The backend keeps up to `connection_pool_size` connections of its own (made with
redis-py's connection class and the URL's settings: address, TLS, credentials, database); each
command is packed here and sent on a free one, and callers beyond that wait, in order. The wait
for a connection, connecting and the reply all count against `socket_timeout`. redis-py's
`execute_command` spends most of a command's client-side time on bookkeeping (the pool lock,
observability hooks, the retry wrapper): a command sent this way costs about 40% fewer
instructions, which is what lets a scripted save, with its larger reply, keep up with a plain
SET. Before reuse, a connection that saw end of file or stray data (a restarted server) is
reconnected, as redis-py's pool does. Pub/sub keeps using the redis-py client.

Cluster. `redis+cluster://host:port,host:port,...` (or `rediss+cluster://`) runs the same
backend on Redis Cluster through redis-py's `RedisCluster`, which routes each command to the
node owning its key's slot and follows MOVED/ASK redirects. Every atomic step touches one key
(one slot), so it stays atomic; managers put a record's id in a `{...}` hash tag, so one team's
records and its queue index, or one workflow's, live in one slot. `get_many` sends one MGET per
slot, `save_many` one script call per slot, `scan` visits every primary, and PUBLISH reaches
every node over the cluster bus, so one pub/sub connection to any node sees every shard's
changes (each shard's in its order; the shards are not ordered with each other). Barriers
(subscribe, close) PUBLISH a marker on every primary instead of a PING. After a failover the
client re-reads the slot map on the next command (reads retry; writes report their outcome as
usual), and the subscriber resyncs. redis-py's own retries stay
off here too. Cluster mode sends commands through redis-py (the held-connection path above is
for a single server).

This backend uses redis-py's asyncio client: it runs under asyncio, not trio. Under trio every
entry point raises `ConfigurationError` before touching the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import math
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

import anyio

from agenticstate._glob import compile_glob
from agenticstate._keys import (
    RESERVED_PREFIX,
    escape_glob,
    validate_key,
    validate_key_prefix,
    validate_pattern,
)
from agenticstate._log import get_logger
from agenticstate.backends import _redis_txn
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    TxnResult,
    backoff,
    check_expected_version,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
)
from agenticstate.config import redact_url
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    InvalidArgumentError,
    MissingDependencyError,
    WriteOutcomeUnknownError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

    import redis.asyncio as aioredis
    from redis.asyncio.connection import AbstractConnection

    from agenticstate.backends.base import TxnCompare, TxnOp

__all__ = ["CHANNEL_NAMESPACE", "RedisBackend"]

log = get_logger(__name__)

CHANNEL_NAMESPACE = "__agenticstate__:"
"""What every change channel starts with (before the key prefix)."""
INDEX_NAMESPACE = "__agenticstate_idx__:"
"""What every sorted index's Redis key starts with (before the key prefix)."""

_SET_MANY_CHUNK = 500  # keys per set_many script call
_BARRIER = "agenticstate-barrier:"  # PING payloads on the pub/sub connection (+ a token)
_GONE_KEPT_MS = 10_000  # how long a resync remembers a key it found gone
_PRUNE_LAG_MS = 1000  # expired keys are forgotten this long after they expire
_HEALTH = "agenticstate-health"
_PUBSUB_IDLE = 2.0  # seconds of silence before the pub/sub connection is asked whether it lives
CLUSTER_SCHEMES = frozenset({"redis+cluster", "rediss+cluster"})
"""URL schemes that name a Redis Cluster (a comma-separated list of startup nodes)."""
_HEADER = 65  # version 20 + created 15 + updated 15 + expires 15 (0 = never), ASCII digits

# The stored length of each key, 0 for a missing one (usage(): sizes without reading values).
_STRLEN_SCRIPT = """
local sizes = {}
for i, name in ipairs(KEYS) do sizes[i] = redis.call('STRLEN', name) end
return sizes
"""

# One write: check the version, store header + value, apply the TTL, publish old and new.
# Returns {1, version, old-or-false, now} or {0, actual version} on a version conflict.
_WRITE_FUNCTION = """
local function write(key, value, ttl, expected, channel, now)
  local cur = redis.call('GET', key)
  local ver = 0
  local created = nil
  local old = false
  if cur then
    ver = tonumber(string.sub(cur, 1, 20))
    created = string.sub(cur, 21, 35)
    old = string.sub(cur, 66)
  end
  if expected >= 0 and expected ~= ver then
    return {0, ver}
  end
  local nowstr = string.format('%015d', now)
  if not created then created = nowstr end
  local expires = 0
  if ttl > 0 then expires = now + ttl end
  ver = ver + 1
  local verstr = string.format('%020d', ver)
  local record = verstr .. created .. nowstr .. string.format('%015d', expires) .. value
  if ttl > 0 then
    redis.call('SET', key, record, 'PX', ttl)
  else
    redis.call('SET', key, record)
  end
  local oldpart = '0'
  if old then oldpart = '1' .. string.format('%010d', #old) .. old end
  redis.call('PUBLISH', channel, 'W' .. verstr .. nowstr .. string.format('%015d', expires)
    .. oldpart .. value)
  return {1, ver, old, now}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] the key; ARGV: value, ttl ms (0 = none), expected version (-1 = any), channel.
_SET_SCRIPT = (
    _WRITE_FUNCTION
    + """
return write(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], now)
"""
)

# KEYS: the keys; ARGV: ttl ms, then a value and a channel per key. Each write is unconditional;
# the reply is each write's reply, in order.
_SET_MANY_SCRIPT = (
    _WRITE_FUNCTION
    + """
local ttl = tonumber(ARGV[1])
local replies = {}
for i = 1, #KEYS do
  replies[i] = write(KEYS[i], ARGV[2 * i], ttl, -1, ARGV[2 * i + 1], now)
end
return replies
"""
)

# KEYS[1] the key; ARGV: expected version (-1 = any), channel.
# Returns {1, version, old, now}, {2} when missing, or {0, actual version} on a conflict.
_DELETE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local ver = 0
if cur then ver = tonumber(string.sub(cur, 1, 20)) end
local expected = tonumber(ARGV[1])
if expected >= 0 and expected ~= ver then
  return {0, ver}
end
if not cur then return {2} end
local old = string.sub(cur, 66)
redis.call('DEL', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local verstr = string.format('%020d', ver)
redis.call('PUBLISH', ARGV[2], 'D' .. verstr .. string.format('%015d', now) .. '1'
  .. string.format('%010d', #old) .. old)
return {1, ver, old, now}
"""


def _ms(value: int) -> datetime:
    return datetime.fromtimestamp(value / 1000, UTC)


def _entry(key: str, raw: bytes) -> Entry:
    if len(raw) < _HEADER:
        raise BackendError(f"the record at {key!r} is not an agenticstate record")
    try:
        version = int(raw[0:20])
        created = int(raw[20:35])
        updated = int(raw[35:50])
        expires = int(raw[50:65])
    except ValueError:
        raise BackendError(f"the record at {key!r} is not an agenticstate record") from None
    return Entry(
        key=key,
        value=raw[_HEADER:],
        version=version,
        created_at=_ms(created),
        updated_at=_ms(updated),
        expires_at=_ms(expires) if expires else None,
    )


def _parse_message(key: str, data: bytes) -> tuple[Change, int]:
    """Decode a published change and when the key expires (server ms, 0 = never).

    `W`: a write (op, version, timestamp, expiry, optional old, new); `D`: a delete (no expiry);
    `S`: a write published by an earlier version of this library (no expiry).
    """
    kind = data[:1]
    op = ChangeOp.DELETE if kind == b"D" else ChangeOp.SET
    version = int(data[1:21])
    stamp = int(data[21:36])
    position = 36
    expires = 0
    if kind == b"W":
        expires = int(data[36:51])
        position = 51
    old: bytes | None = None
    if data[position : position + 1] == b"1":
        size = int(data[position + 1 : position + 11])
        old = data[position + 11 : position + 11 + size]
        position += 11 + size
    else:
        position += 1
    new = data[position:] if op is ChangeOp.SET else None
    change = Change(key=key, op=op, old=old, new=new, version=version, timestamp=_ms(stamp))
    return change, expires


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()  # noqa: S324  # Redis names scripts so


def _pack(args: tuple[str | bytes | int | float, ...]) -> bytes:
    """One command in the Redis protocol (RESP), ready to send."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is str:
            data = arg.encode()
        elif type(arg) is bytes:
            data = arg
        elif type(arg) is int:
            data = b"%d" % arg
        else:
            data = repr(float(arg)).encode()  # scores
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


def _ttl_ms(ttl: timedelta | None) -> int:
    return 0 if ttl is None else max(1, math.ceil(ttl.total_seconds() * 1000))


class _Connections:
    """Connections held for commands: a free list, and callers waiting in order when all are busy.

    At most `size` exist. Each is made from redis-py's pool settings (address, TLS, credentials,
    database) but owned here, connected lazily under the calling command's timeout, and closed
    when the backend closes. Taking a connection never fails and never does I/O, so a waiter is
    only ever handed a connection.
    """

    __slots__ = ("closed", "free", "made", "size", "waiters")

    def __init__(self, size: int) -> None:
        self.size = size
        self.made: list[AbstractConnection] = []
        self.free: list[AbstractConnection] = []
        self.waiters: deque[asyncio.Future[AbstractConnection]] = deque()
        self.closed = False

    async def take(self, client: aioredis.Redis) -> AbstractConnection:
        if self.free:
            return self.free.pop()
        if len(self.made) < self.size:
            connection: AbstractConnection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
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


class _KeyLock:
    """One key's update lock, and how many callers hold or wait for it (to drop it when idle)."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class _Group:
    """The local subscriptions to one pattern, and what was delivered to them.

    `seen` holds, for each key delivered and still alive, its version, a hash of its value and
    when it expires (server milliseconds, 0 = never). It decides duplicates (a resync overlapping
    the live stream), what a resync must emit, and a key's new life after it expired. Entries
    leave on a delete and when they expire (`expiries` orders them), so it never outgrows the
    keys alive in the pattern.
    """

    __slots__ = ("expiries", "fanout", "matcher", "pattern", "seen", "streams", "users")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.matcher = compile_glob(pattern)
        self.fanout = ChangeFanout()
        self.users = 0
        self.streams: list[tuple[ChangeStream, int]] = []  # (stream, its max_buffer)
        # key -> (version, hash of the value or None once gone, expires in server ms or 0)
        self.seen: dict[str, tuple[int, int | None, int]] = {}
        self.expiries: list[tuple[int, str]] = []  # a heap of (expires, key)

    def deliver(self, change: Change, stamp: int, expires: int) -> None:
        """Publish a live change unless it was delivered already (by a resync)."""
        key = change.key
        known = self.seen.get(key)
        if known is not None and not (known[2] and known[2] <= stamp):
            # The same life of the key (it did not expire since): only a newer version is news.
            version, value_hash = known[0], known[1]
            if value_hash is None:
                # A resync found it gone: older writes are stale, a new life (old None) is news.
                if (change.op is ChangeOp.DELETE or change.old is not None) and (
                    change.version <= version
                ):
                    return
            elif change.version < version or (
                change.version == version and change.op is not ChangeOp.DELETE
            ):
                return
        if change.op is ChangeOp.DELETE:
            self.seen.pop(key, None)
        else:
            self.remember(key, change.version, hash(change.new), expires)
        self.fanout.publish(change)

    def remember(self, key: str, version: int, value_hash: int | None, expires: int) -> None:
        """Record what was delivered for `key` (`value_hash=None`: it is gone)."""
        self.seen[key] = (version, value_hash, expires)
        if expires:
            heapq.heappush(self.expiries, (expires, key))
            if len(self.expiries) > 2 * len(self.seen) + 64:
                # Keys rewritten with a TTL leave stale heap entries: rebuild from `seen`.
                self.expiries = [(e, k) for k, (_, _, e) in self.seen.items() if e]
                heapq.heapify(self.expiries)

    def prune(self, now: int) -> None:
        """Forget the keys that expired by `now` (server milliseconds)."""
        expiries = self.expiries
        while expiries and expiries[0][0] <= now:
            expires, key = heapq.heappop(expiries)
            known = self.seen.get(key)
            if known is not None and known[2] == expires:
                del self.seen[key]

    def backlog(self) -> float:
        """How full the fullest open subscription's buffer is (0.0 empty, 1.0 full)."""
        fullest = 0.0
        for stream, max_buffer in self.streams:
            fullest = max(fullest, stream.buffered / max_buffer)
        return fullest


class _Barrier:
    """A subscription (or a drain, `stream=None`) waiting for its barrier messages."""

    __slots__ = ("opened", "remaining", "stream")

    def __init__(self, stream: ChangeStream | None) -> None:
        self.stream = stream
        self.opened = asyncio.Event()
        self.remaining = 1  # barrier messages still to come

    def open(self) -> None:
        if self.stream is not None:
            self.stream.open()
        self.opened.set()


class _PatternIndex:
    """The subscribed patterns by their literal prefix: a key meets only patterns it can match.

    A key is looked up once per distinct literal-prefix length, so a change costs a few dict
    lookups however many patterns are subscribed, plus one glob match per pattern that shares
    the key's prefix.
    """

    __slots__ = ("_by_prefix", "_lengths")

    def __init__(self) -> None:
        self._by_prefix: dict[str, list[_Group]] = {}
        self._lengths: list[int] = []

    def __len__(self) -> int:
        return sum(len(groups) for groups in self._by_prefix.values())

    def add(self, group: _Group) -> None:
        prefix = group.matcher.literal_prefix
        self._by_prefix[prefix] = [*self._by_prefix.get(prefix, []), group]
        self._lengths = sorted({len(p) for p in self._by_prefix})

    def remove(self, group: _Group) -> None:
        prefix = group.matcher.literal_prefix
        rest = [g for g in self._by_prefix.get(prefix, []) if g is not group]
        if rest:
            self._by_prefix[prefix] = rest
        else:
            self._by_prefix.pop(prefix, None)
        self._lengths = sorted({len(p) for p in self._by_prefix})

    def matching(self, key: str) -> list[_Group]:
        """The groups whose pattern matches `key`."""
        found: list[_Group] = []
        by_prefix = self._by_prefix
        size = len(key)
        for length in self._lengths:
            if length > size:
                break
            groups = by_prefix.get(key[:length])
            if groups is not None:
                found += [group for group in groups if group.matcher.match(key)]
        return found

    def groups(self) -> list[_Group]:
        return [group for groups in self._by_prefix.values() for group in groups]


class RedisBackend(Backend):
    """Keep state in Redis, shared by every process that uses the same server and prefix.

    Args:
        url: `redis://[user:password@]host:port/db`, `rediss://...` for TLS, or `unix:///path`.
        db: The database, when the URL names none.
        key_prefix: Put before every key (and every change channel); keys are given and listed
            without it. Empty, or ending with `:` (`"agenticai:"`), so that no other prefix
            starts with it: sibling prefixes never see each other's keys.
        connection_pool_size: The most connections held open (the pub/sub one is separate).
        socket_timeout: Seconds to wait for a reply before `BackendTimeoutError`.
        connect_timeout: Seconds to wait for a connection.
        read_retries: Times a read or scan is retried after a connection failure or timeout.
        client: Use this `redis.asyncio.Redis` instead of creating one (it is not closed).
        **client_options: Passed to `redis.asyncio.Redis.from_url` (TLS files, for example:
            `ssl_ca_certs=...`, `ssl_certfile=...`, `ssl_keyfile=...`).

    Raises:
        MissingDependencyError: redis-py is not installed (`pip install "agenticstate[redis]"`).
        ConfigurationError: A bad URL or option, or a `key_prefix` not ending with `:`.
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379",
        db: int | None = None,
        key_prefix: str = "",
        connection_pool_size: int = 10,
        *,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        read_retries: int = 3,
        client: aioredis.Redis | None = None,
        **client_options: Any,
    ) -> None:
        try:
            import redis.asyncio  # noqa: F401  # optional dependency
        except ImportError:
            raise MissingDependencyError("redis", "redis") from None
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError("url must look like redis://host:port/db")
        validate_key_prefix(key_prefix)
        if connection_pool_size < 1 or read_retries < 0:
            raise ConfigurationError("connection_pool_size must be >= 1, read_retries >= 0")
        self._url = url  # with its password: only connections see it (`url` is redacted)
        self.db = db
        self.key_prefix = key_prefix
        self.connection_pool_size = connection_pool_size
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        self.read_retries = read_retries
        self._client_options = client_options
        self._client: aioredis.Redis | None = client
        self._owns_client = client is None
        self.is_cluster = url.split("://", 1)[0].lower() in CLUSTER_SCHEMES
        if self.is_cluster and db:
            raise ConfigurationError("Redis Cluster has only database 0")
        self._set_sha = _sha(_SET_SCRIPT)
        self._set_many_sha = _sha(_SET_MANY_SCRIPT)
        self._delete_sha = _sha(_DELETE_SCRIPT)
        # One PSUBSCRIBE per backend: every change under the prefix, matched here by pattern.
        self._subscription = escape_glob(f"{CHANNEL_NAMESPACE}{key_prefix}") + "*"
        self._channel_prefix = f"{CHANNEL_NAMESPACE}{key_prefix}".encode()
        self._channel_cut = len(self._channel_prefix)
        # Barrier messages go to a "key" no real key can be (keys may not use the reserved
        # prefix), tagged with this backend's id so other subscribers ignore them.
        self._reserved = RESERVED_PREFIX.encode()
        self._barrier_key = f"{RESERVED_PREFIX}:barrier:{uuid.uuid4().hex}:".encode()
        self._groups: dict[str, _Group] = {}
        self._index = _PatternIndex()
        self._pubsub: Any = None
        self._pubsub_source: aioredis.Redis | None = None  # a cluster node's client for pub/sub
        self._reader: asyncio.Task[None] | None = None
        self._live = asyncio.Event()  # the PSUBSCRIBE is confirmed on the current connection
        self._tokens = itertools.count()
        # Barriers waiting for their PONG: token -> (the stream to open, or None; an event).
        self._barriers: dict[int, _Barrier] = {}  # waiting for their PONG or markers
        self._horizon = 0  # server ms: every change stamped before it was read (or was older)
        self._gap_from = 0  # the horizon when the connection last dropped
        self._resync_pending = False
        # Server clocks of a cluster's nodes may differ a little: a resync looks that far back.
        self._clock_skew_ms = 50 if self.is_cluster else 0
        self._clock_offset = 0.0  # server ms minus local ms, from the last change read
        self._pruned = 0  # server ms of the last pass forgetting expired keys
        self._closed = False
        # Callers beyond the pool size wait here for a connection instead of failing.
        self._connections = _Connections(connection_pool_size)
        self._cluster_slots = asyncio.Semaphore(connection_pool_size)
        self._cluster_mapped = False
        self._update_locks: dict[str, _KeyLock] = {}

    @property
    def url(self) -> str:
        """The URL this backend connects to, with any password replaced by `***`.

        The password is kept for the connections only, so that logging or printing the backend
        (or its `url`) never shows it.
        """
        return redact_url(self._url)

    def __repr__(self) -> str:
        return f"RedisBackend(url={self.url!r}, key_prefix={self.key_prefix!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Create a backend from `redis://`, `rediss://` or `unix://` (`?key_prefix=` allowed)."""
        from urllib.parse import parse_qsl, urlencode, urlsplit

        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("key_prefix", options.pop("key_prefix", ""))
        cleaned = url
        if parts.query:
            # Rebuild by hand: urlunsplit drops the `//` of `unix:///path`.
            rest = f"?{urlencode(query)}" if query else ""
            cleaned = f"{parts.scheme}://{parts.netloc}{parts.path}{rest}"
        return cls(url=cleaned, key_prefix=prefix, **options)

    # connections

    def _cluster_options(self) -> dict[str, Any]:
        """RedisCluster's arguments from a `redis+cluster://[user:password@]h:p,h:p` URL."""
        from urllib.parse import unquote, urlsplit

        from redis.asyncio.cluster import ClusterNode

        parts = urlsplit(self._url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes = []
        for host_port in filter(None, hosts.split(",")):
            host, _, port = host_port.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigurationError(f"cluster URL {self.url!r}: each node must be host:port")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        if not nodes:
            raise ConfigurationError(f"cluster URL {self.url!r} names no node")
        options: dict[str, Any] = {"startup_nodes": nodes}
        if userinfo:
            user, _, password = userinfo.partition(":")
            options["username"] = unquote(user) or None
            options["password"] = unquote(password) if password else None
        if parts.scheme.lower().startswith("rediss"):
            options["ssl"] = True
        return options

    def _make_client(self) -> aioredis.Redis:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        if self.is_cluster:
            from redis.asyncio.cluster import RedisCluster

            try:
                cluster: Any = RedisCluster(
                    **self._cluster_options(),
                    socket_timeout=None,
                    socket_connect_timeout=self.connect_timeout,
                    max_connections=self.connection_pool_size + 2,
                    # Retries are ours to decide: never resend a write whose outcome is unknown.
                    retry=Retry(NoBackoff(), 0),
                    **self._client_options,
                )
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(f"invalid Redis Cluster URL {self.url!r}: {exc}") from None
            return cast("aioredis.Redis", cluster)

        options: dict[str, Any] = {
            # Reply timeouts are enforced around each call with asyncio.timeout (cheap);
            # redis-py's own socket timeout starts a task per read.
            "socket_timeout": None,
            "socket_connect_timeout": self.connect_timeout,
            # Commands are limited to connection_pool_size at once by our semaphore; the pool
            # keeps room for the pub/sub connection on top.
            "max_connections": self.connection_pool_size + 2,
            **self._client_options,
        }
        if self.db is not None:
            options["db"] = self.db
        try:
            pool = aioredis.ConnectionPool.from_url(self._url, **options)
            # Retries are ours to decide: never resend a write whose outcome is unknown.
            return aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid Redis URL {self.url!r}: {exc}") from None

    async def open(self) -> None:
        """Create the client and load the scripts (no connection is made until first use).

        Raises:
            ConfigurationError: Not running under asyncio (this backend does not run under trio).
        """
        _require_asyncio()
        if self._closed:
            raise BackendError("this RedisBackend is closed")
        if self._client is None:
            self._client = self._make_client()

    async def _redis(self) -> aioredis.Redis:
        _require_asyncio()
        if self._client is None:
            await self.open()
        assert self._client is not None  # noqa: S101  # set by open()
        return self._client

    def _k(self, key: str) -> str:
        return self.key_prefix + validate_key(key)

    @staticmethod
    def _channel(name: str) -> str:
        # `name` is the prefixed Redis key, so the channel is the namespace plus that.
        return CHANNEL_NAMESPACE + name

    def _translated(self, exc: Exception, write_key: str | None) -> Exception:
        """Our exception for a failed command (redis-py's, OSError or a timeout), in one place."""
        from redis import exceptions as rexc

        if isinstance(exc, rexc.AuthenticationError):
            return BackendUnavailableError(f"Redis refused the credentials for {self.url}")
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
                f"the Redis Cluster at {self.url} is not serving this key now: {type(exc).__name__}"
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
                return BackendTimeoutError(f"Redis at {self.url} did not answer in time")
            return BackendUnavailableError(f"cannot reach Redis at {self.url}: {_reason(exc)}")
        reply = str(exc).lower().replace("`", "'")  # Redis 5 and 6 quote with backticks
        if isinstance(exc, rexc.ResponseError) and "unknown command 'hello'" in reply:
            # Redis before 6.0 has no HELLO, so it cannot speak RESP3.
            return BackendError(
                f"the server at {self.url} is not supported: it rejected the RESP3 handshake "
                "(HELLO), so it is older than Redis 6.0; agenticstate needs Redis 6.0 or newer "
                "(or Valkey)"
            )
        if isinstance(exc, rexc.RedisError):
            return BackendError(f"Redis error: {type(exc).__name__}: {exc}")
        return exc

    async def _execute(self, *args: str | bytes | int | float, write_key: str | None = None) -> Any:
        """Send one command on a held connection and return its reply (see "Commands").

        Everything the call waits for, a free connection, connecting and the reply, counts
        against `socket_timeout`. A failure before the command was sent is never an unknown
        outcome: a write that was not sent raises `BackendUnavailableError` or
        `BackendTimeoutError`.

        Raises:
            BackendError: A subclass for connection failures and timeouts (a write whose reply
                was lost: `WriteOutcomeUnknownError`), or for an error reply.
        """
        _require_asyncio()
        client = self._client or await self._redis()
        if self.is_cluster:
            return await self._execute_on_cluster(client, args, write_key)
        from redis.exceptions import ResponseError

        connections = self._connections
        connection: AbstractConnection | None = None
        sent = False
        try:
            async with asyncio.timeout(self.socket_timeout):
                connection = await connections.take(client)
                if connection.is_connected and await connection.can_read():
                    await connection.disconnect()  # end of file or stray data: reconnect
                if not connection.is_connected:
                    await connection.connect()  # type: ignore[no-untyped-call]
                sent = True
                await connection.send_packed_command(_pack(args), check_health=False)
                return await connection.read_response()
        except Exception as exc:
            if connection is not None and not isinstance(exc, ResponseError):
                # The reply may still be on its way: never reuse the connection as it is.
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
            raise self._translated(exc, write_key if sent else None) from exc
        except BaseException:
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
            raise
        finally:
            if connection is not None:
                if connections.closed:
                    with contextlib.suppress(Exception):
                        await connection.disconnect(nowait=True)
                else:
                    connections.give(connection)

    async def _execute_on_cluster(
        self,
        client: aioredis.Redis,
        args: tuple[str | bytes | int | float, ...],
        write_key: str | None,
        **options: Any,
    ) -> Any:
        """One command through redis-py's cluster client (it routes by slot, follows MOVED).

        At most `connection_pool_size` run at once (redis-py's cluster client fails instead of
        waiting when a node's connections run out).
        """
        if not self._cluster_mapped:
            # Read the slot map before the first commands: redis-py's cluster client, when
            # many first commands race to initialize it, closes connections others are using.
            await self._primaries(client)
            self._cluster_mapped = True
        async with self._cluster_slots:
            try:
                async with asyncio.timeout(self.socket_timeout):
                    return await client.execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise self._translated(exc, write_key) from exc

    async def _script(
        self, sha: str, source: str, keys: Sequence[str], *args: str | bytes | int, write_key: str
    ) -> Any:
        """EVALSHA a script; after NOSCRIPT (it did not run) load it and run it once more."""
        from redis.exceptions import NoScriptError

        try:
            return await self._execute("EVALSHA", sha, len(keys), *keys, *args, write_key=write_key)
        except BackendError as exc:
            if not isinstance(exc.__cause__, NoScriptError):
                raise
        if self.is_cluster:
            client = self._client or await self._redis()
            try:
                async with asyncio.timeout(self.socket_timeout):
                    await client.script_load(source)  # redis-py loads it on every primary
            except Exception as exc:
                raise self._translated(exc, None) from exc
        else:
            await self._execute("SCRIPT", "LOAD", source)
        return await self._execute("EVALSHA", sha, len(keys), *keys, *args, write_key=write_key)

    def _by_slot(self, names: Sequence[str]) -> list[list[int]]:
        """Positions of `names` grouped by cluster slot (one group for a single server)."""
        if not self.is_cluster or self._client is None:
            return [list(range(len(names)))]
        client: Any = self._client
        groups: dict[int, list[int]] = {}
        for position, name in enumerate(names):
            groups.setdefault(client.keyslot(name), []).append(position)
        return list(groups.values())

    async def _read(self, *args: str | bytes | int) -> Any:
        """Run an idempotent command, retrying connection failures and timeouts a bounded time."""
        attempt = 0
        while True:
            try:
                return await self._execute(*args)
            except (BackendUnavailableError, BackendTimeoutError):
                if attempt >= self.read_retries or self._closed:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)
                attempt += 1

    # the contract

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired (one GET)."""
        raw = await self._read("GET", self._k(key))
        return None if raw is None else _entry(key, raw)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order (one MGET)."""
        if not keys:
            return []
        names = [self._k(key) for key in keys]
        await self._redis()
        raws: list[bytes | None] = [None] * len(names)
        for group in self._by_slot(names):  # one MGET per slot: MGET may not cross slots
            found = await self._read("MGET", *[names[position] for position in group])
            for position, raw in zip(group, found, strict=True):
                raws[position] = raw
        return [
            None if raw is None else _entry(key, raw) for key, raw in zip(keys, raws, strict=True)
        ]

    async def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Return each value's stored size: STRLEN less the header, one script per slot group.

        Values are never transferred. `usage()` calls this with batches of a few hundred keys,
        so each script holds the server for microseconds.
        """
        names = [self._k(key) for key in keys]
        await self._redis()
        sizes: list[int | None] = [None] * len(names)
        groups = [  # a script's keys may not cross slots; at most 1,000 keys per script
            group[start : start + 1000]
            for group in self._by_slot(names)
            for start in range(0, len(group), 1000)
        ]
        for group in groups:
            lengths = await self._read(
                "EVAL", _STRLEN_SCRIPT, len(group), *[names[position] for position in group]
            )
            for position, length in zip(group, lengths, strict=True):
                # A missing or expired key has length 0; a record is never shorter than its header.
                sizes[position] = int(length) - _HEADER if int(length) else None
        return sizes

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
    ) -> Change:
        """Store `value` at `key` in one atomic script; see `Backend.set`."""
        name = self._k(key)
        if ttl is not None:
            check_ttl(ttl)
        if expected_version is not None:
            check_expected_version(expected_version)
        expected = -1 if expected_version is None else expected_version
        reply = await self._script(
            self._set_sha,
            _SET_SCRIPT,
            (name,),
            value,
            _ttl_ms(ttl),
            expected,
            CHANNEL_NAMESPACE + name,
            write_key=key,
        )
        return self._set_change(key, value, reply, expected_version)

    def _set_change(self, key: str, value: bytes, reply: list[Any], expected: int | None) -> Change:
        if reply[0] == 0:
            raise conflict(key, expected if expected is not None else -1, int(reply[1]))
        return new_change(
            key, ChangeOp.SET, reply[2] or None, value, int(reply[1]), _ms(int(reply[3]))
        )

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values in one round trip (a pipeline of scripts; each atomic)."""
        check_ttl(ttl)
        if not items:
            return []
        names = [self._k(key) for key, _ in items]
        life = _ttl_ms(ttl)
        await self._redis()
        replies: list[Any] = [None] * len(items)
        # One script call per chunk of keys sharing a slot (a script's keys may not cross
        # slots in a cluster), so Redis is never blocked for long either.
        for group in self._by_slot(names):
            for start in range(0, len(group), _SET_MANY_CHUNK):
                chunk = group[start : start + _SET_MANY_CHUNK]
                args: list[str | bytes | int] = [life]
                for position in chunk:
                    args += [items[position][1], CHANNEL_NAMESPACE + names[position]]
                done = await self._script(
                    self._set_many_sha,
                    _SET_MANY_SCRIPT,
                    [names[position] for position in chunk],
                    *args,
                    write_key=items[chunk[0]][0],
                )
                for position, reply in zip(chunk, done, strict=True):
                    replies[position] = reply
        return [
            self._set_change(key, value, reply, None)
            for (key, value), reply in zip(items, replies, strict=True)
        ]

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(entry)`: compare-and-set on the version.

        Updates of one key from this process take turns (a lock per key), so they never race
        each other and only other processes' writes can make an attempt retry.
        """
        _require_asyncio()
        self._k(key)
        lock = self._update_locks.get(key)
        if lock is None:
            lock = self._update_locks[key] = _KeyLock()
        lock.users += 1
        try:
            async with lock.lock:
                return await super().update(key, fn, ttl=ttl, max_attempts=max_attempts)
        finally:
            lock.users -= 1
            if lock.users == 0 and self._update_locks.get(key) is lock:
                del self._update_locks[key]

    async def delete(self, key: str, *, expected_version: int | None = None) -> Change | None:
        """Delete `key` in one atomic script; see `Backend.delete`."""
        name = self._k(key)
        check_expected_version(expected_version)
        expected = -1 if expected_version is None else expected_version
        reply = await self._script(
            self._delete_sha,
            _DELETE_SCRIPT,
            (name,),
            expected,
            CHANNEL_NAMESPACE + name,
            write_key=key,
        )
        if reply[0] == 0:
            raise conflict(key, expected, int(reply[1]))
        if reply[0] == 2:
            return None
        return new_change(key, ChangeOp.DELETE, reply[2], None, int(reply[1]), _ms(int(reply[3])))

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Compare, then write, in one Lua script (one EVALSHA); see `Backend.transact`.

        On a cluster, every key and index of the call must hash to one slot (a `{...}` hash
        tag), or it raises `InvalidArgumentError` before anything is sent.
        """
        checked = check_transaction(compare, then, orelse)
        call = _redis_txn.pack(
            *checked, channels=CHANNEL_NAMESPACE, state_key=self._k, index_key=self._index_key
        )
        if not call.keys:
            return TxnResult(succeeded=True, results=[])
        client: Any = self._client or await self._redis()
        if self.is_cluster:
            _redis_txn.check_one_slot(call, client.keyslot)
        source, sha = _redis_txn.script(_WRITE_FUNCTION)
        reply = await self._script(sha, source, call.keys, *call.args, write_key=call.write_key)
        return _redis_txn.result(checked, reply, _entry)

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the keys matching `pattern` with SCAN (never KEYS), without the prefix."""
        match = escape_glob(self.key_prefix) + validate_pattern(pattern)
        cut = len(self.key_prefix.encode())
        seen: set[bytes] = set()
        client = await self._redis()
        # One SCAN per server; in a cluster, one per primary (each holds its own slots).
        nodes: list[Any] = await self._primaries(client) if self.is_cluster else [None]
        for node in nodes:
            cursor: bytes | int = 0
            while True:
                cursor, batch = await self._scan_page(node, cursor, match)
                for raw in batch:
                    if raw.startswith(b"__agenticstate"):
                        continue  # our own index keys, visible to SCAN when the prefix is empty
                    if raw not in seen:
                        seen.add(raw)
                        yield raw[cut:].decode("utf-8", "surrogateescape")
                if int(cursor) == 0:
                    break

    async def _primaries(self, client: aioredis.Redis) -> list[Any]:
        """The cluster's primaries, reading the slot map first if the client has none yet."""
        cluster: Any = client
        try:
            async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
                await cluster.initialize()
        except Exception as exc:
            raise self._translated(exc, None) from exc
        primaries: list[Any] = cluster.get_primaries()
        if not primaries:
            raise BackendUnavailableError(f"the Redis Cluster at {self.url} has no primary")
        return primaries

    async def _scan_page(self, node: Any, cursor: bytes | int, match: str) -> Any:
        if node is None:
            return await self._read("SCAN", cursor, "MATCH", match, "COUNT", 1000)
        client = self._client or await self._redis()
        reply = await self._execute_on_cluster(
            client, ("SCAN", cursor, "MATCH", match, "COUNT", 1000), None, target_nodes=node
        )
        # redis-py's cluster client answers SCAN with ({node name: cursor}, keys).
        cursors, keys = reply
        cursor = next(iter(cursors.values())) if isinstance(cursors, dict) else cursors
        return cursor, keys

    # sorted indexes (Redis sorted sets)

    def _index_key(self, index: str) -> str:
        return f"{INDEX_NAMESPACE}{self.key_prefix}{validate_key(index)}"

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """ZADD members to a sorted index; see `Backend.index_add`."""
        name = self._index_key(index)
        checked = check_index_members(members)
        if not checked:
            return 0
        args: list[str | float] = []
        for member, score in checked.items():
            args += [score, member]
        return int(await self._execute("ZADD", name, *args, write_key=index) or 0)

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """ZREM members from a sorted index; see `Backend.index_remove`."""
        name = self._index_key(index)
        wanted = [validate_key(member) for member in members]
        if not wanted:
            return 0
        return int(await self._execute("ZREM", name, *wanted, write_key=index))

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """ZRANGE a sorted index, lowest score first; see `Backend.index_range`."""
        name = self._index_key(index)
        if check_limit(limit) == 0:
            return []
        stop = -1 if limit is None else limit - 1
        reply = await self._read("ZRANGE", name, 0, stop, "WITHSCORES")
        # RESP3 replies [member, score] pairs; RESP2 one flat list of members and scores.
        if reply and not isinstance(reply[0], list):
            reply = list(zip(reply[::2], reply[1::2], strict=True))
        return [(member.decode(), float(score)) for member, score in reply]

    # subscriptions

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER
    ) -> contextlib.AbstractAsyncContextManager[ChangeStream]:
        """Subscribe to changes of keys matching `pattern` (from every process).

        The subscription is live when the context manager is entered: the server has confirmed
        it, so every change committed after entry, by any client, is delivered.
        """
        return self._changes(validate_pattern(pattern), max_buffer)

    @asynccontextmanager
    async def _changes(self, pattern: str, max_buffer: int) -> AsyncIterator[ChangeStream]:
        _require_asyncio()
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        await self._redis()
        group = self._groups.get(pattern)
        if group is None:
            group = self._groups[pattern] = _Group(pattern)
            self._index.add(group)
        group.users += 1
        try:
            async with group.fanout.subscribe(pattern, max_buffer, start_open=False) as stream:
                held = (stream, max_buffer)
                group.streams.append(held)
                try:
                    await self._go_live(stream)
                    yield stream
                finally:
                    group.streams = [s for s in group.streams if s is not held]
        finally:
            group.users -= 1
            if group.users == 0 and self._groups.get(pattern) is group:
                del self._groups[pattern]
                self._index.remove(group)

    async def _go_live(self, stream: ChangeStream | None) -> None:
        """Open `stream` at a barrier on the live pub/sub connection (see "Delivery").

        The barrier is a message that arrives after every change already on its way: a PING on
        the subscribed connection (answered after every message its server sent before), or on
        a cluster a marker PUBLISHed on every primary (each shard's changes reach the
        connection's node over the cluster bus, in order per shard). The reader opens the
        stream when the last one arrives, so it gets every change committed after entry and
        none from before the barrier. With `stream=None` this drains the connection.
        """
        if self._closed:
            raise BackendError("this RedisBackend is closed")
        self._start_reader()
        token = next(self._tokens)
        barrier = _Barrier(stream)
        self._barriers[token] = barrier
        try:
            async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
                if self._live.is_set():
                    await self._send_barrier(token, barrier)
                # Otherwise the reader opens it once the connection is subscribed again.
                await barrier.opened.wait()
        except TimeoutError:
            raise BackendUnavailableError(
                f"could not subscribe on the pub/sub connection to {self.url}"
            ) from None
        finally:
            self._barriers.pop(token, None)
        if self._closed and stream is not None:
            raise BackendError("this RedisBackend is closed")

    async def _send_barrier(self, token: int, barrier: _Barrier) -> None:
        if not self.is_cluster:
            pubsub = self._pubsub
            if pubsub is not None:
                with contextlib.suppress(Exception):  # a failure reconnects, which opens it
                    await pubsub.ping(f"{_BARRIER}{token}")
            return
        client = await self._redis()
        primaries = await self._primaries(client)
        barrier.remaining = len(primaries)
        channel = self._channel_prefix + self._barrier_key + b"%d" % token
        for node in primaries:
            command = ("PUBLISH", channel, b"")
            await self._execute_on_cluster(client, command, None, target_nodes=node)

    def _open_barriers(self) -> None:
        """Open every waiting barrier: the connection was just subscribed again (and resynced)."""
        for barrier in self._barriers.values():
            barrier.open()

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._live = asyncio.Event()  # of this event loop, for a fresh connection
            self._reader = asyncio.get_running_loop().create_task(
                self._read_changes(), name="agenticstate-redis-pubsub"
            )

    def _pong(self, data: bytes | str) -> None:
        text = data.decode() if isinstance(data, bytes) else data
        if not text.startswith(_BARRIER):
            return  # a health check
        barrier = self._barriers.get(int(text[len(_BARRIER) :]))
        if barrier is not None:
            barrier.remaining -= 1
            if barrier.remaining <= 0:
                barrier.open()

    async def _connect_pubsub(self) -> None:
        """Connect, read the server's clock, and PSUBSCRIBE to every change under the prefix."""
        client = await self._redis()
        async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
            source = await self._pubsub_client(client)
            if source is not client:
                self._pubsub_source = source  # closed with the pub/sub connection
            self._pubsub = source.pubsub(ignore_subscribe_messages=False)
            await self._pubsub.connect()
            # Read before subscribing: every write after the subscription is stamped at or
            # after it (see `_resync`).
            # On the pub/sub connection itself, before it enters subscribed mode.
            connection = self._pubsub.connection
            await connection.send_command("TIME")
            seconds, micros = await connection.read_response()
            self._horizon = int(seconds) * 1000 + int(micros) // 1000
            await self._pubsub.psubscribe(self._subscription)

    async def _read_changes(self) -> None:
        """The one reader of the pub/sub connection: dispatch, reconnect, resync."""
        failures = 0
        heard = ping_sent = 0.0
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                if self._pubsub is None:
                    await self._connect_pubsub()
                    heard, ping_sent = loop.time(), 0.0
                message = await self._pubsub.get_message(timeout=1.0)
                now = loop.time()
                if message is None:
                    self._prune(time.time() * 1000 + self._clock_offset - _PRUNE_LAG_MS)
                    # A connection can die without a word (a NAT or firewall forgets it): when
                    # nothing came for a while, ask, and give up on it if no answer comes.
                    if ping_sent and now - ping_sent > self.socket_timeout:
                        raise ConnectionError("no answer to PING on the pub/sub connection")
                    if not ping_sent and now - heard > _PUBSUB_IDLE:
                        ping_sent = now
                        await self._pubsub.ping(_HEALTH)
                    continue
                heard, ping_sent = now, 0.0
                kind = message["type"]
                if kind == "pmessage":
                    try:
                        self._dispatch(message["channel"], message["data"])
                    except (ValueError, IndexError):
                        # Not a change this library published (someone else's PUBLISH on our
                        # channels): skip it, never drop the connection over it.
                        log.debug("pubsub_message_skipped", size=len(message["data"]))
                elif kind == "pong":
                    self._pong(message["data"])
                elif kind == "psubscribe":
                    since = self._horizon
                    if self._resync_pending:
                        # Live again: now re-read what the gap may have hidden.
                        await self._resync(self._gap_from, since)
                        self._resync_pending = False
                    self._live.set()
                    failures = 0
                    if self.is_cluster:
                        # Changes other shards published before the PSUBSCRIBE may still be on
                        # their way over the cluster bus: waiting subscriptions open at markers
                        # from every primary (sent again: they may have been lost with the old
                        # connection), never before.
                        for token, barrier in list(self._barriers.items()):
                            await self._send_barrier(token, barrier)
                    else:
                        # One server: nothing published before the PSUBSCRIBE can still come.
                        # Waiting subscriptions are live from here (their barrier may have
                        # been lost with the old connection).
                        self._open_barriers()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # any failure: reconnect, then resync
                failures += 1
                log.warning(
                    "pubsub_reconnecting",
                    url=self.url,
                    error=type(exc).__name__,
                    attempt=failures,
                )
                if self._live.is_set():
                    # Changes after the last one read may be lost: resync from there.
                    self._live.clear()
                    self._gap_from = self._horizon
                    self._resync_pending = True
                await self._drop_pubsub()
                await asyncio.sleep(min(0.05 * 2 ** min(failures, 6), 2.0) + backoff(failures))

    async def _pubsub_client(self, client: aioredis.Redis) -> aioredis.Redis:
        """The client the pub/sub connection comes from.

        In a cluster: a plain client to one node, a random primary (PUBLISH reaches every
        node over the cluster bus, so one node sees every shard's changes).
        """
        if not self.is_cluster:
            return client
        import random

        import redis.asyncio as aioredis

        node = random.choice(await self._primaries(client))  # noqa: S311  # load, not crypto
        options = self._cluster_options()
        options.pop("startup_nodes")
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return aioredis.Redis(
            host=node.host,
            port=node.port,
            socket_connect_timeout=self.connect_timeout,
            # No silent reconnects: the reader must see every drop, to resync after it.
            retry=Retry(NoBackoff(), 0),
            **options,
            **self._client_options,
        )

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        if channel.startswith(self._reserved, self._channel_cut):
            # No key starts with the reserved prefix: a barrier, this backend's or another's.
            if channel.startswith(self._barrier_key, self._channel_cut):
                token = channel[self._channel_cut + len(self._barrier_key) :]
                self._pong(_BARRIER + token.decode())
            return
        stamp = int(data[21:36])
        if stamp > self._horizon:
            self._horizon = stamp
            if stamp - self._pruned >= _PRUNE_LAG_MS:
                # Once a second of server time, every subscription forgets the keys that
                # expired over a second ago. Not sooner: on a cluster a shard's change can
                # arrive after another shard's later ones, and a key's own change from before
                # its expiry must still find it remembered (or it would be delivered twice).
                self._pruned = stamp
                self._prune(stamp - _PRUNE_LAG_MS)
        key = channel[self._channel_cut :].decode("utf-8", "surrogateescape")
        groups = self._index.matching(key)
        if not groups:
            return
        self._clock_offset = stamp - time.time() * 1000
        change, expires = _parse_message(key, data)
        for group in groups:
            group.deliver(change, stamp, expires)

    def _prune(self, now: float) -> None:
        for group in self._index.groups():
            group.prune(int(now))

    def _tracked_keys(self) -> int:
        """How many keys the subscriptions remember (for tests: it stays bounded)."""
        return sum(len(group.seen) for group in self._groups.values())

    async def _resync(self, gap_from: int, now: int) -> None:
        """After a gap, emit what changed in it.

        That is every key whose value differs from what was delivered, the keys written since
        `gap_from` that were never delivered, and the keys gone.

        A key last written before `gap_from` and never delivered existed before the subscription
        and has not changed since: it is not a change. Changes are handed over only as fast as
        the subscriptions take them (for up to `socket_timeout` in all), so a resync does not
        overflow a buffer by itself.
        """
        groups = self._index.groups()
        if not groups:
            return
        cutoff = gap_from - self._clock_skew_ms
        patterns = [group.pattern for group in groups] if len(groups) <= 4 else ["*"]
        keys: dict[str, None] = {}
        for pattern in patterns:
            async for key in self.scan(pattern):
                keys[key] = None
        listed = list(keys)
        present: set[str] = set()
        budget = asyncio.get_running_loop().time() + self.socket_timeout
        emitted = 0
        for start in range(0, len(listed), 500):
            chunk = listed[start : start + 500]
            for key, entry in zip(chunk, await self.get_many(chunk), strict=True):
                if entry is None:
                    continue
                present.add(key)
                for group in self._index.matching(key):
                    if not self._changed(group, entry, cutoff, now):
                        continue
                    budget = await self._room(group, budget)
                    expires = 0 if entry.expires_at is None else _stamp(entry.expires_at)
                    group.remember(key, entry.version, hash(entry.value), expires)
                    group.fanout.publish(
                        Change(
                            key=key,
                            op=ChangeOp.RESYNC,
                            old=None,
                            new=entry.value,
                            version=entry.version,
                            timestamp=entry.updated_at,
                        )
                    )
                    emitted += 1
        for group in groups:
            for key, (version, value_hash, expires) in list(group.seen.items()):
                if key in present or value_hash is None:
                    continue
                if expires and expires <= now:
                    del group.seen[key]  # it expired: not a change (as on every backend)
                    continue
                budget = await self._room(group, budget)
                # Remembered as gone for a while, so a late live message cannot revive it.
                group.remember(key, version, None, now + _GONE_KEPT_MS)
                group.fanout.publish(
                    Change(
                        key=key,
                        op=ChangeOp.RESYNC,
                        old=None,
                        new=None,
                        version=version,
                        timestamp=_ms(now),
                    )
                )
                emitted += 1
        log.info("pubsub_resynced", patterns=len(groups), keys=len(listed), changes=emitted)

    @staticmethod
    def _changed(group: _Group, entry: Entry, cutoff: int, now: int) -> bool:
        known = group.seen.get(entry.key)
        if known is not None and known[2] and known[2] <= now:
            known = None  # that life of the key expired
        if known is None:
            # Never delivered: a change only if written after the gap began.
            return _stamp(entry.updated_at) >= cutoff
        if known[1] is None:
            return True  # found gone before, here again
        return (known[0], known[1]) != (entry.version, hash(entry.value))

    async def _room(self, group: _Group, budget: float) -> float:
        """Wait (within the `budget` deadline) until `group`'s subscriptions have room."""
        loop = asyncio.get_running_loop()
        # A poll, not an event: the subscriptions' buffers have no "drained" signal to wait on.
        while group.backlog() >= 0.5 and loop.time() < budget:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        return budget

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        source, self._pubsub_source = self._pubsub_source, None
        if source is not None:
            with contextlib.suppress(Exception):
                await source.aclose(close_connection_pool=True)

    async def aclose(self) -> None:
        """End subscriptions, close the pub/sub connection and (if created here) the client.

        Subscriptions first receive every change published before the close: a last barrier
        on the pub/sub connection (waited for up to `socket_timeout`) drains what is on its way.
        """
        if self._closed:
            return
        reader = self._reader
        if reader is not None and not reader.done() and self._live.is_set() and self._groups:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.socket_timeout),
                contextlib.suppress(BackendError),
            ):
                await self._go_live(None)
        self._closed = True
        for barrier in self._barriers.values():
            barrier.opened.set()  # subscriptions still waiting learn at once that it closed
        for group in self._groups.values():
            group.fanout.close()
        self._reader = None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._drop_pubsub()
        client, self._client = self._client, None
        await self._connections.close()
        if client is not None and self._owns_client:
            with contextlib.suppress(Exception):
                if self.is_cluster:
                    await client.aclose()
                else:
                    await client.aclose(close_connection_pool=True)


def _stamp(moment: datetime) -> int:
    """Milliseconds since the epoch (the inverse of `_ms`)."""
    return round(moment.timestamp() * 1000)


def _require_asyncio() -> None:
    """Raise `ConfigurationError` unless an asyncio event loop runs (not trio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            "RedisBackend runs under asyncio only (redis-py's client is asyncio-only); "
            "use the memory or file backend under trio"
        ) from None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _chain_has(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    return any(isinstance(link, kinds) for link in _chain(exc))


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


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in words: "connection refused", "host name not resolved"."""
    import os  # kept local: this is the only function here that needs them
    import socket

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror):
            return f"host name not resolved ({current.strerror})"
        if isinstance(current, OSError) and current.errno:
            return os.strerror(current.errno).lower()
        current = current.__cause__ or current.__context__
    return str(exc) or type(exc).__name__
