"""MemoryBackend's change feed and history beyond the contract: cursors of other stores, URL
parameters, bounds."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest

from agenticstate import (
    ConfigurationError,
    CursorExpiredError,
    InvalidArgumentError,
    MemoryBackend,
    UnsupportedOperationError,
)
from agenticstate.backends import EARLIEST, FeedRetention, open_backend


async def test_a_cursor_of_another_memory_store_has_expired() -> None:
    """Each instance is its own store: another's cursor is well formed but not resumable."""
    async with MemoryBackend() as first, MemoryBackend() as second:
        await first.set("k", b"1")
        cursor = await first.feed_cursor()
        assert cursor is not None
        assert cursor.startswith("m1:")
        with pytest.raises(CursorExpiredError) as caught:
            async with second.changes("*", since=cursor):
                pass
        assert caught.value.cursor == cursor


async def test_a_cursor_past_the_head_is_invalid() -> None:
    """A cursor newer than the head cannot have been handed out: InvalidArgumentError."""
    async with MemoryBackend() as backend:
        head = await backend.feed_cursor()
        assert head is not None
        forged = head.rsplit(":", 1)[0] + ":99"
        with pytest.raises(InvalidArgumentError):
            async with backend.changes("*", since=forged):
                pass


async def test_the_cursor_is_checked_on_entry_not_before() -> None:
    """changes(since=...) checks the cursor when entered: a context manager made before the
    trim raises then."""
    async with MemoryBackend(feed=FeedRetention(max_changes=2)) as backend:
        old = await backend.feed_cursor()
        subscription = backend.changes("*", since=old)
        for n in range(5):
            await backend.set("k", b"%d" % n)
        with pytest.raises(CursorExpiredError):
            async with subscription:
                pass


async def test_the_ring_keeps_max_changes() -> None:
    """The ring holds the newest max_changes, and EARLIEST replays exactly those."""
    async with MemoryBackend(feed=FeedRetention(max_changes=3)) as backend:
        for n in range(10):
            await backend.set("k", b"%d" % n)
        async with backend.changes("*", since=EARLIEST) as changes:
            await backend.set("end", b"")
            got = []
            with anyio.fail_after(5):
                async for change in changes:
                    got.append((change.key, change.version))
                    if change.key == "end":
                        break
        assert got == [("k", 8), ("k", 9), ("k", 10), ("end", 1)]


async def test_feed_off() -> None:
    """feed=None: no cursor anywhere, since= refused."""
    async with MemoryBackend(feed=None) as backend:
        assert await backend.feed_cursor() is None
        assert (await backend.set("k", b"1")).cursor is None
        with pytest.raises(UnsupportedOperationError):
            backend.changes("*", since=EARLIEST)


async def test_set_returns_the_change_with_its_cursor() -> None:
    """The change a write returns is the feed's (the same cursor a subscriber gets)."""
    async with MemoryBackend() as backend:
        change = await backend.set("k", b"1")
        assert change.cursor == await backend.feed_cursor()


@pytest.mark.parametrize(
    ("url", "feed"),
    [
        ("memory://", FeedRetention()),
        ("memory://?feed=off", None),
        ("memory://?feed_max_changes=5", FeedRetention(max_changes=5)),
        (
            "memory://?feed_max_age=1.5&feed_max_changes=7",
            FeedRetention(max_changes=7, max_age=timedelta(seconds=1.5)),
        ),
    ],
)
def test_url_parameters_set_the_feed(url: str, feed: FeedRetention | None) -> None:
    """memory:// URLs take feed=off, feed_max_changes and feed_max_age."""
    assert open_backend(url).feed == feed


@pytest.mark.parametrize(
    "url",
    [
        "memory://?feed=on",
        "memory://?feed_max_changes=0",
        "memory://?feed_max_changes=x",
        "memory://?feed_max_age=-1",
        "memory://?other=1",  # it used to be ignored: a typo went unnoticed
    ],
)
def test_bad_url_parameters_are_refused(url: str) -> None:
    """An invalid feed parameter, or one the memory backend does not know, is refused."""
    with pytest.raises(ConfigurationError):
        open_backend(url)


async def test_history_rules_from_the_constructor() -> None:
    """history= sets the rules, as keep_history does; the history is bounded by its depth."""
    async with MemoryBackend(history={"a:*": 2}) as backend:
        for n in range(100):
            await backend.set("a:1", b"%d" % n)
            await backend.set("b:1", b"%d" % n)
        assert [e.version for e in await backend.history("a:1")] == [100, 99]
        assert [e.version for e in await backend.history("b:1")] == [100]
        assert len(backend._local.history["a:1"]) == 2
        assert "b:1" not in backend._local.history
        await backend.delete("a:1")
        assert "a:1" not in backend._local.history


async def test_history_set_later_starts_with_the_current_version() -> None:
    """Rules set after a key was written: its history starts with the version the next write
    replaces (the one before is gone)."""
    async with MemoryBackend() as backend:
        await backend.set("a:1", b"1")
        await backend.set("a:1", b"2")
        backend.keep_history({"a:*": 5})
        await backend.set("a:1", b"3")
        assert [e.value for e in await backend.history("a:1")] == [b"3", b"2"]
