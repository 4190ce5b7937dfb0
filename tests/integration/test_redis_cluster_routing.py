"""RedisBackend's own cluster routing: a slot migrated between primaries while writes go on.

Commands go out on connections the backend holds to each primary, routed by a slot map of its
own (issue #21, 5). These tests move a slot from one primary to the other with CLUSTER SETSLOT
and MIGRATE, as `redis-cli --cluster reshard` does, and check that the routing follows: ASK
while the slot is migrating (a key not yet moved is served by the old owner, a moved one by the
new one, after ASKING; a write split between them waits on TRYAGAIN), MOVED once it has moved,
and every write landing exactly once;
and that after a coordinated failover the demoted primary's MOVED replies lead to the new map.
Failover under load (coordinated, then a killed primary) is in test_redis_cluster.py.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from redis.exceptions import ResponseError

from agenticstate import RedisBackend
from agenticstate.backends._redis_wire import key_slot
from tests._redis_cluster import RedisClusterServers
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests._redis_server import RedisServer

pytestmark = pytest.mark.redis

TAG = "{moving}"  # every key of these tests lives in this tag's slot
SLOT = key_slot(TAG)
WRITERS = 8
KEYS = 40


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster of this test's own: 2 primaries, so a slot has somewhere to go."""
    servers = RedisClusterServers(tmp_path / "cluster", primaries=2)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


def _owner_and_other(cluster: RedisClusterServers) -> tuple[RedisServer, RedisServer]:
    """The primary owning SLOT now, and the other one."""
    with cluster.client(cluster.nodes[0]) as client:
        ranges = client.execute_command("CLUSTER SLOTS")
    port = next(primary[1] for start, end, primary, *_ in ranges if start <= SLOT <= end)
    owner = next(node for node in cluster.nodes if node.port == port)
    return owner, next(node for node in cluster.nodes if node is not owner)


def _node_id(cluster: RedisClusterServers, node: RedisServer) -> str:
    with cluster.client(node) as client:
        found = client.execute_command("CLUSTER MYID")
    return found.decode() if isinstance(found, bytes) else str(found)


def _start_migration(
    cluster: RedisClusterServers, source: RedisServer, target: RedisServer
) -> None:
    with cluster.client(target) as client:
        client.execute_command("CLUSTER SETSLOT", SLOT, "IMPORTING", _node_id(cluster, source))
    with cluster.client(source) as client:
        client.execute_command("CLUSTER SETSLOT", SLOT, "MIGRATING", _node_id(cluster, target))


def _move_keys(
    cluster: RedisClusterServers, source: RedisServer, target: RedisServer, batch: int
) -> int:
    """MIGRATE the slot's keys from `source` to `target`, `batch` at a time; how many moved."""
    moved = 0
    with cluster.client(source) as client:
        while True:
            keys = client.execute_command("CLUSTER GETKEYSINSLOT", SLOT, batch)
            if not keys:
                return moved
            client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)


def _finish_migration(cluster: RedisClusterServers, target: RedisServer) -> None:
    target_id = _node_id(cluster, target)
    for node in cluster.nodes:  # the new owner first, as redis-cli does
        with cluster.client(node) as client:
            client.execute_command("CLUSTER SETSLOT", SLOT, "NODE", target_id)


def _keys_in_slot(cluster: RedisClusterServers, node: RedisServer) -> list[str]:
    with cluster.client(node) as client:
        keys = client.execute_command("CLUSTER GETKEYSINSLOT", SLOT, 100)
    return sorted(key.decode() if isinstance(key, bytes) else key for key in keys)


def _stat(cluster: RedisClusterServers, node: RedisServer, section: str, name: str) -> int:
    with cluster.client(node) as client:
        found: Any = client.info(section).get(name, {})
    return int(found.get("calls", found.get("count", 0)))


def _wait_for_an_ask(cluster: RedisClusterServers, target: RedisServer) -> None:
    """Return once `target` has served a command after an ASKING, or after 60 s (the test's
    assertion on ASKING then fails)."""
    deadline = time.monotonic() + 60
    while not _stat(cluster, target, "commandstats", "cmdstat_asking"):
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


async def test_writes_during_a_slot_migration_land_exactly_once(
    cluster: RedisClusterServers,
) -> None:
    """Writers keep writing while the slot of their keys moves to the other primary: every
    acknowledged write is there exactly once (each key's version counts its writes), none
    fails, and the backend was redirected with ASK during the move and MOVED after it."""
    source, target = _owner_and_other(cluster)
    writes = dict.fromkeys((f"{TAG}:{n}" for n in range(KEYS)), 0)
    last: dict[str, bytes] = {}
    migrated = anyio.Event()
    async with RedisBackend(url=cluster.url, key_prefix=unique_prefix()) as backend:
        for key in list(writes)[: KEYS // 2]:  # half the keys exist before the move
            await backend.set(key, b"0")
            writes[key] += 1
            last[key] = b"0"

        async def writer(first: int) -> None:
            n = first
            after = 0
            while after < 100:  # until well past the end of the migration
                key = f"{TAG}:{n % KEYS}"
                value = b"%d" % n
                await backend.set(key, value)
                writes[key] += 1
                last[key] = value
                n += WRITERS
                if migrated.is_set():
                    after += 1

        async def migrate() -> None:
            await anyio.to_thread.run_sync(_start_migration, cluster, source, target)
            moved = await anyio.to_thread.run_sync(_move_keys, cluster, source, target, 3)
            assert moved >= KEYS // 2
            # The slot stays half-moved until a writer has followed an ASK to the target (on a
            # loaded machine the writers could otherwise miss the window altogether).
            await anyio.to_thread.run_sync(_wait_for_an_ask, cluster, target)
            await anyio.to_thread.run_sync(_finish_migration, cluster, target)
            migrated.set()

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for first in range(WRITERS):
                    tg.start_soon(writer, first)
                tg.start_soon(migrate)

        entries = await backend.get_many(list(writes))
    for (key, count), entry in zip(writes.items(), entries, strict=True):
        assert entry is not None, key
        assert (entry.version, entry.value) == (count, last[key]), key
    with cluster.client(target) as client:
        # The keys, the slot's change feed (its stream and counter), its revision counter and
        # its key index moved with them.
        assert client.execute_command("CLUSTER COUNTKEYSINSLOT", SLOT) == KEYS + 4
    with cluster.client(source) as client:
        assert client.execute_command("CLUSTER COUNTKEYSINSLOT", SLOT) == 0
    assert _stat(cluster, target, "commandstats", "cmdstat_asking") > 0  # ASK was followed
    assert _stat(cluster, source, "errorstats", "errorstat_MOVED") > 0  # and MOVED


async def test_ask_sends_a_key_not_yet_moved_to_the_new_owner_only_for_that_command(
    cluster: RedisClusterServers,
) -> None:
    """While the slot is migrating: a key still on the old owner is written there; a key moved
    to the new owner is read from it (ASK, then ASKING on the same connection), and the map is
    not changed by an ASK, so the old owner still serves the rest; a write creating a key waits
    (TRYAGAIN) until the migration is done, then lands once.

    Every write is a script on the key and the slot's revision counter (and, with the feed on,
    its stream): while a migration holds them on different nodes, or the key is new, Redis
    answers TRYAGAIN and the backend tries again until they are together (bounded by
    `socket_timeout`)."""
    source, target = _owner_and_other(cluster)
    async with RedisBackend(url=cluster.url, key_prefix=unique_prefix(), feed=None) as backend:
        await backend.set(f"{TAG}:old", b"before")
        await backend.set(f"{TAG}:moved", b"there")
        prefix = backend.key_prefix
        await anyio.to_thread.run_sync(_start_migration, cluster, source, target)

        change = await backend.set(f"{TAG}:old", b"after")  # still on the old owner
        assert change.version == 2
        with cluster.client(source) as client:  # one key moves ahead of the others
            client.execute_command(
                "MIGRATE", "127.0.0.1", target.port, f"{prefix}{TAG}:moved", 0, 5000
            )
        entry = await backend.get(f"{TAG}:moved")  # missing on the old owner: ASK
        assert entry is not None
        assert (entry.value, entry.version) == (b"there", 1)
        assert _stat(cluster, target, "commandstats", "cmdstat_asking") >= 1
        assert f"{prefix}{TAG}:old" in _keys_in_slot(cluster, source)

        async with anyio.create_task_group() as tg:
            written: list[int] = []

            async def create() -> None:
                written.append((await backend.set(f"{TAG}:new", b"fresh")).version)

            tg.start_soon(create)  # TRYAGAIN until the slot has moved whole
            await anyio.to_thread.run_sync(_move_keys, cluster, source, target, 10)
            await anyio.to_thread.run_sync(_finish_migration, cluster, target)
        assert written == [1]
        entries = await backend.get_many([f"{TAG}:old", f"{TAG}:new", f"{TAG}:moved"])
        assert [(entry.value, entry.version) for entry in entries if entry] == [
            (b"after", 2),
            (b"fresh", 1),
            (b"there", 1),
        ]
        assert sorted([key async for key in backend.scan(f"{TAG}:*")]) == [
            f"{TAG}:moved",
            f"{TAG}:new",
            f"{TAG}:old",
        ]


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """3 primaries, each with a replica."""
    servers = RedisClusterServers(tmp_path / "replicated", primaries=3, replicas=1)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


async def test_after_a_coordinated_failover_commands_follow_without_an_error(
    replicated: RedisClusterServers,
) -> None:
    """CLUSTER FAILOVER turns a primary into a replica: the connections held to it answer
    MOVED once, the backend re-reads the map and carries on, with no failed command at all."""
    async with RedisBackend(url=replicated.url, key_prefix=unique_prefix()) as backend:
        keys = [f"k{n}" for n in range(30)]  # spread over every primary
        for key in keys:
            await backend.set(key, b"1")
        victim = replicated.primary_nodes()[0]
        replica = replicated.replica_of(victim)

        def promoted() -> None:
            # A manual failover gives up after 5 s if the primary does not answer in time (a
            # loaded machine): ask again until it happens.
            deadline = time.monotonic() + 60
            while True:
                with replicated.client(replica) as client, contextlib.suppress(ResponseError):
                    client.execute_command("CLUSTER FAILOVER")  # refused once it is a primary
                attempt_ends = time.monotonic() + 10
                while time.monotonic() < attempt_ends:
                    primaries = replicated.primary_nodes()
                    if replica in primaries and victim not in primaries:
                        return
                    time.sleep(0.05)  # polling other processes' state, with a deadline
                assert time.monotonic() < deadline, "the failover did not happen"

        await anyio.to_thread.run_sync(promoted)
        await anyio.to_thread.run_sync(replicated.wait_ready)
        for key in keys:
            change = await backend.set(key, b"2")
            assert change.version == 2
        entries = await backend.get_many(keys)
        assert [entry.value for entry in entries if entry] == [b"2"] * len(keys)
        assert replica.port in {node.port for node in backend._cluster.primaries}
        assert victim.port not in {node.port for node in backend._cluster.primaries}
    # The first MOVED repointed its slot and had the whole map read again: the demoted
    # primary's other slots (about a third of the keys) were never sent there.
    assert _stat(replicated, victim, "errorstats", "errorstat_MOVED") == 1
