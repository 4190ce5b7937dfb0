"""The Redis key index: listings read it, never the keyspace (one server and Redis Cluster).

- With a million unrelated keys in the database, `list_keys` returns the same keys and the
  server runs exactly the same commands as with none (`INFO commandstats`): no SCAN.
- Expired keys: a listing never returns one and drops the names it meets; writes trim the due
  ones (two a script), so dead names do not pile up.
- Foreign keys: a name never written through agenticstate is not listed; a record that another
  client overwrote is listed (reading it raises `ForeignRecordError`).
- Migration: a store whose index was never built (an earlier release) builds it on its first
  listing, once, and logs it; two processes listing at once both get every key.
- A model-based rule: under generated writes, deletes, transactions and TTL expiry through
  nested stores, and writers SIGKILLed mid-write, `list_keys(p)` equals what a full SCAN
  finds, for generated patterns holding glob metacharacters, braces and U+10FFFF, and
  `scan_tags(p)` equals the tags of what the SCAN finds under `p{`.
- Tags: listing the agents reads one name per agent, however many checkpoints each has.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agenticstate import (
    AgentStateStore,
    ConflictError,
    ForeignRecordError,
    RedisBackend,
    StateConfig,
    StateManager,
)
from agenticstate._keys import escape_glob
from agenticstate.backends import Delete, Put
from agenticstate.backends._redis_keyindex import KEY_INDEX_NAMESPACE
from agenticstate.backends._redis_wire import key_slot
from tests._commandstats import command_counts
from tests._redis_cluster import RedisClusterServers
from tests._redis_server import RedisServer, require_redis
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from collections.abc import Iterator

    from anyio.from_thread import BlockingPortal

    from agenticstate.backends.base import TxnOp

pytestmark = pytest.mark.redis

RESERVED = b"__agenticstate"
BUILD_WORKER = "tests.integration._keyindex_build_worker"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private server that allows DEBUG POPULATE and announces expired keys."""
    found = RedisServer(
        tmp_path_factory.mktemp("key-index"),
        extra_args=("--enable-debug-command", "yes", "--notify-keyspace-events", "Ex"),
    )
    found.start()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private 3-primary cluster for the model-based test, whose truth is a SCAN of every key
    of every primary: on the session's cluster, which holds the keys of every test before it,
    that SCAN made the test take a minute instead of seconds."""
    cluster = RedisClusterServers(tmp_path_factory.mktemp("key-index-cluster"), primaries=3)
    try:
        cluster.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        if require_redis():
            pytest.fail(f"AGENTICSTATE_REQUIRE_REDIS=1 but no Redis Cluster could start: {exc}")
        pytest.skip(f"no Redis Cluster: {exc}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


def _admin(url: str) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(url)


def _primaries(url: str) -> list[sync_redis.Redis]:
    """A client per primary (one for a single server)."""
    if "+cluster" not in url:
        return [_admin(url)]
    hosts = url.split("://", 1)[1].split(",")
    first = _admin(f"redis://{hosts[0]}")
    try:
        nodes: dict[str, Any] = first.execute_command("CLUSTER NODES")  # type: ignore[no-untyped-call]
    finally:
        first.close()
    return [
        _admin(f"redis://{address.split('@')[0]}")
        for address, node in nodes.items()
        if "master" in str(node["flags"])
    ]


def _truth(url: str, prefix: str, pattern: str) -> list[str]:
    """What a full SCAN of every primary finds for `pattern` under `prefix`, as keys."""
    found = set()
    for client in _primaries(url):
        with client:
            for name in client.scan_iter(match=escape_glob(prefix) + pattern, count=5000):
                if not name.startswith(RESERVED):
                    found.add(name.decode()[len(prefix) :])
    return sorted(found)


async def _wait_expired(url: str, names: set[bytes]) -> None:
    """Wait (on the server's `expired` events) until none of `names` exists any more."""
    async with aioredis.Redis.from_url(url) as client, client.pubsub() as pubsub:
        await pubsub.subscribe("__keyevent@0__:expired")
        pending = {name for name in names if await client.exists(name)}
        with anyio.fail_after(20):
            while pending:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None:
                    pending.discard(message["data"])
                pending = {name for name in pending if await client.exists(name)}


def _index_members(url: str, prefix: str) -> list[bytes]:
    with _admin(url) as admin:
        return list(admin.zrange(KEY_INDEX_NAMESPACE + prefix, 0, -1))


# -------------------------------------------------------------- cost against unrelated keys


async def _listings(url: str, state: StateManager) -> tuple[list[list[str]], dict[str, int]]:
    async with command_counts(url) as counts:
        listed = [
            await state.list_keys("agents:{a1}:*"),
            await state.list_keys("agents:{*}:recovery"),
            await state.list_keys("agents:{a1}:cp:1?"),
        ]
    return listed, counts.calls


@pytest.mark.slow
async def test_a_million_unrelated_keys_cost_a_listing_nothing(server: RedisServer) -> None:
    """With 1,000,000 unrelated keys, listings return the same keys and the server runs the
    very same commands (no SCAN): the cost does not depend on the rest of the keyspace."""
    url = server.unix_url
    with _admin(url) as admin:
        admin.flushall()
    async with StateManager(
        StateConfig(), backend=RedisBackend(url=url, key_prefix="app:")
    ) as state:
        await state.save_many({f"agents:{{a1}}:cp:{n}": {"n": n} for n in range(25)})
        await state.save_many({f"agents:{{b{n}}}:recovery": {"n": n} for n in range(40)})
        await state.list_keys("other:*")  # builds the index once (an empty database)
        await state.list_keys("agents:{*}:recovery")  # the skip-scan's script loaded
        before, empty = await _listings(url, state)
        with _admin(url) as admin:
            admin.execute_command("DEBUG", "POPULATE", 1_000_000, "unrelated")
            assert admin.dbsize() > 1_000_000
        after, full = await _listings(url, state)
    with _admin(url) as admin:
        admin.flushall()  # the other tests SCAN this server for their truth
    assert after == before
    assert before[0] == sorted(f"agents:{{a1}}:cp:{n}" for n in range(25))
    assert before[1] == sorted(f"agents:{{b{n}}}:recovery" for n in range(40))
    assert before[2] == sorted(f"agents:{{a1}}:cp:{n}" for n in range(10, 20))
    assert "scan" not in full
    assert full == empty


@pytest.mark.slow
async def test_unrelated_keys_cost_a_cluster_listing_nothing(redis_cluster_url: str) -> None:
    """On a cluster too: a slot-pinned listing and one across every slot run the same commands
    with 100,000 and with 200,000 unrelated keys in the cluster, and no SCAN."""
    prefix = unique_prefix()
    unrelated = f"unrelated-{prefix}"
    seed = redis_cluster_url.split("://", 1)[1].split(",")[0]
    cluster = sync_redis.RedisCluster.from_url(f"redis://{seed}")
    found = []
    try:
        async with StateManager(
            StateConfig(), backend=RedisBackend(url=redis_cluster_url, key_prefix=prefix)
        ) as state:
            await state.save_many({f"agents:{{a1}}:cp:{n}": {"n": n} for n in range(25)})
            await state.save_many({f"agents:{{b{n}}}:recovery": {"n": n} for n in range(40)})
            await state.list_keys("other:*")
            for rounds in (1, 2):
                for tag in range(1000):
                    cluster.mset({f"{unrelated}{{{tag}}}:{rounds}:{n}": b"x" for n in range(100)})
                await _listings(redis_cluster_url, state)  # scripts loaded, map read
                found.append(await _listings(redis_cluster_url, state))
    finally:
        for rounds in (1, 2):
            for tag in range(1000):
                cluster.delete(*[f"{unrelated}{{{tag}}}:{rounds}:{n}" for n in range(100)])
        cluster.close()
    (fewer, fewer_calls), (more, more_calls) = found
    assert fewer == more
    assert fewer[0] == sorted(f"agents:{{a1}}:cp:{n}" for n in range(25))
    assert fewer[1] == sorted(f"agents:{{b{n}}}:recovery" for n in range(40))
    assert "scan" not in more_calls
    assert more_calls == fewer_calls


# -------------------------------------------------------------- tags: one step per id


async def _agents_listing(url: str, checkpoints: int) -> tuple[list[str], dict[str, int]]:
    """`list_agents` over 20 agents with `checkpoints` checkpoints each, and what it ran."""
    async with AgentStateStore(
        state_manager=StateManager(
            StateConfig(), backend=RedisBackend(url=url, key_prefix=unique_prefix())
        )
    ) as agents:
        await agents.state.save_many(
            {
                f"agents:{{a{n:02}}}:{part}": {"n": 1}
                for n in range(20)
                for part in ["state", *(f"checkpoints:{c}" for c in range(checkpoints))]
            }
        )
        await agents.list_agents()  # the script loaded, the index marked built
        async with command_counts(url) as counts:
            listed = await agents.list_agents()
        await agents.state.aclose()
    return listed, counts.calls


@pytest.mark.parametrize("cluster", [False, True])
async def test_listing_agents_costs_one_step_per_agent(
    server: RedisServer, redis_cluster_url: str, cluster: bool
) -> None:
    """20 agents with 2,000 checkpoints each are listed with the very commands 20 agents with
    one checkpoint take: one ZRANGE and one EXISTS per agent, never a read of a checkpoint."""
    url = redis_cluster_url if cluster else server.unix_url
    few, few_calls = await _agents_listing(url, 1)
    many, many_calls = await _agents_listing(url, 2_000)
    assert few == many == [f"a{n:02}" for n in range(20)]
    assert many_calls == few_calls
    assert many_calls["exists"] == 20


# -------------------------------------------------------------- skip-scan: one step per entity


async def _checkpoint_listing(url: str, others: int) -> tuple[list[str], dict[str, int]]:
    """`agents:{*}:state` over 20 agents with `others` other names each, and what it ran.

    Agent a00 also has a name only the `*` across a `}` matches (`agents:{a00}x}:state`), and
    one with two `}` that does not match: the braced set is not empty.
    """
    async with StateManager(
        StateConfig(), backend=RedisBackend(url=url, key_prefix=unique_prefix())
    ) as state:
        await state.save_many(
            {
                f"agents:{{a{n:02}}}:{part}": {"n": 1}
                for n in range(20)
                for part in ["state", *(f"cp:{c}" for c in range(others))]
            }
        )
        await state.save_many({"agents:{a00}x}:state": 1, "agents:{a00}:}y}": 2})
        await state.list_keys("agents:{*}:state")  # the scripts loaded, the index marked built
        async with command_counts(url) as counts:
            listed = await state.list_keys("agents:{*}:state")
    return listed, counts.calls


@pytest.mark.parametrize("cluster", [False, True])
async def test_listing_across_entities_costs_steps_per_entity_not_per_name(
    server: RedisServer, redis_cluster_url: str, cluster: bool
) -> None:
    """`agents:{*}:state` over 20 agents with 2,000 other names each runs the very commands
    it runs with one other name each: per agent two ZRANGE to find it and read its `:state`,
    one for its braced names, and an EXISTS per name listed; never a read of the others."""
    url = redis_cluster_url if cluster else server.unix_url
    few, few_calls = await _checkpoint_listing(url, 1)
    many, many_calls = await _checkpoint_listing(url, 2_000)
    expected = sorted([*(f"agents:{{a{n:02}}}:state" for n in range(20)), "agents:{a00}x}:state"])
    assert few == many == expected
    assert many_calls == few_calls
    if not cluster:
        # Two indexes, the store's and the empty prefix's (which it is nested in): each has
        # its braced set checked once and one ZRANGE past its last agent.
        assert many_calls["zrange"] == 3 * 20 + 2
        assert many_calls["exists"] == 2 + 20 + 2  # each of a00's braced names is checked


@pytest.mark.parametrize("cluster", [False, True])
async def test_a_skip_scan_goes_on_inside_an_entity_past_a_page(
    server: RedisServer, redis_cluster_url: str, cluster: bool
) -> None:
    """Entities with more matching names than a script's page (1,000) are listed whole: the
    next page goes on inside the entity, then reads its braced names and the next entity."""
    url = redis_cluster_url if cluster else server.unix_url
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        keys = [f"agents:{{a{n}}}:cp:{c:04}" for n in range(3) for c in range(1_500)]
        keys += ["agents:{a1}x}:cp:1", "agents:{a2}:other"]
        await backend.set_many([(key, b"v") for key in keys])
        listed = sorted([key async for key in backend.scan("agents:{*}:cp:*")])
    assert listed == sorted(key for key in keys if key != "agents:{a2}:other")


BRACY = st.text(st.sampled_from(["a", "b", "}", "{", ":", "*"]), max_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [False, True])
def test_skip_scans_list_what_a_scan_finds(
    server: RedisServer, redis_cluster_url: str, cluster: bool
) -> None:
    """Generated entity keys whose tags and tails hold more braces (the names a `*` matches
    across a `}`), some deleted, some rewritten through a nested store: every `<head>{*}<rest>`
    listing equals a full SCAN."""
    url = redis_cluster_url if cluster else server.unix_url

    @settings(max_examples=20 if cluster else 40, deadline=None, database=None)
    @given(
        keys=st.lists(st.tuples(st.sampled_from(["", "n:", "}"]), BRACY, BRACY), max_size=12),
        dropped=st.sets(st.integers(0, 11), max_size=4),
        patterns=st.lists(
            st.tuples(st.sampled_from(["", "n:", "}"]), BRACY), min_size=1, max_size=3
        ),
    )
    @example(keys=[("", "a", "b}:"), ("n:", "a", ":")], dropped=set(), patterns=[("", ":")])
    @example(keys=[("n:", "a", "}:"), ("n:", "a", "}:")], dropped={0}, patterns=[("n:", ":")])
    def check(
        keys: list[tuple[str, str, str]], dropped: set[int], patterns: list[tuple[str, str]]
    ) -> None:
        async def run() -> None:
            prefix = unique_prefix()
            async with (
                RedisBackend(url=url, key_prefix=prefix) as outer,
                RedisBackend(url=url, key_prefix=prefix + "n:") as inner,
            ):
                names = [f"{head}{{{tag}}}{tail}" for head, tag, tail in keys]
                for n, name in enumerate(names):
                    if name.startswith("n:") and n % 2:  # through the nested store
                        await inner.set(name[2:], b"i")
                    else:
                        await outer.set(name, b"o")
                for n in dropped:
                    if n < len(names):
                        await outer.delete(names[n])
                for head, rest in patterns:
                    for star in ("", "*"):
                        pattern = f"{escape_glob(head)}{{*}}{escape_glob(rest)}{star}"
                        listed = sorted([key async for key in outer.scan(pattern)])
                        assert listed == _truth(url, prefix, pattern), pattern

        anyio.run(run)

    check()


# -------------------------------------------------------------- the slot registry (cluster)


def _registry(url: str, prefix: str) -> set[bytes]:
    """The members of `prefix`'s slot registry on the cluster at `url`."""
    seed = url.split("://", 1)[1].split(",")[0]
    with sync_redis.RedisCluster.from_url(f"redis://{seed}") as cluster:
        return set(cluster.smembers(KEY_INDEX_NAMESPACE + prefix + "#slots"))


def _slot_members(prefix: str, keys: list[str]) -> set[bytes]:
    return {str(key_slot(prefix + key)).encode() for key in keys}


async def test_a_cross_slot_listing_probes_only_the_registered_slots(
    redis_cluster_url: str,
) -> None:
    """A small store's listing across slots probes one index per slot of its registry (and of
    the empty prefix's it is nested in), not the 16,384 slots; the registry is its slots. Each
    probe is a skip-scan: an EXISTS of the braced set and a ZRANGE past the last entity, and
    per entity one ZRANGE to find it and one to read its `:state`."""
    url = redis_cluster_url
    prefix = unique_prefix()
    keys = [f"w:{{{n}}}:state" for n in range(20)]
    async with StateManager(
        StateConfig(), backend=RedisBackend(url=url, key_prefix=prefix)
    ) as state:
        await state.save_many({key: {"n": 1} for key in keys[:19]})
        await state.save(keys[19], {"n": 1})
        await state.list_keys("w:{*}:state")  # the index built, scripts loaded, map read
        async with command_counts(url) as counts:
            listed = await state.list_keys("w:{*}:state")
    own = _registry(url, prefix)
    outer = _registry(url, "")
    assert listed == sorted(keys)
    assert own == _slot_members(prefix, keys) | {b"complete"}
    assert b"complete" in outer
    probed = len(own) - 1 + len(outer) - 1
    assert counts.calls["zrange"] == probed + 2 * len(keys)
    # EXISTS may also come from another test's store still open in this worker (a build lock's
    # waiter polls one); a few, not one per slot of the 16,384.
    assert probed + len(keys) <= counts.calls["exists"] <= probed + len(keys) + 8
    assert counts.calls["smembers"] == 3  # the nested registry, then both slot registries


async def test_a_slot_is_registered_before_its_write_and_an_unused_one_is_harmless(
    redis_cluster_url: str,
) -> None:
    """A slot joins the registry before the write to it: a write that never lands (refused
    here, as one whose process was killed in between) leaves it registered with an empty
    index, and listings stay right."""
    url = redis_cluster_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await backend.set("w:{a}:state", b"v")
        with pytest.raises(ConflictError):
            await backend.set("w:{never}:state", b"v", expected_version=3)
        await backend.transact([], [Put("w:{nor}:state", b"v")])
        await backend.delete("w:{nor}:state")  # its slot stays registered, its index empty
        assert sorted([key async for key in backend.scan("w:{*}:state")]) == ["w:{a}:state"]
    assert _registry(url, prefix) == _slot_members(
        prefix, ["w:{a}:state", "w:{never}:state", "w:{nor}:state"]
    ) | {b"complete"}


async def test_a_store_without_a_slot_registry_gets_one_from_its_indexes(
    redis_cluster_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster store indexed before slot registries existed (none; then one write of this
    release registers its own slot alone) lists every key: its first listing makes the
    registry from the indexes, once."""
    url = redis_cluster_url
    prefix = unique_prefix()
    keys = [f"w:{{{n}}}:state" for n in range(20)]
    async with RedisBackend(url=url, key_prefix=prefix) as old:
        await old.set_many([(key, b"v") for key in keys])
        assert len([key async for key in old.scan("*")]) == len(keys)
    seed = url.split("://", 1)[1].split(",")[0]
    with sync_redis.RedisCluster.from_url(f"redis://{seed}") as cluster:
        cluster.delete(KEY_INDEX_NAMESPACE + prefix + "#slots")  # as the previous release left it
    caplog.set_level(logging.INFO, logger="agenticstate")
    async with RedisBackend(url=url, key_prefix=prefix) as new:
        await new.set("w:{new}:state", b"v")
        assert _registry(url, prefix) == _slot_members(prefix, ["w:{new}:state"])
        assert sorted([key async for key in new.scan("w:{*}:state")]) == sorted(
            [*keys, "w:{new}:state"]
        )
        assert sorted([key async for key in new.scan("w:{*}:state")]) == sorted(
            [*keys, "w:{new}:state"]
        )
    made = [r for r in caplog.records if "key_index_slots_registered" in r.getMessage()]
    assert len(made) == 1
    assert _registry(url, prefix) == _slot_members(prefix, [*keys, "w:{new}:state"]) | {b"complete"}


# -------------------------------------------------------------- expiry


async def test_expired_keys_are_never_listed_and_leave_the_index(server: RedisServer) -> None:
    """A key that expired is not listed; the listing drops its name, and writes drop the due
    schedule entries (two a script), so nothing of it is left."""
    url = server.unix_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        names = set()
        for n in range(5):
            await backend.set(f"t:{n}", b"x", ttl=timedelta(milliseconds=20))
            names.add(f"{prefix}t:{n}".encode())
        await backend.set("keep", b"k")
        await _wait_expired(url, names)
        assert len(_index_members(url, prefix)) == 11  # 5 dead names, 5 due entries, keep
        assert [key async for key in backend.scan("*")] == ["keep"]
        assert len(_index_members(url, prefix)) == 6  # the names are gone, the entries due
        for _ in range(3):
            await backend.set("keep", b"k")
        assert _index_members(url, prefix) == [f"{prefix}keep".encode()]


async def test_writes_trim_dead_names_without_any_listing(server: RedisServer) -> None:
    """Expired keys nobody lists leave the index as writes go on: after k writes at most
    max(0, expired - 2k) dead names remain."""
    url = server.unix_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        names = set()
        for n in range(7):
            await backend.set(f"t:{n}", b"x", ttl=timedelta(milliseconds=20))
            names.add(f"{prefix}t:{n}".encode())
        await _wait_expired(url, names)
        for writes in range(1, 5):
            await backend.set("other", b"o")
            dead = [m for m in _index_members(url, prefix) if m in names]
            assert len(dead) <= max(0, 7 - 2 * writes)
        assert _index_members(url, prefix) == [f"{prefix}other".encode()]


async def test_a_key_written_again_without_a_ttl_stays_listed(server: RedisServer) -> None:
    """A key whose TTL was replaced by a write without one is never trimmed from the index."""
    url = server.unix_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await backend.set("k", b"1", ttl=timedelta(milliseconds=20))
        await backend.set("k", b"2")
        await backend.set("gone", b"x", ttl=timedelta(milliseconds=20))
        await _wait_expired(url, {f"{prefix}gone".encode()})
        for _ in range(3):
            await backend.set("other", b"o")
        assert [key async for key in backend.scan("*")] == ["k", "other"]
        assert _index_members(url, prefix) == [f"{prefix}{k}".encode() for k in ("k", "other")]


# -------------------------------------------------------------- foreign keys


async def test_listings_show_only_what_agenticstate_wrote(server: RedisServer) -> None:
    """A key another client wrote under the prefix is not listed (SCAN listed it); a record
    another client overwrote is, and reading it raises ForeignRecordError."""
    url = server.unix_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await backend.set("mine", b"1")
        await backend.set("taken", b"2")
        assert [key async for key in backend.scan("*")] == ["mine", "taken"]  # index built
        with _admin(url) as admin:
            admin.set(f"{prefix}foreign", b"another app's string")
            admin.set(f"{prefix}taken", b"overwritten by another app")
        assert _truth(url, prefix, "*") == ["foreign", "mine", "taken"]
        assert [key async for key in backend.scan("*")] == ["mine", "taken"]
        with pytest.raises(ForeignRecordError):
            await backend.get("taken")


# -------------------------------------------------------------- migration


async def test_an_older_store_gets_its_index_built_once(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A store written without the index (an earlier release) builds it on the first listing,
    logs that once with the count, lists every key, and two stores listing at once agree."""
    url = server.unix_url
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as writer:
        await writer.set_many([(f"a:{{{n}}}:x", b"v") for n in range(30)])
        await writer.set("ttl", b"t", ttl=timedelta(hours=1))
    with _admin(url) as admin:  # what an earlier release left: records, no index
        admin.delete(KEY_INDEX_NAMESPACE + prefix, KEY_INDEX_NAMESPACE + prefix + "#built")
    expected = sorted([*(f"a:{{{n}}}:x" for n in range(30)), "ttl"])
    caplog.set_level(logging.INFO, logger="agenticstate")
    async with (
        RedisBackend(url=url, key_prefix=prefix) as one,
        RedisBackend(url=url, key_prefix=prefix) as two,
    ):
        listed: list[list[str]] = []

        async def list_all(backend: RedisBackend) -> None:
            listed.append(sorted([key async for key in backend.scan("*")]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(list_all, one)
            tg.start_soon(list_all, two)
        assert listed == [expected, expected]
        built = [r for r in caplog.records if "key_index_built" in r.getMessage()]
        assert built
        assert all("keys=31" in r.getMessage() for r in built)
    caplog.clear()
    async with RedisBackend(url=url, key_prefix=prefix) as three:
        assert sorted([key async for key in three.scan("*")]) == expected
    assert not [r for r in caplog.records if "key_index_built" in r.getMessage()]


async def _older_store(url: str, junk: int) -> str:
    """A store of 40 records with no index (an earlier release's), and `junk` keys under its
    prefix that are not records (`DEBUG POPULATE`), so that a build takes a while."""
    prefix = unique_prefix()
    async with RedisBackend(url=url, key_prefix=prefix) as writer:
        await writer.set_many([(f"a:{{{n}}}:x", b"v") for n in range(40)])
    with _admin(url) as admin:
        admin.delete(*admin.scan_iter(match=escape_glob(KEY_INDEX_NAMESPACE + prefix) + "*"))
        admin.execute_command("DEBUG", "POPULATE", junk, prefix + "junk")
    return prefix


def _drop_junk(url: str, prefix: str) -> None:
    with _admin(url) as admin:
        batch = []
        for name in admin.scan_iter(match=escape_glob(prefix + "junk:") + "*", count=10_000):
            batch.append(name)
            if len(batch) == 10_000:
                admin.unlink(*batch)
                batch.clear()
        if batch:
            admin.unlink(*batch)


def _builders(url: str, prefix: str, count: int) -> list[LineProcess]:
    """`count` processes on the store, each connected and waiting for its go."""
    workers = [LineProcess(BUILD_WORKER, url, prefix) for _ in range(count)]
    for worker in workers:
        assert worker.wait_until(lambda lines: "ready" in lines), worker.close()
    return workers


def _go(workers: list[LineProcess]) -> None:
    for worker in workers:
        assert worker.process.stdin is not None
        worker.process.stdin.write("go\n")
        worker.process.stdin.flush()


def _results(workers: list[LineProcess]) -> list[dict[str, int]]:
    found = []
    for worker in workers:
        assert worker.wait_until(lambda lines: bool(lines) and lines[-1].startswith("{"), 120), (
            worker.close()
        )
        found.append(json.loads(worker.lines[-1]))
        worker.stop()
    return found


@pytest.mark.slow
async def test_processes_opening_an_unbuilt_store_at_once_build_its_index_once(
    server: RedisServer,
) -> None:
    """Four processes that list a store with no index at the same moment: one builds it
    (the build lock), the others wait for it; every one lists every record."""
    url = server.unix_url
    prefix = await _older_store(url, 100_000)
    workers = _builders(url, prefix, 4)
    try:
        _go(workers)
        results = _results(workers)
    finally:
        for worker in workers:
            worker.close()
        _drop_junk(url, prefix)
    assert [result["keys"] for result in results] == [40] * 4
    assert sum(result["built"] for result in results) == 1


@pytest.mark.slow
async def test_a_builder_killed_mid_build_is_taken_over_once_its_lock_expires(
    server: RedisServer,
) -> None:
    """A process SIGKILLed while it builds leaves no built mark and a lock that expires; two
    processes listing after it wait for that, one of them builds, both list every record."""
    url = server.unix_url
    prefix = await _older_store(url, 200_000)
    try:
        [first] = _builders(url, prefix, 1)
        _go([first])
        assert first.wait_until(lambda lines: "building" in lines), first.close()
        first.kill()
        with _admin(url) as admin:
            assert not admin.exists(KEY_INDEX_NAMESPACE + prefix + "#built")  # killed mid-build
            assert admin.exists(KEY_INDEX_NAMESPACE + prefix + "#building")  # its lock is left
        workers = _builders(url, prefix, 2)
        try:
            _go(workers)
            results = _results(workers)
        finally:
            for worker in workers:
                worker.close()
    finally:
        _drop_junk(url, prefix)
    assert [result["keys"] for result in results] == [40, 40]
    assert sum(result["built"] for result in results) == 1


# -------------------------------------------------------------- processes killed mid-write


async def _kill_writers_then_compare(url: str) -> None:
    prefix = unique_prefix()
    for seed in range(3):
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration._keyindex_worker", url, prefix, str(seed)],
            stdout=subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            with anyio.fail_after(60):
                line = await anyio.to_thread.run_sync(process.stdout.readline)
            assert line == b"writing\n"
            await anyio.sleep(random.Random(seed).random() * 0.2)  # a random point of its run
        finally:
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
    if "+cluster" not in url:
        with _admin(url) as admin:
            living = {
                name
                for name in admin.scan_iter(match=escape_glob(prefix) + "*")
                if admin.pttl(name) > 0
            }
        await _wait_expired(url, living)
    else:  # no expiry events there: the keys still to expire go now, as an expiry would
        for client in _primaries(url):
            with client:
                for name in list(client.scan_iter(match=escape_glob(prefix) + "*")):
                    if client.pttl(name) > 0:
                        client.delete(name)
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        for pattern in ("*", "k:{3}:*", "k:{*}:1*", "k:?:*", "n:{*}"):
            assert sorted([key async for key in backend.scan(pattern)]) == _truth(
                url, prefix, pattern
            ), pattern


@pytest.mark.slow
async def test_writers_killed_mid_write_leave_the_index_equal_to_the_records(
    server: RedisServer,
) -> None:
    """Writer processes SIGKILLed at random points never leave the index apart from the
    records: every listing equals a full SCAN afterwards."""
    await _kill_writers_then_compare(server.unix_url)


@pytest.mark.slow
async def test_cluster_writers_killed_mid_write_never_hide_a_key(redis_cluster_url: str) -> None:
    """On a cluster, writers SIGKILLed while they register new slots and write to them never
    leave a record in a slot the registry lacks: every listing across slots equals a SCAN."""
    await _kill_writers_then_compare(redis_cluster_url)


# -------------------------------------------------------------- model-based

ALPHABET = ["a", "b", "{", "}", "*", "?", "[", "]", "\\", ":", "\U0010ffff"]
KEY = st.text(st.sampled_from(ALPHABET), min_size=1, max_size=5)
TAG = st.lists(st.sampled_from(["a", "n:", "b", "}"]), max_size=2).map("".join)  # before `{`
PATTERN = st.one_of(
    KEY.map(lambda key: escape_glob(key) + "*"),  # a literal prefix
    KEY,  # anything: metacharacters as globs
    KEY.map(lambda key: key + "*"),
    st.just("*"),
)


class IndexMachine(RuleBasedStateMachine):
    """Two stores whose prefixes nest, written at random; every listing equals a full SCAN."""

    portal: BlockingPortal
    url: str
    expiry: bool

    def __init__(self) -> None:
        super().__init__()
        self.root = unique_prefix()
        self.prefixes = [self.root, self.root + "n:"]
        self.stack = AsyncExitStack()
        self.backends: list[RedisBackend] = [
            self.portal.call(
                self.stack.enter_async_context, RedisBackend(url=self.url, key_prefix=p)
            )
            for p in self.prefixes
        ]
        self.expiring: set[bytes] = set()

    def teardown(self) -> None:
        self.portal.call(self.stack.aclose)

    def _key(self, store: int, key: str) -> str:
        return ("n:" + key) if store == 0 and key.startswith("a") else key

    @rule(store=st.integers(0, 1), key=KEY, expiring=st.booleans())
    def put(self, store: int, key: str, expiring: bool) -> None:
        key = self._key(store, key)
        ttl = timedelta(milliseconds=15) if expiring and self.expiry else None
        self.portal.call(lambda: self.backends[store].set(key, b"v", ttl=ttl))
        if ttl is not None:
            self.expiring.add((self.prefixes[store] + key).encode())

    @rule(store=st.integers(0, 1), keys=st.lists(KEY, min_size=1, max_size=3))
    def put_many(self, store: int, keys: list[str]) -> None:
        items = [(self._key(store, key), b"m") for key in keys]
        self.portal.call(lambda: self.backends[store].set_many(items))

    @rule(store=st.integers(0, 1), head=TAG, tag=KEY, tail=KEY, expiring=st.booleans())
    def put_tagged(self, store: int, head: str, tag: str, tail: str, expiring: bool) -> None:
        """An entity's key, `<head>{<tag>}<tail>` (the tag and tail may hold more braces)."""
        self.put(store, f"{head}{{{tag}}}{tail}", expiring)

    @rule(store=st.integers(0, 1), key=KEY)
    def delete(self, store: int, key: str) -> None:
        self.portal.call(lambda: self.backends[store].delete(self._key(store, key)))

    @rule(store=st.integers(0, 1), key=KEY, other=KEY)
    def transact(self, store: int, key: str, other: str) -> None:
        # One slot on a cluster: both keys share a tag.
        put, drop = f"{{t}}{key}", f"{{t}}{other}"
        ops: list[TxnOp] = [Put(put, b"t")]
        if put != drop:
            ops.append(Delete(drop))
        self.portal.call(self.backends[store].transact, [], ops)

    @rule()
    def expire(self) -> None:
        if not self.expiring:
            return
        self.portal.call(_wait_expired, self.url, self.expiring)
        self.expiring.clear()

    @rule(store=st.integers(0, 1), pattern=PATTERN)
    def list_keys(self, store: int, pattern: str) -> None:
        if self.expiring:  # a listing and a SCAN agree once nothing is about to expire
            self.expire()

        async def listed() -> list[str]:
            return sorted([key async for key in self.backends[store].scan(pattern)])

        assert self.portal.call(listed) == _truth(self.url, self.prefixes[store], pattern)

    @rule(store=st.integers(0, 1), head=TAG, rest=KEY, star=st.booleans())
    def list_across_entities(self, store: int, head: str, rest: str, star: bool) -> None:
        """A skip-scan's pattern, `<head>{*}<rest>`: equal to the SCAN's answer too."""
        self.list_keys(store, f"{escape_glob(head)}{{*}}{escape_glob(rest)}{'*' if star else ''}")

    @rule(store=st.integers(0, 1), prefix=st.text(st.sampled_from(ALPHABET), max_size=3))
    def list_tags(self, store: int, prefix: str) -> None:
        if self.expiring:
            self.expire()
        keys = _truth(self.url, self.prefixes[store], escape_glob(prefix) + "{*}*")
        start = len(prefix) + 1
        expected = sorted({key[start : key.index("}", start)] for key in keys})
        assert self.portal.call(self.backends[store].scan_tags, prefix) == expected

    @invariant()
    def every_key_listed(self) -> None:
        if self.expiring:
            return
        for store in (0, 1):

            async def listed(store: int = store) -> list[str]:
                return sorted([key async for key in self.backends[store].scan("*")])

            assert self.portal.call(listed) == _truth(self.url, self.prefixes[store], "*")


def _run_machine(url: str, *, expiry: bool, examples: int) -> None:
    with anyio.from_thread.start_blocking_portal() as portal:
        IndexMachine.portal = portal
        IndexMachine.url = url
        IndexMachine.expiry = expiry
        run_state_machine_as_test(
            IndexMachine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=20,
                deadline=None,
                derandomize=True,
                database=None,
            ),
        )


@pytest.mark.slow
def test_the_index_lists_what_a_scan_finds(server: RedisServer) -> None:
    """Model-based, one server: writes, deletes, transactions and TTL expiry through nested
    stores; every listing, for generated patterns, equals a full SCAN."""
    _run_machine(server.unix_url, expiry=True, examples=15)


@pytest.mark.slow
def test_the_cluster_index_lists_what_a_scan_finds(own_cluster: str) -> None:
    """Model-based, Redis Cluster (no expiry rule: its nodes announce no expired keys)."""
    _run_machine(own_cluster, expiry=False, examples=10)


_WRITES: dict[str, Any] = {
    "set": lambda b: b.set("k1", b"v1"),
    "set with a TTL": lambda b: b.set("k1", b"v1", ttl=timedelta(seconds=60)),
    "overwrite": lambda b: b.set("k0", b"v2"),
    "set_many": lambda b: b.set_many([("m1", b"1"), ("m2", b"2")]),
    "update": lambda b: b.update("k0", lambda entry: entry.value + b"!"),
    "delete": lambda b: b.delete("k0"),
    "transact": lambda b: b.transact([], [Put("t1", b"1"), Delete("k0")]),
}
_BROKEN: dict[str, Any] = {
    "a string": lambda r, name: r.set(name, "not a sorted set"),
    "a list": lambda r, name: r.rpush(name, "x"),
    "a hash": lambda r, name: r.hset(name, "f", "v"),
}


@pytest.mark.parametrize("broken", sorted(_BROKEN))
@pytest.mark.parametrize("write", sorted(_WRITES))
async def test_a_broken_key_index_refuses_every_write_whole(
    server: RedisServer, write: str, broken: str
) -> None:
    """An index another client wrote over stops each write before it writes, naming the index."""
    prefix = unique_prefix()
    admin = _admin(server.tcp_url)
    backend = RedisBackend(url=server.tcp_url, key_prefix=prefix)
    try:
        await backend.set("k0", b"v0")
        index = f"{KEY_INDEX_NAMESPACE}{prefix}"
        admin.delete(index)
        _BROKEN[broken](admin, index)
        before = {
            name: admin.get(name)
            for name in admin.scan_iter(match=f"*{escape_glob(prefix)}*")
            if admin.type(name) == b"string"
        }
        with pytest.raises(ForeignRecordError) as raised:
            await _WRITES[write](backend)
        assert raised.value.key == index
        after = {
            name: admin.get(name)
            for name in admin.scan_iter(match=f"*{escape_glob(prefix)}*")
            if admin.type(name) == b"string"
        }
        assert after == before
        assert admin.xlen(f"__agenticstate_feed__:{prefix}") == 1  # the first write's, alone
    finally:
        await backend.aclose()
        admin.close()
