"""`Backend.transact` beyond the contract suite: real processes racing, one command per call on
Redis and Redis Cluster (counted by the server), one slot per call on a cluster, one log frame
per call on the file backend."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import redis as sync_redis

from agenticstate import InvalidArgumentError
from agenticstate.backends import (
    Delete,
    Exists,
    FileBackend,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    Put,
    RedisBackend,
    SQLiteBackend,
    Version,
    open_backend,
)
from tests.helpers import LineProcess
from tests.integration._transact_worker import INDEX, KEY

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend

PROCESSES, ROUNDS = 4, 40


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


# --------------------------------------------------------------------- command counts (Redis)


def _primaries(url: str) -> list[sync_redis.Redis]:
    """A client per server to count on: the server itself, or each primary of a cluster."""
    if not url.startswith(("redis+cluster://", "rediss+cluster://")):
        return [sync_redis.Redis.from_url(url)]
    clients = []
    for host in urlsplit(url).netloc.rsplit("@", 1)[-1].split(","):
        name, _, port = host.rpartition(":")
        client = sync_redis.Redis(host=name, port=int(port), socket_timeout=5)
        if client.info("replication")["role"] == "master":
            clients.append(client)
        else:
            client.close()
    return clients


def _commandstats(clients: list[sync_redis.Redis]) -> Counter[str]:
    """Calls per command, summed over `clients`' servers (INFO itself left out)."""
    total: Counter[str] = Counter()
    for client in clients:
        for name, stats in client.info("commandstats").items():
            if name != "cmdstat_info":
                total[name.removeprefix("cmdstat_")] += int(stats["calls"])
    return total


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
async def test_one_transaction_is_one_command(kind: str, request: pytest.FixtureRequest) -> None:
    """A transaction sends exactly one command, EVALSHA: the server's counts grow by it and by
    the commands the script itself runs (which Redis counts too), nothing else."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
    clients = _primaries(url)
    try:
        async with RedisBackend(url=url, key_prefix=_prefix()) as backend:
            await backend.set("{t}:b", b"b")
            await backend.transact([], [Get("{t}:warm")])  # connect, map slots, load the script
            before = _commandstats(clients)
            result = await backend.transact(
                [Version("{t}:a", 0), Exists("{t}:b")],
                [Put("{t}:a", b"1"), Delete("{t}:b"), IndexIncr("{t}:i", "n", 1)],
            )
            after = _commandstats(clients)
            assert result.succeeded
            # The script: the clock (TIME), two compares (GETRANGE), the check that the two
            # keys it writes hold records (GETRANGE each), Put (GET, SET, PUBLISH),
            # Delete (GET, DEL, PUBLISH), IndexIncr (ZINCRBY); each write also appends to the
            # change feed (XADD, SET of its counter, read once: GET) and takes a revision (SET
            # of the revision counter, read once: GET). The key index: Put adds its name (ZADD),
            # Delete removes it (ZREM), and the first of them looks for due expiries (ZRANGE).
            assert after - before == Counter(
                evalsha=1,
                time=1,
                getrange=4,
                get=4,
                set=5,
                xadd=2,
                publish=2,
                zincrby=1,
                zadd=1,
                zrem=1,
                zrange=1,
                **{"del": 1},
            )
            before = _commandstats(clients)
            result = await backend.transact([Version("{t}:a", 9)], [], [IndexRange("{t}:i")])
            assert not result.succeeded
            assert result.results == [[("n", 1.0)]]
            assert _commandstats(clients) - before == Counter(
                evalsha=1, time=1, getrange=1, zrange=1
            )
    finally:
        for client in clients:
            client.close()


@pytest.mark.redis
async def test_cluster_refuses_keys_in_several_slots(redis_cluster_url: str) -> None:
    """On a cluster, a transaction whose keys hash to different slots raises before sending,
    naming them; with one hash tag the same transaction runs."""
    async with RedisBackend(url=redis_cluster_url, key_prefix=_prefix()) as backend:
        with pytest.raises(InvalidArgumentError, match=r"'a' \(slot \d+\), 'b' \(slot \d+\)"):
            await backend.transact([Version("a", 0)], [Put("b", b"1")])
        with pytest.raises(InvalidArgumentError, match="'jobs'"):
            await backend.transact([], [Put("{x}:a", b"1"), IndexAdd("jobs", {"m": 1})])
        assert await backend.get("b") is None
        assert await backend.get("{x}:a") is None
        result = await backend.transact([Version("{x}:a", 0)], [Put("{x}:b", b"1")])
        assert result.succeeded


# --------------------------------------------------------------------- one frame (file)


async def test_file_logs_a_transaction_as_one_frame(tmp_path: Path) -> None:
    """Every record of one step goes into one log frame (one checksum: replayed whole or not at
    all), however many there are; a reopened store has all of it."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        before = backend.stats()["batches"]
        ops = [Put(f"k{i}", b"%d" % i) for i in range(40)]
        result = await backend.transact(
            [], [*ops, IndexAdd("idx", {"a": 1}), IndexIncr("idx", "b", 2)]
        )
        assert result.succeeded
        assert backend.stats()["batches"] == before + 1
    async with FileBackend(base_path=tmp_path) as backend:
        entries = await backend.get_many([f"k{i}" for i in range(40)])
        assert [entry.value if entry else None for entry in entries] == [
            b"%d" % i for i in range(40)
        ]
        assert await backend.index_range("idx") == [("a", 1.0), ("b", 2.0)]


async def test_file_replays_a_torn_transaction_not_at_all(tmp_path: Path) -> None:
    """A crash that tears the step's frame (its last bytes never reached the disk) loses the
    whole step on reopen, never part of it; what was logged before it stays."""
    store, crashed = tmp_path / "store", tmp_path / "crashed"
    async with FileBackend(base_path=store, auto_save=False) as backend:
        await backend.set("before", b"kept")
        start = backend.log_path.stat().st_size
        await backend.transact([], [Put(f"k{i}", b"x" * 100) for i in range(30)])
        assert backend.log_path.stat().st_size > start
        # The files as a crash would leave them, the step's frame cut short: a copy taken now.
        crashed.mkdir()
        for path in store.iterdir():
            if not path.name.endswith(".lock"):
                (crashed / path.name).write_bytes(path.read_bytes())
        log = crashed / backend.log_path.name
        log.write_bytes(log.read_bytes()[:-10])
    async with FileBackend(base_path=crashed) as reopened:
        assert (await reopened.get("before")) is not None
        assert [key async for key in reopened.scan("k*")] == []


async def test_shared_file_leases_transact_on_one_store(tmp_path: Path) -> None:
    """Two leases on one file store (`open_backend("file://...")`): a step through one is seen,
    and its compare honoured, through the other."""
    async with open_backend(f"file://{tmp_path}") as one, open_backend(f"file://{tmp_path}") as two:
        assert (await one.transact([Version("k", 0)], [Put("k", b"1")])).succeeded
        result = await two.transact([Version("k", 0)], [Put("k", b"2")], [Get("k")])
        assert not result.succeeded
        assert result.results[0].value == b"1"


# --------------------------------------------------------------------- processes


async def _check_race(backend: Backend) -> None:
    total = PROCESSES * ROUNDS
    entry = await backend.get(KEY)
    assert entry is not None
    assert (entry.value, entry.version) == (b"%d" % total, total)
    scores = dict(await backend.index_range(INDEX))
    assert scores["ok"] == total
    assert scores["calls"] == scores["ok"] + scores.get("lost", 0)


def _race(url: str, prefix: str) -> None:
    procs = [
        LineProcess("tests.integration._transact_worker", url, prefix, str(ROUNDS))
        for _ in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert proc.wait_until(lambda lines: "ready" in lines), proc.errors
        for proc in procs:  # start them together
            assert proc.process.stdin is not None
            proc.process.stdin.write("go\n")
            proc.process.stdin.flush()
        for proc in procs:
            assert proc.wait_until(lambda lines: "done" in lines, 180), proc.errors
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
async def test_processes_race_on_redis_and_lose_nothing(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """4 processes: Version-guarded Puts of one counter and IndexIncr counters end exact."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
    prefix = _prefix()
    _race(url, prefix)
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        await _check_race(backend)


async def test_processes_race_on_sqlite_and_lose_nothing(tmp_path: Path) -> None:
    """The same race on one SQLite file: each step is one write transaction across processes."""
    path = tmp_path / "state.db"
    async with SQLiteBackend(path):
        pass  # create the file before the processes race to
    _race(f"sqlite://{path}", "")
    async with SQLiteBackend(path) as backend:
        await _check_race(backend)
