"""The SQLite backend's change feed: the `changes` table, read by one thread, fanned out in-process.

Every write appends its change (key, old and new bytes, version, time) to the `changes` table in
the same transaction as the value, under a sequence number that grows by one per change (the
writer assigns it: the largest in the table plus one, under the write lock; trimming always keeps
the newest change, so a number is never used twice). A change's cursor is `s1:<db id>:<seq>`,
the database's id being a random string made with the schema (in the `meta` table), so a cursor
of a deleted and recreated file is told apart from one of this file.

Each backend instance with subscriptions runs one notifier thread on its own connection; it wakes
when this process commits (a nudge from the writer) and otherwise polls `PRAGMA data_version`,
which changes only when another connection has committed, so an idle poll reads no table. On a
change it reads the rows after the last sequence it delivered, in one read transaction, and hands
them to the event loop in sequence order, where each matching live subscription receives them.

A subscription with `since=` replays first: it reads the retained changes after its cursor a page
at a time (on the backend's reader thread, as the consumer asks for them, so a long backlog never
overflows its buffer), and when a page comes back empty it joins the live subscriptions from the
last sequence it read: the notifier hands it what was committed after that and before it joined
(to be read before the live ones, outside the bounded buffer), then everything live. No gap, no
duplicate. A cursor whose successors were trimmed raises
`CursorExpiredError` on entry; if retention trims what a subscription still had to read (a
replay or a notifier outrun by more than the retention), the subscription closes as an overflow
(`SubscriptionClosedError(reason="overflow")`): resuming from its last cursor then raises
`CursorExpiredError`. Never a silent gap.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate._log import get_logger
from agenticstate.backends.base import EARLIEST, Change, ChangeOp, new_change
from agenticstate.exceptions import (
    CursorExpiredError,
    InvalidArgumentError,
    SubscriptionClosedError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from agenticstate._glob import GlobMatcher

__all__ = [
    "CURSOR_TAG",
    "Feed",
    "SQLiteChangeStream",
    "Since",
    "format_cursor",
    "from_us",
    "key_range",
    "parse_since",
    "to_us",
]

log = get_logger("agenticstate.backends.sqlite")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_OPS = (ChangeOp.SET, ChangeOp.DELETE)
NEW_VALUE = (
    "CASE WHEN c.new IS NOT NULL OR c.op != 0 THEN c.new ELSE coalesce("
    "(SELECT kv.value FROM kv WHERE kv.key = c.key AND kv.revision = c.seq), "
    "(SELECT n.old FROM changes n WHERE n.key = c.key AND n.seq > c.seq ORDER BY n.seq LIMIT 1)"
    ") END"
)
"""A change's new value (`c` is its `changes` row): inline, or held by reference, then the key's
value while the key is still at the change's revision, else the old value of the key's next
change (which always follows it in the table: trimming drops the oldest first)."""
_LOST = (
    "change {seq} held its new value by reference and the database no longer has it (the file "
    "was changed outside agenticstate); re-read the state and resume from a new cursor"
)
_Item = tuple[int, Change]
REPLAY_PAGE = 2000  # changes a replaying subscription reads per trip to the reader thread

CURSOR_TAG = "s1"
"""The kind tag every SQLite feed cursor starts with: `s1:<db id>:<seq>`."""


def format_cursor(db_id: str, seq: int) -> str:
    """The cursor of change `seq` of the database `db_id`."""
    return f"{CURSOR_TAG}:{db_id}:{seq}"


@dataclass(frozen=True, slots=True)
class Since:
    """Where a replay starts: after sequence `after` (`None`: the oldest retained change).

    A position beyond the feed's head is refused (`InvalidArgumentError`): an `s1:` cursor of
    this database cannot be (it is forged), and a deprecated bare sequence number that is
    names no change of this file (it may be another file's).
    """

    after: int | None
    text: str


def parse_since(since: object, db_id: str) -> Since:
    """Read a `since=` value.

    A cursor `s1:<db id>:<seq>`, `EARLIEST`, or (deprecated) a bare sequence number as an int
    or a string of digits.

    Raises:
        InvalidArgumentError: It is no SQLite feed cursor.
        CursorExpiredError: It is one of another database (a file deleted and made again).
    """
    if since == EARLIEST:
        return Since(None, EARLIEST)
    if type(since) is int:
        if since < 0:
            raise InvalidArgumentError(f"since must be a feed cursor, not {since!r}")
        return Since(since, str(since))
    if isinstance(since, str):
        if since.isdigit() and since.isascii():
            return Since(int(since), since)
        parts = since.split(":")
        if (
            len(parts) == 3
            and parts[0] == CURSOR_TAG
            and parts[1].isalnum()
            and parts[1].isascii()
            and parts[2].isdigit()
            and parts[2].isascii()
        ):
            if parts[1] != db_id:
                raise CursorExpiredError(
                    since, f"cursor {since!r} belongs to another database than this one"
                )
            return Since(int(parts[2]), since)
    raise InvalidArgumentError(
        f"since must be an SQLite feed cursor ('{CURSOR_TAG}:...') or EARLIEST, not {since!r}"
    )


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
    the upper bound is the prefix with its last character moved one code point up. A last
    character that is already the highest (U+10FFFF) cannot move: the bound moves the one
    before it instead, while the low bound stays the whole prefix (a key at or above it that
    starts with the shorter prefix can only continue with U+10FFFF).
    """
    head = prefix
    while head:
        last = ord(head[-1])
        if last < 0x10FFFF:
            bumped = last + 1 if last + 1 != 0xD800 else 0xE000  # skip the surrogates
            return prefix, head[:-1] + chr(bumped)
        head = head[:-1]
    return prefix, None


class _Sub:
    __slots__ = (
        "is_open",
        "matcher",
        "max_buffer",
        "opened",
        "overflowed",
        "receive",
        "send",
        "trimmed",
    )

    def __init__(self, matcher: GlobMatcher, max_buffer: int) -> None:
        self.matcher = matcher
        self.max_buffer = max_buffer
        self.is_open = False
        self.overflowed = False
        self.trimmed = False  # the overflow was retention's, not the buffer's
        self.opened = anyio.Event()
        self.send: MemoryObjectSendStream[_Item]
        self.receive: MemoryObjectReceiveStream[_Item]
        self.send, self.receive = anyio.create_memory_object_stream[_Item](max_buffer)


class _Replay:
    """The changes a `since=` subscription reads from the table before it joins the live ones."""

    __slots__ = ("after", "feed", "items", "joining", "since", "sub")

    def __init__(self, feed: Feed, sub: _Sub, since: Since) -> None:
        self.feed = feed
        self.sub = sub
        self.since = since
        self.after = since.after
        self.items: deque[_Item] = deque()
        self.joining = False  # asked to join the live subscriptions (done once `sub.opened`)

    async def fill(self) -> None:
        """Read the next page; when the table has no more, ask to join the live subscriptions.

        Raises:
            CursorExpiredError: Changes after the position were trimmed.
            InvalidArgumentError: A cursor beyond the head.
        """
        feed = self.feed
        if feed.closed:
            self.joining = True
            feed.enlist(self.sub, self.after, self.items)
            return
        page = functools.partial(feed.page, after=self.after, since=self.since)
        position, rows = await feed.read(page)
        self.since = Since(position, format_cursor(feed.db_id, position))
        self.after = position
        match = self.sub.matcher.match
        self.items.extend(item for item in rows if match(item[1].key))
        if not rows:  # caught up: what came since this read arrives with the joining
            self.joining = True
            feed.enlist(self.sub, position, self.items)

    async def next(self) -> _Item | None:
        """The next replayed change, or `None` once the subscription is live.

        Cancellation-safe: a page read or the joining that is cancelled is taken up again.
        """
        while not self.items:
            if self.joining:
                await self.sub.opened.wait()  # the joining's backlog lands in `items` first
                if self.items:
                    break
                return None
            try:
                await self.fill()
            except CursorExpiredError as exc:
                raise SubscriptionClosedError(
                    "overflow",
                    f"subscription to {self.sub.matcher.pattern!r} was replaying changes that "
                    f"retention has since trimmed: {exc}",
                ) from None
        return self.items.popleft()


class SQLiteChangeStream:
    """An async iterator of `Change`s (each with its `cursor`).

    Attributes:
        cursor: Deprecated: the sequence number (an `int`) of the last change this stream
            yielded (on entry: the last change committed before the subscription, or the
            position it was given). Every `Change` carries its own `cursor` (a `str`); prefer it.
            An int or a string of digits is still accepted as `since=`.
    """

    __slots__ = ("_feed", "_replay", "_sub", "cursor")

    def __init__(self, feed: Feed, sub: _Sub, cursor: int, replay: _Replay | None = None) -> None:
        self._feed = feed
        self._sub = sub
        self._replay = replay
        self.cursor = cursor

    def __aiter__(self) -> SQLiteChangeStream:
        return self

    async def __anext__(self) -> Change:
        replay = self._replay
        if replay is not None:
            item = await replay.next()
            if item is not None:
                self.cursor = item[0]
                return item[1]
            self._replay = None
        try:
            seq, change = await self._sub.receive.receive()
        except anyio.EndOfStream:
            sub = self._sub
            if sub.overflowed:
                behind = (
                    "was outrun by the feed's retention (more changes were committed at once "
                    "than it keeps)"
                    if sub.trimmed
                    else f"fell more than {sub.max_buffer} changes behind"
                )
                raise SubscriptionClosedError(
                    "overflow",
                    f"subscription to {sub.matcher.pattern!r} {behind}; resume with since= the "
                    f"cursor of the last change read "
                    f"({format_cursor(self._feed.db_id, self.cursor)!r}), or re-read the state",
                ) from None
            raise StopAsyncIteration from None
        except anyio.ClosedResourceError:
            raise StopAsyncIteration from None
        self.cursor = seq
        return change


class Feed:
    """Read the `changes` table in one thread and deliver to this process's subscriptions.

    Args:
        open_connection: Makes the notifier's own read connection (called in its thread).
        schedule: Runs a callback on the event loop, thread-safely.
        read: Runs a function of a read connection on the backend's reader thread (awaitable).
        db_id: The database's id (the middle of its cursors).
        key_prefix: The backend's namespace: other keys are skipped, and it is stripped.
        poll_interval: Seconds between `PRAGMA data_version` checks while subscribed.
    """

    def __init__(
        self,
        open_connection: Callable[[], sqlite3.Connection],
        schedule: Callable[[Callable[[], object]], object],
        read: Callable[[Callable[[sqlite3.Connection], Any]], Awaitable[Any]],
        db_id: str,
        key_prefix: str,
        poll_interval: float,
    ) -> None:
        self._open_connection = open_connection
        self._schedule = schedule
        self.read = read
        self.db_id = db_id
        self._prefix = key_prefix
        self._low, self._high = key_range(key_prefix)
        self._poll = poll_interval
        self._subs: list[_Sub] = []
        self._requests: deque[tuple[_Sub, int | None, list[int], deque[_Item] | None]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self.closed = False
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
        self, matcher: GlobMatcher, max_buffer: int, since: Since | None
    ) -> AsyncIterator[SQLiteChangeStream]:
        """Open a subscription (see the module docstring).

        Raises (on entry):
            CursorExpiredError: Changes after `since` were trimmed.
            InvalidArgumentError: A bad `max_buffer`, or a strict cursor beyond the head.
        """
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        sub = _Sub(matcher, max_buffer)
        replay: _Replay | None = None
        start = [0]
        try:
            if since is None:
                start = self.enlist(sub, None)
                await sub.opened.wait()
            else:
                replay = _Replay(self, sub, since)
                await replay.fill()  # checks the cursor now, on entry
                if replay.joining:  # nothing to replay: live on entry, as without since=
                    await sub.opened.wait()
                start = [since.after or 0]
            yield SQLiteChangeStream(self, sub, start[0], replay)
        finally:
            self._drop(sub)
            sub.receive.close()

    def enlist(
        self, sub: _Sub, since: int | None, backlog: deque[_Item] | None = None
    ) -> list[int]:
        """Ask for `sub` to join the live subscriptions after sequence `since` (`None`: the head).

        `sub.opened` is set once it has joined.

        The changes committed after `since` and before it joined go to `backlog` (unbounded:
        a replay's, whose reader takes them first) or else to its stream. Returns a one-item
        list: the sequence it joined after (set when it has).
        """
        start = [since or 0]
        if self.closed:
            sub.send.close()
            sub.opened.set()
            return start
        self._subs = [*self._subs, sub]
        self._start_thread()
        self._requests.append((sub, since, start, backlog))
        self._wake.set()
        return start

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name="agenticstate-sqlite-notify", daemon=True
            )
            self._thread.start()

    def _drop(self, sub: _Sub) -> None:
        sub.send.close()
        self._subs = [s for s in self._subs if s is not sub]

    def _overflow(self, sub: _Sub) -> None:
        sub.overflowed = True
        self._drop(sub)
        sub.opened.set()

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
            log.warning("subscriber_overflow", pattern=sub.matcher.pattern, buffer=sub.max_buffer)
            self._overflow(sub)
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._drop(sub)
            return False
        return True

    def _open_sub(self, sub: _Sub, items: list[_Item], backlog: deque[_Item] | None) -> None:
        if backlog is not None:
            backlog.extend(items)
        else:
            for item in items:
                if not self._send(sub, item):
                    break
        sub.is_open = True
        sub.opened.set()

    def _trimmed(self, subs: list[_Sub]) -> None:
        for sub in subs:
            if sub in self._subs:
                sub.trimmed = True
                self._overflow(sub)

    def close(self) -> None:
        """End every subscription (on the loop) and stop the thread (call `join` after)."""
        self.closed = True
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

    # ---------------------------------------------------------------- reading the table

    def page(
        self, conn: sqlite3.Connection, *, after: int | None, since: Since
    ) -> tuple[int, list[_Item]]:
        """Read up to `REPLAY_PAGE` changes after `after` (`None`: the oldest retained).

        One read transaction (a reader thread's job); returns the position read up to and the
        changes.

        Raises:
            CursorExpiredError: Changes after `after` were trimmed.
            InvalidArgumentError: `after` is beyond the head.
        """
        conn.execute("BEGIN")
        try:
            oldest, last = conn.execute("SELECT min(seq), max(seq) FROM changes").fetchone()
            last = last or 0
            if after is None:
                after = 0
            elif after > last:
                raise InvalidArgumentError(
                    f"cursor {since.text!r} is beyond this database's newest change "
                    "(forged, or another file's)"
                )
            elif after < last and (oldest is None or oldest > after + 1):
                raise CursorExpiredError(since.text)
            rows = self._rows(conn, after, last, REPLAY_PAGE)
        finally:
            conn.execute("COMMIT")
        return (rows[-1][0] if len(rows) == REPLAY_PAGE else last), rows

    def _rows(
        self, conn: sqlite3.Connection, after: int, upto: int | None, limit: int = -1
    ) -> list[_Item]:
        sql = (
            f"SELECT c.seq, c.key, c.op, c.old, {NEW_VALUE}, c.version, c.ts "  # noqa: S608  # constants
            "FROM changes c WHERE c.seq > ?"
        )
        params: list[object] = [after]
        if upto is not None:
            sql += " AND c.seq <= ?"
            params.append(upto)
        if self._prefix:
            sql += " AND c.key >= ?" + (" AND c.key < ?" if self._high is not None else "")
            params += [self._low] + ([self._high] if self._high is not None else [])
        params.append(limit)
        cut, tag = len(self._prefix), f"{CURSOR_TAG}:{self.db_id}:"
        items = []
        for seq, key, op, old, new, version, ts in conn.execute(
            sql + " ORDER BY c.seq LIMIT ?", params
        ):
            if new is None and op == 0:
                # Held by reference, and neither the key nor a later change has it: the file
                # was changed behind the library's back. Never delivered wrong: a gap.
                raise CursorExpiredError(f"{tag}{seq}", _LOST.format(seq=seq))
            change = new_change(
                key[cut:], _OPS[op], old, new, version, from_us(ts), f"{tag}{seq}", seq
            )
            items.append((seq, change))
        return items

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

    def _snapshot(
        self, conn: sqlite3.Connection, after: int, upto: int | None
    ) -> tuple[bool, int, list[_Item]]:
        """Read the changes after `after` in one read transaction: (gap?, last seq, rows)."""
        conn.execute("BEGIN")
        try:
            last = self._max_seq(conn) if upto is None else upto
            (oldest,) = conn.execute("SELECT min(seq) FROM changes").fetchone()
            gap = after < last and (oldest is None or oldest > after + 1)
            rows: list[_Item] = []
            if not gap:
                try:
                    rows = self._rows(conn, after, upto)
                except CursorExpiredError:
                    gap = True  # a value no longer held: the subscriptions resume, and see it

        finally:
            conn.execute("COMMIT")
        return gap, max(last, after), rows

    def _catch_up(self, conn: sqlite3.Connection) -> None:
        gap, last, rows = self._snapshot(conn, self._cursor, None)
        self._cursor = last
        if gap:
            # More changes than retention keeps were committed between two reads: every live
            # subscription missed some. Each closes as an overflow (it resumes from its cursor).
            log.warning("sqlite_changes_trimmed", cursor=self._cursor)
            subs = [sub for sub in self._subs if sub.is_open]
            self._schedule(lambda: self._trimmed(subs))
        elif rows:
            self._schedule(lambda: self._publish(rows))

    def _register(
        self,
        conn: sqlite3.Connection,
        sub: _Sub,
        since: int | None,
        start: list[int],
        backlog: deque[_Item] | None,
    ) -> None:
        items: list[_Item] = []
        if since is None:
            start[0] = self._cursor
        elif since < self._cursor:
            gap, _, rows = self._snapshot(conn, since, self._cursor)
            if gap:
                self._schedule(lambda: self._trimmed([sub]))
                return
            items = [item for item in rows if sub.matcher.match(item[1].key)]
        self._schedule(lambda: self._open_sub(sub, items, backlog))
