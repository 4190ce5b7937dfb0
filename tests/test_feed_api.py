"""StateManager over the change feed: cursors, `changes(since=)`, `on_gap`, resuming pumps.

Every test runs on each backend (`state` and `feed_backend` from conftest); a backend that keeps
no feed yet (`backend.feed is None`) skips them, as `agenticstate.testing`'s feed suite does.
Keys share the hash tag `{f}`, so on Redis Cluster they live in one slot (one ordered stream).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import (
    EARLIEST,
    ChangeOp,
    ConfigurationError,
    CursorExpiredError,
    FeedRetention,
    InvalidArgumentError,
    MemoryBackend,
    StateConfig,
    StateManager,
    SubscriptionClosedError,
    UnsupportedOperationError,
    sync,
)
from agenticstate.backends import Change, Entry
from agenticstate.events import Resync

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from agenticstate import StateChange
    from agenticstate.backends import Backend
    from agenticstate.manager import Watch
    from agenticstate.scope import ScopedWatch

    FeedBackendMaker = Callable[[FeedRetention | None], AbstractAsyncContextManager[Backend]]

A, B, C, Z = "{f}:a", "{f}:b", "{f}:c", "{f}:z"
ALL = "{f}:*"


@pytest.fixture
def fed(state: StateManager) -> StateManager:
    """`state`, skipped where its backend keeps no change feed."""
    if state.backend.feed is None:
        pytest.skip(f"{type(state.backend).__name__} keeps no change feed")
    return state


@pytest.fixture
def small_feed(
    fed: StateManager, feed_backend: FeedBackendMaker
) -> Callable[[], AbstractAsyncContextManager[StateManager]]:
    """A manager over a fresh backend of the test's kind keeping only the last 5 changes."""

    @asynccontextmanager
    async def make() -> AsyncIterator[StateManager]:
        async with (
            feed_backend(FeedRetention(max_changes=5)) as backend,
            StateManager(backend=backend, close_backend=False) as manager,
        ):
            yield manager

    return make


async def take(changes: Watch | ScopedWatch, count: int) -> list[StateChange]:
    out: list[StateChange] = []
    with anyio.fail_after(10):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


async def drain(changes: Watch, into: list[Any]) -> None:
    async for change in changes:
        into.append(change.new_value)


def facts(changes: list[StateChange]) -> list[tuple[Any, ...]]:
    return [(c.key, c.op, c.old_value, c.new_value, c.version) for c in changes]


async def expired_cursor(state: StateManager) -> str:
    """A cursor of `state`'s feed whose later changes have been trimmed (max_changes=5)."""
    old = await state.feed_cursor()
    assert old is not None
    for n in range(60):
        await state.save(C, n)
    return old


# ------------------------------------------------------------------ cursors and replay


async def test_every_change_carries_a_cursor(fed: StateManager) -> None:
    """Live changes carry cursors (str), and feed_cursor() gives the head as a str."""
    assert isinstance(await fed.feed_cursor(), str)
    async with fed.watch(ALL) as changes:
        await fed.save(A, 1)
        await fed.delete(A)
        got = await take(changes, 2)
    assert [c.op for c in got] == [ChangeOp.SET, ChangeOp.DELETE]
    assert all(isinstance(c.cursor, str) for c in got)
    assert got[0].cursor != got[1].cursor
    assert changes.cursor == got[1].cursor


async def test_changes_since_replays_then_follows_live(fed: StateManager) -> None:
    """changes(since=cursor) yields the matching changes after it, then live ones, each once."""
    await fed.save(A, "before")
    cursor = await fed.feed_cursor()
    await fed.save(A, "missed 1")
    await fed.save("other", "not matched")
    await fed.save(B, "missed 2")
    async with fed.changes(ALL, since=cursor) as changes:
        replayed = await take(changes, 2)
        await fed.save(A, "live")
        live = await take(changes, 1)
    assert facts(replayed + live) == [
        (A, ChangeOp.SET, "before", "missed 1", 2),
        (B, ChangeOp.SET, None, "missed 2", 1),
        (A, ChangeOp.SET, "missed 1", "live", 3),
    ]


async def test_resuming_from_any_cursor_yields_exactly_the_later_changes(
    fed: StateManager,
) -> None:
    """From each change's cursor, changes(since=) yields exactly the changes after it."""
    start = await fed.feed_cursor()
    for n in range(4):
        await fed.save(A if n % 2 else B, n)
    async with fed.changes(ALL, since=start) as changes:
        everything = await take(changes, 4)
    for index, change in enumerate(everything):
        assert change.cursor is not None
        async with fed.changes(ALL, since=change.cursor) as changes:
            await fed.save("{f}:end", index)
            rest = await take(changes, len(everything) - index)
        assert facts(rest[:-1]) == facts(everything[index + 1 :])
        assert rest[-1].key == "{f}:end"


async def test_since_earliest_replays_everything_retained(fed: StateManager) -> None:
    """since=EARLIEST replays every retained change (the whole feed of a fresh store)."""
    await fed.save(A, 1)
    await fed.save(B, 2)
    async with fed.changes(ALL, since=EARLIEST) as changes:
        got = await take(changes, 2)
    assert [(c.key, c.new_value) for c in got] == [(A, 1), (B, 2)]


async def test_a_watch_resumes_after_overflow_from_its_cursor(fed: StateManager) -> None:
    """A watch that overflowed resumes with since=watch.cursor and loses nothing."""
    seen: list[int] = []
    async with fed.watch(ALL, max_buffer=2) as changes:
        for n in range(10):
            await fed.save(A, n)
        with pytest.raises(SubscriptionClosedError), anyio.fail_after(10):
            await drain(changes, seen)
        cursor = changes.cursor
    async with fed.changes(ALL, since=cursor) as changes:
        seen += [c.new_value for c in await take(changes, 10 - len(seen))]
    assert seen == list(range(10))


async def test_subscribe_since_replays_to_the_callback(fed: StateManager) -> None:
    """subscribe(since=cursor) calls the callback for the retained changes, then live ones."""
    cursor = await fed.feed_cursor()
    await fed.save(A, "missed")
    calls: list[tuple[str, Any, Any]] = []
    done = anyio.Event()

    def on_change(key: str, old: Any, new: Any) -> None:
        calls.append((key, old, new))
        if new == "live":
            done.set()

    await fed.subscribe(ALL, on_change, since=cursor)
    await fed.save(A, "live")
    with anyio.fail_after(10):
        await done.wait()
    assert calls == [(A, None, "missed"), (A, "missed", "live")]


async def test_callback_overflow_resumes_from_the_last_cursor(fed: StateManager) -> None:
    """A callback that overflows with the feed on receives every change: the pump resumes
    from its last cursor, counts the overflow, and needs no on_overflow."""
    overflowed: list[str] = []
    seen: list[int] = []
    done = anyio.Event()
    release = anyio.Event()

    async def slow(key: str, old: Any, new: Any) -> None:
        await release.wait()
        seen.append(new)
        if new == 49:
            done.set()

    manager = StateManager(
        StateConfig(subscriber_buffer=2), backend=fed.backend, close_backend=False
    )
    async with manager:
        await manager.subscribe(ALL, slow, on_overflow=overflowed.append)
        for n in range(50):
            await manager.save(A, n)
        release.set()
        with anyio.fail_after(20):
            await done.wait()
        assert seen == list(range(50))
        assert manager.stats().overflows >= 1
        assert overflowed == []


# ------------------------------------------------------------------ expired cursors


async def test_expired_cursor_raises_on_entry(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]],
) -> None:
    """With on_gap="raise" (the default), an expired cursor raises CursorExpiredError on entry."""
    async with small_feed() as state:
        old = await expired_cursor(state)
        with pytest.raises(CursorExpiredError) as caught:
            async with state.changes(ALL, since=old):
                pass
        assert caught.value.cursor == old


async def test_expired_cursor_with_resync_yields_current_values_then_live(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]],
) -> None:
    """on_gap="resync": one RESYNC change per present matching key, then only newer changes."""
    async with small_feed() as state:
        await state.save(A, "a")
        await state.save(B, "b")
        await state.save("elsewhere", 1)
        old = await expired_cursor(state)
        await state.delete(B)
        async with state.changes(ALL, since=old, on_gap="resync") as changes:
            resynced = await take(changes, 2)
            await state.save(A, "after")
            (live,) = await take(changes, 1)
    assert [(c.key, c.op, c.old_value, c.new_value, c.cursor) for c in resynced] == [
        (A, ChangeOp.RESYNC, None, "a", None),
        (C, ChangeOp.RESYNC, None, 59, None),
    ]
    assert (live.key, live.old_value, live.new_value, live.version) == (A, "a", "after", 2)
    assert live.cursor is not None


async def test_expired_cursor_with_resync_and_no_matching_key_yields_only_live_changes(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]],
) -> None:
    """on_gap="resync" with no key of the pattern present: no RESYNC, the live changes only."""
    async with small_feed() as state:
        await state.save(B, "b")
        old = await expired_cursor(state)
        await state.delete(B)
        await state.delete(C)
        async with state.changes(ALL, since=old, on_gap="resync") as changes:
            await state.save(A, "live")
            (live,) = await take(changes, 1)
    assert (live.key, live.op, live.old_value, live.new_value) == (A, ChangeOp.SET, None, "live")
    assert live.cursor is not None


async def test_subscribe_with_an_expired_cursor(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]],
) -> None:
    """subscribe(since=expired): "raise" ends it (awaiting raises CursorExpiredError);
    "resync" calls back (key, None, value) for each present key, then live changes."""
    async with small_feed() as state:
        old = await expired_cursor(state)
        calls: list[tuple[str, Any, Any]] = []
        with pytest.raises(CursorExpiredError):
            await state.subscribe(ALL, lambda *call: calls.append(call), since=old)
        assert state.stats().subscriptions == 0
        done = anyio.Event()

        def on_change(key: str, old: Any, new: Any) -> None:
            calls.append((key, old, new))
            if new == "live":
                done.set()

        await state.subscribe(ALL, on_change, since=old, on_gap="resync")
        await state.save(A, "live")
        with anyio.fail_after(10):
            await done.wait()
        assert calls == [(C, None, 59), (A, None, "live")]


async def test_a_scope_subscribe_with_an_expired_cursor_behaves_as_the_managers(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]],
) -> None:
    """A scope's subscribe(since=expired) returns the manager's awaitable handle: awaiting it
    raises CursorExpiredError, and the callback can then be subscribed again from a fresh
    cursor (delivered), and unsubscribed (True once, then False)."""
    async with small_feed() as state:
        scope = state.scope("{f}:")
        old = await expired_cursor(state)
        calls: list[tuple[str, Any, Any]] = []
        done = anyio.Event()

        def on_change(key: str, before: Any, after: Any) -> None:
            calls.append((key, before, after))
            done.set()

        with pytest.raises(CursorExpiredError):
            await scope.subscribe("*", on_change, since=old)
        assert not scope.unsubscribe("*", on_change)  # the expired one is gone
        fresh = await state.feed_cursor()
        handle = scope.subscribe("*", on_change, since=fresh)
        assert await handle is handle
        assert handle.is_live
        assert scope.subscribe("*", on_change) is handle  # the same callback again: one handle
        await state.save(A, "after")
        with anyio.fail_after(10):
            await done.wait()
        assert calls == [("a", None, "after")]
        assert scope.unsubscribe("*", on_change)
        assert not scope.unsubscribe("*", on_change)
        assert state.stats().subscriptions == 0


def test_a_blocking_subscribe_with_an_expired_cursor_raises_on_wait_live() -> None:
    """The sync API's subscribe (on a manager and on a scope) returns a blocking Subscription:
    wait_live() raises CursorExpiredError for an expired cursor; a fresh one goes live."""
    backend = MemoryBackend(feed=FeedRetention(max_changes=5))
    with sync.StateManager(backend=backend) as state:
        old = state.feed_cursor()
        for n in range(60):
            state.save(C, n)
        calls: list[Any] = []

        def on_change(key: str, before: Any, after: Any) -> None:
            calls.append((key, before, after))

        for target in (state, state.scope("{f}:")):
            handle = target.subscribe("*", on_change, since=old)
            assert isinstance(handle, sync.Subscription)
            with pytest.raises(CursorExpiredError):
                handle.wait_live()
            again = target.subscribe("*", on_change, since=state.feed_cursor())
            again.wait_live()
            assert again.is_live
            assert target.unsubscribe("*", on_change)
            assert not target.unsubscribe("*", on_change)


@pytest.mark.parametrize("on_gap", ["raise", "resync"])
async def test_a_callback_behind_the_feeds_retention(
    small_feed: Callable[[], AbstractAsyncContextManager[StateManager]], on_gap: Any
) -> None:
    """A callback that falls behind the feed's retention: "raise" resumes live and calls
    on_overflow (changes were missed); "resync" calls back each key's current value."""
    async with small_feed() as small:
        config = StateConfig(subscriber_buffer=2)
        async with StateManager(config, backend=small.backend, close_backend=False) as state:
            overflowed = anyio.Event()
            calls: list[tuple[str, Any, Any]] = []
            release = anyio.Event()
            done = anyio.Event()

            async def slow(key: str, old: Any, new: Any) -> None:
                await release.wait()
                calls.append((key, old, new))
                if new == "end":
                    done.set()

            since = await state.feed_cursor()
            await state.subscribe(
                ALL, slow, since=since, on_gap=on_gap, on_overflow=lambda _: overflowed.set()
            )
            for n in range(60):
                await state.save(C, n)
            release.set()
            with anyio.fail_after(10):
                if on_gap == "raise":  # live again, and told: later writes are delivered
                    await overflowed.wait()
                await state.save(Z, "end")
                await done.wait()
            assert state.stats().overflows >= 1
            if on_gap == "raise":
                assert calls[-1] == (Z, None, "end")
            else:  # the resync has the keys' values then (old None), the live changes the rest
                assert not overflowed.is_set()
                assert any(key == C and old is None for key, old, _ in calls)
                assert [new for key, _, new in calls if key == C][-1] == 59
                assert calls[-1][0::2] == (Z, "end")


# ------------------------------------------------------------------ bad input, feed off


@pytest.mark.parametrize("since", [42, "", b"cursor"], ids=repr)
def test_since_must_be_a_cursor(since: Any) -> None:
    """since= that is not a non-empty str raises InvalidArgumentError, before anything runs."""
    state = StateManager()
    with pytest.raises(InvalidArgumentError):
        state.changes(ALL, since=since)
    with pytest.raises(InvalidArgumentError):
        state.subscribe(ALL, print, since=since)


@pytest.mark.parametrize("on_gap", ["ignore", None, 1], ids=repr)
def test_on_gap_is_raise_or_resync(on_gap: Any) -> None:
    """on_gap= other than "raise" or "resync" raises InvalidArgumentError."""
    state = StateManager()
    with pytest.raises(InvalidArgumentError):
        state.watch(ALL, since=EARLIEST, on_gap=on_gap)
    with pytest.raises(InvalidArgumentError):
        state.subscribe(ALL, print, on_gap=on_gap)


async def test_a_malformed_cursor_raises_on_entry(fed: StateManager) -> None:
    """A str that is no cursor of this backend raises InvalidArgumentError on entry."""
    with pytest.raises(InvalidArgumentError):
        async with fed.changes(ALL, since="not a cursor"):
            pass


async def test_feed_off_has_no_cursors_and_refuses_since(
    fed: StateManager, feed_backend: FeedBackendMaker
) -> None:
    """Over a backend with its feed off, changes carry no cursor and since= is refused."""
    try:
        off = feed_backend(None)
        async with off as backend, StateManager(backend=backend, close_backend=False) as state:
            assert await state.feed_cursor() is None
            async with state.watch(ALL) as changes:
                await state.save(A, 1)
                (change,) = await take(changes, 1)
            assert change.cursor is None
            with pytest.raises(UnsupportedOperationError):
                async with state.changes(ALL, since=EARLIEST):
                    pass
    except ConfigurationError:
        pytest.skip(f"{type(fed.backend).__name__} cannot turn its feed off")


@pytest.mark.parametrize("name", ["memory", "file", "sqlite", "redis"])
def test_config_feed_reaches_the_backend(name: str, tmp_path: Path) -> None:
    """StateConfig(feed=...) is the retention of the backend the config builds (built, not
    opened: no server is needed); by default it keeps the default feed."""
    paths = {"file_path": tmp_path / "state.json", "sqlite_path": tmp_path / "state.db"}
    retention = FeedRetention(max_changes=123)
    assert StateManager(StateConfig(backend=name, feed=retention, **paths)).backend.feed == (
        retention
    )
    assert StateManager(StateConfig(backend=name, **paths)).backend.feed == FeedRetention()
    if name != "sqlite":  # SQLite's subscriptions read its feed: it cannot turn it off
        assert StateManager(StateConfig(backend=name, feed=None, **paths)).backend.feed is None


def test_config_feed_must_be_a_retention() -> None:
    """StateConfig(feed=) takes a FeedRetention or None."""
    assert StateConfig(feed=None).feed is None
    with pytest.raises(ConfigurationError):
        StateConfig(feed=100)


# ------------------------------------------------------------------ scopes and the sync API


async def test_a_scope_resumes_with_relative_keys(fed: StateManager) -> None:
    """A scope's changes(since=) replays its own keys, relative; its cursor is the manager's."""
    scope = fed.scope("{f}:s:")
    await scope.save("x", 1)
    cursor = await scope.feed_cursor()  # the manager's backend's feed
    assert isinstance(cursor, str)
    await scope.save("x", 2)
    await fed.save(A, "outside the scope")
    await scope.save("y", 3)
    async with scope.changes(since=cursor) as changes:
        got = await take(changes, 2)
        assert changes.cursor == got[-1].cursor
    assert [(c.key, c.new_value) for c in got] == [("x", 2), ("y", 3)]


def test_sync_changes_since() -> None:
    """The blocking API replays from a cursor too (over a memory backend with a feed)."""
    with sync.StateManager(backend=MemoryBackend()) as state:
        if state.async_object.backend.feed is None:
            pytest.skip("MemoryBackend keeps no change feed yet")
        cursor = state.feed_cursor()
        state.save("job:1", "queued")
        with state.changes("job:*", since=cursor) as changes:
            change = next(iter(changes))
            assert changes.cursor == change.cursor is not None
        assert (change.key, change.new_value) == ("job:1", "queued")


def test_a_resync_drops_only_the_live_changes_it_covers() -> None:
    """Resync.covers: a live SET at or below the resynced version is dropped, a DELETE of the
    resynced version is not (a delete carries the version it deleted), and the first newer
    change of a key ends the filtering of that key (its next life starts at version 1)."""
    now = datetime.now(UTC)
    entry = Entry(A, b"v3", 3, now, now)
    resync = Resync([entry, Entry(B, b"v1", 1, now, now)])

    def change(key: str, op: ChangeOp, version: int) -> Change:
        return Change(key, op, None, None if op is ChangeOp.DELETE else b"x", version, now)

    assert resync.covers(change(A, ChangeOp.SET, 2))
    assert resync.covers(change(A, ChangeOp.DELETE, 2))  # an earlier life, deleted before
    assert resync.covers(change(A, ChangeOp.SET, 3))
    assert not resync.covers(change(A, ChangeOp.DELETE, 3))
    assert not resync.covers(change(A, ChangeOp.SET, 1))  # written again after the delete
    assert not resync.covers(change(C, ChangeOp.SET, 1))  # not resynced: never dropped
    assert not resync.covers(change(B, ChangeOp.SET, 2))
    assert not resync.covers(change(B, ChangeOp.SET, 1))  # B's filter ended with version 2
