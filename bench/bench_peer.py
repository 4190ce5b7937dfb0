"""agenticstate against the peer `agenticaiframework` on one fixed workload, in one run.

Run: `python -m bench peer` (or `python -m bench.bench_peer`). The workload (issue #21, point 7):
10,000 keys `agent:0` ... `agent:9999`, each a small dict; every round builds both stores from
empty and then, side by side:

- memory: save every key, get every key (in one shuffled order, the same for both), list
  `agent:*` (all 10,000 keys) 20 times, list it 20 times more with a new key saved before each
  listing (so a store that keeps an index must bring it up to date), delete every key;
- file and SQLite: list `agent:*` 20 times and get every key, over the same 10,000 keys. The peer
  has no SQLite backend: the SQLite rows compare with its file backend, its only durable store;
- Redis (a throwaway redis-server, skipped if none can start): list `agent:*` 20 times.

The peer's API blocks, so its operations run in a plain loop; ours are awaited one after
another on one event loop. Ratios are taken within a round (the machine's speed drifts between
rounds) and the table shows their median and range over the rounds after a warm-up round.
Listing times are each round's median of its 20 listings.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate import FileBackend, RedisBackend, SQLiteBackend, StateManager
from bench._util import publish, ratio_of, redis_server, table

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

KEYS = 10_000
LISTINGS = 20
ROUNDS = 5
WARMUP_ROUNDS = 1
PATTERN = "agent:*"
VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "step": 3}

# (operation, backend, the target ratio if the issue sets one)
ROWS: list[tuple[str, str, float | None]] = [
    ("save", "memory", None),
    ("get", "memory", None),
    ("list_keys('agent:*')", "memory", 1.0),
    ("list_keys('agent:*'), a key saved before each", "memory", 1.0),
    ("delete", "memory", 0.8),
    ("list_keys('agent:*')", "file", 1.0),
    ("get", "file", None),
    ("list_keys('agent:*')", "sqlite (peer: file)", 1.0),
    ("get", "sqlite (peer: file)", None),
    ("list_keys('agent:*')", "redis", 1.0),
]
GET_TARGET = 150_000  # memory gets per second, isolation kept


def _keys() -> list[str]:
    return [f"agent:{i}" for i in range(KEYS)]


def _shuffled() -> list[str]:
    keys = _keys()
    random.Random(1).shuffle(keys)
    return keys


# ---------------------------------------------------------------- timing


async def _rate(operation: Callable[[str], Awaitable[object]], keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        await operation(key)
    return len(keys) / (time.perf_counter() - start)


def _sync_rate(operation: Callable[[str], object], keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        operation(key)
    return len(keys) / (time.perf_counter() - start)


async def _listing_ms(
    listing: Callable[[], Awaitable[list[str]]],
    before: Callable[[int], Awaitable[object]] | None = None,
) -> float:
    times = []
    for n in range(LISTINGS):
        if before is not None:
            await before(n)
        start = time.perf_counter()
        found = await listing()
        times.append(time.perf_counter() - start)
        assert len(found) >= KEYS, len(found)
    return statistics.median(times) * 1000


def _sync_listing_ms(
    listing: Callable[[], list[str]], before: Callable[[int], object] | None = None
) -> float:
    times = []
    for n in range(LISTINGS):
        if before is not None:
            before(n)
        start = time.perf_counter()
        found = listing()
        times.append(time.perf_counter() - start)
        assert len(found) >= KEYS, len(found)
    return statistics.median(times) * 1000


# ---------------------------------------------------------------- one round


async def _ours_memory() -> list[float]:
    async with StateManager() as state:

        async def save(key: str) -> None:
            await state.save(key, VALUE)

        async def extra(n: int) -> None:
            await state.save(f"agent:new:{n}", VALUE)

        saves = await _rate(save, _keys())
        gets = await _rate(state.get, _shuffled())
        listed = await _listing_ms(lambda: state.list_keys(PATTERN))
        listed_after_write = await _listing_ms(lambda: state.list_keys(PATTERN), extra)
        deletes = await _rate(state.delete, _shuffled())
        return [saves, gets, listed, listed_after_write, deletes]


def _peer_memory() -> list[float]:
    from agenticaiframework.state.manager import StateManager as PeerStateManager

    peer = PeerStateManager(backend="memory", auto_checkpoint=False)
    saves = _sync_rate(lambda key: peer.save(key, VALUE), _keys())
    gets = _sync_rate(peer.get, _shuffled())
    listed = _sync_listing_ms(lambda: peer.list("agent:"))
    listed_after_write = _sync_listing_ms(
        lambda: peer.list("agent:"), lambda n: peer.save(f"agent:new:{n}", VALUE)
    )
    deletes = _sync_rate(peer.delete, _shuffled())
    return [saves, gets, listed, listed_after_write, deletes]


async def _ours_stored(kind: str, directory: Path) -> list[float]:
    backend: Any = (
        FileBackend(base_path=directory, format="msgpack", auto_save=False)
        if kind == "file"
        else SQLiteBackend(directory / "state.db")
    )
    async with StateManager(backend=backend) as state:
        keys = _keys()
        for first in range(0, KEYS, 1000):
            await state.save_many(dict.fromkeys(keys[first : first + 1000], VALUE))
        listed = await _listing_ms(lambda: state.list_keys(PATTERN))
        gets = await _rate(state.get, _shuffled())
        return [listed, gets]


def _peer_file(directory: Path) -> list[float]:
    from agenticaiframework.state.manager import StateManager as PeerStateManager

    peer = PeerStateManager(backend="file", persist_path=str(directory), auto_checkpoint=False)
    for key in _keys():
        peer.save(key, VALUE)
    listed = _sync_listing_ms(lambda: peer.list("agent:"))
    gets = _sync_rate(peer.get, _shuffled())
    return [listed, gets]


async def _ours_redis(url: str, prefix: str) -> list[float]:
    async with StateManager(backend=RedisBackend(url=url, key_prefix=prefix)) as state:
        keys = _keys()
        for first in range(0, KEYS, 1000):
            await state.save_many(dict.fromkeys(keys[first : first + 1000], VALUE))
        return [await _listing_ms(lambda: state.list_keys(PATTERN))]


def _peer_redis(url: str) -> list[float]:
    from agenticaiframework.state.manager import StateConfig as PeerConfig
    from agenticaiframework.state.manager import StateManager as PeerStateManager

    config = PeerConfig(backend="redis", redis_url=url, auto_checkpoint=False)
    peer = PeerStateManager(backend="redis", config=config)
    for key in _keys():
        peer.save(key, VALUE)
    return [_sync_listing_ms(lambda: peer.list("agent:"))]


async def _one_round(
    base: Path, redis_url: str | None, round_number: int
) -> tuple[list[float], list[float]]:
    """Our figures and the peer's, in `ROWS` order (the Redis row missing without a server)."""
    ours = await _ours_memory()
    peer = _peer_memory()
    peer_file = _peer_file(base / "peer")
    ours += await _ours_stored("file", base / "file")
    ours += await _ours_stored("sqlite", base / "sqlite")
    peer += peer_file + peer_file
    if redis_url is not None:
        import redis

        redis.Redis.from_url(redis_url).flushdb()  # the peer's keys have a fixed prefix
        ours += await _ours_redis(redis_url, f"round{round_number}:")
        peer += _peer_redis(redis_url)
    return ours, peer


# ---------------------------------------------------------------- report


def _is_listing(operation: str) -> bool:
    return operation.startswith("list_keys")


async def run(redis_url: str | None) -> tuple[str, list[tuple[str, float]]]:
    ours: list[list[float]] = [[] for _ in ROWS]
    peers: list[list[float]] = [[] for _ in ROWS]
    ratios: list[list[float]] = [[] for _ in ROWS]
    for round_number in range(WARMUP_ROUNDS + ROUNDS):
        with tempfile.TemporaryDirectory(dir=".", prefix=".bench-peer-") as root:
            mine, theirs = await _one_round(Path(root), redis_url, round_number)
        if round_number < WARMUP_ROUNDS:
            continue
        for index, (operation, _, _) in enumerate(ROWS[: len(mine)]):
            ours[index].append(mine[index])
            peers[index].append(theirs[index])
            # Higher is better for rates, lower for listing times: a ratio above 1 is ours ahead.
            if _is_listing(operation):
                ratios[index].append(theirs[index] / mine[index])
            else:
                ratios[index].append(mine[index] / theirs[index])
    rows: list[list[str]] = []
    verdicts: list[str] = []
    for index, (operation, backend, target) in enumerate(ROWS):
        if not ours[index]:
            continue  # no Redis server here
        unit = " ms" if _is_listing(operation) else "/s"
        spec = ",.2f" if _is_listing(operation) else ",.0f"
        ratio = ratios[index]
        middle = statistics.median(ratio)
        rows.append(
            [
                operation,
                backend,
                f"{statistics.median(ours[index]):{spec}}{unit}",
                f"{statistics.median(peers[index]):{spec}}{unit}",
                f"{middle:.2f}x ({min(ratio):.2f}-{max(ratio):.2f})",
                "" if target is None else f"{target:g}x: {'met' if middle >= target else 'missed'}",
            ]
        )
        if target is not None:
            verdict = "met" if middle >= target else "missed"
            verdicts.append(f"{operation} on {backend} {middle:.2f}x ({verdict})")
    gets = statistics.median(ours[1])
    notes = [
        f"Workload: {KEYS:,} keys `agent:0` to `agent:{KEYS - 1}`, each a {len(VALUE)}-field dict; "
        f"{ROUNDS} rounds after {WARMUP_ROUNDS} warm-up round, ratios taken within each round "
        "(median and range). A ratio above 1 means agenticstate is ahead (for listings: the "
        "peer's time over ours).",
        f"Listing: `StateManager.list_keys('{PATTERN}')` returns the keys sorted; the peer's "
        "`list('agent:')` returns them in no order. The median of "
        f"{LISTINGS} listings per round; the second memory row saves a new key before each "
        "listing (on both sides), so an index has to take it in.",
        "Isolation: our memory backend stores the encoded bytes and `get` decodes a fresh "
        "value each call; the peer's `get` returns the stored object itself, so a caller "
        "that changes it changes the store.",
        f"Target: memory `get` at least {GET_TARGET:,}/s: {gets:,.0f}/s "
        f"({'met' if gets >= GET_TARGET else 'missed'}).",
        "Targets: " + "; ".join(verdicts) + ".",
        "The peer has no SQLite backend; the SQLite rows compare with its file backend (one "
        "JSON file per key, never fsynced). On Redis the peer lists with one KEYS command; "
        "StateManager.list_keys pages with SCAN (bench_redis compares it with a raw SCAN loop).",
    ]
    bars = [(f"{row[0]} ({row[1]})", ratio_of(row[4]) or 0.0) for row in rows]
    text = table(
        "agenticstate against agenticaiframework: the fixed 10,000-key workload",
        ["operation", "backend", "agenticstate", "agenticaiframework", "ratio (range)", "target"],
        rows,
        notes,
    )
    return text, bars


def main() -> None:
    with contextlib.ExitStack() as stack:
        url: str | None
        try:
            url = stack.enter_context(redis_server())
        except (OSError, RuntimeError):  # no redis-server here: the other rows still run
            url = None
        text, bars = anyio.run(run, url)
    publish("peer", text, bars)


if __name__ == "__main__":
    main()
