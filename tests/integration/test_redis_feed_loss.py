"""A Redis feed that was lost (a restart without data, the streams deleted), on a real server and
a real cluster: nested prefixes stay found, and old cursors never resume over the gap.

On one server an outer prefix finds the streams of the prefixes nested in it in its registry
(`__agenticstate_feeds__:<outer>`). The feed and the registry go together (a restart without
data loses both), and the write that starts a stream anew joins the registries in the same
script, whichever process makes it and through whichever write path: the tables below run each
path as the first write after the loss, then another process's writes, and check the outer
store's replay and its commits. On a cluster the streams are found by SCAN (the same checks
hold). A cursor taken before the loss raises `CursorExpiredError` on both, whatever its form
(a change's, a head's, one that lists only some streams).
"""

from __future__ import annotations

import binascii
import contextlib
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis as sync_redis

from agenticstate import EARLIEST, CursorExpiredError, RedisBackend, StateManager, txn
from agenticstate.backends import _redis_feed as feeds
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.redis


@pytest.fixture(params=["redis", pytest.param("redis-cluster", marks=pytest.mark.slow)])
def url(request: pytest.FixtureRequest) -> str:
    """A plain redis-server's URL and a 3-primary cluster's (the session's servers)."""
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    address: str = request.getfixturevalue(fixture)
    return address


def _clients(url: str) -> list[sync_redis.Redis]:
    """A plain client to the server, or one to every node of the cluster."""
    if "+cluster" not in url:
        return [sync_redis.Redis.from_url(url)]
    hosts = urlsplit(url).netloc.split(",")
    return [
        sync_redis.Redis(host=host.rpartition(":")[0], port=int(host.rpartition(":")[2]))
        for host in hosts
    ]


def _lose_feed(url: str, root: str) -> int:
    """Delete every reserved key (feed streams, counters, registries, revision counters) of
    the prefixes under `root`, as a restart without data does; returns how many."""
    lost = 0
    for client in _clients(url):
        with client:
            for name in list(client.scan_iter(match=f"__agenticstate_*__:*{root}*", count=1000)):
                with contextlib.suppress(sync_redis.exceptions.ResponseError):  # MOVED
                    lost += int(client.delete(name))
    return lost


def _slot(name: str) -> int:
    """The cluster slot of a Redis key (its hash tag's, if it has one)."""
    data = name.encode()
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % 16384


# The first write through the nested prefix after the loss: each write path the backend has.
FIRST_WRITES: dict[str, Callable[[StateManager], Awaitable[Any]]] = {
    "save": lambda state: state.save("a", 1),
    "save_many": lambda state: state.save_many({"a": 1}),
    "update": lambda state: state.update("a", lambda old: 1),
    "delete": lambda state: state.delete("a"),
    "transact": lambda state: state.transact([], [txn.Put("a", 1)]),
}


async def _replay(state: StateManager, pattern: str, end: str) -> list[tuple[str, Any]]:
    """Everything the store's feed holds under `pattern`, up to a marker written now."""
    seen: list[tuple[str, Any]] = []
    async with state.changes(pattern, since=EARLIEST) as changes:
        await state.save(end, "end")
        with anyio.fail_after(20):
            async for change in changes:
                if change.key == end:
                    return seen
                seen.append((change.key, change.new_value))
    return seen


async def _stores(url: str, root: str) -> tuple[StateManager, StateManager, StateManager]:
    """An outer store under `root` and two stores (two processes' worth) under `root + "prod:"`."""
    outer = StateManager(backend=RedisBackend(url=url, key_prefix=root))
    first = StateManager(backend=RedisBackend(url=url, key_prefix=root + "prod:"))
    other = StateManager(backend=RedisBackend(url=url, key_prefix=root + "prod:"))
    for state in (outer, first, other):
        await state.open()
    return outer, first, other


@pytest.mark.parametrize("path", sorted(FIRST_WRITES))
async def test_an_outer_store_replays_a_nested_feed_started_anew_by_any_write(
    url: str, path: str
) -> None:
    """After the feed is lost, the nested store whose write starts the stream again writes
    nothing more; the outer store's replay still holds every later nested write of another."""
    root = unique_prefix()
    outer, first, other = await _stores(url, root)
    try:
        await first.save("a", 0)
        await other.save("b", 0)
        assert _lose_feed(url, root) > 0
        await FIRST_WRITES[path](first)
        for n in range(1, 4):
            await other.save("b", n)
        seen = await _replay(outer, "prod:*", "prod:zz_end")
        assert [change for change in seen if change[0] == "prod:b"] == [
            ("prod:b", 1),
            ("prod:b", 2),
            ("prod:b", 3),
        ]
        assert len(seen) == 4  # and the first write, whatever it was
    finally:
        for state in (outer, first, other):
            await state.aclose()


@pytest.mark.parametrize("path", sorted(FIRST_WRITES))
async def test_an_outer_commit_holds_nested_writes_made_after_the_feed_was_lost(
    url: str, path: str
) -> None:
    """After the feed is lost and started anew by one nested store, an outer store's
    incremental commit records another nested store's later write (never the stale value)."""
    root = unique_prefix()
    outer, first, other = await _stores(url, root)
    try:
        await first.save("a", 0)
        await other.save("b", 0)
        assert _lose_feed(url, root) > 0
        await FIRST_WRITES[path](first)
        await other.save("b", 1)
        await outer.commit("prod:")  # the first after the loss: reads the scope whole
        await other.save("b", 2)
        await other.save("new", 1)
        second = await outer.commit("prod:")  # reads the feed since the first
        view = await outer.checkout(second.id)
        assert await view.get("prod:b") == 2
        assert await view.get("prod:new") == 1
    finally:
        for state in (outer, first, other):
            await state.aclose()


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("path", sorted(FIRST_WRITES))
async def test_a_stream_started_by_any_write_is_in_every_outer_registry(
    redis_url: str, path: str, depth: int
) -> None:
    """One server: whichever write path starts a nested prefix's stream (after it was lost),
    the same script adds the prefix to the registry of every prefix it is nested in."""
    root = unique_prefix()
    nested = root + "n:" * depth
    async with StateManager(backend=RedisBackend(url=redis_url, key_prefix=nested)) as state:
        await state.save("a", 0)
        assert _lose_feed(redis_url, root) > 0
        await FIRST_WRITES[path](state)
    with sync_redis.Redis.from_url(redis_url) as client:
        assert client.type(feeds.FEED_NAMESPACE + nested) == b"stream"
        for outer in feeds.ancestors(nested):
            assert client.sismember(feeds.registry_key(outer), nested), outer


# Cursors taken before the loss, in each form: a head (`feed_cursor`: on a cluster no stream
# listed), a write's change (its own stream listed), a replay's and a live subscription's.
async def _cursor_of_write(state: StateManager) -> str:
    change = await state.backend.set("{a}:k", b"w")
    assert change.cursor is not None
    return change.cursor


async def _cursor_of_head(state: StateManager) -> str:
    cursor = await state.feed_cursor()
    assert cursor is not None
    return cursor


async def _cursor_of_replay(state: StateManager) -> str:
    async with state.changes("*", since=EARLIEST) as changes:
        await state.save("{b}:end", "r")
        with anyio.fail_after(20):
            async for change in changes:
                if change.key == "{b}:end":
                    assert change.cursor is not None
                    return change.cursor
    raise AssertionError("the replay ended")


async def _cursor_of_live(state: StateManager) -> str:
    async with state.changes("*") as changes:
        await state.save("{c}:live", "l")
        with anyio.fail_after(20):
            async for change in changes:
                assert change.cursor is not None
                return change.cursor
    raise AssertionError("the watch ended")


CURSORS: dict[str, Callable[[StateManager], Awaitable[str]]] = {
    "head": _cursor_of_head,
    "write": _cursor_of_write,
    "replay": _cursor_of_replay,
    "live": _cursor_of_live,
}


@pytest.mark.parametrize("form", sorted(CURSORS))
async def test_a_cursor_from_before_the_feed_was_lost_is_expired(url: str, form: str) -> None:
    """A cursor of any form taken before the feed was lost (and changes were made after it)
    raises CursorExpiredError once the feed is written again, on one server and a cluster;
    a cursor taken after the loss resumes exactly."""
    root = unique_prefix()
    async with StateManager(backend=RedisBackend(url=url, key_prefix=root)) as state:
        for n in range(6):
            await state.save(f"k{n}", 1)
        cursor = await CURSORS[form](state)
        for n in range(6):
            await state.save(f"k{n}", 2)  # after the cursor, then lost
        assert _lose_feed(url, root) > 0
        for n in range(6):
            await state.save(f"k{n}", 10)
        with pytest.raises(CursorExpiredError):
            async with state.changes("*", since=cursor):
                pass
        fresh = await CURSORS[form](state)  # from the feed as it is now
        await state.save("k0", 11)
        async with state.changes("k*", since=fresh) as changes:
            with anyio.fail_after(20):
                async for change in changes:
                    assert (change.key, change.new_value) == ("k0", 11)
                    break


async def test_a_cluster_cursor_expires_when_streams_it_does_not_list_were_lost(
    redis_cluster_url: str,
) -> None:
    """Cluster: the streams a cursor lists are intact, the others (and the feed's epoch, as
    when the primary holding them restarted without data) were lost: CursorExpiredError."""
    url, root = redis_cluster_url, unique_prefix()
    async with StateManager(backend=RedisBackend(url=url, key_prefix=root)) as state:
        for n in range(12):
            await state.save(f"k{n}", 1)
        cursor = await _cursor_of_write(state)  # lists the stream of {a}'s slot
        for n in range(12):
            await state.save(f"k{n}", 2)
        kept = feeds.FeedNames(root, cluster=True).for_slot(_slot(root + "{a}"))
        lost = 0
        for client in _clients(url):
            with client:
                for name in list(client.scan_iter(match=f"__agenticstate_*__:*{root}*")):
                    if name.decode() not in kept:
                        lost += int(client.delete(name))
        assert lost > 1
        await state.save("k0", 3)
        with pytest.raises(CursorExpiredError):
            async with state.changes("*", since=cursor):
                pass
