"""The change feed contract: cursors, replay then live, retention (`changes(since=)`).

A backend whose feed is off (`backend.feed is None`, as `Backend`'s default) skips these tests:
it yields changes without cursors and refuses `since=`. One that keeps a feed must pass all of
them.

The retention tests need a second backend of the same kind built with a small `FeedRetention`.
They ask for a `feed_backend` fixture: a callable that takes a `FeedRetention` (or `None`, feed
off) and returns an async context manager yielding a fresh, empty, open backend with it. A suite
without that fixture skips those tests only:

```python
class TestDictBackend(BackendContract):
    @pytest.fixture
    def feed_backend(self):
        return lambda retention: DictBackend(feed=retention)  # a backend is a context manager
```

Every key shares the hash tag `{f}` (the history tests: `{h}`), so on Redis Cluster they live
in one slot, whose feed is one ordered stream.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import (
    ChangeOp,
    ConfigurationError,
    CursorExpiredError,
    InvalidArgumentError,
    SubscriptionClosedError,
    UnsupportedOperationError,
)
from agenticstate.backends import EARLIEST, Delete, FeedRetention, Put

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from contextlib import AbstractAsyncContextManager

    from agenticstate.backends import Backend, Change

    FeedBackendMaker = Callable[[FeedRetention | None], AbstractAsyncContextManager[Backend]]

A, B, C = "{f}:a", "{f}:b", "{f}:c"
ALL = "{f}:*"
SHORT = timedelta(milliseconds=150)


def _needs_feed(backend: Backend) -> None:
    if backend.feed is None:
        pytest.skip(f"{type(backend).__name__} keeps no change feed (feed is None)")


def _maker(request: pytest.FixtureRequest) -> FeedBackendMaker:
    try:
        maker: FeedBackendMaker = request.getfixturevalue("feed_backend")
    except pytest.FixtureLookupError:
        pytest.skip("no feed_backend fixture: it builds a backend with a given FeedRetention")
    return maker


async def _take(changes: AsyncIterator[Change], count: int) -> list[Change]:
    out: list[Change] = []
    if count == 0:
        return out
    with anyio.fail_after(10):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


def _facts(changes: list[Change]) -> list[tuple[Any, ...]]:
    return [(c.key, c.op, c.old, c.new, c.version) for c in changes]


def _same(changes: list[Change]) -> list[tuple[Any, ...]]:
    return [(c.key, c.op, c.old, c.new, c.version, c.cursor) for c in changes]


class FeedContract:
    """The change feed contract: every change has a cursor; `since=` replays, then follows live.

    Its tests take a `backend` fixture (a fresh, empty, open backend); the retention tests also
    a `feed_backend` fixture (see the module docstring).
    """

    async def test_feed_every_change_carries_a_cursor(self, backend: Backend) -> None:
        """Live changes carry distinct str cursors: set, set_many, update, delete, transact."""
        _needs_feed(backend)
        async with backend.changes(ALL) as changes:
            await backend.set(A, b"1")
            await backend.set_many([(B, b"1"), (C, b"1")])
            await backend.update(A, lambda entry: b"2")
            await backend.delete(B)
            try:
                await backend.transact([], [Put(C, b"2"), Delete(A)])
                count = 7
            except UnsupportedOperationError:
                count = 5
            got = await _take(changes, count)
        cursors = [c.cursor for c in got]
        assert all(isinstance(cursor, str) and cursor for cursor in cursors), cursors
        assert len(set(cursors)) == len(cursors)

    async def test_feed_since_replays_the_later_matching_changes_then_live(
        self, backend: Backend
    ) -> None:
        """since=cursor yields the retained matching changes after it, in order, then live ones,
        with nothing missed or repeated across the switch (writes land while it replays)."""
        _needs_feed(backend)
        await backend.set(A, b"before")
        head = await backend.feed_cursor()
        assert isinstance(head, str)
        await backend.set(A, b"1")
        await backend.set("{g}:other", b"not matched")
        await backend.set(B, b"1")
        await backend.delete(A)
        async with backend.changes(ALL, since=head) as changes:
            first = await _take(changes, 1)
            await backend.set(C, b"live")  # written while the replay is still being read
            await backend.set(A, b"again")
            rest = await _take(changes, 4)
        assert _facts(first + rest) == [
            (A, ChangeOp.SET, b"before", b"1", 2),
            (B, ChangeOp.SET, None, b"1", 1),
            (A, ChangeOp.DELETE, b"1", None, 2),
            (C, ChangeOp.SET, None, b"live", 1),
            (A, ChangeOp.SET, None, b"again", 1),
        ]
        assert all(c.cursor for c in first + rest)

    async def test_feed_switch_to_live_under_concurrent_writes(self, backend: Backend) -> None:
        """A writer task runs while a subscriber enters with since=: every write arrives once."""
        _needs_feed(backend)
        total = 200
        await backend.set(A, b"0")
        head = await backend.feed_cursor()
        half = anyio.Event()

        async def writer() -> None:
            for n in range(1, total + 1):
                await backend.set(A, b"%d" % n)
                if n == total // 2:
                    half.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await half.wait()
            async with backend.changes(ALL, since=head, max_buffer=10 * total) as changes:
                got = await _take(changes, total)
        assert [c.version for c in got] == list(range(2, total + 2))
        assert [c.new for c in got] == [b"%d" % n for n in range(1, total + 1)]

    async def test_feed_earliest_replays_everything_retained(self, backend: Backend) -> None:
        """since=EARLIEST replays every retained change (here: all of them), then live."""
        _needs_feed(backend)
        await backend.set(A, b"1")
        await backend.set(B, b"1")
        await backend.set(A, b"2")
        async with backend.changes(ALL, since=EARLIEST) as changes:
            replayed = await _take(changes, 3)
            await backend.set(C, b"1")
            live = await _take(changes, 1)
        assert _facts(replayed + live) == [
            (A, ChangeOp.SET, None, b"1", 1),
            (B, ChangeOp.SET, None, b"1", 1),
            (A, ChangeOp.SET, b"1", b"2", 2),
            (C, ChangeOp.SET, None, b"1", 1),
        ]

    async def test_feed_cursor_is_the_head(self, backend: Backend) -> None:
        """feed_cursor() is a cursor on a fresh store too; since=it replays nothing before."""
        _needs_feed(backend)
        fresh = await backend.feed_cursor()
        assert isinstance(fresh, str)
        assert fresh
        async with backend.changes(ALL, since=fresh) as changes:
            await backend.set(A, b"1")
            assert _facts(await _take(changes, 1)) == [(A, ChangeOp.SET, None, b"1", 1)]
        head = await backend.feed_cursor()
        assert isinstance(head, str)
        async with backend.changes(ALL, since=head) as changes:
            await backend.set(B, b"1")
            assert _facts(await _take(changes, 1)) == [(B, ChangeOp.SET, None, b"1", 1)]

    async def test_feed_resume_from_every_cursor(self, backend: Backend) -> None:
        """Resuming from any yielded change's cursor yields exactly the later matching changes."""
        _needs_feed(backend)
        start = await backend.feed_cursor()
        for n in range(4):
            await backend.set(A, b"a%d" % n)
            await backend.set(B, b"b%d" % n)
        await backend.delete(A)
        async with backend.changes(ALL, since=start) as changes:
            seen = await _take(changes, 9)
        count = len(seen)
        for i in range(count):
            async with backend.changes(ALL, since=seen[i].cursor) as changes:
                replayed = await _take(changes, len(seen) - i - 1)
                # A write after the replay is the very next change: nothing extra was replayed.
                await backend.set(C, b"mark %d" % i)
                (mark,) = await _take(changes, 1)
            assert _same(replayed) == _same(seen[i + 1 :])
            assert (mark.key, mark.new) == (C, b"mark %d" % i)
            seen.append(mark)

    async def test_feed_overflow_then_resume_loses_nothing(self, backend: Backend) -> None:
        """An overflowed subscriber resumes from the cursor of the last change it read."""
        _needs_feed(backend)
        async with backend.changes(ALL, max_buffer=3) as changes:
            for n in range(12):
                await backend.set(A, b"%d" % n)
            read: list[Change] = []

            async def drain() -> None:
                async for change in changes:
                    read.append(change)

            with anyio.fail_after(10), pytest.raises(SubscriptionClosedError) as caught:
                await drain()
        assert caught.value.reason == "overflow"
        assert read
        assert [c.version for c in read] == list(range(1, len(read) + 1))
        async with backend.changes(ALL, since=read[-1].cursor) as changes:
            rest = await _take(changes, 12 - len(read))
        assert [c.version for c in read + rest] == list(range(1, 13))

    async def test_feed_holds_every_write_as_committed(self, backend: Backend) -> None:
        """The feed holds set, set_many, update, delete and transact writes with old and new
        bytes; an expiry adds nothing."""
        _needs_feed(backend)
        head = await backend.feed_cursor()
        await backend.set(A, b"a1")
        await backend.set_many([(A, b"a2"), (B, b"b1")])
        await backend.update(B, lambda entry: b"b2")
        await backend.delete(A)
        await backend.set(C, b"short", ttl=SHORT)
        expected = [
            (A, ChangeOp.SET, None, b"a1", 1),
            (A, ChangeOp.SET, b"a1", b"a2", 2),
            (B, ChangeOp.SET, None, b"b1", 1),
            (B, ChangeOp.SET, b"b1", b"b2", 2),
            (A, ChangeOp.DELETE, b"a2", None, 2),
            (C, ChangeOp.SET, None, b"short", 1),
        ]
        try:
            await backend.transact([], [Put(A, b"t"), Delete(B)])
            expected += [(A, ChangeOp.SET, None, b"t", 1), (B, ChangeOp.DELETE, b"b2", None, 2)]
        except UnsupportedOperationError:
            pass
        await anyio.sleep(SHORT.total_seconds() + 0.1)  # expiry is wall-clock time: let it pass
        assert await backend.get(C) is None
        await backend.set(C, b"again")
        expected.append((C, ChangeOp.SET, None, b"again", 1))
        async with backend.changes(ALL, since=head) as changes:
            got = await _take(changes, len(expected))
            await backend.set("{f}:end", b"")
            (end,) = await _take(changes, 1)
        assert _facts(got) == expected
        assert end.key == "{f}:end"

    @pytest.mark.parametrize("bad", ["", "not a cursor", "zz9:1:2", "::", 42, b"m1:x:1"], ids=repr)
    async def test_feed_malformed_cursor_is_an_invalid_argument(
        self, backend: Backend, bad: Any
    ) -> None:
        """A cursor that is not one of this kind of backend raises InvalidArgumentError."""
        _needs_feed(backend)
        with pytest.raises(InvalidArgumentError):
            async with backend.changes(ALL, since=bad):
                pass

    async def test_feed_cursor_of_another_kind_is_an_invalid_argument(
        self, backend: Backend
    ) -> None:
        """A valid cursor with its kind tag changed is another kind's: InvalidArgumentError."""
        _needs_feed(backend)
        await backend.set(A, b"1")
        head = await backend.feed_cursor()
        assert head is not None
        tag = head.split(":", 1)[0]
        other = ("q9" if tag != "q9" else "q8") + head[len(tag) :]
        with pytest.raises(InvalidArgumentError):
            async with backend.changes(ALL, since=other):
                pass

    async def test_feed_trimmed_cursor_raises_cursor_expired(
        self, backend: Backend, request: pytest.FixtureRequest
    ) -> None:
        """With max_changes=5, a cursor from 50 writes ago raises CursorExpiredError on entry;
        EARLIEST replays the newest retained (at least 5) and a recent cursor still resumes."""
        _needs_feed(backend)
        async with _maker(request)(FeedRetention(max_changes=5)) as small:
            old = await small.feed_cursor()
            assert old is not None
            for n in range(50):
                await small.set(A, b"%d" % n)
            with pytest.raises(CursorExpiredError) as caught:
                async with small.changes(ALL, since=old):
                    pass
            assert caught.value.cursor == old
            async with small.changes(ALL, since=EARLIEST) as changes:
                await small.set(B, b"mark")
                kept: list[Change] = []
                with anyio.fail_after(10):
                    async for change in changes:
                        if change.key == B:
                            break
                        kept.append(change)
            assert 5 <= len(kept) <= 50
            assert [c.version for c in kept] == list(range(51 - len(kept), 51))
            async with small.changes(ALL, since=kept[-3].cursor) as changes:
                resumed = await _take(changes, 3)
            assert [(c.key, c.version) for c in resumed] == [(A, 49), (A, 50), (B, 1)]

    async def test_feed_old_changes_age_out(
        self, backend: Backend, request: pytest.FixtureRequest
    ) -> None:
        """With max_age, changes older than it are dropped as writes happen."""
        _needs_feed(backend)
        async with _maker(request)(FeedRetention(max_age=SHORT)) as aging:
            old = await aging.feed_cursor()
            assert old is not None
            await aging.set(A, b"old")
            await anyio.sleep(SHORT.total_seconds() * 2)  # the feed's age is wall-clock time
            await aging.set(B, b"new")
            with pytest.raises(CursorExpiredError):
                async with aging.changes(ALL, since=old):
                    pass
            async with aging.changes(ALL, since=EARLIEST) as changes:
                (first,) = await _take(changes, 1)
            assert (first.key, first.new) == (B, b"new")

    async def test_feed_off_refuses_since(
        self, backend: Backend, request: pytest.FixtureRequest
    ) -> None:
        """feed=None: no cursors, feed_cursor() is None, since= raises UnsupportedOperationError."""
        _needs_feed(backend)
        try:
            off_backend = _maker(request)(None)
            async with off_backend as off:
                assert off.feed is None
                assert await off.feed_cursor() is None
                async with off.changes(ALL) as changes:
                    await off.set(A, b"1")
                    (change,) = await _take(changes, 1)
                assert change.cursor is None
                with pytest.raises(UnsupportedOperationError):
                    async with off.changes(ALL, since=EARLIEST):
                        pass
        except ConfigurationError:
            pytest.skip(f"{type(backend).__name__} cannot turn its feed off")
