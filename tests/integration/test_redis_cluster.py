"""RedisBackend on a real Redis Cluster: processes, a coordinated failover and a killed primary.

The contract suite and the managers' tests also run on a cluster (the `redis-cluster` backend in
tests/conftest.py); these tests add what only a cluster has.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis as sync_redis

from agenticstate import (
    BackendUnavailableError,
    ChangeOp,
    RedisBackend,
    StateConfig,
    StateManager,
    WriteOutcomeUnknownError,
)
from tests._redis_cluster import RedisClusterServers
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests._redis_server import RedisServer

pytestmark = pytest.mark.redis

KEYS = 30  # spread over every shard: keys without a hash tag hash all over the slot space


def Worker(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._redis_worker", *args)


def view(lines: list[str]) -> dict[str, tuple[int, Any]]:
    """A subscriber process's picture of the keys: the last version and value it reported."""
    seen: dict[str, tuple[int, Any]] = {}
    for line in lines[1:]:
        event = json.loads(line)
        if event["value"] is None:
            seen.pop(event["key"], None)
        else:
            seen[event["key"]] = (event["version"], event["value"])
    return seen


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster of this test's own: 3 primaries, each with a replica."""
    servers = RedisClusterServers(tmp_path / "cluster", primaries=3, replicas=1)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


def test_four_processes_increment_one_key_exactly_on_a_cluster(redis_cluster_url: str) -> None:
    """4 processes x 300 update() increments of one key on a cluster add up to exactly 1200."""
    prefix = unique_prefix()
    workers = [Worker("increment", redis_cluster_url, prefix, "300") for _ in range(4)]
    try:
        for worker in workers:
            assert worker.wait_until(lambda lines: "done" in lines, timeout=120), worker.close()
    finally:
        errors = [worker.close() for worker in workers]
    assert all(not error for error in errors), errors
    first = redis_cluster_url.split("://", 1)[1].split(",")[0]
    client = sync_redis.RedisCluster.from_url(f"redis://{first}")
    try:
        raw = client.get(f"{prefix}counter")
    finally:
        client.close()
    assert raw is not None
    assert int(raw[:20]) == 1200  # the record's version: one per increment


async def test_keys_spread_over_every_primary_and_list_from_all(redis_cluster_url: str) -> None:
    """Keys land on every primary; list_keys, get_many and save_many cover all of them."""
    async with RedisBackend(url=redis_cluster_url, key_prefix=unique_prefix()) as backend:
        changes = await backend.set_many([(f"k{n}", b"%d" % n) for n in range(KEYS)])
        assert [change.version for change in changes] == [1] * KEYS
        assert sorted([key async for key in backend.scan("k*")]) == sorted(
            f"k{n}" for n in range(KEYS)
        )
        entries = await backend.get_many([f"k{n}" for n in range(KEYS)])
        assert [entry.value for entry in entries if entry] == [b"%d" % n for n in range(KEYS)]
        client: Any = backend._client
        owners = {client.get_node_from_key(f"{backend.key_prefix}k{n}").name for n in range(KEYS)}
        assert len(owners) == 3


async def _write_round(
    state: StateManager, start: int, count: int, acked: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Save f:{n % KEYS} = n for n in [start, start+count); record what was acknowledged.

    Writes that fail while the cluster reconfigures are retried until they succeed; one whose
    outcome is unknown is resolved by reading the key's version afterwards.
    """
    outcomes = {"ok": 0, "unavailable": 0, "unknown": 0}
    for n in range(start, start + count):
        key = f"f:{n % KEYS}"
        with anyio.fail_after(60):
            while True:
                try:
                    version = await state.save(key, n)
                except BackendUnavailableError:
                    outcomes["unavailable"] += 1  # not applied: the write was refused
                    await anyio.sleep(0.05)  # back off while the cluster elects a primary
                    continue
                except WriteOutcomeUnknownError:
                    outcomes["unknown"] += 1
                    await anyio.sleep(0.05)
                    continue  # write again: last writer wins, versions tell the story
                outcomes["ok"] += 1
                acked[key] = (version, n)
                break
    return outcomes


def _replicas_caught_up(cluster: RedisClusterServers, primary: RedisServer) -> bool:
    with cluster.client(primary) as client:
        info = client.info("replication")
    offset = int(info["master_repl_offset"])
    replicas = [value for name, value in info.items() if name.startswith("slave")]
    return bool(replicas) and all(int(replica["offset"]) >= offset for replica in replicas)


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling other processes' state, with a deadline


def _kill_pubsub_clients(cluster: RedisClusterServers) -> None:
    for node in cluster.live_nodes():
        with cluster.client(node) as client:
            client.client_kill_filter(_type="pubsub")


async def test_failover_loses_no_acknowledged_write_and_subscribers_resync(
    cluster: RedisClusterServers,
) -> None:
    """Mid-run, first a coordinated failover (CLUSTER FAILOVER) and then a primary killed with
    SIGKILL and its replica promoted: writes meanwhile fail with typed errors only, every
    acknowledged write survives, and a subscriber process ends on the final state."""
    prefix = unique_prefix()
    subscriber = Worker("subscribe", cluster.url, prefix, "f:*")
    try:
        assert subscriber.wait_until(lambda lines: lines[:1] == ["ready"], timeout=60)
        config = StateConfig(backend="redis", redis_url=cluster.url, key_prefix=prefix)
        acked: dict[str, tuple[int, int]] = {}
        async with StateManager(config) as state:
            await _write_round(state, 0, 300, acked)

            # 1. A coordinated failover while writes go on: the replica takes over only once it
            # has everything, so nothing acknowledged can be lost.
            victim = cluster.primary_nodes()[0]
            replica = cluster.replica_of(victim)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_write_round, state, 300, 300, acked)
                with cluster.client(replica) as client:
                    client.execute_command("CLUSTER FAILOVER")
            await anyio.to_thread.run_sync(
                lambda: _wait(lambda: replica in cluster.primary_nodes(), 30, "the failover")
            )
            await anyio.to_thread.run_sync(cluster.wait_ready)
            await _write_round(state, 600, 300, acked)

            # 2. A primary killed outright. Replication is asynchronous: a write acknowledged
            # just before its primary dies may be lost, as Redis documents. So the writes stop
            # until the replicas have everything; then any loss would be ours.
            victim = cluster.primary_nodes()[1]
            await anyio.to_thread.run_sync(
                lambda: _wait(lambda: _replicas_caught_up(cluster, victim), 30, "replication")
            )
            victim.process.kill()  # type: ignore[union-attr]  # SIGKILL
            victim.process.wait()  # type: ignore[union-attr]
            victim.process = None
            outcomes = await _write_round(state, 900, 300, acked)  # through the election
            await anyio.to_thread.run_sync(cluster.wait_ready)
            await anyio.to_thread.run_sync(_kill_pubsub_clients, cluster)  # force a resync too
            await _write_round(state, 1200, 100, acked)

            final = {key: await state.get_entry(key) for key in acked}
        for key, (version, value) in acked.items():
            entry = final[key]
            assert entry is not None, key
            assert (entry.version, entry.value) == (version, value), key
        assert outcomes["ok"] == 300
        expected = {key: (entry.version, entry.value) for key, entry in final.items() if entry}
        assert subscriber.wait_until(lambda lines: view(lines) == expected, timeout=60), (
            view(subscriber.lines),
            expected,
        )
    finally:
        log = subscriber.close()
    # It lost its pub/sub connection (at least when we killed it), reconnected and caught up
    # from the change feed (or, where the feed had a gap, re-read its keys: a RESYNC event is
    # emitted only for a key it had missed meanwhile).
    assert "pubsub_caught_up" in log or "pubsub_resynced" in log
    events = [json.loads(line) for line in subscriber.lines[1:]]
    assert all(event["op"] in {ChangeOp.SET.value, ChangeOp.RESYNC.value} for event in events)
