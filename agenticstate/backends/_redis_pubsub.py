"""The Redis backend's change subscriptions: one pub/sub connection, patterns, resync.

One pub/sub connection per backend, with one PSUBSCRIBE for every change under the prefix,
serves all its subscriptions: the reader (`_read_changes`) matches each change against the
subscribed patterns through `_PatternIndex` (a few dict lookups per change however many patterns
there are). Each pattern's subscriptions share a `_Group`, which remembers what was delivered to
them. A subscription opens at a barrier (`_Barrier`): a PING on the subscribed connection, or on
a cluster a marker published on every primary. After a drop the reader reconnects and resyncs
(see "Delivery" in `backends/redis.py`).

`Subscriber` is mixed into `RedisBackend`: it runs on the backend's client, its commands and its
scan, and keeps all of the pub/sub state.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import time
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate._glob import compile_glob
from agenticstate._keys import RESERVED_PREFIX, escape_glob
from agenticstate._log import get_logger
from agenticstate.backends import _redis_wire as wire
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._redis_scripts import CHANNEL_NAMESPACE, from_ms, parse_message, to_ms
from agenticstate.backends.base import Change, ChangeOp, Entry, backoff
from agenticstate.exceptions import BackendError, BackendUnavailableError, InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    import redis.asyncio as aioredis

__all__ = ["Subscriber"]

log = get_logger("agenticstate.backends.redis")  # the backend's logger: its events keep their name

_BARRIER = "agenticstate-barrier:"  # PING payloads on the pub/sub connection (+ a token)
_GONE_KEPT_MS = 10_000  # how long a resync remembers a key it found gone
_PRUNE_LAG_MS = 1000  # expired keys are forgotten this long after they expire
_HEALTH = "agenticstate-health"
_PUBSUB_IDLE = 2.0  # seconds of silence before the pub/sub connection is asked whether it lives


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


class Subscriber:
    """`RedisBackend`'s subscriptions (a mixin): `changes()` and the pub/sub reader behind it."""

    if TYPE_CHECKING:  # what the backend provides
        _url: str
        _client_options: dict[str, Any]
        _closed: bool
        is_cluster: bool
        socket_timeout: float
        connect_timeout: float

        @property
        def url(self) -> str: ...
        async def _redis(self) -> aioredis.Redis: ...
        async def _primaries(self, client: aioredis.Redis) -> list[Any]: ...
        async def _execute_on_cluster(
            self,
            client: aioredis.Redis,
            args: tuple[str | bytes | int | float, ...],
            write_key: str | None,
            *,
            target_nodes: Any,
        ) -> Any: ...
        def scan(self, pattern: str) -> AsyncIterator[str]: ...
        async def get_many(self, keys: Sequence[str]) -> list[Entry | None]: ...

    def _init_subscriber(self, key_prefix: str) -> None:
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
        self._barriers: dict[int, _Barrier] = {}  # waiting for their PONG or markers
        self._horizon = 0  # server ms: every change stamped before it was read (or was older)
        self._gap_from = 0  # the horizon when the connection last dropped
        self._resync_pending = False
        # Server clocks of a cluster's nodes may differ a little: a resync looks that far back.
        self._clock_skew_ms = 50 if self.is_cluster else 0
        self._clock_offset = 0.0  # server ms minus local ms, from the last change read
        self._pruned = 0  # server ms of the last pass forgetting expired keys

    @asynccontextmanager
    async def _changes(self, pattern: str, max_buffer: int) -> AsyncIterator[ChangeStream]:
        wire.require_asyncio()
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
            # Read the clock before subscribing: every write after the subscription is stamped
            # at or after it (see `_resync`).
            self._horizon = await wire.connect_pubsub(self._pubsub)
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
        node = random.choice(await self._primaries(client))  # noqa: S311  # load, not crypto
        return wire.node_client(
            self._url, node, connect_timeout=self.connect_timeout, options=self._client_options
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
        change, expires = parse_message(key, data)
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
                    expires = 0 if entry.expires_at is None else to_ms(entry.expires_at)
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
                        timestamp=from_ms(now),
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
            return to_ms(entry.updated_at) >= cutoff
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

    async def _drain_subscriptions(self) -> None:
        """Before a close, deliver every change published before it.

        A last barrier on the pub/sub connection, waited for up to `socket_timeout`, drains what
        is on its way.
        """
        reader = self._reader
        if reader is not None and not reader.done() and self._live.is_set() and self._groups:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.socket_timeout),
                contextlib.suppress(BackendError),
            ):
                await self._go_live(None)

    async def _close_subscriptions(self) -> None:
        """End every subscription, stop the reader and close the pub/sub connection."""
        for barrier in self._barriers.values():
            barrier.opened.set()  # subscriptions still waiting learn at once that it closed
        for group in self._groups.values():
            group.fanout.close()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._drop_pubsub()
