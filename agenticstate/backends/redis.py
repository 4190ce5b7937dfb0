"""RedisBackend: shared state across processes and machines, with change events over pub/sub.

Layout. Each state key is one Redis string, `{key_prefix}{key}`, holding a fixed 97-byte ASCII
header (version, created, updated and expiry times in milliseconds, revision and create revision)
followed by the value bytes, so `get` is one GET and `get_many` one MGET. Each write's revision
comes from the prefix's counter `__agenticstate_rev__:{key_prefix}` in the write's own script
(`_redis_scripts`, `_redis_revision`). A non-empty prefix ends with `:`, so that no other
prefix starts with it (`app1:` and `app12:` never meet); prefixes nest at colons (`app:` holds
the keys of `app:prod:`). Each change is notified on the channel
`__agenticstate__:{key_prefix}{key}`.

Key index. Every write script also adds the written name to its prefix's key index (a sorted
set read by lexicographic range; on a cluster one per prefix and slot) and a delete removes it,
so `scan`/`scan_batches` (every listing) read the index over the pattern's literal prefix and
never SCAN the keyspace (`_redis_keyindex`). Names of expired keys are checked and dropped by
listings and trimmed by writes; an index missing from an older store is built on the first
listing (`reindex`), by one process at a time (a build lock that expires if its builder dies).
A listing across entities (`agents:{*}:state`) is a skip-scan: per entity one jump and one range,
with a braced set beside the index for the names its `*` may match across a second `}`. On a
cluster, a prefix's slot registry holds the slots whose index may hold a name (a writer adds a
slot before its first write to it), so a listing without a hash tag probes those slots' indexes
only.

Writes. Every write is one Lua script run on the server (loaded once by SHA, re-loaded after
NOSCRIPT): it checks `expected_version`, stores the value, bumps the version, applies the TTL,
appends the change to the feed and PUBLISHes a notification of it, all in one atomic step.
Clock readings come from the server (`TIME`), so every client agrees on timestamps and expiry.

History. With `history=` rules (`keep_history`), a key a rule names with a depth above 1 also
has a list of its last versions, `__agenticstate_hist__:{key_prefix}{key}{tag}` (one per Redis
key, whichever store of nested prefixes writes it), which the same
script that writes the key pushes to and trims (`_redis_history`): a write stays one command.
The list takes the key's expiry, a delete drops it, and writing version 1 starts it afresh;
`{tag}` puts it in the key's cluster slot. `history()` and `get_version()` read the key and its
list in one script. Each process that writes such keys must set the same rules.

Delivery. One pub/sub connection per backend serves all its subscriptions: it PSUBSCRIBEs the
literal prefix of each subscribed pattern (a shorter prefix covers longer ones; past 16 they are
cut to one shared length; a pattern without a literal prefix takes the whole key prefix), so a
process hears only the changes near what it watches, and the reader matches each change against the
subscribed patterns through an index on their literal prefixes (a few dict lookups per change
however many patterns there are), with the same glob rules as Redis. A subscription is live when
`changes()` is entered: the PSUBSCRIBE is confirmed and a barrier on the connection has come back
(a PING; in a cluster, a marker published on every primary), so every change committed after entry
is delivered and none from before it.

A message is a hint, never the change delivered. With the feed on, a write publishes which feed
entry holds its change; the subscriber reads the entries it was told of back from their streams
(one script per slot for a batch) and delivers those, in commit order: a message naming nothing
the feed holds, or an entry delivered already, delivers nothing, so nobody who may PUBLISH on the
channels can inject a change or move a subscription's place. With the feed off, a write publishes
its change, and the subscriber delivers it once the key vouches for it (the key holds it, or a
later change it leads to); a backend with the feed on ignores those (see `_redis_pubsub`).

Redis pub/sub is at-most-once: a message published while a subscriber is disconnected is lost.
When the connection drops (or Redis restarts), the backend reconnects by itself with backoff,
subscribes again, then **catches up from the change feed** (below): it reads every stream from
the last change it delivered and delivers what the gap hid before the live changes, dropping any
live change it read there already, so nothing is lost or repeated. With the feed off, or when the
feed no longer holds the gap (trimmed, or a restart lost it), it **resyncs** instead: it scans
the subscribed keys and emits a `RESYNC` change (old value unknown, `None`) for every key
whose version or value differs from what it delivered, for every key written since the last
change it read that it never delivered, and for every key it delivered that is gone
(`new=None`). A key that existed before the subscription and did not
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
reconnected, as redis-py's pool does. Pub/sub uses redis-py's connection, read directly with
hiredis (`_redis_wire.PubSubLink`).

Cluster. `redis+cluster://host:port,host:port,...` (or `rediss+cluster://`) runs the same
backend on Redis Cluster. Commands take the held-connection path above, to the primary owning
their key's slot: the backend keeps its own slot map (CLUSTER SLOTS) and up to
`connection_pool_size` connections to each primary (made with the settings of redis-py's
`RedisCluster` client, which is kept for discovery); it follows MOVED (repoints the slot, re-reads
the map before the next command) and ASK (ASKING on the same connection, once), and re-reads the
map after a failed connection (a failover: reads retry; writes report their outcome as usual).
Every atomic step touches one key (one slot), so it stays atomic; managers put a record's id in a
`{...}` hash tag, so one team's records and its queue index, or one workflow's, live in one slot.
`get_many` sends one MGET per slot, `save_many` one script call per slot, `scan` without a hash
tag visits every primary serving a registered slot, scripts load on every primary, and PUBLISH
reaches every node over the cluster bus, so one pub/sub connection to any node sees every
shard's changes (each shard's in its order; the shards are not ordered with each other).
Barriers (subscribe, close) PUBLISH a marker on every primary instead of a PING. The subscriber
resyncs after a failover.

Change feed. Unless built with `feed=None`, every write script also appends its change to a
Redis stream (one per key prefix; on a cluster, one per prefix and slot, so no script crosses
slots), trims it to the backend's `FeedRetention`, and publishes a notification of it. Prefixes
nest: a store reads its own stream, those of the prefixes nested in it (on one server found in
its registry, which a nested store joins before its first write, `_register_feed`, and again in
the write script that starts its stream anew) and those of
the prefixes it is nested in, so it sees every change to its keys, whichever store made it. Each
`Change` carries a `cursor`: on one server a point in commit order (`r1:<id>`, or
`r1:<id>@<stream>` for another prefix's stream), on a cluster a vector over streams
`c1:<floor>:<slot>=<id>,...`. `changes(since=cursor)` replays the streams after the cursor,
then follows live with no gap and no duplicate; `feed_cursor()` is the head. `_redis_feed` holds
the names, ids, cursors and the rules for telling a trimmed cursor (`CursorExpiredError`) from a
current one.

This backend uses redis-py's asyncio client: it runs under asyncio, not trio. Under trio every
entry point raises `ConfigurationError` before touching the network.

Modules. This one keeps `RedisBackend`, the Backend API. The record layout and the Lua scripts
are in `_redis_scripts`; redis-py's clients, the held connections, the cluster's slot map and the
one mapping of foreign errors (`translate`) in `_redis_wire`, the only module that imports
redis-py or touches its internals; the pub/sub reader, its barriers, the feed's replay and
catch-up and the resync in `_redis_pubsub`; the feed's names, ids and cursors in `_redis_feed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from agenticstate._checks import seconds
from agenticstate._glob import compile_glob
from agenticstate._keys import escape_glob, validate_key, validate_key_prefix, validate_pattern
from agenticstate._log import get_logger
from agenticstate._retry import retry_delay
from agenticstate.backends import _redis_feed, _redis_revision, _redis_txn
from agenticstate.backends import _redis_history as history_lists
from agenticstate.backends import _redis_keyindex as key_index
from agenticstate.backends import _redis_scripts as scripts
from agenticstate.backends import _redis_wire as wire
from agenticstate.backends._keyorder import skip_plan
from agenticstate.backends._redis_keyindex import braced_set
from agenticstate.backends._redis_pubsub import Subscriber
from agenticstate.backends._redis_scripts import CHANNEL_NAMESPACE
from agenticstate.backends._redis_scripts import INDEX_NAMESPACE as INDEX_NAMESPACE
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Delete,
    Entry,
    EntryStat,
    FeedRetention,
    FeedSize,
    HistoryRules,
    Put,
    TxnResult,
    check_expected,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
)
from agenticstate.config import check_redis_url, redact_url
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    ForeignRecordError,
    InvalidArgumentError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from collections.abc import (
        AsyncGenerator,
        AsyncIterator,
        Callable,
        Iterable,
        Mapping,
        Sequence,
    )

    import redis.asyncio as aioredis

    from agenticstate.backends.base import TxnCompare, TxnOp

__all__ = [
    "CHANNEL_NAMESPACE",
    "CHANNEL_NAMESPACES",
    "KEY_NAMESPACES",
    "KeyIndexReport",
    "RedisBackend",
]

KEY_NAMESPACES: tuple[str, ...] = (
    "",  # the state keys themselves: `{key_prefix}{key}`
    scripts.INDEX_NAMESPACE,  # sorted indexes
    _redis_feed.FEED_NAMESPACE,  # the change feed's streams
    _redis_feed.COUNTER_NAMESPACE,  # the feed's id counters
    history_lists.HISTORY_NAMESPACE,  # kept versions of keys with history rules
    _redis_revision.REVISION_NAMESPACE,  # the revision counters every write takes from
    _redis_feed.REGISTRY_NAMESPACE,  # the feeds of nested prefixes, for an outer prefix's reader
    key_index.KEY_INDEX_NAMESPACE,  # the key indexes listings read (and their companions)
    _redis_feed.REFS_NAMESPACE,  # the feed's values held by reference, per key
)
"""Every Redis key a store uses is `{namespace}{key_prefix}...` for one of these namespaces.

An ACL user limited to one store needs the key pattern `~{namespace}{key_prefix}*` for each
(the Security page's recipes; a test fails if a recipe misses one). A new kind of key gets its
namespace here.
"""
CHANNEL_NAMESPACES: tuple[str, ...] = (scripts.CHANNEL_NAMESPACE,)
"""Every channel a store publishes or subscribes to is `{namespace}{key_prefix}...`."""

log = get_logger("agenticstate.backends.redis")

_SET_MANY_CHUNK = 500  # keys per set_many script call
# Slots a SCAN call visits: a page of 5,000 holds the server well under a millisecond, and
# the next page is asked for while one is decoded, so few and large pages cost no waiting.
_SCAN_COUNT = 5_000
# Names a key-index listing script looks at, at most: a page holds the server well under a
# millisecond (a ZRANGE and an EXISTS per name).
_LIST_PAGE = 1_000
_PROBE_CHUNK = 2_000  # indexes one cluster node's listing script probes, at most
_BUILD_LOCK_MS = 3_000
"""How long a key index build's lock lives unless its builder keeps it (`_build_index`): how
long the other processes wait for a builder that died."""
_BUILD_LOCK_KEEP = 1.0  # seconds between a builder's renewals of its lock
_LIST, _TAGS, _SKIP = 0, 1, 2
_LIST_SCRIPTS = {  # by kind: the script, the same across slots, and how many names an index has
    _LIST: (
        key_index.LIST_SHA,
        key_index.LIST,
        key_index.LIST_ACROSS_SLOTS_SHA,
        key_index.LIST_ACROSS_SLOTS,
        1,
    ),
    _TAGS: (
        key_index.TAGS_SHA,
        key_index.TAGS,
        key_index.TAGS_ACROSS_SLOTS_SHA,
        key_index.TAGS_ACROSS_SLOTS,
        1,
    ),
    _SKIP: (
        key_index.SKIP_SHA,
        key_index.SKIP,
        key_index.SKIP_ACROSS_SLOTS_SHA,
        key_index.SKIP_ACROSS_SLOTS,
        2,
    ),
}
# Prefixes whose indexes a cluster listing without a hash tag probes in every slot, at most
# (the store's own, those it is nested in, those nested in it); beyond, it SCANs.
_MAX_PROBED_PREFIXES = 4
_SLOT_COUNT = 16_384
_SLOTS_COMPLETE = key_index.SLOTS_COMPLETE.encode()
_RESERVED = "__agenticstate"  # our own keys (indexes) start with it: SCAN never lists them
CLUSTER_SCHEMES = frozenset({"redis+cluster", "rediss+cluster"})
"""URL schemes that name a Redis Cluster (a comma-separated list of startup nodes)."""


_URL_PARAMETERS = (
    "key_prefix",
    "feed",
    "feed_max_changes",
    "feed_max_age",
    "subscribe_whole_prefix",
)
_NO_FEED_OPTION: Any = object()  # the URL says nothing about the feed
_FLAGS = {"1": True, "true": True, "yes": True, "on": True}
_FLAGS.update({"0": False, "false": False, "no": False, "off": False})


def _feed_from_query(query: dict[str, str]) -> FeedRetention | None:
    """The feed a URL's query asks for (its `feed*` parameters are taken out of `query`)."""
    off = query.pop("feed", None)
    max_changes = query.pop("feed_max_changes", None)
    max_age = query.pop("feed_max_age", None)
    max_bytes = query.pop("feed_max_bytes", None)
    if off is None and max_changes is None and max_age is None and max_bytes is None:
        return _NO_FEED_OPTION  # type: ignore[no-any-return]
    if off is not None:
        if off.lower() not in ("off", "on"):
            raise ConfigurationError(f"feed must be 'off' or 'on', not {off!r}")
        if off.lower() == "off":
            return None
    bounds: dict[str, Any] = {}
    try:
        if max_changes is not None:
            bounds["max_changes"] = int(max_changes)
        if max_age is not None:
            bounds["max_age"] = timedelta(seconds=float(max_age))
        if max_bytes is not None:
            bounds["max_bytes"] = int(max_bytes)
    except ValueError:
        raise ConfigurationError(
            f"feed_max_changes and feed_max_bytes must be ints and feed_max_age a number of "
            f"seconds, not {max_changes!r}, {max_bytes!r} and {max_age!r}"
        ) from None
    return FeedRetention(**bounds)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's outcome as seen (no "exception never retrieved" warning)."""
    if not future.cancelled():
        future.exception()


def _expectation(expected_version: int | None, expected_revision: int | None) -> int | str:
    """A write script's condition argument: -1 (none), the version, or `r<revision>`."""
    if expected_revision is not None:
        return f"r{expected_revision}"
    return -1 if expected_version is None else expected_version


class _KeyLock:
    """One key's update lock, and how many callers hold or wait for it (to drop it when idle)."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


@dataclasses.dataclass(frozen=True, slots=True)
class KeyIndexReport:
    """What `RedisBackend.reindex` did to a store's key index.

    Attributes:
        keys: The records it found under the prefix (a SCAN of the database).
        added: How many of them the index did not hold yet (0: it was complete).
    """

    keys: int
    added: int


class RedisBackend(Subscriber, Backend):
    """Keep state in Redis, shared by every process that uses the same server and prefix.

    Args:
        url: `redis://[user:password@]host:port/db`, `rediss://...` for TLS, or `unix:///path`.
        db: The database, when the URL names none.
        key_prefix: Put before every key (and every change channel); keys are given and listed
            without it. Empty, or ending with `:` (`"agenticai:"`), so that no other prefix
            starts with it: sibling prefixes never see each other's keys.
        connection_pool_size: The most connections held open (the pub/sub one is separate); on
            a cluster, to each primary.
        socket_timeout: Seconds to wait for a reply before `BackendTimeoutError`.
        connect_timeout: Seconds to wait for a connection.
        read_retries: Times a read or scan is retried after a connection failure or timeout.
        history: Keep the last versions of the keys these rules name (`keep_history`).
        client: Use this `redis.asyncio.Redis` instead of creating one (it is not closed).
        feed: The change feed's retention (see "Change feed"), or `None` for no feed: then
            changes carry no cursor, `since=` is refused and a reconnect resyncs.
        subscribe_whole_prefix: Subscribe to every change channel of the key prefix with one
            pattern (`__agenticstate__:<prefix>*`) and match subscriptions locally, instead of
            one pattern per subscription. Needed under an ACL user limited to its prefix's
            channels, since Redis checks a `PSUBSCRIBE` pattern literally against the user's
            channel rules (see the Security page); it costs receiving every change of the prefix.
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
        history: Mapping[str, int] | HistoryRules | None = None,
        client: aioredis.Redis | None = None,
        feed: FeedRetention | None = FeedRetention(),  # noqa: B008  # frozen: shared safely
        subscribe_whole_prefix: bool = False,
        **client_options: Any,
    ) -> None:
        wire.require_redis()
        if feed is not None and not isinstance(feed, FeedRetention):
            raise ConfigurationError(f"feed must be a FeedRetention or None, not {feed!r}")
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError("url must look like redis://host:port/db")
        check_redis_url(url)  # a parameter redis-py cannot take fails here, not at first use
        validate_key_prefix(key_prefix)
        if connection_pool_size < 1 or read_retries < 0:
            raise ConfigurationError("connection_pool_size must be >= 1, read_retries >= 0")
        self._url = url  # with its password: only connections see it (`url` is redacted)
        self._shown_url = redact_url(url)  # once: every command's error mapping names it
        self.db = db
        self.key_prefix = key_prefix
        self.connection_pool_size = connection_pool_size
        self.socket_timeout = seconds(socket_timeout, "socket_timeout")
        self.connect_timeout = seconds(connect_timeout, "connect_timeout")
        self.read_retries = read_retries
        self._client_options = client_options
        self._client: aioredis.Redis | None = client
        self._owns_client = client is None
        self.is_cluster = url.split("://", 1)[0].lower() in CLUSTER_SCHEMES
        if self.is_cluster and db:
            raise ConfigurationError("Redis Cluster has only database 0")
        self.feed = feed
        self._feed_names = _redis_feed.FeedNames(key_prefix, cluster=self.is_cluster)
        self._revision_names = _redis_revision.RevisionNames(key_prefix, cluster=self.is_cluster)
        self._key_index = key_index.KeyIndexNames(key_prefix, cluster=self.is_cluster)
        self._prefix_bytes = len(key_prefix.encode())
        # An outer prefix's listings read this store's index once it is in their registries:
        # joined before the first write (`_register_index`).
        self._index_unregistered = bool(key_prefix)
        self._index_ready = False  # the index is known to be built (`_ensure_index`)
        # On a cluster: the slots this process added to the slot registry (`_register_slots`).
        self._slots_registered: set[int] = set()
        # Outer prefixes whose registry of nested prefixes this ACL user may not add to.
        self._nested_refused: set[str] = set()
        # Other prefixes' indexes this ACL user may (not) read, found out once each.
        self._index_allowed: dict[str, bool] = {key_prefix: True}
        self._cross_slot_scripts: bool | None = None  # the cluster runs flagged scripts
        # The scripts' retention arguments (`feed_at`): '<max changes> <max bytes> <cluster>'
        # and the max age in ms (0 = no bound).
        self._feed_retention: tuple[str, int] = (
            ("0 0 0", 0)
            if feed is None
            else (
                f"{feed.max_changes or 0} {feed.max_bytes or 0} {int(self.is_cluster)}",
                0 if feed.max_age is None else scripts.ttl_ms(feed.max_age),
            )
        )
        self.subscribe_whole_prefix = bool(subscribe_whole_prefix)
        self._init_subscriber(key_prefix, whole_prefix=self.subscribe_whole_prefix)
        # On one server an outer prefix finds this store's feed in its registry: added before
        # the first write (`_register_feed`), and by every write script that starts the stream
        # (the registries this user may write are its last keys: `_registries`).
        self._feed_unregistered = feed is not None and not self.is_cluster and bool(key_prefix)
        self._registries: tuple[str, ...] = ()
        # On a cluster every cursor carries the feed's epoch: read before the first write
        # (`_read_epoch`), and again when a write starts a stream (`_births`).
        self._epoch_unread = feed is not None and self.is_cluster
        self._closed = False
        # Callers beyond the pool size wait here for a connection instead of failing.
        self._connections = wire.Connections(connection_pool_size)
        # In a cluster: the slot map, and as many connections again to each node.
        self._cluster = wire.Cluster(connection_pool_size, self.url)
        self._update_locks: dict[str, _KeyLock] = {}
        self._keeps_history = False
        if history is not None:
            self.keep_history(history)

    has_revisions = True

    @property
    def url(self) -> str:
        """The URL this backend connects to, with any password replaced by `***`.

        The password is kept for the connections only, so that logging or printing the backend
        (or its `url`) never shows it.
        """
        return self._shown_url

    def __repr__(self) -> str:
        return f"RedisBackend(url={self.url!r}, key_prefix={self.key_prefix!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Create a backend from `redis://`, `rediss://` or `unix://`.

        Query parameters: `key_prefix`, the feed's `feed=off`, `feed_max_changes=N`,
        `feed_max_age=SECONDS`, `feed_max_bytes=N`, and `subscribe_whole_prefix=1`.
        """
        from urllib.parse import parse_qsl, urlencode, urlsplit

        check_redis_url(url, own=_URL_PARAMETERS)  # before it is taken apart and put together
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("key_prefix", options.pop("key_prefix", ""))
        feed = _feed_from_query(query)
        if feed is not _NO_FEED_OPTION:
            options["feed"] = feed
        whole = query.pop("subscribe_whole_prefix", None)
        if whole is not None:
            if whole.lower() not in _FLAGS:
                raise ConfigurationError(
                    f"subscribe_whole_prefix must be 1 or 0 (true or false), not {whole!r}"
                )
            options["subscribe_whole_prefix"] = _FLAGS[whole.lower()]
        cleaned = url
        if parts.query:
            # Rebuild by hand: urlunsplit drops the `//` of `unix:///path`.
            rest = f"?{urlencode(query)}" if query else ""
            cleaned = f"{parts.scheme}://{parts.netloc}{parts.path}{rest}"
        return cls(url=cleaned, key_prefix=prefix, **options)

    async def open(self) -> None:
        """Create the client and load the scripts (no connection is made until first use).

        Raises:
            ConfigurationError: Not running under asyncio (this backend does not run under trio).
        """
        wire.require_asyncio()
        if self._closed:
            raise BackendError("this RedisBackend is closed")
        if self._client is None:
            self._client = wire.make_client(
                self._url,
                cluster=self.is_cluster,
                db=self.db,
                pool_size=self.connection_pool_size,
                connect_timeout=self.connect_timeout,
                options=self._client_options,
            )

    async def _redis(self) -> aioredis.Redis:
        wire.require_asyncio()
        if self._client is None:
            await self.open()
        assert self._client is not None  # noqa: S101  # set by open()
        return self._client

    def _k(self, key: str) -> str:
        return self.key_prefix + validate_key(key)

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
        wire.require_asyncio()
        client = self._client or await self._redis()
        with wire.translate(self.url, write_key, sent=False) as attempt:
            async with asyncio.timeout(self.socket_timeout):
                if self.is_cluster:
                    return await self._cluster.call(client, args, attempt)
                return await self._connections.call(client, args, attempt)

    async def _execute_on_cluster(
        self,
        client: aioredis.Redis,
        args: tuple[str | bytes | int | float, ...],
        write_key: str | None,
        *,
        target_nodes: Any,
    ) -> Any:
        """One command to one cluster node (`target_nodes`, from `_primaries`), as `_execute`."""
        if self._closed:
            raise BackendError("this RedisBackend is closed")
        with wire.translate(self.url, write_key, sent=False) as attempt:
            async with asyncio.timeout(self.socket_timeout):
                return await self._cluster.call(client, args, attempt, target_nodes)

    async def _script(
        self, sha: str, source: str, keys: Sequence[str], *args: str | bytes | int, write_key: str
    ) -> Any:
        """EVALSHA a script; after NOSCRIPT (it did not run) load it and run it once more."""
        try:
            return await self._execute("EVALSHA", sha, len(keys), *keys, *args, write_key=write_key)
        except BackendError as exc:
            if not wire.unknown_script(exc):
                raise
        await self._load_script(source)
        return await self._execute("EVALSHA", sha, len(keys), *keys, *args, write_key=write_key)

    async def _load_script(self, source: str) -> None:
        """SCRIPT LOAD `source` (on a cluster, on every primary: each keeps its own scripts)."""
        if self.is_cluster:
            client = self._client or await self._redis()
            for node in await self._primaries(client):
                await self._execute_on_cluster(
                    client, ("SCRIPT", "LOAD", source), None, target_nodes=node
                )
        else:
            await self._execute("SCRIPT", "LOAD", source)

    def _by_slot(self, names: Sequence[str]) -> list[list[int]]:
        """Positions of `names` grouped by cluster slot (one group for a single server)."""
        if not self.is_cluster:
            return [list(range(len(names)))]
        groups: dict[int, list[int]] = {}
        for position, name in enumerate(names):
            groups.setdefault(wire.key_slot(name), []).append(position)
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
                await asyncio.sleep(retry_delay(attempt, base=0.05, cap=2.0))
                attempt += 1

    # the contract

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired (one GET)."""
        raw = await self._read("GET", self._k(key))
        return None if raw is None else scripts.entry(key, raw)

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
            None if raw is None else scripts.entry(key, raw)
            for key, raw in zip(keys, raws, strict=True)
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
                "EVAL", scripts.STRLEN, len(group), *[names[position] for position in group]
            )
            for position, length in zip(group, lengths, strict=True):
                # -1: a missing or expired key (the script takes off either header's size).
                sizes[position] = int(length) if int(length) >= 0 else None
        return sizes

    async def stat_many(self, keys: Sequence[str]) -> list[EntryStat | None]:
        """Return each key's metadata and stored size, one script per slot group.

        See `Backend.stat_many`. The script returns each record's header and STRLEN: values are
        never transferred, about 80 bytes a key.
        """
        if not keys:
            return []
        names = [self._k(key) for key in keys]
        await self._redis()
        stats: list[EntryStat | None] = [None] * len(names)
        groups = [  # as in value_sizes: one slot per script, at most 1,000 keys
            group[start : start + 1000]
            for group in self._by_slot(names)
            for start in range(0, len(group), 1000)
        ]
        for group in groups:
            replies = await self._read(
                "EVAL", scripts.STAT, len(group), *[names[position] for position in group]
            )
            for position, reply in zip(group, replies, strict=True):
                if reply:
                    header, length = reply
                    try:
                        head = scripts.entry(keys[position], header)
                    except ForeignRecordError:
                        continue  # another application's string: listed as missing
                    stats[position] = EntryStat(
                        key=head.key,
                        size=int(length) - len(header) + len(head.value),
                        version=head.version,
                        created_at=head.created_at,
                        updated_at=head.updated_at,
                        expires_at=head.expires_at,
                    )
        return stats

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key` in one atomic script; see `Backend.set`."""
        name = self._k(key)
        if ttl is not None:
            check_ttl(ttl)
        expected: int | str = -1
        if expected_version is not None or expected_revision is not None:
            check_expected(expected_version, expected_revision)
            expected = _expectation(expected_version, expected_revision)
        if self._feed_unregistered:
            await self._register_feed()
        if self._epoch_unread:
            await self._first_epoch()
        if self._index_unregistered:
            await self._register_index()
        if self.is_cluster and wire.key_slot(name) not in self._slots_registered:
            await self._register_slots((name,))
        kept = self._keeps_history and self._history_list(key)
        braced = self._braced(name)
        if kept:  # the history list comes before the key index, its spec is the last argument
            reply = await self._script(
                scripts.SET_SHA,
                scripts.SET,
                (
                    name,
                    self._revision_key(name),
                    *self._feed_keys(name),
                    kept[0],
                    *self._index_keys(name, bool(braced)),
                ),
                value,
                scripts.ttl_ms(ttl),
                expected,
                CHANNEL_NAMESPACE + name,
                *self._feed_argv,
                history_lists.spec([(1, kept[1])]),
                *braced,
                write_key=key,
            )
        else:
            reply = await self._script(
                scripts.SET_SHA,
                scripts.SET,
                (
                    name,
                    self._revision_key(name),
                    *self._feed_keys(name),
                    *self._index_keys(name, bool(braced)),
                ),
                value,
                scripts.ttl_ms(ttl),
                expected,
                CHANNEL_NAMESPACE + name,
                *self._feed_argv,
                *braced,
                write_key=key,
            )
        if self.is_cluster and reply[0] == 1:
            await self._births((reply[4],), (name,))
        return self._set_change(key, value, reply, expected_version, name, expected_revision)

    def _set_change(
        self,
        key: str,
        value: bytes,
        reply: list[Any],
        expected: int | None,
        name: str,
        expected_revision: int | None = None,
    ) -> Change:
        if reply[0] == 0:
            if expected_revision is not None:
                raise conflict(key, expected_revision, int(reply[1]), what="revision")
            raise conflict(key, expected if expected is not None else -1, int(reply[1]))
        return new_change(
            key,
            ChangeOp.SET,
            reply[2] or None,
            value,
            int(reply[1]),
            scripts.from_ms(int(reply[3])),
            self._write_cursor(name, reply[4]),
            int(reply[5]),
        )

    # the change feed

    @property
    def _feed_argv(self) -> tuple[str | int, ...]:
        """The write scripts' feed arguments: max changes and max age ms (none when off)."""
        return () if self.feed is None else self._feed_retention

    def _revision_key(self, name: str) -> str:
        """The revision counter a write of Redis key `name` draws from (`_redis_revision`)."""
        if not self.is_cluster:
            return self._revision_names.plain
        return self._revision_names.for_slot(wire.key_slot(name))

    def _index_keys(self, name: str, braced: bool = False) -> tuple[str, ...]:
        """The key index a write of Redis key `name` keeps (`_redis_keyindex`): the last key.

        With `braced` (a written key holds two `}`: `_braced`), its braced set after it.
        """
        index = self._key_index.index(wire.key_slot(name) if self.is_cluster else 0)
        return (index, key_index.braced_set(index)) if braced else (index,)

    def _braced(self, *names: str) -> tuple[int, ...]:
        """The write script's last argument when one of `names` goes in the braced set.

        (The prefix's length in bytes, which the script reads the keys after; none when no
        written key holds two `}`, as for every key the managers write.)
        """
        cut = len(self.key_prefix)
        for name in names:
            if name.count("}", cut) >= 2:
                return (self._prefix_bytes,)
        return ()

    def _feed_keys(self, name: str) -> tuple[str, ...]:
        """The feed stream and counter a write of Redis key `name` appends to (none when off).

        On one server the registries of the outer prefixes follow: a script that starts the
        stream joins them in the same step (`_redis_scripts.FEED_FUNCTION`).
        """
        if self.feed is None:
            return ()
        if not self.is_cluster:
            return self._feed_names.plain + self._registries
        return self._feed_names.for_slot(wire.key_slot(name))

    def _write_cursor(self, name: str, at: bytes | None) -> str | None:
        """The cursor of a change this backend wrote, from its feed id (`None`: no feed).

        Its own stream at its id, every other stream from its time on.
        """
        if at is None:
            return None
        text = at.decode()
        if not self.is_cluster:
            return _redis_feed.point_cursor(self._feed_names, (0, self.key_prefix), text)
        own: _redis_feed.Stream = (wire.key_slot(name), self.key_prefix)
        return _redis_feed.make_cursor(
            self._feed_names, _redis_feed.parse_id(text)[0], (own, text), {}
        )

    async def feed_cursor(self) -> str | None:
        """The cursor of the newest committed change, or `None` when the feed is off.

        On one server: this store's stream's last id (`r1:0-0` before its first change) and
        the server's clock in microseconds (`r1:<id>/<µs>`): changes committed before this
        call, through any prefix, are before it, and those after are not; a feed lost since
        (a restart without its data) is told apart by the id. On a cluster: every slot from
        a time read from the primaries' clocks (`TIME`): one past the largest, once every
        clock has passed it (if the clocks are more than a second apart, the smallest: then
        a change committed just before the call may be replayed too).
        """
        if self.feed is None:
            return None
        if self.is_cluster:
            floor = await self._clock_floor(exact=True)
            await self._read_epoch()
            return _redis_feed.make_cursor(self._feed_names, floor, None, {})
        last = await self._read("GET", self._feed_names.plain[1])
        now = await self._clock_us()
        text = _redis_feed.id_text(_redis_feed.parse_id(last) if last else (0, 0))
        return _redis_feed.point_cursor(self._feed_names, (0, self.key_prefix), text, now)

    async def feed_size(self) -> FeedSize | None:
        """The changes this store's streams retain and the bytes they hold (`None`: no feed).

        One XLEN and one GET per stream (on a cluster, per slot's stream, found by SCAN). The
        bytes are those each stream's writes counted (`_redis_scripts.to_feed`): a stream last
        written by an earlier version of this library counts from its next write on.
        """
        if self.feed is None:
            return None
        if self.is_cluster:
            own = [s for s in await self._feed_streams() if s[1] == self.key_prefix]
        else:
            own = [(0, self.key_prefix)]
        changes = held = 0
        for stream in own:
            name, counter = self._feed_names.stream(stream)
            changes += int(await self._read("XLEN", name))
            text = await self._read("GET", counter)
            parts = text.split() if text else []
            if len(parts) >= 3 and parts[2].isdigit():
                held += int(parts[2])
        return FeedSize(changes, held)

    async def _first_epoch(self) -> None:
        """Read the cluster feed's epoch before this backend's first write (`_read_epoch`)."""
        await self._read_epoch()
        self._epoch_unread = False

    async def _births(self, ids: Iterable[Any], names: Iterable[str] = ()) -> None:
        """After writes on a cluster: read the epoch again if one of them started a stream.

        A feed id whose count is 1 starts its stream: the first in its slot, or the first after
        the cluster lost its data. The cursors made from here on carry the epoch as it is now.
        A loss also took the key index's registries (the slots in use, the nested prefixes) and
        its built mark: the slots of `names` (the keys just written) join the slot registry
        again, this store joins its outer prefixes' registries again, and the next listing
        checks the mark, whatever this process remembers of them.
        """
        if self.feed is not None and any(
            isinstance(at, bytes) and at.endswith(b"-1") and at[:-2].isdigit() for at in ids
        ):
            await self._read_epoch()
            self._index_ready = False
            await self._register_index()
            # Every slot's first write after a loss starts its stream anew, so each slot this
            # process remembers is added again by its own next write.
            written = list(names)
            self._slots_registered.difference_update(wire.key_slot(name) for name in written)
            await self._register_slots(written)

    async def _register_feed(self) -> None:
        """Add this store's prefix to the registries of the prefixes it is nested in.

        A store under an outer prefix reads the feeds of the prefixes in its registry
        (`__agenticstate_feeds__:<outer prefix>`, a set) along with its own, so it replays the
        changes written through this one (see "Change feed"). Done before this backend's first
        write to its feed: one SADD per outer prefix. An ACL user that may not add to one is not
        found by it; the others become the write scripts' last keys (`_registries`), so a script
        that starts the stream anew (the old one was lost: a restart without data) joins them
        again in the same atomic step, whichever process writes first.
        """
        allowed = []
        for outer in _redis_feed.ancestors(self.key_prefix):
            registry = _redis_feed.registry_key(outer)
            try:
                await self._execute("SADD", registry, self.key_prefix, write_key=None)
            except BackendError as exc:
                if not wire.no_permission(exc):
                    raise
                log.debug("feed_not_registered", outer=outer)
            else:
                allowed.append(registry)
        self._registries = tuple(allowed)
        self._feed_unregistered = False

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values in one round trip (a pipeline of scripts; each atomic)."""
        check_ttl(ttl)
        if not items:
            return []
        names = [self._k(key) for key, _ in items]
        life = scripts.ttl_ms(ttl)
        await self._redis()
        if self._feed_unregistered:
            await self._register_feed()
        if self._epoch_unread:
            await self._first_epoch()
        if self._index_unregistered:
            await self._register_index()
        if self.is_cluster:
            await self._register_slots(names)
        replies: list[Any] = [None] * len(items)
        # One script call per chunk of keys sharing a slot (a script's keys may not cross
        # slots in a cluster), so Redis is never blocked for long either.
        retention = self._feed_retention
        for group in self._by_slot(names):
            feed_keys = (self._revision_key(names[group[0]]), *self._feed_keys(names[group[0]]))
            for start in range(0, len(group), _SET_MANY_CHUNK):
                chunk = group[start : start + _SET_MANY_CHUNK]
                args: list[str | bytes | int] = [life, *retention]
                for position in chunk:
                    args += [items[position][1], CHANNEL_NAMESPACE + names[position]]
                keys = [*(names[position] for position in chunk), *feed_keys]
                if self._keeps_history:  # history lists come last, their spec too
                    depths: list[tuple[int, int]] = []
                    for n, position in enumerate(chunk, 1):
                        kept = self._history_list(items[position][0])
                        if kept:
                            keys.append(kept[0])
                            depths.append((n, kept[1]))
                    if depths:
                        args.append(history_lists.spec(depths))
                braced = self._braced(*(names[position] for position in chunk))
                keys += self._index_keys(names[chunk[0]], bool(braced))
                args += braced
                done = await self._script(
                    scripts.SET_MANY_SHA,
                    scripts.SET_MANY,
                    keys,
                    *args,
                    write_key=items[chunk[0]][0],
                )
                for position, reply in zip(chunk, done, strict=True):
                    replies[position] = reply
        if self.is_cluster:
            await self._births([reply[4] for reply in replies], names)
        return [
            self._set_change(key, value, reply, None, name)
            for (key, value), reply, name in zip(items, replies, names, strict=True)
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
        wire.require_asyncio()
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

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key` in one atomic script; see `Backend.delete`."""
        name = self._k(key)
        check_expected(expected_version, expected_revision)
        expected = _expectation(expected_version, expected_revision)
        if self._feed_unregistered:
            await self._register_feed()
        if self._epoch_unread:
            await self._first_epoch()
        if self._index_unregistered:
            await self._register_index()
        kept = self._keeps_history and self._history_list(key)
        keys = (name, self._revision_key(name), *self._feed_keys(name))
        braced = self._braced(name)
        index = self._index_keys(name, bool(braced))
        reply = await self._script(
            scripts.DELETE_SHA,
            scripts.DELETE,
            (*keys, kept[0], *index) if kept else (*keys, *index),
            expected,
            CHANNEL_NAMESPACE + name,
            *self._feed_argv,
            *([history_lists.spec([(1, kept[1])])] if kept else []),
            *braced,
            write_key=key,
        )
        if reply[0] == 0:
            if expected_revision is not None:
                raise conflict(key, expected_revision, int(reply[1]), what="revision")
            raise conflict(key, expected_version or 0, int(reply[1]))
        if reply[0] == 2:
            return None
        if self.is_cluster:
            await self._births((reply[4],), (name,))
        return new_change(
            key,
            ChangeOp.DELETE,
            reply[2],
            None,
            int(reply[1]),
            scripts.from_ms(int(reply[3])),
            self._write_cursor(name, reply[4]),
            int(reply[5]),
        )

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
        # Every key and index is validated by `check_transaction`: only the prefixes are added.
        prefix = self.key_prefix
        index_prefix = INDEX_NAMESPACE + prefix
        call = _redis_txn.pack(
            *checked,
            channels=CHANNEL_NAMESPACE,
            state_key=prefix.__add__,
            index_key=index_prefix.__add__,
            history=self._history_list if self._keeps_history else lambda key: None,
        )
        if not call.keys:
            return TxnResult(succeeded=True, results=[])
        client: Any = self._client or await self._redis()
        if self.is_cluster:
            _redis_txn.check_one_slot(call, client.keyslot)
        first = call.keys[0]
        if self._feed_unregistered:
            await self._register_feed()
        if self._epoch_unread and call.writes:
            await self._first_epoch()
        if self._index_unregistered and call.writes:
            await self._register_index()
        if self.is_cluster and call.writes and wire.key_slot(first) not in self._slots_registered:
            await self._register_slots((first,))
        _redis_txn.add_written(
            call, self._revision_key(first), self._feed_keys(first), self._feed_retention
        )
        if call.writes:  # the key index comes last: the script takes it off first
            braced = self._braced(
                *(
                    prefix + op.key
                    for op in (*checked[1], *checked[2])
                    if isinstance(op, Put | Delete)
                )
            )
            call.keys.extend(self._index_keys(first, bool(braced)))
            call.args.extend(braced)
        source, sha = _redis_txn.script(
            scripts.WRITE_FUNCTION, scripts.DROP_FUNCTION, history_lists.HISTORY_FUNCTION
        )
        command = ("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
        try:  # `_script`, inline: one coroutine less on the hot path
            reply = await self._execute(*command, write_key=call.write_key)
        except BackendError as exc:
            if not wire.unknown_script(exc):
                raise
            await self._load_script(source)
            reply = await self._execute(*command, write_key=call.write_key)
        name = call.keys[0]
        if self.is_cluster and call.writes:
            # A write's feed id is among its result's fields (an old value may look like one:
            # then the epoch is read once more, no harm).
            await self._births(
                [field for result in reply[1] if isinstance(result, list) for field in result],
                call.keys,
            )
        return _redis_txn.result(
            checked, reply, scripts.entry, lambda at: self._write_cursor(name, at)
        )

    # per-key history (`_redis_history`)

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep the last versions of the keys `rules` names, from the next write on.

        Each write of such a key pushes its record onto the key's history list in the same
        script (one command still). Every process that writes these keys must set the same rules.
        """
        self.history_rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)
        self._keeps_history = bool(self.history_rules)

    def _history_list(self, key: str) -> tuple[str, int] | None:
        """The Redis key and depth of `key`'s history list, if it keeps history."""
        depth = self.history_rules.depth(key)
        return (history_lists.history_key(self.key_prefix, key), depth) if depth > 1 else None

    def _history_lists(self, key: str) -> list[str]:
        """`READ`'s keys: the key, its history list, and where an earlier version kept it."""
        lists = [self.key_prefix + key, history_lists.history_key(self.key_prefix, key)]
        legacy = history_lists.legacy_history_key(self.key_prefix, key)
        return lists if legacy == lists[1] else [*lists, legacy]

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest first, in one script; see `Backend.history`."""
        self._k(key)  # validated
        limit = check_limit(limit)
        if limit == 0:
            return []
        if self.history_rules.depth(key) == 1:
            entry = await self.get(key)
            return [] if entry is None else [entry]
        stop = -1 if limit is None else limit - 1
        reply = await self._run_script(
            history_lists.READ_SHA, history_lists.READ, self._history_lists(key), [stop, 0]
        )
        return history_lists.versions(key, reply, limit, scripts.entry)

    async def get_version(self, key: str, version: int) -> Entry | None:
        """Version `version` of `key` if retained, read in one script; see `Backend.get_version`."""
        self._k(key)  # validated
        if type(version) is not int or version < 1:
            raise InvalidArgumentError(f"version must be an int >= 1, not {version!r}")
        if self.history_rules.depth(key) == 1:
            entry = await self.get(key)
            return entry if entry is not None and entry.version == version else None
        reply = await self._run_script(
            history_lists.READ_SHA, history_lists.READ, self._history_lists(key), [0, version]
        )
        for found in history_lists.versions(key, reply, None, scripts.entry):
            if found.version == version:
                return found
        return None

    async def _run_script(
        self, sha: str, source: str, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Any:
        """EVALSHA a read-only script, retried as `_read`; loaded after NOSCRIPT."""
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        try:
            return await self._read(*command)
        except BackendError as exc:
            if not wire.unknown_script(exc):
                raise
        await self._load_script(source)
        return await self._read(*command)

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the keys matching `pattern` from the key index, without the prefix.

        See `scan_batches` for what it reads and costs.
        """
        async with contextlib.aclosing(self.scan_batches(pattern)) as batches:
            async for batch in batches:  # left early, the page on its way is dropped at once
                for key in batch:
                    yield key

    async def scan_batches(self, pattern: str) -> AsyncGenerator[list[str], None]:
        """Yield the keys matching `pattern` a page at a time, sorted, without the prefix.

        The pages come from the key index (see "Key index"), never from the keyspace: the
        names in the range of the pattern's literal prefix, each checked to exist, in pages of
        `_LIST_PAGE` names: O(log n + the names in the range); a pattern across entities,
        `<literal>*}<rest>` with literal text after the `}`, is a skip-scan (`_skip_args`):
        O(entities x log n + result). On a cluster, a pattern whose
        literal prefix holds a complete `{tag}` reads that slot's indexes; any other reads those
        of the slots in the slot registries (the slots the prefixes were written in), one script
        per primary (Redis 7.0 or later; an older cluster SCANs each primary instead). The
        first listing of a store whose index was never built builds it first
        (`reindex`).
        """
        match = validate_pattern(pattern)
        await self._redis()
        await self._ensure_index()
        async with contextlib.aclosing(self._list_index(match)) as pages:
            async for page in pages:
                yield page

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the keys starting `<prefix>{`; see `Backend.scan_tags`.

        Read from the key index as `scan_batches` reads it (the same indexes), by the `TAGS`
        script: one ZRANGE BYLEX LIMIT 0 1 per tag and one EXISTS on the name it finds,
        O(tags x log n), never the tag's other names. On a cluster, a prefix holding a
        complete `{tag}` reads that slot's indexes; any other the registered slots' indexes,
        one script per primary (at least one step per slot probed). A cluster older than Redis
        7.0, or a store with many nested prefixes, lists the keys instead (`Backend.scan_tags`).
        """
        validate_key(prefix + "{")
        await self._redis()
        await self._ensure_index()
        start = self.key_prefix + prefix + "{"
        low, high = key_index.lex_range(start)
        sources = await self._index_sources(start)
        groups = await self._index_groups(sources, start, whole=False)
        if groups is None:
            return await super().scan_tags(prefix)
        width = len(start.encode("utf-8", "surrogatepass"))
        found: set[bytes] = set()
        for node, indexes in groups:
            position: Any = 1
            bound: bytes = low
            while position:
                tags, position, bound = await self._list_page(
                    node, indexes, (low, high, _LIST_PAGE, position, bound, width), kind=_TAGS
                )
                found.update(tags)
        return sorted(tag.decode("utf-8", "surrogateescape") for tag in found)

    async def _scan_keyspace(self, pattern: str) -> AsyncGenerator[list[str], None]:
        """Yield the keys matching `pattern` one SCAN page at a time, sorted, without the prefix.

        Each page is decoded whole (one join, one decode, one split) while the server already
        walks the next one: the next SCAN goes out as soon as the cursor is known.
        """
        match = escape_glob(self.key_prefix) + pattern
        client = await self._redis()
        # One SCAN per server; in a cluster, one per primary (each holds its own slots).
        nodes: list[Any] = await self._primaries(client) if self.is_cluster else [None]
        seen: set[bytes] | None = None  # every name yielded, once there is a second page
        first: list[bytes] = []
        for node in nodes:
            page: asyncio.Future[Any] | None = asyncio.ensure_future(
                self._scan_page(node, 0, match)
            )
            try:
                while page is not None:
                    cursor, raw = await page
                    page = None
                    if int(cursor) != 0:
                        page = asyncio.ensure_future(self._scan_page(node, cursor, match))
                        await asyncio.sleep(0)  # let it send its SCAN before we decode
                    if not raw:
                        continue
                    # SCAN may return a name again on a later page (never twice in one page).
                    if seen is None and first:
                        seen = set(first)
                    if seen is not None:
                        again = seen.intersection(raw)
                        seen.update(raw)
                        if again:
                            raw = [name for name in raw if name not in again]
                    else:
                        first = raw
                    keys = self._key_names(raw)
                    if keys:
                        keys.sort()  # while the next page is on its way: sorting all is a merge
                        yield keys
            finally:
                if page is not None:  # the caller stopped early, or this page failed
                    page.cancel()
                    page.add_done_callback(_retrieve)

    def _key_names(self, raw: list[bytes]) -> list[str]:
        """Keys as given to the backend: SCAN's names without the prefix, decoded in bulk."""
        prefix = self.key_prefix
        text = b"\n".join(raw).decode("utf-8", "surrogateescape")
        if text.count("\n") == len(raw) - 1:  # no name holds a newline: split the whole page
            # Every name starts with the prefix (SCAN matched it), so the prefix follows each
            # newline; a key may hold the prefix again, but never after a newline.
            keys = text[len(prefix) :].split("\n" + prefix) if prefix else text.split("\n")
        else:  # a name with a newline (not written by agenticstate): one at a time
            cut = len(prefix.encode())
            keys = [name[cut:].decode("utf-8", "surrogateescape") for name in raw]
        if _RESERVED.startswith(prefix) or prefix.startswith(_RESERVED):
            # Our own index keys are visible to SCAN under the empty prefix: never list them.
            keys = [key for key in keys if not (prefix + key).startswith(_RESERVED)]
        return keys

    async def _primaries(self, client: aioredis.Redis) -> list[Any]:
        """The cluster's primaries, reading the slot map first if it is not known or stale."""
        if self._closed:
            # (A task that took the client before the close must not bring it back to life.)
            raise BackendError("this RedisBackend is closed")
        if self._cluster.stale:
            with wire.translate(self.url):
                async with asyncio.timeout(self.connect_timeout + self.socket_timeout):
                    await self._cluster.refresh(client)
        primaries = list(self._cluster.primaries)
        if not primaries:
            raise BackendUnavailableError(f"the Redis Cluster at {self.url} has no primary")
        return primaries

    async def _scan_page(self, node: Any, cursor: bytes | int, match: str) -> Any:
        if node is None:
            return await self._read("SCAN", cursor, "MATCH", match, "COUNT", _SCAN_COUNT)
        client = self._client or await self._redis()
        return await self._execute_on_cluster(
            client, ("SCAN", cursor, "MATCH", match, "COUNT", _SCAN_COUNT), None, target_nodes=node
        )

    # the key index (`_redis_keyindex`): what listings read

    async def _index_groups(
        self, sources: list[key_index.KeyIndexNames], start: str, *, whole: bool
    ) -> list[tuple[Any, list[str]]] | None:
        """The indexes of `sources` a read of the range from `start` goes to, by node.

        One server: each source's index. A cluster: each source's index in the slot `start`
        pins (`whole`: `start` is the whole key), else those of the registered slots, grouped
        by primary. `None` where no index read can answer: a cluster older than Redis 7.0 (no
        script may read several slots), or many nested stores (probing every slot's index of
        each would cost more than a SCAN); the caller reads the keys instead.
        """
        if not self.is_cluster:
            return [(None, [names.plain for names in sources])]
        pinned = key_index.pinned_slot_key(start, whole=whole)
        if pinned is not None:
            slot = wire.key_slot(pinned)
            return [(None, [names.index(slot) for names in sources])]
        if len(sources) <= _MAX_PROBED_PREFIXES and await self._lists_across_slots():
            return await self._indexes_by_primary(sources)
        return None

    async def _list_index(self, pattern: str) -> AsyncGenerator[list[str], None]:
        """Yield the keys matching `pattern` from the key indexes, a checked page at a time."""
        matcher = compile_glob(pattern)
        prefix = self.key_prefix
        start = prefix + matcher.literal_prefix
        low, high = key_index.lex_range(start)
        sources = await self._index_sources(start)
        groups = await self._index_groups(sources, start, whole=matcher.is_literal)
        if groups is None:
            async with contextlib.aclosing(self._scan_keyspace(pattern)) as pages:
                async for page in pages:
                    yield page
            return
        skip = self._skip_args(pattern, start, sources)
        # One name may be in two indexes (written through two stores whose prefixes nest), and
        # a skip-scan may meet a name of the braced set twice.
        seen: set[bytes] | None = set() if len(sources) > 1 or skip else None
        cut = len(prefix.encode())
        for node, indexes in groups:
            if skip:  # each index with its braced set
                indexes = [name for index in indexes for name in (index, braced_set(index))]
            position: Any = 1
            bound: bytes = low
            inside: bytes = b""  # the group a skip-scan's page stopped inside
            while position:
                if skip:
                    args = (low, high, _LIST_PAGE, position, bound, *skip, inside)
                    found, position, bound, inside = await self._list_page(
                        node, indexes, args, kind=_SKIP
                    )
                else:
                    found, position, bound = await self._list_page(
                        node, indexes, (low, high, _LIST_PAGE, position, bound)
                    )
                if seen is not None:
                    fresh = []
                    for name in found:
                        if name not in seen:
                            seen.add(name)
                            fresh.append(name)
                    found = fresh
                keys = [name[cut:].decode("utf-8", "surrogateescape") for name in found]
                if not matcher.is_prefix:
                    keys = [key for key in keys if matcher.match(key)]
                if keys:
                    keys.sort()
                    yield keys

    def _skip_args(
        self, pattern: str, start: str, sources: list[key_index.KeyIndexNames]
    ) -> tuple[int, bytes, bytes] | None:
        """The `SKIP` script's arguments for `pattern`, or `None` where `LIST` reads it.

        A skip-scan answers `<literal>*}<rest>` when `rest` starts with literal text (with
        none, every name of a group is a candidate: `LIST` reads the range as cheaply). A
        source whose prefix holds a `}` past `start` lists through `LIST` too: its braced set
        counts the `}` after that prefix only, so it may miss a name the `*` matches across.
        """
        plan = skip_plan(pattern)
        if plan is None:
            return None
        rest = compile_glob(plan[1]).literal_prefix
        if not rest:
            return None
        for names in sources:
            if len(names.prefix) > len(start) and "}" in names.prefix[len(start) :]:
                return None
        low, past = key_index.lex_range(rest)
        return (len(start.encode("utf-8", "surrogatepass")), low[1:], past[1:])

    async def _list_page(
        self,
        node: Any,
        indexes: list[str],
        args: tuple[bytes | int, ...],
        *,
        kind: int = 0,
    ) -> list[Any]:
        """One `LIST` script (`TAGS`, `SKIP` by `kind`): on one server or slot, or on a node.

        `node` None: on one server, or on the slot the indexes share.
        On a node, at most `_PROBE_CHUNK` indexes a script: the next chunk goes in the next
        call, so no script holds the server for long. Returns {names, the position to go on
        from (None: done), its low bound, and what else the script returns}.
        """
        sha, source, across_sha, across, width = _LIST_SCRIPTS[kind]
        if node is None:
            reply = list(await self._run_script(sha, source, indexes, args))
        else:
            low, high, budget, position, bound, *extra = args
            first = (int(position) - 1) // _PROBE_CHUNK * _PROBE_CHUNK
            chunk = indexes[first * width : (first + _PROBE_CHUNK) * width]
            args = (low, high, budget, int(position) - first, bound, *extra)
            command = ("EVALSHA", across_sha, 0, *args, *chunk)
            client = self._client or await self._redis()
            try:
                reply = await self._execute_on_cluster(client, command, None, target_nodes=node)
            except BackendError as exc:
                if not wire.unknown_script(exc):
                    raise
                await self._load_script(across)
                reply = await self._execute_on_cluster(client, command, None, target_nodes=node)
            reply = list(reply)
            if reply[1]:
                reply[1] = int(reply[1]) + first
            elif (first + _PROBE_CHUNK) * width < len(indexes):  # on to the next chunk
                reply[1:3] = [first + _PROBE_CHUNK + 1, low]
                if kind == _SKIP:
                    reply[3] = b""
        reply[0] = list(reply[0])
        reply[1] = int(reply[1]) if reply[1] else None
        return reply

    async def _index_sources(self, start: str) -> list[key_index.KeyIndexNames]:
        """The indexes that may hold names starting with `start` (this user may read).

        This store's, those of the prefixes it is nested in, and those of the prefixes nested
        in it (its registry) that can hold such names.
        """
        own = self.key_prefix
        prefixes = [own, *_redis_feed.ancestors(own)]
        try:
            members = await self._read("SMEMBERS", self._key_index.nested)
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            members = []
        for member in members:
            with contextlib.suppress(UnicodeDecodeError):
                nested = member.decode()
                if (
                    nested != own
                    and nested.startswith(own)
                    and _redis_feed.is_prefix(nested)
                    and (nested.startswith(start) or start.startswith(nested))
                ):
                    prefixes.append(nested)
        sources = []
        for prefix in prefixes:
            names = key_index.KeyIndexNames(prefix, cluster=self.is_cluster)
            allowed = self._index_allowed.get(prefix)
            if allowed is None:
                allowed = self._index_allowed[prefix] = await self._may_read_index(names)
                if not allowed:
                    log.info("key_index_denied", url=self.url)
            if allowed:
                sources.append(names)
        return sources

    async def _may_read_index(self, names: key_index.KeyIndexNames) -> bool:
        """Whether this ACL user may read another prefix's indexes (once per prefix)."""
        try:
            await self._read("EXISTS", names.index(0))
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            return False
        return True

    async def _indexes_by_primary(
        self, sources: list[key_index.KeyIndexNames]
    ) -> list[tuple[Any, list[str]]]:
        """The registered slots' indexes of `sources`, grouped by the primary serving the slot.

        A source whose slot registry this user may not read or make has every slot probed.
        """
        used = [await self._registered_slots(names) for names in sources]
        wanted: Iterable[int]
        if any(slots is None for slots in used):
            wanted = range(_SLOT_COUNT)
        else:
            wanted = sorted(frozenset[int]().union(*(slots for slots in used if slots)))
        return [
            (
                node,
                [
                    names.index(slot)
                    for slot in slots
                    for names, kept in zip(sources, used, strict=True)
                    if kept is None or slot in kept
                ],
            )
            for node, slots in await self._slots_by_primary(wanted)
        ]

    async def _slots_by_primary(self, slots: Iterable[int]) -> list[tuple[Any, list[int]]]:
        """`slots` grouped by the primary serving them (the slot map read first if stale)."""
        client = self._client or await self._redis()
        await self._primaries(client)  # the slot map, read if stale
        served = self._cluster.slots
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for slot in slots:
            node = served[slot]
            if node is None:
                self._cluster.stale = True
                raise BackendUnavailableError(
                    f"no node of the Redis Cluster at {self.url} serves slot {slot}"
                )
            group = by_node.get(node.name)
            if group is None:
                group = by_node[node.name] = (node, [])
            group[1].append(slot)
        return list(by_node.values())

    async def _register_slots(self, names: Iterable[str]) -> None:
        """Add the slots of `names` to this store's slot registry, before writing them.

        One SADD for the slots this process has not added yet (none, mostly): the registry is
        a superset of the slots whose index holds a name, whatever process is killed when.
        """
        new = {wire.key_slot(name) for name in names}.difference(self._slots_registered)
        if new:
            await self._execute("SADD", self._key_index.slots, *sorted(new), write_key=None)
            self._slots_registered.update(new)

    async def _registered_slots(self, names: key_index.KeyIndexNames) -> frozenset[int] | None:
        """The slots whose index of `names` may hold a name (`None`: unknown, probe every slot).

        Read from the slot registry; one not complete yet (made before registries existed) is
        made first (`_make_slot_registry`).
        """
        try:
            members = await self._read("SMEMBERS", names.slots)
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            return None
        slots: list[int] = []
        complete = False
        for member in members:
            if member == _SLOTS_COMPLETE:
                complete = True
            elif member.isdigit() and int(member) < _SLOT_COUNT:
                slots.append(int(member))
        if complete:
            return frozenset(slots)
        made = await self._make_slot_registry(names)
        return None if made is None else made.union(slots)

    async def _make_slot_registry(self, names: key_index.KeyIndexNames) -> frozenset[int] | None:
        """Register every slot whose index of `names` holds a name, and mark the registry complete.

        For an index written before slot registries existed: one `USED_SLOTS` script per 2,000
        slots of each primary (an EXISTS per slot, once). Returns the slots found (`None`: this
        user may not add to the registry).
        """
        client = self._client or await self._redis()
        found: list[int] = []
        for node, slots in await self._slots_by_primary(range(_SLOT_COUNT)):
            for begin in range(0, len(slots), _PROBE_CHUNK):
                chunk = slots[begin : begin + _PROBE_CHUNK]
                command: tuple[str | int, ...] = (
                    "EVALSHA",
                    key_index.USED_SLOTS_SHA,
                    0,
                    *(names.index(slot) for slot in chunk),
                )
                try:
                    reply = await self._execute_on_cluster(client, command, None, target_nodes=node)
                except BackendError as exc:
                    if not wire.unknown_script(exc):
                        raise
                    await self._load_script(key_index.USED_SLOTS)
                    reply = await self._execute_on_cluster(client, command, None, target_nodes=node)
                found.extend(chunk[int(position) - 1] for position in reply)
        try:
            await self._execute(
                "SADD", names.slots, *sorted(found), key_index.SLOTS_COMPLETE, write_key=None
            )
        except BackendError as exc:
            if not wire.no_permission(exc):
                raise
            log.info("key_index_slots_denied", url=self.url)
            return None
        log.info("key_index_slots_registered", url=self.url, slots=len(found))
        return frozenset(found)

    async def _lists_across_slots(self) -> bool:
        """Whether the cluster runs scripts flagged `allow-cross-slot-keys` (Redis >= 7.0)."""
        if self._cross_slot_scripts is None:
            try:
                await self._load_script(key_index.LIST_ACROSS_SLOTS)
            except BackendError as exc:
                text = str(exc).lower()
                if "shebang" not in text and "compil" not in text and "unexpected" not in text:
                    raise
                log.info("key_index_cross_slot_unsupported", url=self.url)
                self._cross_slot_scripts = False
            else:
                self._cross_slot_scripts = True
        return self._cross_slot_scripts

    async def _register_index(self) -> None:
        """Add this store's prefix to the registries of the prefixes it is nested in.

        An outer store's listings read the indexes of the prefixes in its registry
        (`__agenticstate_keys__:<outer>#nested`) along with its own. Done before this
        backend's first write: one SADD per outer prefix (one this ACL user may not add to is
        skipped: its listings would not be allowed to read this store's index either).
        """
        for outer in _redis_feed.ancestors(self.key_prefix):
            if outer in self._nested_refused:
                continue  # asked once: the ACL log shows the refusal once
            registry = key_index.KeyIndexNames(outer, cluster=self.is_cluster).nested
            try:
                await self._execute("SADD", registry, self.key_prefix, write_key=None)
            except BackendError as exc:
                if not wire.no_permission(exc):
                    raise
                self._nested_refused.add(outer)
        self._index_unregistered = False

    async def _ensure_index(self) -> None:
        """Build the key index once, if no process built it yet (`reindex`)."""
        if self._index_ready:
            return
        if not await self._read("EXISTS", self._key_index.built):
            await self._build_index(again=False)
        self._index_ready = True

    async def _build_index(self, *, again: bool) -> KeyIndexReport | None:
        """Build the key index under its build lock: one process builds, the others wait.

        The lock (`#building`) holds a token of this call, set with `SET NX PX` for
        `_BUILD_LOCK_MS` and kept alive while the build goes on; a process that finds it held
        waits until it is gone (released, or expired: its builder died), then looks again.
        Without `again` (a first listing), a build another process finished meanwhile is
        taken as done (`None`). An ACL user that may not take the lock builds without it.
        """
        await self._redis()
        lock = self._key_index.building
        token = secrets.token_hex(16)
        waited = False
        while True:
            if not again and await self._read("EXISTS", self._key_index.built):
                return None
            try:
                taken = await self._execute(
                    "SET", lock, token, "NX", "PX", _BUILD_LOCK_MS, write_key=None
                )
            except BackendError as exc:
                if not wire.no_permission(exc):
                    raise
                return await self._build(None)
            if taken:
                break
            if not waited:
                log.info("key_index_build_waiting", url=self.url)
                waited = True
            delay = 0.01
            while await self._read("EXISTS", lock):  # until its builder releases it or dies
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        try:
            return await self._build(token)
        finally:
            with contextlib.suppress(BackendError):  # else it expires by itself
                await self._script(
                    key_index.RELEASE_BUILD_LOCK_SHA,
                    key_index.RELEASE_BUILD_LOCK,
                    (lock,),
                    token,
                    write_key="",
                )

    async def reindex(self) -> KeyIndexReport:
        """Build the key index over every record under the prefix, and mark it built.

        Listings read the index that every write keeps (see "Key index"). A store written by
        an earlier release of this library has records but no index: its first listing builds
        it once, and marks the index built so that no process does it again. A build SCANs the
        prefix's keys once (the whole keyspace: O(keys in the database)) and adds every record
        to the index (a foreign key is not added). One process builds at a time (a lock that
        expires if its builder dies): one that finds another building waits for it, then
        builds again. Safe while other processes write: every step is idempotent and listings
        check that each name exists.

        Returns:
            How many records it found under the prefix, and how many of them joined the index
            (0 when it was complete).
        """
        report = await self._build_index(again=True)
        assert report is not None  # noqa: S101  # `again`: it always builds
        return report

    async def _build(self, token: str | None) -> KeyIndexReport:
        """The build itself (`reindex`), keeping the build lock `token` alive as it goes."""
        log.info("key_index_build_started", url=self.url)
        loop = asyncio.get_running_loop()
        kept_at = loop.time()
        added = 0
        records = 0
        prefix = self.key_prefix
        # A name another index holds already (written through a store whose prefix nests with
        # this one) is listed from there: not added twice.
        others = [names for names in await self._index_sources(prefix) if names.prefix != prefix]
        async with contextlib.aclosing(self._scan_keyspace("*")) as pages:
            async for keys in pages:
                names = []
                for key in keys:
                    with contextlib.suppress(UnicodeEncodeError):  # not UTF-8: not a record's
                        (prefix + key).encode()
                        names.append(prefix + key)
                for group in self._by_slot(names):
                    for begin in range(0, len(group), 1000):
                        chunk = [names[position] for position in group[begin : begin + 1000]]
                        slot = wire.key_slot(chunk[0]) if self.is_cluster else 0
                        if self.is_cluster:
                            await self._register_slots(chunk[:1])
                        index = self._key_index.index(slot)
                        held = [names.index(slot) for names in others]
                        added += int(
                            await self._script(
                                key_index.BUILD_SHA,
                                key_index.BUILD,
                                (index, key_index.braced_set(index), *held, *chunk),
                                len(held),
                                self._prefix_bytes,
                                write_key="",
                            )
                        )
                        records += len(chunk)
                        if token is not None and loop.time() - kept_at > _BUILD_LOCK_KEEP:
                            kept_at = loop.time()
                            await self._script(
                                key_index.KEEP_BUILD_LOCK_SHA,
                                key_index.KEEP_BUILD_LOCK,
                                (self._key_index.building,),
                                token,
                                _BUILD_LOCK_MS,
                                write_key="",
                            )
        if self.is_cluster and await self._lists_across_slots():
            # The slots of names an index held before slot registries existed, too.
            await self._make_slot_registry(self._key_index)
        await self._execute("SET", self._key_index.built, str(records), write_key=None)
        self._index_ready = True
        log.info("key_index_built", url=self.url, keys=records, added=added)
        return KeyIndexReport(keys=records, added=added)

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
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Change]]:
        """Subscribe to changes of keys matching `pattern` (from every process).

        The subscription is live when the context manager is entered: the server has confirmed
        it, so every change committed after entry, by any client, is delivered. With `since=`,
        the feed's changes after that cursor come first (see "Change feed").
        """
        if since is not None and self.feed is None:
            raise UnsupportedOperationError(
                "this RedisBackend keeps no change feed (feed=None): since= needs one"
            )
        return self._changes(validate_pattern(pattern), max_buffer, since)

    async def aclose(self) -> None:
        """End subscriptions, close the pub/sub connection and (if created here) the client.

        Subscriptions first receive every change published before the close: a last barrier
        on the pub/sub connection (waited for up to `socket_timeout`) drains what is on its way.
        """
        if self._closed:
            return
        await self._drain_subscriptions()
        self._closed = True
        await self._close_subscriptions()
        client, self._client = self._client, None
        await self._connections.close()
        await self._cluster.close()
        if client is not None and self._owns_client:
            with contextlib.suppress(Exception):
                if self.is_cluster:
                    await client.aclose()
                else:
                    await client.aclose(close_connection_pool=True)
