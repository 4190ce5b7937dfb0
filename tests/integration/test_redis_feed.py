"""The Redis backend's change feed on a real server and a real cluster (issue #23).

The public FeedContract runs on both (tests/contract); these tests add what only Redis has: the
streams' names and slots, retention as Redis trims, cluster cursors (vectors over slots, kept
small), resuming across slots, and the pub/sub reader catching up from the feed after its
connection is killed, exactly once.
"""

from __future__ import annotations

import binascii
import contextlib
import logging
import time
from collections import defaultdict
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis as sync_redis

from agenticstate import (
    ChangeOp,
    ConfigurationError,
    CursorExpiredError,
    InvalidArgumentError,
    RedisBackend,
)
from agenticstate.backends import EARLIEST, FeedRetention, Put
from agenticstate.backends import _redis_feed as feeds
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Change

pytestmark = pytest.mark.redis


@pytest.fixture(params=["redis", "redis-cluster"])
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


def _kill_pubsub(url: str) -> int:
    """Kill the pub/sub connections, once the subscriber has reconnected from the last kill."""
    clients = _clients(url)
    deadline = time.monotonic() + 10
    while not any(client.client_list(_type="pubsub") for client in clients):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)  # polling another connection's state, with a deadline
    killed = 0
    for client in clients:
        with client:
            killed += int(client.client_kill_filter(_type="pubsub"))
    return killed


async def _take(changes: AsyncIterator[Change], count: int, within: float = 20) -> list[Change]:
    out: list[Change] = []
    with anyio.fail_after(within):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


def _slot(name: str | bytes) -> int:
    data = name.encode() if isinstance(name, str) else name
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % 16384


def test_slot_tags_cover_every_slot() -> None:
    """Each slot's tag hashes to that slot, and no tag is longer than three characters."""
    for slot in range(16384):
        tag = feeds.slot_tag(slot)
        assert _slot("{" + tag + "}") == slot
        assert len(tag) <= 3


@pytest.mark.parametrize(
    "cursor", ["r1:", "r1:x-1", "r1:1", "c1:1:x", "c1:x:", "c1:1:99999=1.1", "c1:1:5=1-1", "m1:a:1"]
)
def test_malformed_cursors_are_invalid_arguments(cursor: str) -> None:
    """A cursor that does not parse, or of the other kind, raises InvalidArgumentError."""
    for cluster in (False, True):
        with pytest.raises(InvalidArgumentError):
            feeds.parse_cursor(cursor, feeds.FeedNames("p:", cluster=cluster))


# Every numeric field of every cursor form: a template per field ({} is the field), and whether
# the field may be negative (a cluster listing's time, relative to the floor).
CURSOR_FIELDS: dict[bool, list[tuple[str, bool]]] = {
    False: [
        ("r1:{}-0", False),
        ("r1:1-{}", False),
        ("r1:{}-1@+sub%3A", False),
        ("r1:1-{}@-2", False),
        ("r1:1-1/{}", False),
        ("r1:0-0/{}", False),
    ],
    True: [
        ("c1:{}:", False),
        ("c1:{}:5=0.1", False),
        ("c1:100:5={}.1", True),
        ("c1:100:5=0.{}", False),
        ("c1:100:5=0.1,7+sub%3A=2.{}", False),
        ("c1:100:5=0.1,7-2={}.3", True),
    ],
}
# Numbers no field takes: past the range (Redis refuses ids past 2**64 - 1; cursors stop at
# 2**63 - 1), and spellings int() would take but a cursor never holds.
BAD_NUMBERS = [
    "99999999999999999999",
    "99999999999999999999999",
    str(2**64),
    str(2**64 - 1),
    str(2**63),
    "1_0",
    "+1",
    " 1",
    "1 ",
    "\u0661",  # ARABIC-INDIC DIGIT ONE
    "",
    "0x1",
    "1e3",
    "--1",
]


@pytest.mark.parametrize("cluster", [False, True])
def test_every_numeric_field_of_every_cursor_form_is_checked(cluster: bool) -> None:
    """Each numeric field of each cursor form takes ASCII digits up to 2**63 - 1 (a `-` where
    it is relative), and anything else in it raises InvalidArgumentError before a command."""
    names = feeds.FeedNames("p:", cluster=cluster)
    for template, signed in CURSOR_FIELDS[cluster]:
        for good in ["0", "7", str(2**40), *(["-3"] if signed else [])]:
            feeds.parse_cursor(template.format(good), names)
        for bad in [*BAD_NUMBERS, *([] if signed else ["-1"])]:
            with pytest.raises(InvalidArgumentError):
                feeds.parse_cursor(template.format(bad), names)
    if cluster:  # in range alone, out of range once the floor is added
        for cursor in (f"c1:{2**63 - 1}:5=1.1", "c1:5:5=-6.1"):
            with pytest.raises(InvalidArgumentError):
                feeds.parse_cursor(cursor, names)


async def test_an_over_large_cursor_is_an_invalid_argument_on_the_server(url: str) -> None:
    """Entering changes() from a cursor whose number is past Redis's range raises
    InvalidArgumentError (never the server's "Invalid stream ID" as a BackendError)."""
    cluster = "+cluster" in url
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        await backend.set("k", b"1")
        for template, _ in CURSOR_FIELDS[cluster]:
            for bad in ("99999999999999999999", str(2**64)):
                cursor = template.format(bad)
                with pytest.raises(InvalidArgumentError):
                    async with backend.changes("*", since=cursor):
                        pass


def _ahead(cursor: str, by_ms: int) -> list[str]:
    """Cursors like `cursor` (a head) but naming a time `by_ms` later, in each of its fields."""
    if cursor.startswith("r1:"):
        body, _, order = cursor[3:].partition("/")
        ms, _, n = body.partition("-")
        return [
            f"r1:{body}/{int(order) + by_ms * 1000}",
            f"r1:{int(ms) + by_ms}-{int(n) + 1}/{int(order) + by_ms * 1000}",
            f"r1:{int(ms) + by_ms}-{int(n) + 1}",
        ]
    floor = int(cursor[3:].partition(":")[0])
    slot = _slot("{x}")
    return [
        f"c1:{floor + by_ms}:",
        f"c1:{floor}:{slot}={by_ms}.1",
        f"c1:{floor + by_ms}:{slot}=0.1",
    ]


@pytest.mark.parametrize("by_ms", [3_600_000, 10_000])
async def test_a_cursor_ahead_of_the_feed_head_is_expired(url: str, by_ms: int) -> None:
    """A cursor naming a time after the feed's head (another feed's, a clock ahead) raises
    CursorExpiredError on entry, in each of its fields, instead of skipping changes."""
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        head = await backend.feed_cursor()
        assert head is not None
        for n in range(6):
            await backend.set(f"{{x}}:k{n}", b"1")
        for cursor in _ahead(head, by_ms):
            with pytest.raises(CursorExpiredError):
                async with backend.changes("*", since=cursor):
                    pass
        async with backend.changes("*", since=head) as changes:  # the head itself resumes
            got = await _take(changes, 6)
        assert sorted(change.key for change in got) == [f"{{x}}:k{n}" for n in range(6)]


async def test_streams_live_in_the_reserved_namespace_and_are_never_scanned(
    redis_url: str,
) -> None:
    """Under the empty prefix the feed's stream and counter exist, and scan never lists them."""
    async with RedisBackend(url=redis_url, db=7) as backend:
        await backend.set("feedscan:a", b"1")
        with sync_redis.Redis.from_url(redis_url, db=7) as client:
            assert client.type(feeds.FEED_NAMESPACE) == b"stream"
            assert client.get(feeds.COUNTER_NAMESPACE) is not None
        keys = [key async for key in backend.scan("*")]
        assert "feedscan:a" in keys
        assert not [key for key in keys if key.startswith("__agenticstate")]
        await backend.delete("feedscan:a")


async def test_feed_off_writes_no_stream(url: str) -> None:
    """feed=None: writes leave no stream and no counter, and changes carry no cursor."""
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix, feed=None) as backend:
        async with backend.changes("*") as changes:
            await backend.set("a", b"1")
            await backend.transact([], [Put("a", b"2")])
            got = await _take(changes, 2)
        assert [c.cursor for c in got] == [None, None]
    for client in _clients(url):
        with client:
            assert not list(client.scan_iter(match=f"__agenticstate_feed*{prefix}"))


async def test_cluster_streams_hash_to_the_written_keys_slots(redis_cluster_url: str) -> None:
    """Each key's change goes to the stream of its own slot, also under a hash-tagged prefix."""
    for prefix in (
        unique_prefix(),
        "{tenant" + unique_prefix()[:-1] + "}:",  # a hash tag of its own
        "b{" + unique_prefix(),  # a brace that spoils a tag after it
    ):
        async with RedisBackend(url=redis_cluster_url, key_prefix=prefix) as backend:
            keys = [f"k{n}" for n in range(20)]
            for key in keys:
                await backend.set(key, b"v")
            cluster = sync_redis.RedisCluster.from_url(
                redis_cluster_url.replace("redis+cluster://", "redis://").split(",")[0]
            )
            with cluster:
                for key in keys:
                    slot = _slot(prefix + key)
                    stream, counter = feeds.FeedNames(prefix, cluster=True).for_slot(slot)
                    assert _slot(stream) == slot == _slot(counter)
                    assert cluster.xlen(stream) >= 1
                    entries: Any = cluster.xrange(stream)
                    assert (prefix + key).encode() in {fields[b"k"] for _, fields in entries}


async def test_retention_keeps_at_least_max_changes(url: str) -> None:
    """MAXLEN ~ trims whole stream nodes: at least max_changes stay, and far fewer than written."""
    async with RedisBackend(
        url=url, key_prefix=unique_prefix(), feed=FeedRetention(max_changes=50)
    ) as backend:
        for n in range(1000):
            await backend.set("{r}:k", b"%d" % n)
        kept = []
        async with backend.changes("{r}:*", since=EARLIEST) as changes:
            await backend.set("{r}:end", b"")
            with anyio.fail_after(10):
                async for change in changes:
                    if change.key == "{r}:end":
                        break
                    kept.append(change.version)
        assert 50 <= len(kept) <= 300
        assert kept == list(range(1001 - len(kept), 1001))


async def test_a_recreated_feed_expires_old_cursors(url: str) -> None:
    """A cursor from before the feed was lost (a restart without data): CursorExpiredError."""
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        for n in range(3):
            await backend.set("{x}:k", b"%d" % n)
        old = (await backend.set("{x}:k", b"last")).cursor
        assert old is not None
        names = feeds.FeedNames(prefix, cluster=backend.is_cluster).for_slot(_slot(prefix + "{x}"))
        for client in _clients(url):
            with client:
                for name in names:
                    with contextlib.suppress(sync_redis.exceptions.ResponseError):
                        client.delete(name)  # MOVED when another node holds it
        await backend.set("{x}:k", b"after")
        with pytest.raises(CursorExpiredError):
            async with backend.changes("{x}:*", since=old):
                pass


def _listed(cursor: str) -> int:
    return len([part for part in cursor.split(":", 2)[2].split(",") if part])


async def test_cluster_cursors_resume_across_slots_and_stay_small(redis_cluster_url: str) -> None:
    """Changes over many slots: each cursor lists few slots, and resuming from any of them
    yields exactly the later changes (per key, in version order, none twice, none missed)."""
    async with RedisBackend(url=redis_cluster_url, key_prefix=unique_prefix()) as backend:
        start = await backend.feed_cursor()
        assert start is not None
        total = 600
        for n in range(total):
            await backend.set(f"k:{n % 200}", b"%d" % n)
        async with backend.changes("k:*", since=start) as changes:
            seen = await _take(changes, total)
        assert sorted((c.key, c.version) for c in seen) == sorted(
            (f"k:{n % 200}", n // 200 + 1) for n in range(total)
        )
        assert max(_listed(c.cursor or "") for c in seen) <= 64
        for index in (0, 17, 299, 598):
            cursor = seen[index].cursor
            assert cursor is not None
            async with backend.changes("k:*", since=cursor) as changes:
                rest = await _take(changes, total - index - 1) if index < total - 1 else []
                await backend.set("k:mark", str(index).encode())
                (mark,) = await _take(changes, 1)
            assert mark.key == "k:mark"
            assert _per_key(rest) == _per_key(seen[index + 1 :])


async def test_cluster_cursors_hold_what_came_before_them_out_of_commit_order(
    redis_cluster_url: str,
) -> None:
    """Slots deliver apart: a replay may yield a change before one committed earlier in another
    slot (here slot {a}'s clock runs ahead: its counter says a minute from now). A cursor holds
    what was yielded before it, in any order: resuming from each change's cursor yields exactly
    the changes yielded after it, never one yielded before it (the model suite once counted such
    a change, committed after the cursor's own but yielded before it, as missed)."""
    prefix = unique_prefix()
    async with RedisBackend(url=redis_cluster_url, key_prefix=prefix) as backend:
        counter = feeds.FeedNames(prefix, cluster=True).for_slot(_slot("{a}"))[1]
        cluster = sync_redis.RedisCluster.from_url(
            redis_cluster_url.replace("redis+cluster://", "redis://").split(",")[0]
        )
        with cluster:
            ahead = int(time.time() * 1000) + 60_000  # the id, and the order (`u`, in µs)
            cluster.set(counter, f"{ahead}-0 {ahead * 1000}")
        await backend.set("{a}k", b"1")
        async with backend.changes("*", since=EARLIEST) as changes:
            (first,) = await _take(changes, 1)
        assert first.cursor is not None
        await backend.set("{a}k", b"2")  # committed first, stamped a minute ahead
        await backend.set("{b}k", b"1")
        await backend.set("{b}k", b"2")
        async with backend.changes("*", since=first.cursor) as changes:
            seen = await _take(changes, 3)
        assert [(c.key, c.version) for c in seen] == [("{b}k", 1), ("{b}k", 2), ("{a}k", 2)]
        for index, change in enumerate(seen):
            assert change.cursor is not None
            rest = []
            async with backend.changes("*", since=change.cursor) as changes:
                await backend.set("{c}mark", b"%d" % index)
                with anyio.fail_after(20):
                    async for later in changes:
                        if later.key != "{c}mark":
                            rest.append((later.key, later.version))
                        elif later.new == b"%d" % index:
                            break  # (the marks before are of the resumes before)
            assert rest == [(c.key, c.version) for c in seen[index + 1 :]]


async def test_cluster_live_cursors_after_a_replay_hold_what_it_read(
    redis_cluster_url: str,
) -> None:
    """A live change waits in the buffer while the replay still reads a stream up to the switch
    (here slot {s}'s second page, with Y committed after the live change L arrived). L comes after
    Y, so L's cursor holds Y too: resuming from it yields what came after L, not Y again."""
    async with RedisBackend(url=redis_cluster_url, key_prefix=unique_prefix()) as backend:
        head = await backend.feed_cursor()
        assert head is not None
        async with (
            backend.changes("{t}*") as watch,  # on the same connection: shows L has arrived
            backend.changes("*", since=head, max_buffer=5000) as changes,
        ):
            for n in range(1000):  # a full page (`_PAGE`): the replay reads {s} a page at a time
                await backend.set("{s}k", b"%d" % n)
            seen = await _take(changes, 1)  # the replay switched: live from here
            await backend.set("{t}k", b"L")  # a stream made after the switch's SCAN: live
            await _take(watch, 1)
            await backend.set("{s}k", b"Y")  # read by the replay (its next page), before L
            seen += await _take(changes, 1001)
        assert [(c.key, c.new) for c in seen[-2:]] == [("{s}k", b"Y"), ("{t}k", b"L")]
        assert seen[-1].cursor is not None
        async with backend.changes("*", since=seen[-1].cursor) as changes:
            await backend.set("{c}mark", b"")
            (mark,) = await _take(changes, 1)
        assert mark.key == "{c}mark"


def _per_key(changes: list[Change]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for change in changes:
        out[change.key].append(change.version)
    return dict(out)


async def test_live_cluster_cursors_stay_small_and_resume(redis_cluster_url: str) -> None:
    """A live subscription's cursors (floor raised by marker rounds) resume without a gap."""
    async with RedisBackend(url=redis_cluster_url, key_prefix=unique_prefix()) as backend:
        async with backend.changes("k:*") as changes:
            for n in range(400):
                await backend.set(f"k:{n % 100}", b"%d" % n)
            seen = await _take(changes, 400)
        assert max(_listed(c.cursor or "") for c in seen) <= 128
        cursor = seen[199].cursor
        assert cursor is not None
        async with backend.changes("k:*", since=cursor) as changes:
            rest = await _take(changes, 200)
            await backend.set("k:mark", b"")
            (mark,) = await _take(changes, 1)
        assert mark.key == "k:mark"
        assert _per_key(rest) == _per_key(seen[200:])


async def test_reconnects_catch_up_from_the_feed_exactly_once(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The pub/sub connection is killed 5 times during 3,000 writes: the subscription gets
    every change once, per key in version order, never a RESYNC."""
    caplog.set_level(logging.INFO, logger="agenticstate")
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        got: list[Change] = []
        async with backend.changes("k:*", max_buffer=10_000) as changes:

            async def write() -> None:
                for n in range(3000):
                    await backend.set(f"k:{n % 30}", b"%d" % n)
                    if n % 500 == 250:
                        assert await anyio.to_thread.run_sync(_kill_pubsub, url) >= 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                got = await _take(changes, 3000, within=60)
        assert all(c.op is ChangeOp.SET and c.cursor for c in got)
        versions = _per_key(got)
        assert versions == {f"k:{k}": list(range(1, 101)) for k in range(30)}
    assert "pubsub_caught_up" in caplog.text
    assert "pubsub_resynced" not in caplog.text


async def test_since_subscription_catches_up_after_a_reconnect(url: str) -> None:
    """A subscription from a cursor keeps exactly-once delivery across a killed connection."""
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        for n in range(50):
            await backend.set(f"k:{n % 5}", b"%d" % n)
        async with backend.changes("k:*", since=EARLIEST, max_buffer=5000) as changes:
            first = await _take(changes, 50)
            for n in range(50, 300):
                await backend.set(f"k:{n % 5}", b"%d" % n)
                if n == 120:
                    assert await anyio.to_thread.run_sync(_kill_pubsub, url) >= 1
            rest = await _take(changes, 250)
        assert _per_key(first + rest) == {f"k:{k}": list(range(1, 61)) for k in range(5)}


async def test_catch_up_waits_for_a_slow_subscriber_instead_of_overflowing(
    redis_url: str,
) -> None:
    """1,500 changes while disconnected, buffer 100: the catch-up hands them over paced, as
    real changes."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=prefix) as writer,
        RedisBackend(url=redis_url, key_prefix=prefix) as reader,
        reader.changes("k:*", max_buffer=100) as stream,
        anyio.create_task_group() as tg,
    ):
        received: list[Change] = []
        done = anyio.Event()

        async def slow() -> None:
            async for change in stream:
                received.append(change)
                await anyio.lowlevel.checkpoint()
                if len(received) % 50 == 0:
                    await anyio.sleep(0.001)
                if len(received) == 1500:
                    done.set()

        tg.start_soon(slow)
        with sync_redis.Redis.from_url(redis_url) as admin:
            await writer.get("warm")  # the writer holds its connection before the server is full
            maxclients = str(admin.config_get("maxclients")["maxclients"])
            # No new connection is accepted: the reader cannot come back until the writes are.
            admin.config_set("maxclients", 1)
            try:
                admin.client_kill_filter(_type="pubsub")
                await writer.set_many([(f"k:{n}", b"changed") for n in range(1500)])
            finally:
                admin.config_set("maxclients", maxclients)
        with anyio.fail_after(30):
            await done.wait()
        tg.cancel_scope.cancel()
    assert sorted(change.key for change in received) == sorted(f"k:{n}" for n in range(1500))
    assert {change.op for change in received} == {ChangeOp.SET}


def test_url_options_set_the_feed() -> None:
    """`feed=off`, `feed_max_changes` and `feed_max_age` in the URL; nothing: the default."""
    url = "redis://localhost:6379/0"
    assert RedisBackend.from_url(url).feed == FeedRetention()
    assert RedisBackend.from_url(url + "?feed=off").feed is None
    made = RedisBackend.from_url(url + "?feed_max_changes=7&feed_max_age=1.5&key_prefix=a:")
    assert made.feed == FeedRetention(max_changes=7, max_age=timedelta(seconds=1.5))
    assert made.key_prefix == "a:"
    for bad in ("?feed=maybe", "?feed_max_changes=x", "?feed_max_changes=0", "?feed_max_age=-1"):
        with pytest.raises(ConfigurationError):
            RedisBackend.from_url(url + bad)


async def test_catch_up_hands_a_later_subscription_nothing_from_before_it(url: str) -> None:
    """A pattern subscribed while the connection is live, then a drop: the catch-up gives it
    only the changes after it was subscribed, none from before."""
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        async with backend.changes("a:*") as early:
            await backend.set("a:1", b"1")
            await _take(early, 1)
            for n in range(5):
                await backend.set("b:1", b"%d" % n)  # before the b:* subscription
            async with backend.changes("b:*") as late:
                assert await anyio.to_thread.run_sync(_kill_pubsub, url) >= 1
                await backend.set("b:1", b"after")
                (change,) = await _take(late, 1)
                await backend.set("b:1", b"next")
                (following,) = await _take(late, 1)
        assert (change.new, change.version) == (b"after", 6)
        assert (following.new, following.version) == (b"next", 7)
