"""Another ACL user PUBLISHes on a store's channels while it is written: nothing forged arrives.

A notification is a hint: a subscriber delivers what the store holds (the feed entry it names,
or, without a feed, what the key holds), so a message someone else publishes can neither inject
a change nor move a position. Mallory, an ACL user who may publish and subscribe on every
channel but touch no key, listens to the store's real messages and publishes, during 400 real
writes: notifications of made-up and far-future feed ids, of other keys' entries, of streams
that are not this store's; every real notification again, late and out of order; changes in the
format an earlier version of this library published (made-up versions and values); and markers
on every barrier channel she heard. Subscribers, one opened before and one after the flood, and
a `LocalView`, get exactly the real changes, on plain Redis and on Redis Cluster.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from agenticstate import RedisBackend, StateConfig, StateManager
from agenticstate.backends import ChangeOp
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Change

pytestmark = pytest.mark.redis

WRITES = 400
KEYS = 8
WAIT = 30.0
USER, PASSWORD = "mallory", "mallory-pw"


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """The URL of a plain redis-server, then of the 3-primary Redis Cluster."""
    name = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(name))


def _nodes(url: str) -> list[dict[str, Any]]:
    """Connection settings of every server behind `url` (each node of a cluster)."""
    parts = urlsplit(url)
    if parts.scheme.endswith("+cluster"):
        hosts = [hp.rpartition(":") for hp in parts.netloc.rpartition("@")[2].split(",")]
        return [{"host": host, "port": int(port)} for host, _, port in hosts]
    if parts.scheme == "unix":
        return [{"unix_socket_path": parts.path}]
    return [{"host": parts.hostname, "port": parts.port or 6379}]


async def _mallory(url: str) -> list[aioredis.Redis]:
    """An ACL user on every node who may publish and subscribe on any channel, and no more."""
    for node in _nodes(url):
        async with aioredis.Redis(**node) as admin:
            await admin.execute_command(  # type: ignore[no-untyped-call]
                "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "&*",
                "+publish", "+psubscribe", "+subscribe", "+ping", "+hello", "+client",
            )  # fmt: skip
    return [aioredis.Redis(**node, username=USER, password=PASSWORD) for node in _nodes(url)]


class Forger:
    """Mallory: hears the store's real messages, and publishes forged ones."""

    def __init__(self, clients: list[aioredis.Redis], prefix: str) -> None:
        self.clients = clients
        self.prefix = prefix
        self.heard: list[tuple[bytes, bytes]] = []  # (channel, data), real ones only
        self.forged: set[bytes] = set()
        self.sent = 0
        self.rng = random.Random(7)

    async def listen(self, ready: anyio.Event) -> None:
        pubsub = self.clients[0].pubsub()
        async with pubsub:
            await pubsub.psubscribe(f"__agenticstate__:{self.prefix}*")
            ready.set()
            async for message in pubsub.listen():
                if message["type"] == "pmessage" and message["data"] not in self.forged:
                    self.heard.append((message["channel"], message["data"]))

    async def publish(self, channel: bytes | str, data: bytes) -> None:
        self.forged.add(data)
        await self.rng.choice(self.clients).publish(channel, data)
        self.sent += 1

    async def flood(self, rounds: int) -> None:
        """Publish each kind of forgery `rounds` times, interleaved."""
        rng = self.rng
        channel = f"__agenticstate__:{self.prefix}"
        for _ in range(rounds):
            key = f"k{rng.randrange(KEYS)}"
            real = [item for item in self.heard if item[1][:1] == b"F"]
            stream = real[-1][1].split(b" ", 1)[1] if real else self.prefix.encode()
            far = b"%d-%d" % (rng.randrange(1, 1 << 50), rng.randrange(1, 1 << 40))
            forgeries: list[tuple[bytes | str, bytes]] = [
                (channel + key, b"F" + far + b" " + stream),  # a made-up, far-future id
                (channel + key, b"F99999999999999-1 " + stream),
                (channel + key, b"F1-1 " + stream),  # long gone (or never was)
                (channel + key, b"F1-1 __not_a_stream__"),
                (channel + key, b"F" + far),  # malformed
                # An earlier version's message: a change with a made-up version and value.
                (channel + key, _old_message(far, rng.randrange(1, 10**6))),
                (channel + key, b"W" + b"%020d" % rng.randrange(1, 10**6) + b"0" * 30 + b"0evil"),
                (channel + key, b"D" + b"%020d" % 999_999 + b"0" * 15 + b"0"),
            ]
            if real:
                # A real notification, on another key's channel, and again late.
                other_channel, data = rng.choice(real)
                forgeries.append((channel + key, data))
                forgeries.append((other_channel, data))
                forgeries.append(rng.choice(real))
            markers = [item[0] for item in self.heard if b"barrier" in item[0]]
            if markers:
                forgeries.append((rng.choice(markers), b"99999999999999"))
            for forged_channel, data in forgeries:
                await self.publish(forged_channel, data)
            await anyio.lowlevel.checkpoint()


def _old_message(at: bytes, version: int) -> bytes:
    """A change as an earlier version of this library published it, all made up."""
    return (
        b"X" + at + b" 0-0 W" + b"%020d" % version + b"1700000000000".zfill(15)
        + b"0" * 15 + b"0" + b"forged"
    )  # fmt: skip


async def _collect(
    changes: AsyncIterator[Change], into: list[Change], done: anyio.Event, wanted: int = 1
) -> None:
    """Collect into `into` until `wanted` changes of the key "end" came, and every key holds
    its last value (on a cluster, slots deliver apart: "end" may come before another slot's
    last change)."""
    ends = 0
    async for change in changes:
        into.append(change)
        ends += change.key == "end"
        if ends >= wanted and _settled(into):
            done.set()


def _settled(into: list[Change]) -> bool:
    """Whether every key's last change received is its final write (see `FINAL`)."""
    last = {change.key: change.new for change in into}
    return all(last.get(key) == value for key, value in FINAL.items())


FINAL: dict[str, bytes] = {}  # each key's last written value, set by the test as it writes


async def test_forged_messages_deliver_nothing_and_hide_nothing(url: str) -> None:
    """Forged, replayed, reordered and far-future messages from another ACL user during real
    writes: subscribers (opened before and after) and a view get exactly the real changes,
    and the messages ignored are reported with a warning."""
    prefix = unique_prefix()
    clients = await _mallory(url)
    forger = Forger(clients, prefix)
    FINAL.clear()
    written: dict[str, list[bytes]] = defaultdict(list)
    early: list[Change] = []
    late: list[Change] = []
    try:
        with capture_logs() as logs:
            async with (
                RedisBackend(url=url, key_prefix=prefix) as writer,
                RedisBackend(url=url, key_prefix=prefix) as reader,
                reader.changes("*", max_buffer=100_000) as before,
                anyio.create_task_group() as tg,
            ):
                heard = anyio.Event()
                tg.start_soon(forger.listen, heard)
                with anyio.fail_after(WAIT):
                    await heard.wait()
                early_done, late_done = anyio.Event(), anyio.Event()
                tg.start_soon(_collect, before, early, early_done)
                rng = random.Random(3)
                for number in range(WRITES):
                    key = f"k{rng.randrange(KEYS)}"
                    value = b"%d" % number
                    await writer.set(key, value)
                    written[key].append(value)
                    FINAL[key] = value
                    if number % 8 == 0:
                        await forger.flood(1)
                    if number == WRITES // 2:
                        late_stream = await tg.start(_open_late, reader, late, late_done)
                await forger.flood(20)  # a flood after the last real change too
                await writer.set("end", b"end")
                with anyio.fail_after(WAIT):
                    await early_done.wait()
                    await late_done.wait()
                assert late_stream is not None
                tg.cancel_scope.cancel()
    finally:
        for client in clients:
            await client.aclose()
    assert forger.sent > 500
    for received in (early, late):
        assert [c for c in received if c.op is not ChangeOp.SET] == []  # no RESYNC, no delete
        by_key: dict[str, list[bytes]] = defaultdict(list)
        for change in received:
            assert change.new is not None
            by_key[change.key].append(change.new)
        assert by_key.pop("end") == [b"end"]
        if received is early:
            assert dict(by_key) == dict(written)
        else:  # everything from when it opened, in order
            for key, values in by_key.items():
                assert values == written[key][len(written[key]) - len(values) :]
            assert sum(map(len, by_key.values())) >= WRITES // 2 - 1
    assert any(event["event"] == "pubsub_message_ignored" for event in logs)


async def _open_late(
    reader: RedisBackend,
    late: list[Change],
    done: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[object] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A subscription opened mid-flood (after far-future ids were published)."""
    async with reader.changes("*", max_buffer=100_000) as changes:
        task_status.started(changes)
        await _collect(changes, late, done)


async def test_a_view_follows_only_real_changes_through_forged_messages(url: str) -> None:
    """A `LocalView` fed through forged messages holds exactly the real final state."""
    prefix = unique_prefix()
    clients = await _mallory(url)
    forger = Forger(clients, prefix)
    config = StateConfig(backend="redis", redis_url=url, key_prefix=prefix)
    try:
        async with (
            StateManager(config) as state,
            state.view("*") as view,
            anyio.create_task_group() as tg,
        ):
            heard = anyio.Event()
            tg.start_soon(forger.listen, heard)
            with anyio.fail_after(WAIT):
                await heard.wait()
            final: dict[str, int] = {}
            for number in range(200):
                key = f"k{number % KEYS}"
                await state.save(key, number)
                final[key] = number
                if number % 10 == 0:
                    await forger.flood(1)
            await state.save("end", True)
            # On a cluster slots deliver apart: "end" may come before another slot's last
            # change, so wait for the final state itself (the view converges to it).
            final["end"] = True
            with anyio.move_on_after(WAIT):  # then the assertion shows what the view missed
                await view.wait_until(lambda v: all(v.get(k) == final[k] for k in final))
            assert {key: view.get(key) for key in final} == final
            tg.cancel_scope.cancel()
    finally:
        for client in clients:
            await client.aclose()


async def test_without_a_feed_forged_changes_are_never_delivered(url: str) -> None:
    """With the feed off a message carries its change; a subscriber checks it against the key:
    of the forged changes (made-up versions and values) none is delivered, and the last value
    of every key arrives."""
    prefix = unique_prefix()
    clients = await _mallory(url)
    forger = Forger(clients, prefix)
    received: list[Change] = []
    final = FINAL
    final.clear()
    try:
        async with (
            RedisBackend(url=url, key_prefix=prefix, feed=None) as writer,
            RedisBackend(url=url, key_prefix=prefix, feed=None) as reader,
            reader.changes("*", max_buffer=100_000) as changes,
            anyio.create_task_group() as tg,
        ):
            heard = anyio.Event()
            tg.start_soon(forger.listen, heard)
            with anyio.fail_after(WAIT):
                await heard.wait()
            done = anyio.Event()
            tg.start_soon(_collect, changes, received, done)
            for number in range(200):
                key = f"k{number % KEYS}"
                await writer.set(key, b"%d" % number)
                final[key] = b"%d" % number
                if number % 10 == 0:
                    await forger.flood(1)
            await writer.set("end", b"end")
            with anyio.fail_after(WAIT):
                await done.wait()
            tg.cancel_scope.cancel()
    finally:
        for client in clients:
            await client.aclose()
    real = {b"%d" % number for number in range(200)} | {b"end"}
    # Nothing made up: every value is one written, every version one the key held. (A delete
    # no change vouches for comes as the key's state, gone: a RESYNC with no value.)
    assert [c for c in received if c.new not in real and c.op is not ChangeOp.RESYNC] == []
    assert [
        c for c in received if c.op is ChangeOp.RESYNC and (c.new, c.version) != (None, 0)
    ] == []
    assert [c for c in received if c.op is ChangeOp.SET and c.version > 200 // KEYS + 1] == []
    last = {change.key: change.new for change in received}
    assert {key: last[key] for key in final} == final
