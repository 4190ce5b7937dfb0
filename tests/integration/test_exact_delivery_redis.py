"""Exact delivery on Redis and Redis Cluster (issue 15): every change once, in order, none invented.

Each test names the case of the issue it pins. Plain Redis and the 3-primary cluster run the same
test where the case applies to both.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import random
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from agenticstate import (
    BackendError,
    Change,
    ChangeOp,
    ConfigurationError,
    RedisBackend,
    StateConfig,
    StateManager,
    SubscriptionClosedError,
)
from agenticstate._glob import glob_match
from agenticstate._keys import escape_glob
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.redis


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """The URL of a plain redis-server, then of the 3-primary Redis Cluster."""
    name = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(name))


def _admin_clients(url: str) -> list[aioredis.Redis]:
    """A plain client to every server behind `url` (each node of a cluster)."""
    parts = urlsplit(url)
    if parts.scheme.endswith("+cluster"):
        nodes = [hp.rpartition(":") for hp in parts.netloc.rpartition("@")[2].split(",")]
        return [aioredis.Redis(host=host, port=int(port)) for host, _, port in nodes]
    return [aioredis.Redis.from_url(url)]


async def _kill_pubsub(url: str) -> int:
    """`CLIENT KILL TYPE pubsub` on every server: every pub/sub connection drops at once."""
    killed = 0
    for admin in _admin_clients(url):
        async with admin:
            killed += int(await admin.client_kill_filter(_type="pubsub"))
    return killed


async def _wait_for(condition: Callable[[], bool], seconds: float = 10) -> None:
    """Wait for `condition` (state another task or the server changes), with a deadline."""
    with anyio.fail_after(seconds):
        # A poll with a deadline: the state polled has no event to wait on.
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.005)


async def _server_ms(backend: RedisBackend) -> int:
    """The server's clock (a cluster's first primary), in milliseconds."""
    if backend.is_cluster:
        client: Any = await backend._redis()
        seconds, micros = await client.time(target_nodes=client.get_primaries()[0])
    else:
        seconds, micros = await backend._execute("TIME")
    return int(seconds) * 1000 + int(micros) // 1000


async def _age(backend: RedisBackend, stamp_ms: int, by_ms: int) -> None:
    """Wait until the server clock is `by_ms` past `stamp_ms` (older than any skew margin)."""
    with anyio.fail_after(5):
        while await _server_ms(backend) <= stamp_ms + by_ms:  # noqa: ASYNC110  # the server's clock
            await anyio.sleep(0.01)


class _Reader:
    """Collect a subscription's changes in a task; wait for a count or a key."""

    def __init__(self, stream: AsyncIterator[Change]) -> None:
        self.stream = stream
        self.changes: list[Change] = []
        self.error: BaseException | None = None
        self.finished = False

    async def run(self) -> None:
        try:
            async for change in self.stream:
                self.changes.append(change)
        except SubscriptionClosedError as exc:
            self.error = exc
        finally:
            self.finished = True

    async def until(self, condition: Callable[[list[Change]], bool], seconds: float = 10) -> None:
        await _wait_for(lambda: condition(self.changes) or self.finished, seconds)
        assert condition(self.changes), (self.error, self.changes[-5:])


def _record_new(seen: list[Any], key: str, old: Any, new: Any) -> None:
    seen.append(new)


def _at_least(count: int, changes: list[Change]) -> bool:
    return len(changes) >= count


# 1. Several patterns subscribed before the store opens: every pattern gets every change.


@pytest.mark.parametrize("patterns", [3, 8])
async def test_patterns_subscribed_before_open_each_receive_all(url: str, patterns: int) -> None:
    """The README's order (construct, subscribe n patterns, save): each gets its 100 changes."""
    prefix = unique_prefix()
    counts: collections.Counter[str] = collections.Counter()
    state = StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=prefix))
    for number in range(patterns):
        state.subscribe(f"agent:{number}:*", lambda k, o, v: counts.update([k.split(":")[1]]))
    for j in range(100 * patterns):
        await state.save(f"agent:{j % patterns}:x", {"j": j})
    await _wait_for(lambda: sum(counts.values()) >= 100 * patterns)
    # The cause was a second pub/sub connection opened by a racing PSUBSCRIBE, never read.
    connections = 0
    for admin in _admin_clients(url):
        async with admin:
            connections += len(await admin.client_list(_type="pubsub"))
    await state.aclose()
    assert counts == {str(number): 100 for number in range(patterns)}
    assert connections == 1


# 2. A key that expired and is written again: every write of its new life is delivered.


async def test_key_rewritten_after_expiry_delivers_every_write(url: str) -> None:
    """3 writes with a TTL, expiry, 4 more writes: 7 changes, versions 1-3 then 1-4."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("k*") as stream,
        anyio.create_task_group() as tg,
    ):
        collected = _Reader(stream)
        tg.start_soon(collected.run)
        for number in range(3):
            await writer.set("k", b"a%d" % number, ttl=timedelta(milliseconds=200))
        await _wait_for(lambda: len(collected.changes) == 3)
        with anyio.fail_after(5):
            while await writer.get("k") is not None:  # noqa: ASYNC110  # the server expires it
                await anyio.sleep(0.02)
        for number in range(4):
            await writer.set("k", b"b%d" % number)
        await collected.until(lambda changes: len(changes) >= 7)
        tg.cancel_scope.cancel()
    assert [(c.new, c.version) for c in collected.changes] == [
        (b"a0", 1),
        (b"a1", 2),
        (b"a2", 3),
        (b"b0", 1),
        (b"b1", 2),
        (b"b2", 3),
        (b"b3", 4),
    ]
    assert collected.changes[3].old is None  # a new life: nothing before it


async def test_delivered_versions_are_forgotten_when_keys_expire(url: str) -> None:
    """5,000 keys with a 50 ms TTL under a subscriber: afterwards it remembers (almost) none."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("*", max_buffer=20_000) as stream,
        anyio.create_task_group() as tg,
    ):
        collected = _Reader(stream)
        tg.start_soon(collected.run)
        done = await writer.set_many(
            [(f"e:{n}", b"v") for n in range(5000)], ttl=timedelta(milliseconds=50)
        )
        await collected.until(lambda changes: len(changes) == 5000)
        assert reader._tracked_keys() <= 5000  # those expired already are forgotten
        # Expired, and past the second a backend waits before forgetting an expired key.
        await _age(writer, max(round(c.timestamp.timestamp() * 1000) for c in done), 2100)
        await writer.set("after", b"x")
        await collected.until(lambda changes: changes[-1].key == "after")
        tracked = reader._tracked_keys()
        tg.cancel_scope.cancel()
    assert tracked <= 1


# 3. A reconnect emits only what changed, paced to the subscriber.


async def test_reconnect_emits_only_what_changed(url: str) -> None:
    """1,500 keys, a subscriber, CLIENT KILL: only the keys changed meanwhile come, once each.

    The resync of a backend without a change feed (with one it catches up from the feed:
    tests/integration/test_redis_feed.py)."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix, feed=None) as reader,
    ):
        written = await writer.set_many([(f"k:{n}", b"old") for n in range(1500)])
        newest = max(round(c.timestamp.timestamp() * 1000) for c in written)
        await _age(writer, newest, 120)  # older than the cluster's clock-skew margin
        async with (
            reader.changes("k:*", max_buffer=1000) as stream,
            anyio.create_task_group() as tg,
        ):
            collected = _Reader(stream)
            tg.start_soon(collected.run)
            await writer.set("k:seen", b"1")  # delivered live, then deleted in the gap
            await collected.until(lambda changes: len(changes) == 1)
            with capture_logs() as logs:
                assert await _kill_pubsub(url) >= 1
                await writer.set("k:7", b"new")
                await writer.delete("k:seen")
                await _wait_for(lambda: any(e["event"] == "pubsub_resynced" for e in logs))
            await writer.set("k:end", b"end")
            await collected.until(lambda changes: changes[-1].key == "k:end")
            tg.cancel_scope.cancel()
    keys = [change.key for change in collected.changes]
    assert keys[0] == "k:seen"
    assert keys[-1] == "k:end"
    assert sorted(keys[1:-1]) == ["k:7", "k:seen"], keys
    by_key = {change.key: change for change in collected.changes[1:-1]}
    assert by_key["k:7"].new == b"new"
    assert by_key["k:seen"].new is None
    assert collected.error is None


async def test_resync_waits_for_a_slow_subscriber_instead_of_overflowing(redis_url: str) -> None:
    """1,500 keys changed while disconnected, buffer 100: the resync hands them over paced
    (without a change feed; test_redis_feed.py has the catch-up's)."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=prefix) as writer,
        RedisBackend(url=redis_url, key_prefix=prefix, feed=None) as reader,
        aioredis.Redis.from_url(redis_url) as admin,
        reader.changes("k:*", max_buffer=100) as stream,
        anyio.create_task_group() as tg,
    ):
        received: list[Change] = []
        failed: list[BaseException] = []

        async def slow() -> None:
            try:
                async for change in stream:
                    received.append(change)
                    await anyio.lowlevel.checkpoint()
                    if len(received) % 50 == 0:
                        await anyio.sleep(0.001)
            except SubscriptionClosedError as exc:
                failed.append(exc)

        tg.start_soon(slow)
        await writer.get("warm")  # the writer holds its connection before the server is full
        maxclients = str((await admin.config_get("maxclients"))["maxclients"])
        # No new connection is accepted: the reader cannot come back until the writes are done.
        await admin.config_set("maxclients", 1)
        try:
            await admin.client_kill_filter(_type="pubsub")
            await writer.set_many([(f"k:{n}", b"changed") for n in range(1500)])
        finally:
            await admin.config_set("maxclients", maxclients)
        await _wait_for(lambda: len(received) >= 1500 or bool(failed), 30)
        tg.cancel_scope.cancel()
    assert not failed
    assert sorted(change.key for change in received) == sorted(f"k:{n}" for n in range(1500))
    assert {change.op for change in received} == {ChangeOp.RESYNC}


async def test_reconnect_during_a_burst_keeps_each_key_in_order(url: str) -> None:
    """Writes keep coming while the pub/sub connection drops: per key, versions only grow."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("b:*", max_buffer=100_000) as stream,
        anyio.create_task_group() as tg,
    ):
        collected = _Reader(stream)
        tg.start_soon(collected.run)
        final: dict[str, int] = {}
        for round_ in range(40):
            if round_ in (10, 25):
                await _kill_pubsub(url)
            for change in await writer.set_many([(f"b:{n}", b"%d" % round_) for n in range(20)]):
                final[change.key] = change.version

        def reached(changes: list[Change]) -> bool:
            # In any order: a resync hands keys over in scan order, and a cluster's shards are
            # not ordered with each other.
            return {c.key: c.version for c in changes} == final

        await collected.until(reached, 30)
        tg.cancel_scope.cancel()
    last: dict[str, int] = {}
    for change in collected.changes:
        assert change.version > last.get(change.key, 0), (change.key, change.version)
        last[change.key] = change.version
    assert last == final  # nobody is left on a stale value
    assert collected.error is None


# 4. aclose() delivers every change committed before it.


async def test_close_delivers_every_committed_change(url: str) -> None:
    """subscribe, three saves, leave `async with`: the callback got [0, 1, 2], every time."""
    for _ in range(5):
        seen: list[Any] = []
        config = StateConfig(backend="redis", redis_url=url, key_prefix=unique_prefix())
        async with StateManager(config) as state:
            state.subscribe("n:*", functools.partial(_record_new, seen))
            for number in range(3):
                await state.save("n:1", number)  # one key: in order on a cluster too
        assert seen == [0, 1, 2]


# 7. Key prefixes have a boundary.


@pytest.mark.parametrize("prefix", ["app1", "app:1", "t-", "app1:\x00:"])
def test_prefix_without_a_boundary_is_refused(redis_url: str, prefix: str) -> None:
    """A prefix must end with ':' (or be empty): a clear ConfigurationError otherwise."""
    with pytest.raises(ConfigurationError, match="key_prefix"):
        RedisBackend(url=redis_url, key_prefix=prefix)
    with pytest.raises(ConfigurationError, match="key_prefix"):
        StateManager(StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix))
    with pytest.raises(ConfigurationError, match="key_prefix"):
        RedisBackend.from_url(f"{redis_url}?key_prefix={prefix}")


async def test_overlapping_prefixes_are_isolated(url: str) -> None:
    """`app1:` never sees `app12:`: not its keys, not its changes, and cannot overwrite them."""
    base = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=f"{base}app1:") as one,
        RedisBackend(url=url, key_prefix=f"{base}app12:") as twelve,
        one.changes("*") as stream,
        anyio.create_task_group() as tg,
    ):
        collected = _Reader(stream)
        tg.start_soon(collected.run)
        await twelve.set("x", b"12")
        await one.set("2x", b"1")
        await collected.until(lambda changes: len(changes) >= 1)
        assert [change.key for change in collected.changes] == ["2x"]
        assert [key async for key in one.scan("*")] == ["2x"]
        entry = await twelve.get("x")
        assert entry is not None
        assert entry.value == b"12"
        tg.cancel_scope.cancel()


# 8. changes() is live on entry: another client's write right after entry is delivered.


async def test_changes_is_live_on_entry_for_another_clients_writes(url: str) -> None:
    """Enter changes() on one client, write at once on another: delivered, 20 times over."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
    ):
        for number in range(20):
            # New patterns and a pattern joined while already subscribed, alternately.
            pattern = f"live:{number}" if number % 2 else "live:*"
            async with reader.changes(pattern) as stream:
                await writer.set(f"live:{number}", b"%d" % number)
                with anyio.fail_after(5):
                    change = await stream.__anext__()
                assert change.key == f"live:{number}"


async def test_manager_watch_sees_another_processes_first_write(url: str) -> None:
    """A watch entered on one manager sees a save made at once by another manager."""
    config = StateConfig(backend="redis", redis_url=url, key_prefix=unique_prefix())
    async with StateManager(config) as reader, StateManager(config) as writer:
        for number in range(10):
            async with reader.watch(f"w:{number}") as changes:
                await writer.save(f"w:{number}", number)
                with anyio.fail_after(5):
                    change = await changes.__anext__()
                assert change.new_value == number


# 9. Under trio, a typed ConfigurationError; overflow logs name the user's pattern.


def test_every_entry_point_raises_configuration_error_under_trio(redis_url: str) -> None:
    """open, get, set, changes, ... under trio: ConfigurationError, not a RuntimeError."""
    pytest.importorskip("trio")
    outcomes: dict[str, str] = {}

    async def main() -> None:
        backend = RedisBackend(url=redis_url, key_prefix=unique_prefix())
        calls: dict[str, Callable[[], Any]] = {
            "open": backend.open,
            "get": lambda: backend.get("k"),
            "get_many": lambda: backend.get_many(["k"]),
            "set": lambda: backend.set("k", b"v"),
            "set_many": lambda: backend.set_many([("k", b"v")]),
            "delete": lambda: backend.delete("k"),
            "update": lambda: backend.update("k", lambda entry: b"v"),
            "index_add": lambda: backend.index_add("i", {"m": 1.0}),
            "scan": lambda: backend.scan("*").__anext__(),
            "changes": lambda: backend.changes("*").__aenter__(),
        }
        for name, call in calls.items():
            try:
                await call()
            except ConfigurationError:
                outcomes[name] = "ConfigurationError"
            except BaseException as exc:  # noqa: BLE001  # recorded and asserted below
                outcomes[name] = repr(exc)
            else:
                outcomes[name] = "no error"
        await backend.aclose()
        with pytest.raises(ConfigurationError):
            async with StateManager(backend=backend) as state:
                await state.save("k", 1)

    anyio.run(main, backend="trio")
    assert outcomes == dict.fromkeys(outcomes, "ConfigurationError")
    assert len(outcomes) == 10


async def test_overflow_log_names_the_users_pattern(redis_url: str) -> None:
    """A subscriber that falls behind is logged with its own pattern, not an internal one."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=prefix) as writer,
        RedisBackend(url=redis_url, key_prefix=prefix) as reader,
        reader.changes("ov:*", max_buffer=1) as stream,
    ):
        with capture_logs() as logs:
            for number in range(3):
                await writer.set(f"ov:{number}", b"x")
            await _wait_for(lambda: any(e["event"] == "subscriber_overflow" for e in logs))
        with pytest.raises(SubscriptionClosedError):
            async for _ in stream:
                pass
    overflow = next(e for e in logs if e["event"] == "subscriber_overflow")
    assert overflow["pattern"] == "ov:*"


# Adversarial: many overlapping patterns, storms, cancellation mid-subscribe.


def _patterns(rng: random.Random) -> list[str]:
    pieces = ["*", "?", "a", "b", ":", "[ab]", "[^a]", "a*", "*:b", "\\*", "ab"]
    made = {"*", "a:*", "a*", "*b", "a:b", "a:?", "[ab]:*"}
    while len(made) < 60:
        made.add("".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))))
    return sorted(made)


async def test_many_overlapping_patterns_each_get_exactly_their_changes(url: str) -> None:
    """60 generated overlapping patterns on one backend: each gets its keys' changes, once each,
    in version order per key (a cluster's shards are not ordered with each other)."""
    rng = random.Random(15)
    prefix = unique_prefix()
    patterns = _patterns(rng)
    keys = ["".join(rng.choice("ab:*") for _ in range(rng.randint(1, 5))) for _ in range(40)]
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
    ):
        async with contextlib.AsyncExitStack() as stack:
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            readers: dict[str, _Reader] = {}
            for pattern in patterns:
                stream = await stack.enter_async_context(reader.changes(pattern, max_buffer=10_000))
                readers[pattern] = _Reader(stream)
                tg.start_soon(readers[pattern].run)
            written: list[tuple[str, int]] = []
            for number in range(300):
                key = rng.choice(keys)
                change = await writer.set(key, b"%d" % number)
                written.append((key, change.version))
            for pattern, collected in readers.items():
                expected = [pair for pair in written if glob_match(pattern, pair[0])]
                await collected.until(functools.partial(_at_least, len(expected)))
                got = [(c.key, c.version) for c in collected.changes]
                assert _per_key(got) == _per_key(expected), pattern
                if not reader.is_cluster:
                    assert got == expected, pattern
        assert not reader._groups


def _per_key(pairs: list[tuple[str, int]]) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = collections.defaultdict(list)
    for key, version in pairs:
        grouped[key].append(version)
    return dict(grouped)


async def test_subscribe_unsubscribe_storm_leaves_nothing_behind(url: str) -> None:
    """200 subscriptions opened and closed concurrently while writes go on: all state is gone,
    and a subscription afterwards gets exactly the later writes."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
    ):

        async def churn(number: int) -> None:
            async with reader.changes(f"s:{number % 7}*") as stream:
                await writer.set(f"s:{number % 7}", b"%d" % number)
                with anyio.fail_after(5):
                    change = await stream.__anext__()
                assert change.key == f"s:{number % 7}"

        async with anyio.create_task_group() as tg:
            for number in range(200):
                tg.start_soon(churn, number)
        assert not reader._groups
        assert len(reader._index) == 0
        assert not reader._barriers
        async with reader.changes("s:*") as stream:
            await writer.set("s:last", b"x")
            with anyio.fail_after(5):
                change = await stream.__anext__()
        assert change.key == "s:last"


async def test_cancel_mid_subscribe_leaves_nothing_behind(url: str) -> None:
    """A changes() cancelled before it is live leaves no group or barrier; the next one works."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
    ):
        for _ in range(5):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with reader.changes("c:*"):
                    pytest.fail("entered a cancelled subscription")
            assert not reader._groups
            assert not reader._barriers
        async with anyio.create_task_group() as tg:

            async def enter_and_hang() -> None:
                async with reader.changes("c:*"):
                    await anyio.sleep_forever()

            tg.start_soon(enter_and_hang)
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        assert not reader._groups
        async with reader.changes("c:*") as stream:
            await writer.set("c:1", b"x")
            with anyio.fail_after(5):
                change = await stream.__anext__()
        assert change.key == "c:1"


async def test_foreign_messages_on_the_channels_are_skipped(url: str) -> None:
    """A PUBLISH of garbage on a change channel neither breaks nor reconnects the subscriber."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        RedisBackend(url=url) as everything,  # the empty prefix hears every prefix, barriers too
        reader.changes("*") as stream,
        everything.changes("*") as wide,
    ):
        with capture_logs() as logs:
            for garbage in (b"", b"S", b"Wxyz", b"D" + b"9" * 40):
                await writer._execute("PUBLISH", f"__agenticstate__:{prefix}g", garbage)
            await writer.set("real", b"1")
            with anyio.fail_after(5):
                change = await stream.__anext__()
            async with writer.changes("other"):  # a cluster's barrier markers reach `everything`
                pass
            await writer.set("real", b"2")
            with anyio.fail_after(5):
                seen = [await wide.__anext__(), await wide.__anext__()]
        assert change.key == "real"
        assert [c.key for c in seen] == [f"{prefix}real"] * 2
        assert not [e for e in logs if e["event"] == "pubsub_reconnecting"]


async def test_subscriptions_made_during_a_reconnect_are_live_on_entry(url: str) -> None:
    """Subscriptions entered while the pub/sub connection is being killed are live on entry."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("warm"),  # the connection exists, so the kills below hit it
    ):
        for attempt in range(4):

            async def subscribe_and_check(number: int, attempt: int = attempt) -> None:
                key = f"r:{attempt}:{number}"
                async with reader.changes(key) as stream:
                    await writer.set(key, b"x")
                    with anyio.fail_after(10):
                        change = await stream.__anext__()
                assert change.key == key

            async with anyio.create_task_group() as tg:
                for number in range(10):
                    tg.start_soon(subscribe_and_check, number)
                    if number == 3:
                        await _kill_pubsub(url)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_writes_expiry_and_drops_converge_without_duplicates(
    url: str, seed: int
) -> None:
    """Random writes (some with a short TTL, expiring and written again) and deletes under
    overlapping subscriptions, the pub/sub connection killed now and then: every subscription
    ends on the real state of its keys, with no value delivered twice."""
    rng = random.Random(seed)
    prefix = unique_prefix()
    keys = [f"{a}:{b}{c}" for a in "ab" for b in "12" for c in ("", "x", "y", "*")]
    patterns = ["*", "a*", "a:1?", "[ab]:2*", "b:*x", "a:1", "b:1\\*", "?:2"]
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        contextlib.AsyncExitStack() as stack,
    ):
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        readers: dict[str, _Reader] = {}
        for pattern in patterns:
            readers[pattern] = _Reader(
                await stack.enter_async_context(reader.changes(pattern, max_buffer=100_000))
            )
            tg.start_soon(readers[pattern].run)
        # Keys ever written with a TTL: a subscriber is not told of an expiry (on no backend),
        # so such a value may linger in its view; after an outage that hid the key's later
        # writes and its delete, the resync cannot tell that from an expiry either.
        expiring: set[str] = set()
        for step in range(600):
            key = rng.choice(keys)
            if step % 150 == 75:
                await _kill_pubsub(url)
            roll = rng.random()
            if roll < 0.2:
                await writer.delete(key)  # may find it expired already: nothing to tell
            elif roll < 0.35:
                ttl = timedelta(milliseconds=rng.randint(5, 40))
                await writer.set(key, b"%d" % step, ttl=ttl)
                expiring.add(key)
            else:
                await writer.set(key, b"%d" % step)
        checked = [key for key in keys if key not in expiring]
        real = {
            key: entry.value
            for key, entry in zip(checked, await writer.get_many(checked), strict=True)
            if entry is not None
        }

        def differences() -> dict[str, dict[str, tuple[bytes | None, bytes | None]]]:
            found = {}
            for pattern, collected in readers.items():
                view = {k: v for k, v in _view(collected.changes).items() if k in checked}
                wanted = {k: v for k, v in real.items() if glob_match(pattern, k)}
                if view != wanted:
                    found[pattern] = {
                        k: (view.get(k), wanted.get(k))
                        for k in view.keys() | wanted.keys()
                        if view.get(k) != wanted.get(k)
                    }
            return found

        with contextlib.suppress(TimeoutError):
            await _wait_for(lambda: not differences(), 20)
        assert not differences()
        for pattern, collected in readers.items():
            assert collected.error is None, pattern
            # No value twice in a row for a key. (Two deletes in a row can both be real: the
            # write between them may have been lost in an outage, which is allowed.)
            last: dict[str, tuple[int, bytes | None]] = {}
            for change in collected.changes:
                if change.new is not None:
                    assert last.get(change.key) != (change.version, change.new), (
                        pattern,
                        [
                            (c.op.value, c.version, c.new, c.timestamp.time())
                            for c in collected.changes
                            if c.key == change.key
                        ],
                    )
                last[change.key] = (change.version, change.new)


def _view(changes: list[Change]) -> dict[str, bytes]:
    """What a subscriber believes from its changes: the latest value of each key."""
    view: dict[str, bytes] = {}
    for change in changes:
        if change.new is None:
            view.pop(change.key, None)
        else:
            view[change.key] = change.new
    return view


async def test_close_wakes_a_subscription_still_waiting_to_go_live() -> None:
    """aclose() while changes() waits for an unreachable server: BackendError at once."""
    backend = RedisBackend(url="redis://127.0.0.1:9/0", connect_timeout=0.2, socket_timeout=30)
    failures: list[BaseException] = []

    async def subscribe() -> None:
        try:
            async with backend.changes("*"):
                pytest.fail("live without a server")
        except BackendError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscribe)
        await _wait_for(lambda: bool(backend._barriers))
        with anyio.fail_after(5):  # not the 30 s a subscription may wait for the server
            await backend.aclose()
            await _wait_for(lambda: bool(failures))
    assert "closed" in str(failures[0])


async def test_a_thousand_patterns_share_one_connection_and_few_psubscribes(redis_url: str) -> None:
    """1,000 patterns on one backend: one pub/sub connection holding at most 16 patterns (the
    narrow prefixes `agent:0:` ... merged into `agent:0` ... `agent:9`: every pattern on a server
    costs each PUBLISH a match)."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=prefix) as writer,
        RedisBackend(url=redis_url, key_prefix=prefix) as reader,
        aioredis.Redis.from_url(redis_url) as admin,
        contextlib.AsyncExitStack() as stack,
    ):
        streams = [
            await stack.enter_async_context(reader.changes(f"agent:{number}:*"))
            for number in range(1000)
        ]
        clients = await admin.client_list(_type="pubsub")
        subscribed = [c for c in clients if int(c.get("psub", 0)) > 0]
        assert len(subscribed) == 1
        assert 1 <= int(subscribed[0]["psub"]) <= 16
        await writer.set("agent:999:x", b"x")
        with anyio.fail_after(5):
            change = await streams[999].__anext__()
        assert change.key == "agent:999:x"


# Narrow subscriptions (issue 21): the connection holds each subscription's literal prefix.


async def _psub(admin: aioredis.Redis) -> list[int]:
    """The pattern count of every pub/sub connection that holds a pattern."""
    clients = await admin.client_list(_type="pubsub")
    return [int(c["psub"]) for c in clients if int(c.get("psub", 0)) > 0]


async def test_a_subscription_reads_nothing_written_outside_its_prefix(url: str) -> None:
    """`a:*` is subscribed as the prefix `a:`: 50 writes under `b:` never reach the reader."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("a:*") as stream,
    ):
        before = reader._received  # a cluster's barrier markers came before
        for number in range(50):
            await writer.set(f"b:{number}", b"x")
        await writer.set("a:1", b"y")
        with anyio.fail_after(5):
            change = await stream.__anext__()
        assert change.key == "a:1"
        assert reader._received - before == 1


async def test_overlapping_prefixes_deliver_each_change_once(url: str) -> None:
    """`a:x:*`, `a:*`, `a:x:1` and `*a:x*` on one backend (covered by one prefix, then by none):
    every subscription gets each of its changes once, in order (per key on a cluster)."""
    prefix = unique_prefix()
    patterns = ["a:x:*", "a:*", "a:x:1", "*a:x*"]
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        contextlib.AsyncExitStack() as stack,
    ):
        streams = [await stack.enter_async_context(reader.changes(p)) for p in patterns]
        keys = ["a:x:1", "a:x:2", "a:y", "ba:x", "a:x:1", "end"]
        for key in keys:
            await writer.set(key, b"v")
        for pattern, stream in zip(patterns, streams, strict=True):
            wanted = [k for k in keys if glob_match(pattern, k)]
            got: list[str] = []
            with anyio.fail_after(5):
                while len(got) < len(wanted):
                    got.append((await stream.__anext__()).key)
            if "cluster" in url.split("://", 1)[0]:
                # Shards are not ordered with each other: each key's changes in order, and the
                # same changes (only a:x:1 repeats, and one key lives on one shard).
                assert sorted(got) == sorted(wanted), pattern
            else:
                assert got == wanted, pattern
        # Nothing more came: a marker write every pattern but the exact one sees, then nothing.
        await writer.set("a:x:end", b"v")
        for pattern, stream in zip(patterns, streams, strict=True):
            if glob_match(pattern, "a:x:end"):
                with anyio.fail_after(5):
                    assert (await stream.__anext__()).key == "a:x:end", pattern


async def test_prefixes_subscribed_while_writes_go_on_lose_and_repeat_nothing(url: str) -> None:
    """While one process sets and deletes `a:x:k` without pause, another subscribes and
    unsubscribes `a:*` (which replaces `a:x:` on the server, then gives it back) and `a:x:1`:
    the long-lived `a:x:*` subscription gets every set and every delete once, in order (a
    delete is not deduplicated by version: a second copy would show)."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("a:x:*") as stream,
    ):
        done = anyio.Event()
        rounds = 0

        async def write() -> None:
            nonlocal rounds
            while not done.is_set() and rounds < 300:  # within the subscription's buffer
                await writer.set("a:x:k", b"%d" % rounds)
                await writer.delete("a:x:k")
                rounds += 1
                if rounds % 10 == 0:
                    await anyio.lowlevel.checkpoint()

        async def churn() -> None:
            for number in range(40):
                async with reader.changes("a:*" if number % 2 else "a:x:1"):
                    await anyio.lowlevel.checkpoint()
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            tg.start_soon(churn)
        await writer.set("a:x:k", b"end")
        seen = []
        with anyio.fail_after(10):
            async for change in stream:
                seen.append((change.op, change.new))
                if change.new == b"end":
                    break
        expected = [
            step
            for number in range(rounds)
            for step in ((ChangeOp.SET, b"%d" % number), (ChangeOp.DELETE, None))
        ]
        assert seen == [*expected, (ChangeOp.SET, b"end")]
        assert rounds > 20


async def test_a_change_two_confirmed_patterns_match_is_delivered_once(url: str) -> None:
    """Between the PSUBSCRIBE of a wider prefix and the PUNSUBSCRIBE of the narrower one it
    replaces, the server sends a change once per pattern: the subscriber keeps one. The window
    is held open here (the backend sends the two commands together)."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix) as writer,
        RedisBackend(url=url, key_prefix=prefix) as reader,
        reader.changes("a:x:*") as stream,
    ):
        link = reader._link
        assert link is not None
        wider = escape_glob(reader._channel_text + "a:").encode() + b"*"
        reader._sent[wider] = ("a:", False)
        link.send("PSUBSCRIBE", wider)
        await reader._round_trip()
        assert reader._overlap
        await writer.set("a:x:k", b"1")
        await writer.delete("a:x:k")
        del reader._sent[wider]
        link.send("PUNSUBSCRIBE", wider)
        await writer.set("a:x:k", b"end")
        seen = []
        with anyio.fail_after(5):
            async for change in stream:
                seen.append((change.op, change.new))
                if change.new == b"end":
                    break
        assert seen == [(ChangeOp.SET, b"1"), (ChangeOp.DELETE, None), (ChangeOp.SET, b"end")]
        assert not reader._overlap


async def test_the_connection_holds_the_covering_prefixes_only(redis_url: str) -> None:
    """`a:x:*` then `a:*` (covers it) then `*` (covers all): one pattern each time; leaving
    them gives the narrower ones back, and the last one leaves none."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=prefix) as reader,
        aioredis.Redis.from_url(redis_url) as admin,
        contextlib.AsyncExitStack() as outer,
    ):
        await outer.enter_async_context(reader.changes("a:x:*"))
        assert await _psub(admin) == [1]
        async with reader.changes("a:*"), reader.changes("b:1"):
            assert await _psub(admin) == [2]  # `a:` and the key `b:1`
            async with reader.changes("*"):
                assert sorted(reader._sent.values()) == [("", False)]
                await _wait_for_psub(admin, [1])
        assert sorted(reader._sent.values()) == [("a:x:", False)]
        await outer.aclose()
        await _wait_for_psub(admin, [])


async def _wait_for_psub(admin: aioredis.Redis, expected: list[int]) -> None:
    """Wait until the server holds `expected` patterns (a PUNSUBSCRIBE gets no reply awaited)."""
    with anyio.fail_after(5):
        # A poll with a deadline: the server's state has no event to wait on.
        while await _psub(admin) != expected:  # noqa: ASYNC110
            await anyio.sleep(0.01)
