"""The Redis backend's change subscriptions: one pub/sub connection, patterns, read-back.

One pub/sub connection per backend serves all its subscriptions. It PSUBSCRIBEs the channels of
the subscriptions' literal prefixes (`_wanted_patterns`: a prefix covers the longer ones under
it, at most `_MAX_PATTERNS`), so it hears only what some subscription may want; the reader
(`_read_changes`) matches each key heard against the subscribed patterns through
`_PatternIndex` (a few dict lookups per change however many patterns there are). Each
pattern's subscriptions share a `_Group`, which remembers what was delivered to them.

A message is a hint, never a change to deliver (see "Delivery" in `backends/redis.py`). The
reader queues what it hears (`_Hint`) with the actions that must follow it (a barrier opening
a subscription, a floor raised), in the order heard; a deliverer task (`_deliver`) reads the
feed entries the notifications name back from their streams (`_read_back`: one script per slot
for a batch, and a barrier when an entry does not follow the last one delivered from its
stream), or checks a change written without the feed against its key (`_deliver_checked`), and
delivers them, in order. A subscription opens at a barrier (`_Barrier`): a PING on the
subscribed connection after its PSUBSCRIBE, or on a cluster a marker published on every primary
once the PSUBSCRIBE is confirmed, run once everything heard before it was delivered. After a
drop the reader reconnects, subscribes every prefix again and catches up from the feed, or
resyncs. Replies are read through `_redis_wire.PubSubLink`, every reply of one read at once.

`Subscriber` is mixed into `RedisBackend`: it runs on the backend's client, its commands and its
scan, and keeps all of the pub/sub state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import random
import secrets
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate._glob import compile_glob
from agenticstate._keys import RESERVED_PREFIX, escape_glob
from agenticstate._log import get_logger
from agenticstate.backends import _redis_feed as feeds
from agenticstate.backends import _redis_wire as wire
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._redis_scripts import (
    CHANNEL_NAMESPACE,
    from_ms,
    parse_message,
    split_feed,
    stamp_of,
    to_ms,
)
from agenticstate.backends.base import EARLIEST, Change, ChangeOp, Entry, backoff
from agenticstate.exceptions import (
    BackendError,
    BackendUnavailableError,
    CursorExpiredError,
    InvalidArgumentError,
    SubscriptionClosedError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    import redis.asyncio as aioredis

    from agenticstate.backends.base import FeedRetention

__all__ = ["Subscriber"]

log = get_logger("agenticstate.backends.redis")  # the backend's logger: its events keep their name

_BARRIER = b"agenticstate-barrier:"  # PING payloads on the pub/sub connection (+ a token)
_SUBSCRIBED = b"agenticstate-subscribed"  # the PING after a new connection's PSUBSCRIBE
_SETTLE = b"agenticstate-settle:"  # a PING after a lookup (see `_read_back`), + a token
_MAX_PATTERNS = 16  # server-side patterns per connection at most (see `_bounded_cover`)
_GONE_KEPT_MS = 10_000  # how long a resync remembers a key it found gone
_PRUNE_LAG_MS = 1000  # expired keys are forgotten this long after they expire
_HEALTH = b"agenticstate-health"
_PUBSUB_IDLE = 2.0  # seconds of silence before the pub/sub connection is asked whether it lives
_IDLE_CHECK = 1.0  # the reader looks at the silence (and prunes) after about this long without one
_LISTED_MAX = 16  # cluster cursors: slots listed above the floor before a marker round raises it
_PAGE = 1000  # feed entries read per XRANGE
_PACE = 16  # a catch-up looks at the subscriptions' room after this many entries
_LOOKUP_BATCH = 1000  # notifications read back per script, at most
_MAX_NESTED = 1000  # nested prefixes a store reads the feeds of, at most
_HELD_RECHECK = 0.02  # seconds between looks at keys whose changes wait (no feed)
_IGNORED_LOG_EVERY = 10.0  # seconds between warnings about ignored messages
LOOKUP_SHA = hashlib.sha1(feeds.LOOKUP.encode()).hexdigest()  # noqa: S324  # Redis names scripts so
READ_SHA = hashlib.sha1(feeds.READ.encode()).hexdigest()  # noqa: S324
FIRSTS_SHA = hashlib.sha1(feeds.FIRSTS.encode()).hexdigest()  # noqa: S324
EPOCH_SHA = hashlib.sha1(feeds.EPOCH.encode()).hexdigest()  # noqa: S324
# A cluster marker: the node's clock (ms), published after it was read (see `_redis_feed`).
_MARKER = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('PUBLISH', ARGV[1], string.format('%d', ms))
return ms
"""


class _Group:
    """The local subscriptions to one pattern, and what was delivered to them.

    `seen` holds, for each key delivered and still alive, its version, a hash of its value and
    when it expires (server milliseconds, 0 = never). It decides duplicates (a resync overlapping
    the live stream), what a resync must emit, and a key's new life after it expired. Entries
    leave on a delete and when they expire (`expiries` orders them), so it never outgrows the
    keys alive in the pattern. Every subscription of its `fanout` is to `pattern`, which the
    reader matched already: changes go to all of them (`publish_to_all`), not matched again.
    """

    __slots__ = (
        "expiries",
        "fanout",
        "feed_after",
        "matcher",
        "pattern",
        "seen",
        "streams",
        "users",
    )

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.matcher = compile_glob(pattern)
        self.fanout = ChangeFanout()
        self.users = 0
        self.streams: list[tuple[ChangeStream, int]] = []  # (stream, its max_buffer)
        # key -> (version, hash of the value or None once gone, expires in server ms or 0)
        self.seen: dict[str, tuple[int, int | None, int]] = {}
        self.expiries: list[tuple[int, str]] = []  # a heap of (expires, key)
        # The feed's changes up to this order (`u`) came before the group was subscribed: a
        # catch-up after a reconnect hands it only later ones (None: every one it missed).
        self.feed_after: int | None = None

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
        self.fanout.publish_to_all(change)  # `pattern` matched the key

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
    """A subscription (or a drain, `stream=None`) waiting for its barrier.

    The barrier is this backend's PING coming back on the pub/sub connection, or, for one that
    waits for `markers` (a cluster's subscriptions), a marker from every primary, counted in
    `remaining`, of its latest `round` (a round is sent again after a reconnect).
    """

    __slots__ = ("clocks", "low", "markers", "opened", "remaining", "round", "stream")

    def __init__(self, stream: ChangeStream | None, *, markers: bool = False) -> None:
        self.stream = stream
        self.markers = markers
        self.opened = asyncio.Event()
        self.remaining = 1  # barrier messages still to come
        self.round = 0
        self.low = 0  # the smallest node clock the round's markers were sent after (0: none)
        self.clocks = False  # every node's clock of the round has come back

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


# A server-side subscription's topic: a literal key prefix, or one exact key (`exact=True`).
_Topic = tuple[str, bool]


def _cover(topics: set[_Topic]) -> list[_Topic]:
    """The fewest topics that cover `topics`: none covers another, so no change comes twice.

    A prefix covers every topic that starts with it; sorted, those follow it directly.
    """
    chosen: list[_Topic] = []
    covering: str | None = None  # the last prefix chosen
    for text, exact in sorted(topics):  # a prefix sorts before the exact key of the same text
        if covering is not None and text.startswith(covering):
            continue
        chosen.append((text, exact))
        if not exact:
            covering = text
    return chosen


def _bounded_cover(topics: set[_Topic]) -> list[_Topic]:
    """`_cover(topics)` in at most `_MAX_PATTERNS` topics, cutting every prefix to one length.

    Every pattern on a server costs every PUBLISH there a glob match, whoever subscribed it:
    many narrow prefixes (`agent:1:`, `agent:2:`, ...) are merged into their shared start
    (`agent:`), the longest cut that fits.
    """
    chosen = _cover(topics)
    if len(chosen) <= _MAX_PATTERNS:
        return chosen
    low, high = 0, max(len(text) for text, _ in chosen)  # a cut at `low` always fits
    best = [("", False)]
    while low < high:
        cut = (low + high + 1) // 2
        trial = _cover(
            {(text[:cut], False) if len(text) > cut else (text, exact) for text, exact in chosen}
        )
        if len(trial) <= _MAX_PATTERNS:
            low, best = cut, trial
        else:
            high = cut - 1
    return best


def _covers(topic: _Topic, key: str) -> bool:
    return key == topic[0] if topic[1] else key.startswith(topic[0])


class _Hint:
    """A notification the reader heard, to be read back from the store (`_deliver`).

    A feed notification names its entry: `stream` and `at` (the entry's id) are set. A
    notification of a write without a feed carries the change itself (`data`, checked against
    the key before it is delivered). `groups`: the subscriptions whose pattern matched the key
    when it was heard (a subscription made later opens after it: `_action`).
    """

    __slots__ = ("at", "data", "groups", "key", "name", "raw", "stream")

    def __init__(
        self,
        groups: list[_Group],
        key: str,
        name: bytes,
        stream: feeds.Stream | None,
        at: feeds.Id | None,
        data: bytes,
        raw: bytes = b"",
    ) -> None:
        self.groups = groups
        self.key = key  # without the prefix
        self.name = name  # the Redis key
        self.stream = stream
        self.at = at
        self.raw = raw  # `at` as the notification wrote it
        self.data = data


class _Read:
    """A feed entry read back for a notification, or by a catch-up (what is delivered)."""

    __slots__ = ("at", "data", "groups", "key", "order", "prev", "start", "stream", "text")

    def __init__(
        self,
        stream: feeds.Stream,
        at: feeds.Id,
        prev: feeds.Id,
        order: int,
        key: str,
        data: bytes,
        groups: list[_Group] | None,
        start: int,
        text: str,
    ) -> None:
        self.stream = stream
        self.at = at
        self.text = text  # `at` as text
        self.prev = prev
        self.order = order  # the entry's `u`: its place in its server's commit order
        self.key = key
        self.data = data
        self.start = start  # where the change starts in `data` (after the feed's header)
        self.groups = groups  # None: match the key now (a catch-up)


class _Claim:
    """A change a message says happened (a write without a feed), until checked."""

    __slots__ = ("change", "expires", "heard", "hint", "stamp")

    def __init__(self, hint: _Hint, change: Change, stamp: int, expires: int, heard: int) -> None:
        self.hint = hint
        self.change = change
        self.stamp = stamp
        self.expires = expires
        self.heard = heard  # its place in the order the messages were heard


def _chain(claims: list[_Claim], entry: Entry | None) -> list[_Claim] | None:
    """The claims that lead to `entry` (the key's state), oldest first; `None` if none does.

    The newest claim that `entry` confirms anchors the chain; each claim before it belongs to
    it when its successor started from it (the version before, and its new value as the old).
    """
    anchor = -1
    for index in range(len(claims) - 1, -1, -1):
        change = claims[index].change
        if entry is None:
            if change.op is ChangeOp.DELETE:
                anchor = index
                break
        elif (
            change.op is ChangeOp.SET
            and change.version == entry.version
            and claims[index].stamp == to_ms(entry.updated_at)
            and change.new == entry.value
        ):
            anchor = index
            break
    if anchor < 0:
        return None
    chain = [claims[anchor]]
    for index in range(anchor - 1, -1, -1):
        later, change = chain[-1].change, claims[index].change
        if change.version == later.version - (later.op is ChangeOp.SET) and (
            change.op is ChangeOp.SET and change.new == later.old
        ):
            chain.append(claims[index])
        elif change.version < later.version - 1:
            break
    chain.reverse()
    return chain


def _deliver_gone(group: _Group, claim: _Claim) -> None:
    """Deliver a delete that nothing before it vouches for.

    The key is gone, but its version and old value come from the message: delivered as heard
    when they match what `group` was given; otherwise as the key's state as read (gone: a
    `RESYNC`, old value unknown), unless `group` knows it gone already.
    """
    change = claim.change
    known = group.seen.get(change.key)
    if known is not None and known[1] is None:
        return  # known gone
    if known is not None and (known[0], known[1]) == (change.version, hash(change.old)):
        group.deliver(change, claim.stamp, claim.expires)
        return
    group.remember(change.key, 0, None, claim.stamp + _GONE_KEPT_MS)
    group.fanout.publish_to_all(
        Change(change.key, ChangeOp.RESYNC, None, None, 0, from_ms(claim.stamp))
    )


class _Gap(Exception):  # noqa: N818  # a signal inside the reader, never raised to users
    """The feed trimmed a change the reader was told of before it read it: catch up."""


if TYPE_CHECKING:
    _Item = _Hint | Callable[[], None]


class Subscriber:
    """`RedisBackend`'s subscriptions (a mixin): `changes()` and the pub/sub reader behind it."""

    if TYPE_CHECKING:  # what the backend provides
        _url: str
        _client_options: dict[str, Any]
        _closed: bool
        is_cluster: bool
        socket_timeout: float
        connect_timeout: float
        feed: FeedRetention | None
        _feed_names: feeds.FeedNames
        key_prefix: str

        async def _read(self, *args: str | bytes | int) -> Any: ...

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
        async def _run_script(
            self, sha: str, source: str, keys: Sequence[str], args: Sequence[str | bytes | int]
        ) -> Any: ...

    def _init_subscriber(self, key_prefix: str, *, whole_prefix: bool = False) -> None:
        self._whole_prefix = whole_prefix  # one pattern for every channel of the key prefix
        self._channel_text = f"{CHANNEL_NAMESPACE}{key_prefix}"
        self._channel_prefix = self._channel_text.encode()
        self._channel_cut = len(self._channel_prefix)
        self._namespace_cut = len(CHANNEL_NAMESPACE.encode())
        self._own_stream: feeds.Stream = (0, key_prefix)
        # Barrier markers go to a "key" no real key can be (keys may not use the reserved
        # prefix), tagged with this backend's id so other subscribers ignore them.
        self._reserved = RESERVED_PREFIX.encode()
        barrier_key = f"{RESERVED_PREFIX}:barrier:{uuid.uuid4().hex}:"
        self._barrier_key = barrier_key.encode()
        # A cluster's subscriber always hears its own markers.
        self._fixed_topics: set[_Topic] = {(barrier_key, False)} if self.is_cluster else set()
        self._groups: dict[str, _Group] = {}
        self._index = _PatternIndex()
        self._pubsub: Any = None
        self._link: wire.PubSubLink | None = None  # the connection, once it is being subscribed
        self._pubsub_source: aioredis.Redis | None = None  # a cluster node's client for pub/sub
        self._reader: asyncio.Task[None] | None = None
        # The server's patterns on the current connection: those PSUBSCRIBEd (and not since
        # PUNSUBSCRIBEd), and those the server has confirmed (as of the last reply read).
        self._sent: dict[bytes, _Topic] = {}
        self._acked: dict[bytes, _Topic] = {}
        self._overlap = False  # some confirmed pattern covers another: a change may come twice
        self._received = 0  # messages read (for tests: a subscription hears only its prefix)
        self._live = asyncio.Event()  # the connection is subscribed (and resynced) again
        self._tokens = itertools.count()
        self._barriers: dict[int, _Barrier] = {}  # waiting for their PONG or markers
        self._connect_waiters: list[int] = []  # barriers opened when the connection is subscribed
        self._horizon = 0  # server ms: every change stamped before it was read (or was older)
        self._gap_from = 0  # the horizon when the connection last dropped
        self._resync_pending = False
        # Server clocks of a cluster's nodes may differ a little: a resync looks that far back.
        self._clock_skew_ms = 50 if self.is_cluster else 0
        self._clock_offset = 0.0  # server ms minus local ms, from the last change read
        self._pruned = 0  # server ms of the last pass forgetting expired keys
        # The feed, as this reader has delivered it: per stream the last id, the floor (every
        # change stamped before it was delivered) and the streams delivered at or above it
        # (what a cursor lists).
        self._feed_last: dict[feeds.Stream, feeds.Id] = {}
        # One server: the last change delivered (its stream, id and order), where a catch-up
        # resumes (None: nowhere yet).
        self._point: tuple[feeds.Stream, feeds.Id, int] | None = None
        self._feed_floor = 0
        self._feed_listed: dict[feeds.Stream, str] = {}
        self._floor_task: asyncio.Task[None] | None = None
        self._drops = 0  # connections lost while live (`_feed_start` checks for one)
        # What the reader heard and has yet to deliver, in the order heard (`_deliver`): the
        # notifications, and the barriers' actions that must follow them.
        self._queue: deque[_Item] = deque()
        self._queue_ready = asyncio.Event()
        self._deliverer: asyncio.Task[None] | None = None
        self._delivering = False
        self._settling: dict[int, _Barrier] = {}  # lookups waiting for their barrier
        self._denied: set[feeds.Stream] = set()  # streams this ACL user may not read
        # (slot, stream name after the namespace) -> (stream, its prefix as bytes), or () if it
        # is no feed stream
        self._streams_named: dict[tuple[int, bytes], tuple[feeds.Stream, bytes] | tuple[()]] = {}
        self._caught = 0  # changes the last catch-up read
        self._ignored = 0  # notifications ignored since the last warning
        self._ignored_logged = 0.0
        # Without a feed: the changes heard of each key, until checked (`_deliver_checked`).
        self._held: dict[str, list[_Claim]] = {}
        self._held_since: dict[str, float] = {}
        self._heard = itertools.count()

    @asynccontextmanager
    async def _changes(
        self, pattern: str, max_buffer: int, since: str | None = None
    ) -> AsyncIterator[ChangeStream | _Replay]:
        wire.require_asyncio()
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        position: feeds.Position | None = None
        if since is not None:
            position = (
                feeds.Position(earliest=True)
                if since == EARLIEST
                else feeds.parse_cursor(since, self._feed_names)
            )
        await self._redis()
        group = self._groups.get(pattern)
        joined = group is None and self._link is not None  # a new topic, on a live connection
        if group is None:
            group = self._groups[pattern] = _Group(pattern)
            self._index.add(group)
        group.users += 1
        try:
            async with group.fanout.subscribe(pattern, max_buffer, start_open=False) as stream:
                held = (stream, max_buffer)
                group.streams.append(held)
                try:
                    if position is None:
                        await self._go_live(stream)
                        if joined:
                            await self._feed_start(group)
                        yield stream
                    else:
                        # Live from here, but opened only once the feed has been read up to
                        # now (`_Replay`): the changes before that come from the feed. (Closed
                        # meanwhile, entry raises `BackendError`, as a live subscription's.)
                        await self._go_live(None)
                        replay = _Replay(self, group.matcher, since or "", position, stream)
                        await replay.begin()
                        yield replay
                finally:
                    group.streams = [s for s in group.streams if s is not held]
        finally:
            group.users -= 1
            if group.users == 0 and self._groups.get(pattern) is group:
                del self._groups[pattern]
                self._index.remove(group)
                self._subscribe_patterns()  # PUNSUBSCRIBE what no subscription needs now

    # the server's patterns

    def _wanted_patterns(self) -> dict[bytes, _Topic]:
        """The patterns the connection should hold: each subscription's literal prefix, covered.

        A subscription to `agent:*` needs the channels starting `agent:`, one to `job:7` that
        key's channel, one with no literal prefix (`*`, `?x`) every channel of the key prefix.
        """
        topics = set(self._fixed_topics)
        for group in self._groups.values():
            matcher = group.matcher
            topics.add((matcher.literal_prefix, matcher.is_literal))
        if self._whole_prefix and topics:
            # Under an ACL limited to `&__agenticstate__:<prefix>*`, the one pattern Redis lets
            # this user PSUBSCRIBE (it compares patterns literally); the rest is matched here.
            topics = {("", False)}
        return {
            (escape_glob(self._channel_text + text) + ("" if exact else "*")).encode(): (
                text,
                exact,
            )
            for text, exact in _bounded_cover(topics)
        }

    def _subscribe_patterns(self) -> None:
        """Bring the connection's patterns to what the subscriptions need (no reply awaited).

        New patterns are PSUBSCRIBEd before old ones are PUNSUBSCRIBEd, so no change falls into
        the gap; a change both match meanwhile comes twice, and `_first_match` keeps one.
        """
        link = self._link
        if link is None:
            return  # the reader subscribes what is wanted when it connects
        wanted = self._wanted_patterns()
        sent = self._sent
        new = [pattern for pattern in wanted if pattern not in sent]
        old = [pattern for pattern in sent if pattern not in wanted]
        if new:
            link.send("PSUBSCRIBE", *new)
            for pattern in new:
                sent[pattern] = wanted[pattern]
        if old:
            link.send("PUNSUBSCRIBE", *old)
            for pattern in old:
                del sent[pattern]

    def _confirmed(self, kind: bytes, pattern: bytes) -> None:
        """The server confirmed a PSUBSCRIBE or a PUNSUBSCRIBE of `pattern`."""
        if kind == b"psubscribe":
            topic = self._sent.get(pattern)
            if topic is None:
                return  # PUNSUBSCRIBEd since: its confirmation follows
            self._acked[pattern] = topic
        else:
            self._acked.pop(pattern, None)
        confirmed = sorted(self._acked.values())
        self._overlap = any(
            not exact and later.startswith(text)
            for (text, exact), (later, _) in itertools.pairwise(confirmed)
        )

    def _first_match(self, pattern: bytes, key: str) -> bool:
        """Whether the message `pattern` brought for `key` is the one to keep.

        While two confirmed patterns overlap (between a PSUBSCRIBE and the PUNSUBSCRIBE it
        replaces), a change under both comes once per pattern: the shortest keeps it. Confirmed
        patterns are read in order with the messages, so they are the server's at publish time.
        """
        topic = self._acked.get(pattern)
        if topic is None:
            return False
        matching = [other for other in self._acked.values() if _covers(other, key)]
        return min(matching, key=lambda other: (len(other[0]), other[1])) == topic

    # going live

    async def _go_live(self, stream: ChangeStream | None) -> None:
        """Open `stream` at a barrier on the live pub/sub connection (see "Delivery").

        The barrier is a message that arrives after every change already on its way: a PING on
        the subscribed connection (answered after every message its server sent before, and
        after the PSUBSCRIBE sent just before it took effect), or on a cluster a marker
        PUBLISHed on every primary once that PSUBSCRIBE is confirmed (each shard's changes reach
        the connection's node over the cluster bus, in order per shard). The reader opens the
        stream when the last one arrives, so it gets every change committed after entry and
        none from before the barrier. With `stream=None` this drains the connection.
        """
        if self._closed:
            raise BackendError("this RedisBackend is closed")
        self._start_reader()
        token = next(self._tokens)
        barrier = _Barrier(stream, markers=self.is_cluster)
        self._barriers[token] = barrier
        try:
            async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
                link = self._link
                if link is not None:
                    self._subscribe_patterns()
                    if self.is_cluster:
                        await self._round_trip()  # the PSUBSCRIBE is in effect
                        if not barrier.opened.is_set() and not self._closed:
                            await self._send_markers(token, barrier)
                    else:
                        link.send("PING", _BARRIER + b"%d" % token)
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

    async def _round_trip(self) -> None:
        """Wait for a PING on the pub/sub connection: every command sent before took effect."""
        token = next(self._tokens)
        barrier = _Barrier(None)
        self._barriers[token] = barrier
        try:
            link = self._link
            if link is not None:
                link.send("PING", _BARRIER + b"%d" % token)
            # If the connection drops meanwhile, the reader opens it once subscribed again.
            await barrier.opened.wait()
        finally:
            self._barriers.pop(token, None)

    async def _send_markers(self, token: int, barrier: _Barrier) -> None:
        """PUBLISH a new round of `barrier`'s marker on every primary (a cluster).

        Each marker is published after its node's clock was read; the clock comes back in the
        script's reply, not in the message (nothing that arrives on a channel is trusted), and
        the round's name is random, so that nobody else can end it early.
        """
        client = await self._redis()
        primaries = await self._primaries(client)
        barrier.round = random.getrandbits(62)  # unguessable enough: not crypto
        barrier.remaining = len(primaries)
        barrier.low = 0
        barrier.clocks = False
        channel = self._channel_prefix + self._barrier_key + b"%d:%d" % (token, barrier.round)
        for node in primaries:
            command = ("EVAL", _MARKER, 0, channel)
            clock = int(await self._execute_on_cluster(client, command, None, target_nodes=node))
            barrier.low = clock if not barrier.low else min(barrier.low, clock)
        barrier.clocks = True
        if barrier.remaining <= 0:
            self._markers_in(barrier)

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._live = asyncio.Event()  # of this event loop, for a fresh connection
            self._reader = asyncio.get_running_loop().create_task(
                self._read_changes(), name="agenticstate-redis-pubsub"
            )

    def _pong(self, data: bytes) -> None:
        if data.startswith(_SETTLE):
            settling = self._settling.get(int(data[len(_SETTLE) :]))
            if settling is not None:
                settling.opened.set()  # a lookup's barrier: read in order, acted on at once
            return
        if not data.startswith(_BARRIER):
            return  # a health check
        barrier = self._barriers.get(int(data[len(_BARRIER) :]))
        if barrier is not None and not barrier.markers:
            # Opened once every change heard before it has been delivered.
            self._action(barrier.open)

    def _marker(self, tail: bytes) -> None:
        token, _, round_ = tail.partition(b":")
        if token.startswith(b"L"):
            settling = self._settling.get(int(token[1:]))
            if settling is not None and int(round_) == settling.round:
                settling.remaining -= 1
                if settling.remaining <= 0:
                    settling.opened.set()
            return
        barrier = self._barriers.get(int(token))
        if barrier is not None and barrier.markers and int(round_) == barrier.round:
            barrier.remaining -= 1
            if barrier.remaining <= 0 and barrier.clocks:
                self._markers_in(barrier)

    def _markers_in(self, barrier: _Barrier) -> None:
        """Every primary's marker (and clock) of `barrier`'s round is in."""
        low = barrier.low

        def done() -> None:
            # Every primary's changes stamped before its marker came before it, and have been
            # delivered (this runs after them).
            self._raise_floor(low)
            barrier.open()

        barrier.remaining = 1 << 30  # a stray marker of this round changes nothing now
        self._action(done)

    def _raise_floor(self, floor: int) -> None:
        """Every change stamped before `floor` has been read: list only the slots above it."""
        if floor <= self._feed_floor:
            return
        self._feed_floor = floor
        self._feed_listed = {
            slot: at for slot, at in self._feed_listed.items() if feeds.parse_id(at)[0] >= floor
        }

    def _start_floor_round(self) -> None:
        """Raise the floor with a marker round, unless one is on its way (a cluster's feed)."""
        task = self._floor_task
        if task is not None and not task.done():
            return
        self._floor_task = asyncio.get_running_loop().create_task(
            self._floor_round(), name="agenticstate-redis-feed-floor"
        )

    async def _floor_round(self) -> None:
        """A marker round on every primary; `_marker` raises the floor when it completes."""
        token = next(self._tokens)
        barrier = _Barrier(None, markers=True)
        self._barriers[token] = barrier
        try:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
                    await self._send_markers(token, barrier)
                    await barrier.opened.wait()
        finally:
            self._barriers.pop(token, None)

    # the reader

    async def _connect_pubsub(self) -> None:
        """Connect, read the server's clock, PSUBSCRIBE what is wanted and PING after it."""
        client = await self._redis()
        async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
            source = await self._pubsub_client(client)
            if source is not client:
                self._pubsub_source = source  # closed with the pub/sub connection
            self._pubsub = source.pubsub(ignore_subscribe_messages=False)
            # Read the clock before subscribing: every write after the subscription is stamped
            # at or after it (see `_resync`).
            # On one server, the feed's head too: where a catch-up starts if nothing comes
            # before the first drop (read on this connection: it is the only one a
            # subscriber needs).
            head_key = None
            if (
                self.feed is not None
                and not self.is_cluster
                and not self._feed_last
                and not self._resync_pending  # after a gap the head is no place to resume
            ):
                head_key = self._feed_names.plain[1]
            self._horizon, head = await wire.connect_pubsub(self._pubsub, head_key)
            if head_key is not None:
                # Its own stream from its head; the others (nested prefixes) from the clock.
                at = feeds.parse_id(head) if head else (0, 0)
                self._feed_last[self._own_stream] = at
                self._point = (self._own_stream, at, self._horizon * 1000)
        self._sent.clear()
        self._acked.clear()
        self._overlap = False
        link = self._link = wire.PubSubLink(self._pubsub)
        self._subscribe_patterns()
        # Barriers waiting now open at this PING's answer (their own PINGs, if any, were lost
        # with the old connection); those that come after send their own.
        self._connect_waiters = list(self._barriers)
        link.send("PING", _SUBSCRIBED)

    async def _subscribed(self) -> None:
        """The connection's patterns are in effect: resync if a gap came before, then go live."""
        since = self._horizon
        if self._resync_pending:
            # Live again: now read what the gap hid from the feed, or else re-read the keys.
            if not await self._catch_up():
                await self._resync(self._gap_from, since)
                # Live changes from here on set the feed's place again (until one comes, a
                # next gap resyncs too).
                self._feed_last.clear()
                self._point = None
            self._resync_pending = False

        self._live.set()
        waiters, self._connect_waiters = self._connect_waiters, []
        for token in waiters:
            barrier = self._barriers.get(token)
            if barrier is None:
                continue
            if barrier.markers:
                # Changes other shards published before the PSUBSCRIBE may still be on their
                # way over the cluster bus: open at markers from every primary, never before.
                await self._send_markers(token, barrier)
            else:
                # One server: nothing published before the PSUBSCRIBE can still come.
                barrier.open()

    async def _read_changes(self) -> None:
        """The one reader of the pub/sub connection: dispatch, reconnect, resync."""
        failures = 0
        heard = ping_sent = 0.0
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                link = self._link
                if link is None:
                    await self._connect_pubsub()
                    link = self._link
                    assert link is not None  # noqa: S101  # set by _connect_pubsub
                    heard, ping_sent = loop.time(), 0.0
                    self._start_deliverer()
                # One timeout for many reads, pushed back at most twice a second while replies
                # come (not set and cancelled around each read): it fires after a silence.
                deadline = loop.time() + _IDLE_CHECK
                try:
                    async with asyncio.timeout_at(deadline) as idle:
                        while True:
                            replies = await link.read()
                            heard = now = loop.time()
                            ping_sent = 0.0
                            if deadline - now < _IDLE_CHECK / 2:
                                deadline = now + _IDLE_CHECK
                                idle.reschedule(deadline)
                            for reply in replies:
                                if type(reply) is not bytes and reply[0] == b"pmessage":
                                    self._message(reply)
                                elif self._control(reply):
                                    # Subscribed again: resync (never cut short by the timeout).
                                    idle.reschedule(None)
                                    await self._subscribed()
                                    failures = 0
                                    deadline = loop.time() + _IDLE_CHECK
                                    idle.reschedule(deadline)
                            if self._queue and not self._queue_ready.is_set():
                                self._queue_ready.set()  # the deliverer reads them back
                except TimeoutError:
                    if not idle.expired():
                        raise
                now = loop.time()
                self._prune(time.time() * 1000 + self._clock_offset - _PRUNE_LAG_MS)
                if self._feed_listed and self.is_cluster:
                    self._start_floor_round()  # keep cursors short while changes are few
                # A connection can die without a word (a NAT or firewall forgets it): when
                # nothing came for a while, ask, and give up on it if no answer comes.
                if ping_sent and now - ping_sent > self.socket_timeout:
                    raise ConnectionError("no answer to PING on the pub/sub connection")
                if not ping_sent and now - heard > _PUBSUB_IDLE:
                    ping_sent = now
                    link.send("PING", _HEALTH)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # any failure: reconnect, then resync
                if self._closed:
                    break
                failures += 1
                log.warning(
                    "pubsub_reconnecting",
                    url=self.url,
                    error=type(exc).__name__,
                    attempt=failures,
                )
                await self._stop_deliverer()
                if self._live.is_set():
                    # Changes after the last one delivered may be lost: catch up from there.
                    self._live.clear()
                    self._gap_from = self._horizon
                    self._resync_pending = True
                    self._drops += 1
                await self._drop_pubsub()
                await asyncio.sleep(min(0.05 * 2 ** min(failures, 6), 2.0) + backoff(failures))
        await self._stop_deliverer()

    def _message(self, reply: list[Any]) -> None:
        """A `pmessage` reply, `[b"pmessage", pattern, channel, data]`: queue what it names.

        Nothing in a message is delivered as it is: a notification names a feed entry, which
        the deliverer reads back (`_deliver`); without a feed, the change it carries is checked
        against the key first. A message that names nothing this store holds is ignored.
        """
        channel = reply[2]
        cut = self._channel_cut
        if channel.startswith(self._reserved, cut):
            # No key starts with the reserved prefix: a barrier, this backend's or another's.
            if channel.startswith(self._barrier_key, cut):
                with contextlib.suppress(ValueError):
                    self._marker(channel[cut + len(self._barrier_key) :])
            return
        self._received += 1
        key = channel[cut:].decode("utf-8", "surrogateescape")
        if self._overlap and not self._first_match(reply[1], key):
            return
        groups = self._index.matching(key)
        if not groups:
            return
        data = reply[3]
        name = channel[self._namespace_cut :]
        kind = data[:1]
        stream: feeds.Stream | None = None
        at: feeds.Id | None = None
        raw = b""
        try:
            if kind == b"F":  # F<id> <stream name after the namespace>
                space = data.index(b" ")
                raw = data[1:space]
                at = feeds.parse_id(raw)
                slot = wire.key_slot(name) if self.is_cluster else 0
                named = self._streams_named.get((slot, data[space + 1 :]))
                if named is None:
                    named = self._stream_named(slot, data[space + 1 :])
                if not named or not name.startswith(named[1]):
                    self._ignore("not_a_feed_of_this_key")
                    return
                stream = named[0]
            elif kind == b"X":  # an earlier version's writer: the change, in its own stream
                header = split_feed(data)
                assert header is not None  # noqa: S101  # it starts with X
                raw = header[0]
                at = feeds.parse_id(raw)
                stream = (wire.key_slot(name) if self.is_cluster else 0, self.key_prefix)
            elif kind not in (b"R", b"W", b"D", b"S"):  # R: a change with its revision first
                if b":" + self._reserved not in name:  # (not another store's barrier)
                    self._ignore("unknown")
                return
            elif self.feed is not None:
                # A change written without the feed: this store's feed does not hold it, so
                # neither does its live delivery (what a subscriber gets is what it can replay).
                self._ignore("not_in_the_feed")
                return
        except (ValueError, IndexError):
            self._ignore("malformed")
            return
        if stream is not None:
            assert at is not None  # noqa: S101  # set with the stream
            last = self._feed_last.get(stream)
            if last is not None and at <= last:
                return  # delivered already (a catch-up read it, or a message heard again)
        self._queue.append(_Hint(groups, key, name, stream, at, data, raw))

    def _stream_named(self, slot: int, tail: bytes) -> tuple[feeds.Stream, bytes] | tuple[()]:
        """The stream `FEED_NAMESPACE + tail` of `slot` and its prefix's bytes (cached)."""
        prefix = self._feed_names.prefix_of(tail, slot)
        named: tuple[feeds.Stream, bytes] | tuple[()] = (
            () if prefix is None else ((slot, prefix), prefix.encode())
        )
        if len(self._streams_named) < 65536:
            self._streams_named[(slot, tail)] = named
        return named

    def _ignore(self, reason: str) -> None:
        """Count a message that was ignored; warn about them at most every 10 seconds."""
        self._ignored += 1
        now = time.monotonic()
        if now - self._ignored_logged >= _IGNORED_LOG_EVERY:
            log.warning("pubsub_message_ignored", reason=reason, count=self._ignored)
            self._ignored_logged = now
            self._ignored = 0

    def _control(self, reply: Any) -> bool:
        """Any other reply; true for the PING after a new connection's PSUBSCRIBEs."""
        if type(reply) is bytes:  # a PING's answer while nothing is subscribed
            kind, data = b"pong", (b"" if reply == b"PONG" else reply)
        else:
            kind, data = reply[0], reply[1]
        if kind == b"pong":
            if data == _SUBSCRIBED:
                return True
            self._pong(data)
        elif kind in (b"psubscribe", b"punsubscribe"):
            self._confirmed(kind, data)
        return False

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

    # delivery: what was heard, read back from the store, in the order heard

    def _action(self, action: Callable[[], None]) -> None:
        """Run `action` once everything heard before it has been delivered."""
        if not self._queue and not self._delivering:
            action()
        else:
            self._queue.append(action)
            self._queue_ready.set()

    def _start_deliverer(self) -> None:
        if self._deliverer is None or self._deliverer.done():
            self._queue_ready = asyncio.Event()
            self._deliverer = asyncio.get_running_loop().create_task(
                self._deliver(), name="agenticstate-redis-deliver"
            )

    async def _stop_deliverer(self) -> None:
        """Stop delivering; forget what was heard (a catch-up reads it from the feed)."""
        task, self._deliverer = self._deliverer, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._delivering = False
        # Barriers whose opening was queued behind what was heard open again once the
        # connection is back (`_connect_waiters`); what was heard, a catch-up reads.
        self._queue.clear()
        self._settling.clear()
        self._held.clear()
        self._held_since.clear()

    async def _deliver(self) -> None:
        """The deliverer: read back what the reader heard, deliver it, run actions, in order."""
        queue = self._queue
        try:
            while True:
                if not queue:
                    self._queue_ready.clear()
                    if not self._held:
                        await self._queue_ready.wait()
                        continue
                    # Changes of keys that moved on wait for their successors: look again soon.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_HELD_RECHECK):
                            await self._queue_ready.wait()
                    if not queue:
                        self._delivering = True
                        try:
                            await self._deliver_checked([])
                        finally:
                            self._delivering = False
                    continue
                if type(queue[0]) is not _Hint:
                    queue.popleft()()  # type: ignore[operator]  # an action
                    continue
                batch: list[_Hint] = []
                while queue and type(queue[0]) is _Hint and len(batch) < _LOOKUP_BATCH:
                    batch.append(queue.popleft())  # type: ignore[arg-type]  # a hint
                self._delivering = True
                try:
                    await self._deliver_batch(batch)
                finally:
                    self._delivering = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # the reader reconnects and catches up
            if self._closed:
                return
            log.warning("pubsub_read_back_failed", url=self.url, error=type(exc).__name__)
            link = self._link
            if link is not None:
                link.close()  # the reader sees the connection end: it reconnects

    async def _deliver_batch(self, batch: list[_Hint]) -> None:
        noted = [hint for hint in batch if hint.stream is not None]
        changes = [hint for hint in batch if hint.stream is None]
        if noted:
            reads = await self._read_back(noted, settle=True)
            for read in reads:
                self._deliver_entry(read)
        if changes:
            await self._deliver_checked(changes)

    async def _read_back(self, hints: list[_Hint], *, settle: bool) -> list[_Read]:
        """The feed entries `hints` name, read from their streams, in commit order.

        With `settle`, an entry that does not follow the last one delivered from its stream
        waits for a barrier (a PING; on a cluster, a marker its lookup published): every
        notification of an earlier entry has then been heard, and those still queued are read
        and delivered with it, in order. So a notification heard early (someone PUBLISHed it
        before the real one came) can never put an earlier change behind a later one.
        """
        by_slot: dict[int, dict[feeds.Stream, list[_Hint]]] = {}
        for hint in hints:
            assert hint.stream is not None  # noqa: S101  # a feed notification
            if hint.stream in self._denied:
                continue
            by_slot.setdefault(hint.stream[0], {}).setdefault(hint.stream, []).append(hint)
        marked = settle and self.is_cluster
        settling = _Barrier(None, markers=True)
        token = next(self._tokens)
        if marked:
            settling.round = random.getrandbits(62)  # not crypto
            settling.remaining = len(by_slot)
            self._settling[token] = settling
        try:
            channel = (
                self._channel_prefix + self._barrier_key + b"L%d:%d" % (token, settling.round)
                if marked
                else b""
            )
            found = await asyncio.gather(
                *(self._look_up(streams, channel, settling) for streams in by_slot.values())
            )
            reads = [read for part in found for read in part]
            if settle and not self._follows(reads):
                await self._settle(token, settling, marked)
                reads += await self._earlier(reads)
        finally:
            self._settling.pop(token, None)
        reads.sort(key=lambda read: (read.order, read.at))
        return reads

    def _follows(self, reads: list[_Read]) -> bool:
        """Whether each stream's entries follow the last one delivered, with no gap between."""
        last: dict[feeds.Stream, feeds.Id | None] = {}
        known = self._feed_last
        for read in reads:  # in the order heard: each stream's in its order, if nothing is amiss
            stream = read.stream
            before = last[stream] if stream in last else known.get(stream)
            if before != read.prev:
                return False
            last[stream] = read.at
        return True

    async def _settle(self, token: int, settling: _Barrier, marked: bool) -> None:
        """Wait until every notification published before the lookups ran has been heard."""
        async with asyncio.timeout(self.socket_timeout):
            if not marked:
                self._settling[token] = settling
                link = self._link
                if link is None:
                    raise ConnectionError("the pub/sub connection is gone")
                link.send("PING", _SETTLE + b"%d" % token)
            await settling.opened.wait()
        if self._link is None:
            raise ConnectionError("the pub/sub connection is gone")

    async def _earlier(self, reads: list[_Read]) -> list[_Read]:
        """Take the queued notifications of entries before those in `reads` and read them."""
        newest: dict[feeds.Stream, feeds.Id] = {}
        for read in reads:
            if read.at > newest.get(read.stream, (0, 0)):
                newest[read.stream] = read.at
        taken: list[_Hint] = []
        kept: deque[_Item] = deque()
        for item in self._queue:
            if (
                type(item) is _Hint
                and item.stream in newest
                and item.at is not None
                and item.at < newest[item.stream]
            ):
                taken.append(item)
            else:
                kept.append(item)
        if not taken:
            return []
        self._queue.clear()
        self._queue.extend(kept)
        return await self._read_back(taken, settle=False)

    async def _look_up(
        self, streams: dict[feeds.Stream, list[_Hint]], channel: bytes, settling: _Barrier
    ) -> list[_Read]:
        """Read the entries `streams`' notifications name (one slot), in one script."""
        names = [self._feed_names.stream(stream)[0] for stream in streams]
        args: list[str | bytes | int] = [channel, int(self.is_cluster)]
        asked: list[tuple[feeds.Stream, _Hint]] = []
        for position, (stream, hints) in enumerate(streams.items(), 1):
            for hint in hints:
                args += [position, hint.raw]
                asked.append((stream, hint))
        try:
            found = await self._run_script(LOOKUP_SHA, feeds.LOOKUP, names, args)
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            # A stream this ACL user may not read (a prefix it is nested in): find it, and
            # read the others.
            allowed = {
                stream: hints for stream, hints in streams.items() if await self._may_read(stream)
            }
            if allowed:
                return await self._look_up(allowed, channel, settling)
            if channel:  # no marker will come from this slot
                settling.remaining -= 1
                if settling.remaining <= 0:
                    settling.opened.set()
            return []
        reads = []
        missing: list[tuple[feeds.Stream, _Hint]] = []
        for (stream, hint), entry in zip(asked, found, strict=True):
            if entry and entry[1] is None:
                # Its value is gone from the store (deleted or evicted outside the library):
                # the reader cannot deliver it exactly, so it catches up as after a gap.
                log.warning("pubsub_feed_value_lost", url=self.url)
                raise _Gap
            if entry:
                read = self._entry_read(stream, entry, hint)
                if read is not None:
                    reads.append(read)
            else:
                missing.append((stream, hint))
        if missing:
            await self._missing(missing)
        return reads

    async def _missing(self, missing: list[tuple[feeds.Stream, _Hint]]) -> None:
        """Notifications whose entries the feed does not hold: made up, or trimmed already.

        Trimmed, when the stream's first retained entry is past one this reader was told of
        and had not delivered: the reader fell behind the feed's retention, so it catches up
        (`_Gap`: reconnect, then read the feed from its place, or resync when that is gone),
        as when its connection drops, never silently. Otherwise the notification names no
        change: it is ignored.
        """
        streams = list(dict.fromkeys(stream for stream, _ in missing))
        names = [self._feed_names.stream(stream)[0] for stream in streams]
        firsts = dict(
            zip(streams, await self._run_script(FIRSTS_SHA, feeds.FIRSTS, names, []), strict=True)
        )
        for stream, hint in missing:
            first, known, at = firsts[stream], self._feed_last.get(stream), hint.at
            assert at is not None  # noqa: S101  # a feed notification
            if first and at < feeds.parse_id(first) and (known is None or at > known):
                log.warning("pubsub_fell_behind_the_feed", url=self.url)
                raise _Gap
            self._ignore("no_such_change")

    async def _may_read(self, stream: feeds.Stream) -> bool:
        """Whether this ACL user may read `stream` (remembered when not)."""
        try:
            name = self._feed_names.stream(stream)[0]
            await self._run_script(LOOKUP_SHA, feeds.LOOKUP, [name], [b"", 0, 1, "0-1"])
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            self._denied.add(stream)
            log.warning("feed_stream_denied", url=self.url)
            return False
        return True

    def _entry_read(self, stream: feeds.Stream, entry: list[Any], hint: _Hint) -> _Read | None:
        """A looked-up entry as a `_Read`, if it is the change its notification names."""
        name, data, order = entry
        at = hint.at
        assert at is not None  # noqa: S101  # a feed notification
        try:
            header = split_feed(data)
            if header is None or name != hint.name or header[0] != hint.raw:
                self._ignore("not_this_key")
                return None
            prev = feeds.parse_id(header[1])
        except ValueError:
            self._ignore("malformed_entry")
            return None
        return _Read(
            stream,
            at,
            prev,
            int(order) if order else at[0] * 1000,
            hint.key,
            data,
            hint.groups,
            header[2],
            header[0].decode(),
        )

    def _deliver_entry(self, read: _Read, *, catching_up: bool = False) -> None:
        """Deliver a change read from the feed, unless delivered already.

        It gets its cursor, then goes to each matching subscription.
        """
        stream, at = read.stream, read.at
        last = self._feed_last.get(stream)
        if last is not None and at <= last:
            return
        self._feed_last[stream] = at
        data = read.data
        start = read.start
        if data[start : start + 1] == b"R":  # the change's revision first: 17 bytes
            stamp = int(data[start + 38 : start + 53])
        else:
            stamp = int(data[start + 21 : start + 36])
        cursor: str | None = None
        text = read.text
        if not self.is_cluster:
            # One server: changes are delivered in commit order (`_read_back`), so a change's
            # cursor is its own place, and the reader's place is the last change delivered.
            self._point = (stream, at, read.order)
            if self.feed is not None:
                cursor = feeds.point_cursor(self._feed_names, stream, text)
        elif self.feed is not None:
            listed = self._feed_listed
            listed.pop(stream, None)
            listed[stream] = text
            if len(listed) > _LISTED_MAX:
                self._start_floor_round()
            cursor = feeds.make_cursor(self._feed_names, self._feed_floor, (stream, text), listed)
        if stamp > self._horizon:
            self._horizon = stamp
            if stamp - self._pruned >= _PRUNE_LAG_MS:
                # Once a second of server time, every subscription forgets the keys that
                # expired over a second ago. Not sooner: on a cluster a shard's change can
                # arrive after another shard's later ones, and a key's own change from before
                # its expiry must still find it remembered (or it would be delivered twice).
                self._pruned = stamp
                self._prune(stamp - _PRUNE_LAG_MS)
        groups = read.groups
        if groups is None:
            groups = self._index.matching(read.key)
            if catching_up:
                order = read.order
                groups = [g for g in groups if g.feed_after is None or order > g.feed_after]
        if not groups:
            return
        self._clock_offset = stamp - time.time() * 1000
        change, expires = parse_message(read.key, data, start, cursor)
        for group in groups:
            group.deliver(change, stamp, expires)

    async def _deliver_checked(self, hints: list[_Hint]) -> None:
        """Deliver the changes of writes without a feed, once checked against the store.

        Without a feed the store keeps no change, only each key's present state, so a change is
        delivered when it leads there: the newest change heard for a key must be what the key
        holds (version, time and value; for a delete, the key is gone), and each one before it
        must be the one its successor started from (the version before, and the value its
        successor names as old). Changes of a key that has moved on wait for the notifications
        still on their way (up to `socket_timeout`); changes that lead nowhere (made up, or
        written through a store with a feed, whose notifications name its entries instead) are
        dropped. The one part of a change nothing can check is its old value when it is the
        first one heard: it comes from the message.
        """
        held = self._held
        for hint in hints:
            try:
                change, expires = parse_message(hint.key, hint.data)
            except (ValueError, IndexError):
                self._ignore("malformed")
                continue
            if not held.get(hint.key):
                self._held_since[hint.key] = time.monotonic()
            claim = _Claim(hint, change, stamp_of(hint.data), expires, next(self._heard))
            held.setdefault(hint.key, []).append(claim)
        if not held:
            return
        keys = list(held)
        entries = dict(zip(keys, await self.get_many(keys), strict=True))
        give_up = time.monotonic() - self.socket_timeout
        checked: list[tuple[int, _Claim]] = []  # (position in the chain, claim)
        for key in keys:
            claims = held[key]
            entry = entries[key]
            accepted = _chain(claims, entry)
            if accepted is None and self._held_since[key] > give_up:
                continue  # the key has moved on: its newer changes are on their way
            del held[key]
            del self._held_since[key]
            if accepted is None:
                self._ignore("unchecked_change")  # made up, or a write the key never held
                continue
            if len(accepted) < len(claims):
                self._ignore("unchecked_change")
            checked += enumerate(accepted)
        # In the order heard: across keys as their writes were published.
        checked.sort(key=lambda item: item[1].heard)
        for index, claim in checked:
            if claim.stamp > self._horizon:
                self._horizon = claim.stamp
            for group in claim.hint.groups:
                if index == 0 and claim.change.op is ChangeOp.DELETE:
                    _deliver_gone(group, claim)
                else:
                    group.deliver(claim.change, claim.stamp, claim.expires)

    # the change feed

    async def _feed_start(self, group: _Group) -> None:
        """Note where the feed stood when `group` (a new topic) was subscribed.

        The reader's place in the feed is the last change it delivered, and it never heard the
        new topic's changes before this: a catch-up must not hand those to the group. The place
        noted is read after the subscription took effect: a time every change before it was
        stamped under (`_clock_floor`, exact). Then a barrier: every change up to that place has
        been delivered (if it came after the subscription), so a catch-up skipping them for
        this group loses nothing, unless the connection dropped meanwhile: then nothing is noted
        (a catch-up may then hand the group a change from just before it subscribed, as
        without this).
        """
        if self.feed is None:
            return
        drops = self._drops
        with contextlib.suppress(BackendError):
            if self.is_cluster:
                after = await self._clock_floor(exact=True) * 1000 - 1
            else:
                after = await self._clock_us()
            await self._go_live(None)
            if self._drops == drops:
                group.feed_after = after

    async def _feed_streams(self, also: Sequence[feeds.Stream] = ()) -> list[feeds.Stream]:
        """The streams this store reads, and those in `also`.

        Its own, those of the prefixes nested in it (on one server: those in its registry;
        on a cluster: every feed stream a SCAN of each primary finds, by name), and those of
        the prefixes it is nested in (their writes may land in its keys), minus those this ACL
        user may not read.
        """
        names = self._feed_names
        found = set(also)
        if not self.is_cluster:
            found.add(self._own_stream)
            found.update((0, prefix) for prefix in feeds.ancestors(self.key_prefix))
            found.update((0, prefix) for prefix in await self._nested_prefixes())
            return sorted(found - self._denied)
        client = await self._redis()
        match = names.scan_match()
        for node in await self._primaries(client):
            cursor: Any = 0
            while True:
                cursor, listed = await self._execute_on_cluster(
                    client,
                    ("SCAN", cursor, "MATCH", match, "TYPE", "stream", "COUNT", 1000),
                    None,
                    target_nodes=node,
                )
                for name in listed:
                    stream = names.stream_of_name(name.decode(), wire.key_slot(name))
                    if stream is not None:
                        found.add(stream)
                if int(cursor) == 0:
                    break
        return sorted(found - self._denied)

    async def _nested_prefixes(self) -> list[str]:
        """The prefixes nested in this store's that registered a feed (one server)."""
        try:
            members = await self._read("SMEMBERS", feeds.registry_key(self.key_prefix))
        except BackendError as exc:
            if wire.no_permission(exc):
                return []
            raise
        own = self.key_prefix
        found = []
        for member in members:
            with contextlib.suppress(UnicodeDecodeError):
                prefix = member.decode()
                if prefix != own and prefix.startswith(own) and feeds.is_prefix(prefix):
                    found.append(prefix)
        if len(found) > _MAX_NESTED:
            log.warning("feed_registry_truncated", prefixes=len(found), kept=_MAX_NESTED)
            found = sorted(found)[:_MAX_NESTED]
        return found

    async def _feed_pages(
        self, stream: feeds.Stream, position: feeds.Position, cursor: str
    ) -> AsyncIterator[list[tuple[bytes, bytes, feeds.Id, int]]]:
        """The entries of `stream` after `position`, a page at a time: (key, data, id, order).

        Only the entries of this store's keys (a stream of a prefix it is nested in holds
        others too). A stream this ACL user may not read is read as empty.

        Raises:
            CursorExpiredError: Entries after `position` were trimmed (checked on each page).
        """
        names = self._feed_names.stream(stream)
        keep = "" if stream[1].startswith(self.key_prefix) else self.key_prefix
        start = position.start(stream)
        while True:
            try:
                page, last, scanned, first_prev, last_read = await self._run_script(
                    READ_SHA, feeds.READ, names, [start, _PAGE, keep, int(self.is_cluster)]
                )
            except BackendError as exc:
                if not wire.no_permission(exc):
                    raise
                self._denied.add(stream)
                return
            feeds.check_start(
                cursor,
                position,
                stream,
                None if not first_prev else feeds.parse_id(first_prev),
                None if last is None else feeds.parse_id(last),
            )
            entries = [_feed_entry(fields) for _, fields in page]
            for _, data, _, _ in entries:
                if data[-2:] == b" ?" and _lost(data):
                    raise CursorExpiredError(cursor, _LOST_MESSAGE.format(cursor=cursor))
            if entries:
                yield entries
            if int(scanned) < _PAGE:
                return
            at = feeds.parse_id(last_read)
            start, position = "(" + feeds.id_text(at), feeds.Position(ids={stream: at})

    async def _read_epoch(self) -> str:
        """The cluster feed's epoch now (started if the key is gone), kept for new cursors.

        Every cluster cursor ends with the epoch its backend last read (`/<epoch>`); a cursor
        whose epoch is not the feed's any more is from before the feed was lost (the cluster
        lost its data) and raises `CursorExpiredError`. Read before this backend's first write,
        after a write started a stream (the first in its slot, or the first after a loss), when
        resuming, when catching up and for `feed_cursor`.
        """
        names = self._feed_names
        held = await self._run_script(
            EPOCH_SHA, feeds.EPOCH, [names.epoch_key], [secrets.token_hex(4)]
        )
        names.epoch = held.decode() if isinstance(held, bytes) else str(held)
        return names.epoch

    async def _clocks(self) -> list[int]:
        """Every primary's clock (ms), read with TIME (one server: its own)."""
        if not self.is_cluster:
            seconds, micros = await self._read("TIME")
            return [int(seconds) * 1000 + int(micros) // 1000]
        client = await self._redis()
        times = []
        for node in await self._primaries(client):
            seconds, micros = await self._execute_on_cluster(
                client, ("TIME",), None, target_nodes=node
            )
            times.append(int(seconds) * 1000 + int(micros) // 1000)
        return times

    async def _order_of(self, stream: feeds.Stream, at: feeds.Id) -> int:
        """The order (`u`) of entry `at` of `stream`; its id's time if it is gone (one server).

        A cursor names a change; the streams it does not name are read from its order.
        """
        name = self._feed_names.stream(stream)[0]
        text = feeds.id_text(at)
        try:
            found = await self._read("XRANGE", name, text, text)
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            found = []
        if found:
            return _feed_entry(found[0][1])[3]
        return at[0] * 1000  # trimmed: an earlier order (a change of its millisecond comes twice)

    async def _clock_us(self) -> int:
        """The server's clock in microseconds, once it has passed the value read (one server).

        Every change committed before the call has an order (`u`) at most the value returned,
        every one committed after it a greater one.
        """
        seconds, micros = await self._read("TIME")
        now = int(seconds) * 1_000_000 + int(micros)
        while True:
            seconds, micros = await self._read("TIME")
            if int(seconds) * 1_000_000 + int(micros) > now:
                return now

    async def _clock_floor(self, *, exact: bool = False) -> int:
        """A time (ms) that every change committed before this call was stamped before.

        The smallest of the primaries' clocks qualifies at once, but a change committed just
        before, in that millisecond or on a node whose clock is ahead, may be stamped after it.
        `exact`: one past the largest clock instead, returned once every primary's clock has
        passed it (so every change committed after the call is stamped at or after it); if the
        clocks are more than a second apart, the smallest.
        """
        times = await self._clocks()
        if not exact:
            return min(times)
        floor = max(times) + 1
        deadline = asyncio.get_running_loop().time() + 1.0
        while min(times) < floor:
            if asyncio.get_running_loop().time() > deadline:
                return min(times)
            await asyncio.sleep(0.001)  # a clock to pass, not an event to wait for
            times = await self._clocks()
        return floor

    async def _catch_up(self) -> bool:
        """After a gap, read what it hid from the feed; false if some of it is gone.

        On one server the streams' entries are merged by commit order and delivered up to the
        clock read before they were (the later ones were heard: they follow); on a cluster
        each slot's stream is delivered in its order.
        """
        if self.feed is None:
            return False
        cap = 0
        self._caught = 0
        if self.is_cluster:
            if not self._feed_floor:
                return False
            held = self._feed_names.epoch
            if held is not None and await self._read_epoch() != held:
                return False  # the feed was lost meanwhile: the gap is not in it
            position = feeds.Position(floor=self._feed_floor, ids=dict(self._feed_last))
        else:
            point = self._point
            if point is None:
                return False
            stream, at, order = point
            position = feeds.Position(
                floor=order // 1000, ids={**self._feed_last, stream: at}, point=True, order=order
            )
            cap = await self._clock_us()
        budget = asyncio.get_running_loop().time() + self.socket_timeout
        cut = len(self.key_prefix.encode())
        found: list[_Read] = []
        try:
            for stream in await self._feed_streams(list(self._feed_last)):
                async for entries in self._feed_pages(stream, position, "(this reader's place)"):
                    for name, data, at, order in entries:
                        header = split_feed(data)
                        if header is None or position.skips(stream, order):
                            continue
                        key = name[cut:].decode("utf-8", "surrogateescape")
                        if cap and order > cap:
                            continue  # heard live: it follows
                        found.append(
                            _Read(
                                stream,
                                at,
                                feeds.parse_id(header[1]),
                                order,
                                key,
                                data,
                                None,
                                header[2],
                                header[0].decode(),
                            )
                        )
                    if not cap:  # a cluster: each slot's stream in its order, as read
                        budget = await self._hand_over(found, budget)
                        found = []
        except CursorExpiredError:
            log.info("pubsub_feed_gap", read=len(found))
            return False
        found.sort(key=lambda read: (read.order, read.at))
        await self._hand_over(found, budget)
        log.info("pubsub_caught_up", changes=self._caught)
        return True

    async def _hand_over(self, reads: list[_Read], budget: float) -> float:
        """Deliver a catch-up's changes only as fast as the subscriptions take them."""
        for start in range(0, len(reads), _PACE):
            for group in self._index.groups():
                budget = await self._room(group, budget)
            for read in reads[start : start + _PACE]:
                self._deliver_entry(read, catching_up=True)
        self._caught += len(reads)
        return budget

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
                    group.fanout.publish_to_all(
                        Change(
                            key=key,
                            op=ChangeOp.RESYNC,
                            old=None,
                            new=entry.value,
                            version=entry.version,
                            timestamp=entry.updated_at,
                            revision=entry.revision,
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
                group.fanout.publish_to_all(
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
        self._link = None
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
        floor_task, self._floor_task = self._floor_task, None
        if floor_task is not None:
            floor_task.cancel()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._stop_deliverer()
        await self._drop_pubsub()


_LOST_MESSAGE = (
    "a change after cursor {cursor!r} held a value the store no longer has (its key was "
    "deleted or evicted outside agenticstate, or overwritten by a store without a feed); "
    "re-read the state and resume from a new cursor"
)


def _lost(data: bytes) -> bool:
    """Whether a feed message read back by `READ` stands for a change whose value is gone."""
    header = split_feed(data)
    return header is not None and data[header[2] :] == b"?"


def _feed_entry(fields: list[bytes]) -> tuple[bytes, bytes, feeds.Id, int]:
    """A stream entry's fields as (key, data, id, order).

    `k` is the Redis key, `m` the message (`X<id> <previous id> <change>`), `u` its place in
    the server's commit order (microseconds; an entry written by an earlier version of this
    library has none: its id's time, in microseconds).
    """
    name = data = order = None
    for index in range(0, len(fields) - 1, 2):
        field = fields[index]
        if field == b"k":
            name = fields[index + 1]
        elif field == b"m":
            data = fields[index + 1]
        elif field == b"u":
            order = fields[index + 1]
    header = None if data is None else split_feed(data)
    if name is None or data is None or header is None:
        raise BackendError("a feed stream entry is not an agenticstate change")
    at = feeds.parse_id(header[0])
    return name, data, at, at[0] * 1000 if order is None else int(order)


class _Replay:
    """A subscription from a cursor: the feed's changes after it, then the live ones.

    Entered with its live subscription in effect but not open. It reads every stream after the
    cursor (its own, those of the prefixes nested in it and those of the prefixes it is nested
    in, a page at a time, merged by commit order: each stream in its order), then opens the
    live subscription and reads the streams once more up to now, then hands over the live
    changes, dropping those at or below what it read from their stream. So the live buffer
    holds only what came after the switch, and no change is missed or repeated. A change's
    cursor is this subscription's place: the cursor's floor raised as the merge goes (never past
    the clocks read before the streams were listed: a stream made later is read from the
    floor), with the streams read above it listed.

    A close of the backend ends the iteration, wherever it finds the replay.
    """

    def __init__(
        self,
        owner: Subscriber,
        matcher: Any,
        cursor: str,
        position: feeds.Position,
        live: ChangeStream,
    ) -> None:
        self._owner = owner
        self._matcher = matcher
        self._cursor = cursor
        self._position = position  # where each stream has been read to
        self._live = live
        self._pass = 0  # 0: reading up to entry, 1: up to the switch, 2: live
        self._pages: dict[
            feeds.Stream, AsyncIterator[list[tuple[bytes, bytes, feeds.Id, int]]]
        ] = {}
        self._waiting: dict[feeds.Stream, list[tuple[bytes, bytes, feeds.Id, int]]] = {}
        # (order, id, stream, index in its page)
        self._heap: list[tuple[int, feeds.Id, feeds.Stream, int]] = []
        self._read: dict[feeds.Stream, feeds.Id] = {}  # per stream, the last id handed over
        self._cut = len(owner.key_prefix.encode())
        self._cap = 0  # the floor may not pass this (see the class docstring)
        self._floor = position.floor
        self._listed = {stream: feeds.id_text(at) for stream, at in position.ids.items()}
        self._named = frozenset(position.ids)  # the streams the cursor names
        # A cluster's live cursors also hold what the replay read (`_merged`); on one server a
        # cursor is a change's own place.
        self._merging = owner.is_cluster
        self._plain = not owner.is_cluster
        self._ended = False

    def __aiter__(self) -> _Replay:
        return self

    async def begin(self) -> None:
        """Start reading every stream (raises `CursorExpiredError` now, on entry)."""
        owner = self._owner
        position = self._position
        if position.point and position.order is None:
            position.order = await owner._order_of(*next(iter(position.ids.items())))
        if self._plain:
            self._cap = await owner._clock_us()
            feeds.check_not_ahead(self._cursor, position, (), self._cap)
        else:
            clocks = await owner._clocks()
            self._cap = min(clocks)  # `_clock_floor()`, with the clocks kept for the check
            feeds.check_not_ahead(self._cursor, position, clocks, 0)
            feeds.check_epoch(self._cursor, position, await owner._read_epoch())
        for stream in await owner._feed_streams(list(self._position.ids)):
            pages = owner._feed_pages(stream, self._position, self._cursor)
            self._pages[stream] = pages
            await self._fetch(stream)

    async def _fetch(self, stream: feeds.Stream) -> None:
        """Take `stream`'s next page onto the heap (or forget the stream, read to its end)."""
        page = await anext(self._pages[stream], None)
        if page is None:
            del self._pages[stream]
            self._waiting.pop(stream, None)
            return
        self._waiting[stream] = page
        heapq.heappush(self._heap, (page[0][3], page[0][2], stream, 0))

    async def _next_entry(self) -> tuple[feeds.Stream, bytes, bytes, feeds.Id, int] | None:
        heap = self._heap
        if not heap:
            return None
        _, _, stream, index = heapq.heappop(heap)
        page = self._waiting[stream]
        name, data, at, order = page[index]
        if index + 1 < len(page):
            following = page[index + 1]
            heapq.heappush(heap, (following[3], following[2], stream, index + 1))
        else:
            await self._fetch(stream)
        return stream, name, data, at, order

    async def _switch(self) -> None:
        """Open the live subscription, then read once more what came before the switch."""
        owner = self._owner
        self._live.open()
        position = self._position
        self._position = feeds.Position(
            floor=self._floor if not self._plain else position.floor,
            ids=dict(position.ids),
            earliest=position.earliest,
            point=position.point,
            order=position.order,
        )
        self._cap = await owner._clock_us() if self._plain else await owner._clock_floor()
        for stream in await owner._feed_streams(list(self._position.ids)):
            self._pages[stream] = owner._feed_pages(stream, self._position, self._cursor)
            await self._fetch(stream)

    async def _end_pass(self) -> None:
        """Stop reading this pass's pages (the rest is read again, or comes live)."""
        pages, self._pages = self._pages, {}
        self._heap.clear()
        self._waiting.clear()
        for generator in pages.values():
            await generator.aclose()  # type: ignore[attr-defined]  # an async generator

    def _cursor_of(self, stream: feeds.Stream, at: feeds.Id, order: int) -> str:
        text = feeds.id_text(at)
        if self._plain:
            return feeds.point_cursor(self._owner._feed_names, stream, text)
        floor = min(order // 1000, at[0], self._cap)
        listed = self._listed
        if floor > self._floor:
            self._floor = floor
            if len(listed) > _LISTED_MAX or not self._owner.is_cluster:
                self._listed = listed = {
                    s: t for s, t in listed.items() if feeds.parse_id(t)[0] >= floor
                }
        listed.pop(stream, None)
        listed[stream] = text
        return feeds.make_cursor(self._owner._feed_names, self._floor, (stream, text), listed)

    async def __anext__(self) -> Change:
        if self._ended:
            raise StopAsyncIteration
        try:
            return await self._next_change()
        except CursorExpiredError as exc:
            if self._owner._closed:
                raise StopAsyncIteration from None
            # Trimmed while this subscription was still reading the feed (entry checked the
            # start): what it had not read yet is gone. That is an overflow, as on SQLite:
            # resuming from the last change's cursor then raises CursorExpiredError on entry.
            raise SubscriptionClosedError(
                "overflow",
                "the feed was trimmed past what this subscription had read; resume with "
                "since= the cursor of the last change read, or re-read the state",
            ) from exc
        except BackendError:
            if self._owner._closed:
                # The backend closed while this replay read the feed: the end, as live.
                self._ended = True
                raise StopAsyncIteration from None
            raise

    async def _next_change(self) -> Change:
        while self._pass < 2:
            if self._owner._closed:
                self._ended = True
                raise StopAsyncIteration
            entry = await self._next_entry()
            if entry is None:
                self._pass += 1
                if self._pass == 1:
                    await self._switch()
                continue
            stream, name, data, at, order = entry
            if self._plain and order > self._cap:
                # One server, merged by commit order: what follows came after the clock read
                # for this pass, so after any stream it did not list; the next pass reads it.
                await self._end_pass()
                self._pass += 1
                if self._pass == 1:
                    await self._switch()
                continue
            skipped = self._position.skips(stream, order, self._named)
            self._position.ids[stream] = at
            self._read[stream] = at
            if skipped:
                continue  # before the cursor's point, in a stream it does not name
            cursor = self._cursor_of(stream, at, order)
            key = name[self._cut :].decode("utf-8", "surrogateescape")
            if not self._matcher.match(key):
                continue
            header = split_feed(data)
            assert header is not None  # noqa: S101  # `_feed_entry` checked it
            return parse_message(key, data, header[2], cursor)[0]
        while True:
            change = await self._live.__anext__()
            read = self._read
            if read and change.cursor is not None:
                stream, at = feeds.cursor_place(self._owner._feed_names, change.cursor)
                done = read.get(stream)
                if done is not None:
                    if at <= done:
                        continue  # read from the feed already
                    del read[stream]
            if self._merging and change.cursor is not None:
                cursor = self._merged(change.cursor)
                if cursor != change.cursor:
                    change = dataclasses.replace(change, cursor=cursor)
            return change

    def _merged(self, cursor: str) -> str:
        """A live change's cursor, also holding what this replay read before it.

        The cursor was made when the change was delivered, and the replay may have read changes
        of other streams from the feed after that (reading up to the switch) and yielded them
        first: the cursor must hold them too, or resuming from it repeats them. Both say what
        was yielded before the change, so their union does: the higher floor, and per stream
        the higher id, listed only if at or above that floor (the change's own stream first,
        always). Once the replay adds nothing (the live floor passed what it read), nothing
        more is done.
        """
        names = self._owner._feed_names
        live = feeds.parse_cursor(cursor, names)
        floor = max(live.floor, self._floor)
        own = feeds.cursor_place(names, cursor)[0]
        ids = dict(live.ids)
        adds = floor > live.floor
        for stream, text in self._listed.items():
            at = feeds.parse_id(text)
            if at[0] >= floor and at > ids.get(stream, (0, 0)):
                ids[stream] = at
                adds = True
        if not adds:
            self._merging = False  # the live cursors hold all of it now, and keep holding it
            return cursor
        listed = {
            stream: feeds.id_text(at)
            for stream, at in ids.items()
            if stream == own or at[0] >= floor
        }
        return feeds.make_cursor(names, floor, (own, listed[own]), listed)
