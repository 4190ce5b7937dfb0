"""The SQLite backend's change feed: the `changes` table, read by one thread, fanned out in-process.

Every write appends its change (key, old and new bytes, version, time) to the `changes` table in
the same transaction as the value, under a sequence number that grows by one per change. Each
backend instance with subscriptions runs one notifier thread on its own connection; it wakes when
this process commits (a nudge from the writer) and otherwise polls `PRAGMA data_version`, which
changes only when another connection has committed, so an idle poll reads no table. On a change
it reads the rows after the last sequence it delivered, in one read transaction, and hands them
to the event loop in sequence order, where each matching subscription receives them.

A subscription starts after the last committed change (or after a cursor it gives, to catch up
on what it missed). If the rows it needs were trimmed by retention, it receives a `RESYNC` change
for every present key it matches (the current value; what happened in between is unknown), as the
Redis backend does after a reconnect, and then the live changes: never a silent gap.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections import deque
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import anyio

from agenticstate._log import get_logger
from agenticstate.backends.base import Change, ChangeOp, new_change
from agenticstate.exceptions import InvalidArgumentError, SubscriptionClosedError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from agenticstate._glob import GlobMatcher

__all__ = ["Feed", "SQLiteChangeStream", "from_us", "key_range", "to_us"]

log = get_logger("agenticstate.backends.sqlite")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_OPS = (ChangeOp.SET, ChangeOp.DELETE)
_Item = tuple[int, Change]


def to_us(moment: datetime) -> int:
    """Microseconds since the epoch (exact)."""
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(value: int) -> datetime:
    """The aware UTC datetime `value` microseconds after the epoch (exact)."""
    return _EPOCH + timedelta(microseconds=value)


def key_range(prefix: str) -> tuple[str, str | None]:
    """Bounds `low <= key < high` holding exactly the keys that start with `prefix`.

    Keys compare as UTF-8 bytes (SQLite's BINARY collation), which orders like code points, so
    the upper bound is the prefix with its last character moved one code point up.
    """
    while prefix:
        last = ord(prefix[-1])
        if last < 0x10FFFF:
            bumped = last + 1 if last + 1 != 0xD800 else 0xE000  # skip the surrogates
            return prefix, prefix[:-1] + chr(bumped)
        prefix = prefix[:-1]
    return "", None


class _Sub:
    __slots__ = (
        "is_open",
        "matcher",
        "max_buffer",
        "opened",
        "overflowed",
        "receive",
        "send",
    )

    def __init__(self, matcher: GlobMatcher, max_buffer: int) -> None:
        self.matcher = matcher
        self.max_buffer = max_buffer
        self.is_open = False
        self.overflowed = False
        self.opened = anyio.Event()
        self.send: MemoryObjectSendStream[_Item]
        self.receive: MemoryObjectReceiveStream[_Item]
        self.send, self.receive = anyio.create_memory_object_stream[_Item](max_buffer)


class SQLiteChangeStream:
    """An async iterator of `Change`s with the sequence number of the last one read.

    Attributes:
        cursor: The sequence number of the last change this stream yielded (on entry: the last
            change committed before the subscription, or the `since` it was given). Keep it and
            pass it as `since=` to catch up later on what was missed.
    """

    __slots__ = ("_sub", "cursor")

    def __init__(self, sub: _Sub, cursor: int) -> None:
        self._sub = sub
        self.cursor = cursor

    def __aiter__(self) -> SQLiteChangeStream:
        return self

    async def __anext__(self) -> Change:
        try:
            seq, change = await self._sub.receive.receive()
        except anyio.EndOfStream:
            if self._sub.overflowed:
                raise SubscriptionClosedError(
                    "overflow",
                    f"subscription to {self._sub.matcher.pattern!r} fell more than "
                    f"{self._sub.max_buffer} changes behind; re-read the state and subscribe "
                    f"again (or pass since={self.cursor} to catch up)",
                ) from None
            raise StopAsyncIteration from None
        except anyio.ClosedResourceError:
            raise StopAsyncIteration from None
        if seq:
            self.cursor = seq
        return change


class Feed:
    """Read the `changes` table in one thread and deliver to this process's subscriptions.

    Args:
        open_connection: Makes the notifier's own read connection (called in its thread).
        schedule: Runs a callback on the event loop, thread-safely.
        key_prefix: The backend's namespace: other keys are skipped, and it is stripped.
        poll_interval: Seconds between `PRAGMA data_version` checks while subscribed.
    """

    def __init__(
        self,
        open_connection: Callable[[], sqlite3.Connection],
        schedule: Callable[[Callable[[], object]], object],
        key_prefix: str,
        poll_interval: float,
    ) -> None:
        self._open_connection = open_connection
        self._schedule = schedule
        self._prefix = key_prefix
        self._low, self._high = key_range(key_prefix)
        self._poll = poll_interval
        self._subs: list[_Sub] = []
        self._requests: deque[tuple[_Sub, int | None, list[int]]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._cursor = 0
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether any subscription is open (so the writer nudges the notifier)."""
        return bool(self._subs)

    def nudge(self) -> None:
        """Wake the notifier now (this process just committed)."""
        self._wake.set()

    # ---------------------------------------------------------------- the event loop's side

    @contextlib.asynccontextmanager
    async def subscribe(
        self, matcher: GlobMatcher, max_buffer: int, since: int | None
    ) -> AsyncIterator[SQLiteChangeStream]:
        """Open a subscription; active on entry (see the module docstring)."""
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        if since is not None and (type(since) is not int or since < 0):
            raise InvalidArgumentError(f"since must be an int >= 0 or None, not {since!r}")
        sub = _Sub(matcher, max_buffer)
        start = [since or 0]
        if self._closed:
            sub.send.close()
        else:
            self._subs = [*self._subs, sub]
            self._start_thread()
            self._requests.append((sub, since, start))
            self._wake.set()
            try:
                await sub.opened.wait()
            except BaseException:
                self._drop(sub)
                sub.receive.close()
                raise
        try:
            yield SQLiteChangeStream(sub, start[0])
        finally:
            self._drop(sub)
            sub.receive.close()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name="agenticstate-sqlite-notify", daemon=True
            )
            self._thread.start()

    def _drop(self, sub: _Sub) -> None:
        sub.send.close()
        self._subs = [s for s in self._subs if s is not sub]

    def _publish(self, items: list[_Item]) -> None:
        for sub in self._subs:
            if not sub.is_open:
                continue
            for item in items:
                if sub.matcher.match(item[1].key) and not self._send(sub, item):
                    break

    def _send(self, sub: _Sub, item: _Item) -> bool:
        try:
            sub.send.send_nowait(item)
        except anyio.WouldBlock:
            sub.overflowed = True
            log.warning("subscriber_overflow", pattern=sub.matcher.pattern, buffer=sub.max_buffer)
            self._drop(sub)
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._drop(sub)
            return False
        return True

    def _open_sub(self, sub: _Sub, items: list[_Item]) -> None:
        for item in items:
            if not self._send(sub, item):
                break
        sub.is_open = True
        sub.opened.set()

    def close(self) -> None:
        """End every subscription (on the loop) and stop the thread (call `join` after)."""
        self._closed = True
        for sub in self._subs:
            sub.send.close()
            sub.opened.set()
        self._subs = []
        self._stopping = True
        self._wake.set()

    def join(self) -> None:
        """Wait for the notifier thread to end (blocking; after `close`)."""
        if self._thread is not None:
            self._thread.join()

    # ---------------------------------------------------------------- the notifier thread

    def _main(self) -> None:
        try:
            conn = self._open_connection()
        except Exception:
            log.exception("sqlite_notifier_failed")
            self._schedule(self.close)
            return
        try:
            self._cursor = self._max_seq(conn)
            version = -1
            while not self._stopping:
                self._wake.wait(self._poll if self._subs else None)
                self._wake.clear()
                if self._stopping:
                    break
                # Take the requests before reading: a change committed before a subscription was
                # asked for must be read (and passed over for it) before the subscription opens.
                requests = [self._requests.popleft() for _ in range(len(self._requests))]
                current = conn.execute("PRAGMA data_version").fetchone()[0]
                if current != version or requests:
                    version = current
                    self._catch_up(conn)
                for request in requests:
                    self._register(conn, *request)
        except Exception:  # the thread must not die silently: end the subscriptions loudly
            log.exception("sqlite_notifier_failed")
            with contextlib.suppress(RuntimeError):
                self._schedule(self.close)
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    @staticmethod
    def _max_seq(conn: sqlite3.Connection) -> int:
        # Trimming always keeps the newest change, so the largest sequence is never reused.
        (last,) = conn.execute("SELECT max(seq) FROM changes").fetchone()
        return int(last) if last is not None else 0

    def _rows(self, conn: sqlite3.Connection, after: int, upto: int | None) -> list[_Item]:
        sql = "SELECT seq, key, op, old, new, version, ts FROM changes WHERE seq > ?"
        params: list[object] = [after]
        if upto is not None:
            sql += " AND seq <= ?"
            params.append(upto)
        if self._prefix:
            sql += " AND key >= ?" + (" AND key < ?" if self._high is not None else "")
            params += [self._low] + ([self._high] if self._high is not None else [])
        cut = len(self._prefix)
        return [
            (seq, new_change(key[cut:], _OPS[op], old, new, version, from_us(ts)))
            for seq, key, op, old, new, version, ts in conn.execute(sql + " ORDER BY seq", params)
        ]

    def _snapshot(
        self, conn: sqlite3.Connection, after: int, upto: int | None
    ) -> tuple[bool, int, list[_Item]]:
        """Read the changes after `after` in one read transaction: (gap?, last seq, rows)."""
        conn.execute("BEGIN")
        try:
            last = self._max_seq(conn) if upto is None else upto
            (oldest,) = conn.execute("SELECT min(seq) FROM changes").fetchone()
            gap = after > last or (after < last and (oldest is None or oldest > after + 1))
            rows = [] if gap else self._rows(conn, after, upto)
        finally:
            conn.execute("COMMIT")
        return gap, last, rows

    def _catch_up(self, conn: sqlite3.Connection) -> None:
        gap, last, rows = self._snapshot(conn, self._cursor, None)
        self._cursor = last
        if gap:
            log.warning("sqlite_changes_trimmed", cursor=self._cursor)
            for sub in list(self._subs):
                if sub.is_open:
                    items = self._resync(conn, sub.matcher, last)
                    self._schedule(functools.partial(self._open_sub, sub, items))
        elif rows:
            self._schedule(lambda: self._publish(rows))

    def _register(
        self, conn: sqlite3.Connection, sub: _Sub, since: int | None, start: list[int]
    ) -> None:
        items: list[_Item] = []
        if since is None:
            start[0] = self._cursor
        elif since != self._cursor:
            gap, _, rows = self._snapshot(conn, since, self._cursor)
            items = self._resync(conn, sub.matcher, self._cursor) if gap else rows
            items = [item for item in items if sub.matcher.match(item[1].key)]
            start[0] = since if not gap else self._cursor
        self._schedule(lambda: self._open_sub(sub, items))

    def _resync(self, conn: sqlite3.Connection, matcher: GlobMatcher, seq: int) -> list[_Item]:
        """A `RESYNC` change for every present key `matcher` selects (its current value)."""
        now = datetime.now(UTC)
        low, high = key_range(self._prefix + matcher.literal_prefix)
        sql = "SELECT key, value, version FROM kv WHERE key >= ?"
        params: list[object] = [low]
        if high is not None:
            sql += " AND key < ?"
            params.append(high)
        sql += " AND (expires_at IS NULL OR expires_at > ?)"
        params.append(to_us(now))
        cut = len(self._prefix)
        changes = [
            new_change(key[cut:], ChangeOp.RESYNC, None, value, version, now)
            for key, value, version in conn.execute(sql, params)
            if matcher.match(key[cut:])
        ]
        # Only the last carries the sequence: a cursor taken midway must not skip the rest.
        return [(seq if i == len(changes) - 1 else 0, c) for i, c in enumerate(changes)]
