"""MemoryBackend: the in-process store for development and tests.

Values are bytes produced by the serializer, so nothing a caller does to a dict after saving it,
or after reading it, reaches the stored state. Every call runs to completion without awaiting,
so on one event loop each call is atomic without a lock, and `update` runs its function inside
that same step: concurrent updates never conflict, let alone lose anything.

Every write, listing and index call yields to the event loop before it runs, so other tasks (a
subscriber's pump, a task waiting for what a loop of writes causes) run between two writes. A
read (`get`, `get_many`) yields only one time in `_YIELD_EVERY`: the yield costs more than the
rest of a `get`, and yielding that often still keeps a loop of reads from starving other tasks
(a task polling a key sees the write another task makes).

Revisions come from a counter of the instance, one more for every write and delete; a change's
revision is also its place in the feed. The change feed is a bounded ring (`FeedRing`) of the
committed changes, appended in the same step as each write; a cursor is `m1:<store id>:<revision>`,
the store id random per instance (so another instance's cursor, or one from before a restart, raises
`CursorExpiredError`). `changes(since=)` takes the replay from the ring and starts the live
subscription in one step, with no await between. History (`keep_history`) keeps the last versions of
a key in a bounded deque, also in the write's step.

Listings read the keys in order (`LocalStore`, shared with the file backend): a list of sorted
chunks kept in the same step as every write, delete and expiry. A pattern with a literal prefix
costs O(log n + its range), one across entities (`agents:{*}:recovery`) O(entities x log n +
result), one with no literal prefix a test of every key; the expiry sweep costs what expires.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import anyio.lowlevel

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_key_prefix, validate_pattern
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._local import FeedRing, LocalStore, feed_from_query, run_transaction
from agenticstate.backends._urls import url_query
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    FeedRetention,
    FeedSize,
    HistoryRules,
    check_expected,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
    new_entry,
    utcnow,
)
from agenticstate.exceptions import ConfigurationError, UnsupportedOperationError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager
    from datetime import datetime, timedelta

    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult

_DEFAULT_FEED = FeedRetention()

__all__ = ["MemoryBackend"]

_YIELD_EVERY = 64
"""Reads that complete at once between two yields to the event loop (see the module docstring)."""


class MemoryBackend(Backend):
    """Keep state in this process: fast, isolated, gone when the process exits.

    Each instance is its own store. Use it for development and tests, or for state that need not
    outlive the process; it is safe for many tasks on one event loop, not for several threads.

    Args:
        key_prefix: A namespace shown in `repr`; each instance is separate already.
        feed: The change feed's retention (`None`: no feed, changes carry no cursor).
        history: History rules (`keep_history`): key patterns to the versions each keeps.
    """

    def __init__(
        self,
        *,
        key_prefix: str = "",
        feed: FeedRetention | None = _DEFAULT_FEED,
        history: Mapping[str, int] | HistoryRules | None = None,
    ) -> None:
        if feed is not None and not isinstance(feed, FeedRetention):
            raise ConfigurationError(f"feed must be a FeedRetention or None, not {feed!r}")
        self.key_prefix = validate_key_prefix(key_prefix)
        self.feed = feed
        self._local = LocalStore()
        self._fanout = ChangeFanout()
        self._ring = FeedRing(feed, "m1", uuid.uuid4().hex[:16]) if feed is not None else None
        self._closed = False
        self._turns = 0  # reads since the last yield to the event loop
        self._revision = 0  # the last revision given (a write's or a delete's)
        self._keeps_history = False
        if history is not None:
            self.keep_history(history)

    has_revisions = True

    def __repr__(self) -> str:
        return f"MemoryBackend(key_prefix={self.key_prefix!r}, keys={len(self._local.data)})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        """Create a backend from `memory://` (any path is ignored: each is a new store).

        Query parameters set the feed: `feed=off`, `feed_max_changes=N`, `feed_max_age=SECONDS`,
        `feed_max_bytes=N`;
        any other is refused.
        """
        feed_from_query(
            url_query(url, ("feed", "feed_max_changes", "feed_max_age", "feed_max_bytes")), options
        )
        return cls(**options)

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep the last versions of the keys `rules` names; see `Backend.keep_history`."""
        self.history_rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)
        self._keeps_history = bool(self.history_rules) or bool(self._local.history)

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest first; see `Backend.history`."""
        validate_key(key)
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        return self._local.versions(key, utcnow(), limit)

    async def feed_cursor(self) -> str | None:
        """The cursor of the newest change, or `None` with the feed off."""
        ring = self._ring
        return None if ring is None else ring.cursor(ring.head)

    async def feed_size(self) -> FeedSize | None:
        """The changes the feed retains and the bytes they hold (`None` with the feed off)."""
        ring = self._ring
        return None if ring is None else FeedSize(len(ring), ring.bytes)

    def _emit(
        self,
        key: str,
        op: ChangeOp,
        old: bytes | None,
        new: bytes | None,
        version: int,
        now: datetime,
        revision: int,
    ) -> Change:
        """Build the change, append it to the feed and hand it to subscribers, in one step."""
        ring = self._ring
        if ring is None:
            change = new_change(key, op, old, new, version, now, None, revision)
        else:
            change = new_change(
                key, op, old, new, version, now, ring.prefix + str(revision), revision
            )
            ring.add(revision, change)
        self._fanout.publish(change)
        return change

    def _turn(self) -> bool:
        """Whether this read is the one in `_YIELD_EVERY` that yields first."""
        self._turns += 1
        if self._turns < _YIELD_EVERY:
            return False
        self._turns = 0
        return True

    def _write(
        self,
        key: str,
        value: bytes,
        ttl: timedelta | None,
        expected: int | None,
        now: datetime,
        expected_revision: int | None = None,
    ) -> Change:
        current = self._local.live(key, now)
        version = current.version if current is not None else 0
        if expected is not None and expected != version:
            raise conflict(key, expected, version)
        if expected_revision is not None:
            found = current.revision if current is not None else 0
            if expected_revision != found:
                raise conflict(key, expected_revision, found, what="revision")
        expires_at = now + ttl if ttl is not None else None
        self._revision = revision = self._revision + 1
        entry = new_entry(
            key,
            value,
            version + 1,
            current.created_at if current is not None else now,
            now,
            expires_at,
            revision,
            current.create_revision if current is not None else revision,
        )
        self._local.store(entry)
        if self._keeps_history:
            self._local.keep(entry, self.history_rules.depth(key), current)
        return self._emit(
            key,
            ChangeOp.SET,
            current.value if current is not None else None,
            value,
            version + 1,
            now,
            revision,
        )

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired."""
        validate_key(key)
        if self._turn():
            await anyio.lowlevel.checkpoint()
        return self._local.get(key, utcnow)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order."""
        for key in keys:
            validate_key(key)
        if self._turn():
            await anyio.lowlevel.checkpoint()
        now = utcnow()
        self._local.sweep(now)
        return [self._local.live(key, now) for key in keys]

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key`; see `Backend.set`."""
        validate_key(key)
        check_ttl(ttl)
        check_expected(expected_version, expected_revision)
        await anyio.lowlevel.checkpoint()
        now = utcnow()
        self._local.sweep(now)
        return self._write(key, value, ttl, expected_version, now, expected_revision)

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values in one step."""
        for key, _ in items:
            validate_key(key)
        check_ttl(ttl)
        await anyio.lowlevel.checkpoint()
        now = utcnow()
        self._local.sweep(now)
        return [self._write(key, value, ttl, None, now) for key, value in items]

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key`; see `Backend.delete`."""
        validate_key(key)
        if expected_version is not None or expected_revision is not None:
            check_expected(expected_version, expected_revision)
        await anyio.lowlevel.checkpoint()
        current = self._local.get(key, utcnow)
        if expected_version is not None:
            version = current.version if current is not None else 0
            if expected_version != version:
                raise conflict(key, expected_version, version)
        if expected_revision is not None:
            found = current.revision if current is not None else 0
            if expected_revision != found:
                raise conflict(key, expected_revision, found, what="revision")
        if current is None:
            return None
        return self._drop(current, utcnow())

    def _drop(self, current: Entry, now: datetime) -> Change:
        self._local.drop(current.key)
        self._revision = revision = self._revision + 1
        return self._emit(
            current.key, ChangeOp.DELETE, current.value, None, current.version, now, revision
        )

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Compare, then write, in one step with no await inside; see `Backend.transact`."""
        checked = check_transaction(compare, then, orelse)
        await anyio.lowlevel.checkpoint()
        now = utcnow()
        self._local.sweep(now)
        return run_transaction(_MemoryStep(self, now), *checked)

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(entry)` in one step (no retries needed)."""
        validate_key(key)
        check_ttl(ttl)
        await anyio.lowlevel.checkpoint()
        now = utcnow()
        self._local.sweep(now)
        current = self._local.live(key, now)
        value = fn(current)
        return self._write(key, value, ttl, None, now)

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`, sorted.

        Costs O(log n + the range) for a pattern with a literal prefix (`agent:*`), one lookup
        for a literal key, O(entities x log n + result) across entities (`agents:{*}:recovery`,
        a skip-scan), and a test of every key for a pattern with no literal prefix (`*:x`).
        """
        matcher = compile_glob(validate_pattern(pattern))
        await anyio.lowlevel.checkpoint()
        for key in self._local.matching(matcher, utcnow()):
            yield key

    async def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        """Yield the present keys matching `pattern` as one sorted list (none if no key matches).

        Costs O(log n + the range) for a pattern with a literal prefix (`agent:*`), one lookup
        for a literal key, O(entities x log n + result) across entities (`agents:{*}:recovery`,
        a skip-scan), and a test of every key for a pattern with no literal prefix (`*:x`).
        """
        matcher = compile_glob(validate_pattern(pattern))
        await anyio.lowlevel.checkpoint()
        keys = self._local.matching(matcher, utcnow())
        if keys:
            yield keys

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the keys starting `<prefix>{`; see `Backend.scan_tags`.

        Costs O(tags x log n): one seek in the ordered keys per tag (`tag_scan`).
        """
        validate_key(prefix + "{")
        await anyio.lowlevel.checkpoint()
        return self._local.tags(prefix, utcnow())

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members to a sorted index; see `Backend.index_add`."""
        validate_key(index)
        checked = check_index_members(members)
        await anyio.lowlevel.checkpoint()
        return self._local.index_add(index, checked)

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """Remove members from a sorted index; see `Backend.index_remove`."""
        validate_key(index)
        await anyio.lowlevel.checkpoint()
        return self._local.index_remove(index, members)

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Read a sorted index, lowest score first; see `Backend.index_range`."""
        validate_key(index)
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        return self._local.index_range(index, limit)

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> AbstractAsyncContextManager[ChangeStream]:
        """Subscribe to changes of keys matching `pattern` (from `since`); see `Backend.changes`."""
        pattern = validate_pattern(pattern)
        if since is None:
            return self._fanout.subscribe(pattern, max_buffer)
        ring = self._ring
        if ring is None:
            raise UnsupportedOperationError("this MemoryBackend keeps no change feed (feed=None)")
        return self._fanout.subscribe(
            pattern, max_buffer, backlog=lambda matcher: ring.since(since, matcher)
        )

    async def aclose(self) -> None:
        """End every subscription; the data stays readable until the object is dropped."""
        self._closed = True
        self._fanout.close()


class _MemoryStep:
    """A `TxnTarget` over a `MemoryBackend` at one moment (`run_transaction`'s view)."""

    __slots__ = ("_backend", "_now")

    def __init__(self, backend: MemoryBackend, now: datetime) -> None:
        self._backend = backend
        self._now = now

    def txn_get(self, key: str) -> Entry | None:
        return self._backend._local.live(key, self._now)

    def txn_put(self, key: str, value: bytes, ttl: timedelta | None) -> Change:
        return self._backend._write(key, value, ttl, None, self._now)

    def txn_delete(self, key: str) -> Change | None:
        current = self.txn_get(key)
        return None if current is None else self._backend._drop(current, self._now)

    def txn_score(self, index: str, member: str) -> float | None:
        return self._backend._local.index_score(index, member)

    def txn_index_add(self, index: str, members: dict[str, float]) -> int:
        return self._backend._local.index_add(index, members)

    def txn_index_remove(self, index: str, members: list[str]) -> int:
        return self._backend._local.index_remove(index, members)

    def txn_index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        return self._backend._local.index_range(index, limit)
