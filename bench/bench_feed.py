"""The durable change feed and commits (issue #23): what they cost, and how fast a feed replays.

Run: `python -m bench.bench_feed` (starts its own redis-server and a 3-primary Redis Cluster on
loopback; `--quick` for small sizes). Three parts, each on memory, file, SQLite, Redis and Redis
Cluster (or those named: `python -m bench.bench_feed --quick sqlite redis`):

1. `save` with the feed on (the backend's default `FeedRetention()`) against the same backend
   built with `feed=None`, one save after another, the two sides alternating in slices. SQLite's
   feed cannot be off (its subscriptions read the changes table): its save is compared with
   plain sqlite3's `INSERT OR REPLACE` in WAL at the same synchronous level instead. Issue #23's
   target: on Redis the feed costs at most 1.25x (a ratio of rates >= 0.8).
2. Replay: `changes("*", since=cursor)` from a cursor `REPLAY` changes back (retention above
   that), changes per second, against reading as many values with `get_many`.
3. `commit` of a `SCOPE_KEYS`-key scope with 1% of its keys changed, against writing those keys
   (one `save` at a time, and one `save_many`); issue #23's target: a commit under 3x the
   writes. And the first commit, which stores every value, against `save_many` of the scope.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import time
from contextlib import AsyncExitStack, ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from agenticstate import (
    FeedRetention,
    FileBackend,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    StateManager,
    SubscriptionClosedError,
)
from bench._util import ROOT, Row, publish, redis_server, table

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from agenticstate.backends import Backend

KINDS = ["memory", "file", "sqlite", "redis", "cluster"]
VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
ROUNDS = 5
SAVES = 1000  # saves per side per round (part 1)
SLICE = 100  # saves in a row on one side before the other's turn
SQLITE_SAVES = 200  # SQLite's saves fsync each: fewer of them
REPLAY = 100_000  # changes replayed (part 2)
BATCH = 1000  # keys per save_many / get_many
SCOPE_KEYS = 10_000  # keys in the committed scope (part 3)
CHANGED = 100  # keys changed between commits: 1%
DEFAULT_FEED = FeedRetention()  # what a backend keeps by default


def quick() -> None:
    """Small sizes, for a check that every part runs (`--quick`)."""
    global ROUNDS, SAVES, SLICE, SQLITE_SAVES, REPLAY, SCOPE_KEYS, CHANGED
    ROUNDS, SAVES, SLICE, SQLITE_SAVES = 2, 200, 50, 50
    REPLAY, SCOPE_KEYS, CHANGED = 5_000, 1_000, 10


class Stores:
    """Where each kind of backend lives for this run: a directory, a Redis, a cluster."""

    def __init__(self, directory: Path, redis_url: str, cluster_url: str) -> None:
        self.directory = directory
        self.redis_url = redis_url
        self.cluster_url = cluster_url
        self._made = 0

    def backend(self, kind: str, *, feed: FeedRetention | None = DEFAULT_FEED) -> Backend:
        """A fresh, empty store of `kind` (its own directory, file or key prefix)."""
        self._made += 1
        name = f"s{self._made}"
        if kind == "memory":
            return MemoryBackend(feed=feed)
        if kind == "file":
            return FileBackend(base_path=self.directory / name, feed=feed)
        if kind == "sqlite":
            assert feed is not None  # its feed cannot be off
            return SQLiteBackend(self.directory / f"{name}.db", feed=feed)
        url = self.redis_url if kind == "redis" else self.cluster_url
        return RedisBackend(url=url, key_prefix=f"{name}:", feed=feed)


def seconds(rate: float) -> str:
    """A rate of operations per second as the time of one operation."""
    per = 1 / rate
    return f"{per * 1e3:,.1f} ms" if per >= 1e-3 else f"{per * 1e6:,.0f} µs"


# ---------------------------------------------------------------- 1. save, feed on vs off


async def _timed_saves(state: StateManager, count: int, first: int) -> float:
    start = time.perf_counter()
    for i in range(first, first + count):
        await state.save(f"k{i % 100}", VALUE)
    return time.perf_counter() - start


async def _plain_sqlite_saves(conn: sqlite3.Connection, count: int, first: int) -> float:
    raw = repr(VALUE).encode()  # bytes of about the same size; plain sqlite3 stores them as is
    start = time.perf_counter()
    for i in range(first, first + count):
        conn.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (f"k{i % 100}", raw))
    return time.perf_counter() - start


async def feed_cost(stores: Stores, kind: str) -> Row:
    """Saves per second with the feed on against off (SQLite: against plain sqlite3)."""
    count = SQLITE_SAVES if kind == "sqlite" else SAVES
    rounds: list[dict[str, float]] = []
    async with AsyncExitStack() as stack:
        on = await stack.enter_async_context(StateManager(backend=stores.backend(kind)))
        sides: dict[str, Callable[[int, int], Awaitable[float]]] = {
            "on": lambda n, first: _timed_saves(on, n, first)
        }
        if kind == "sqlite":
            conn = sqlite3.connect(stores.directory / "plain.db", isolation_level=None)
            stack.callback(conn.close)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # SQLiteBackend's default
            conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB) WITHOUT ROWID")
            sides["off"] = lambda n, first: _plain_sqlite_saves(conn, n, first)
        else:
            off = await stack.enter_async_context(
                StateManager(backend=stores.backend(kind, feed=None))
            )
            sides["off"] = lambda n, first: _timed_saves(off, n, first)
        for run in sides.values():  # warm up
            await run(min(count, 100), 0)
        slice_ = min(SLICE, count)
        for _ in range(ROUNDS):
            spent = dict.fromkeys(sides, 0.0)
            for turn in range(count // slice_):
                order = list(sides) if turn % 2 else list(reversed(sides))
                for side in order:
                    spent[side] += await sides[side](slice_, turn * slice_)
            rounds.append({side: count // slice_ * slice_ / spent[side] for side in sides})
    base = "plain sqlite3 INSERT OR REPLACE (WAL)" if kind == "sqlite" else "feed off"
    return Row.over(kind, "on", "off", base, rounds)


# ---------------------------------------------------------------- 2. replay from a cursor


async def replay_rate(stores: Stores, kind: str) -> Row:
    """Changes per second replayed from a cursor REPLAY changes back, against get_many."""
    keys = [f"r:{i}" for i in range(min(REPLAY, SCOPE_KEYS))]
    retention = FeedRetention(max_changes=REPLAY + REPLAY // 2)
    rounds: list[dict[str, float]] = []
    async with StateManager(backend=stores.backend(kind, feed=retention)) as state:
        cursor = await state.feed_cursor()
        assert cursor is not None
        for first in range(0, REPLAY, BATCH):
            await state.save_many(
                {keys[i % len(keys)]: {"n": i} for i in range(first, min(REPLAY, first + BATCH))}
            )
        for _ in range(max(1, ROUNDS // 2)):
            start = time.perf_counter()
            replayed = await _replay(state, cursor, REPLAY)
            replay = REPLAY / (time.perf_counter() - start)
            assert replayed == REPLAY, (kind, replayed)
            start = time.perf_counter()
            read = 0
            while read < REPLAY:
                for first in range(0, len(keys), BATCH):
                    read += len(await state.get_many(keys[first : first + BATCH]))
            reads = read / (time.perf_counter() - start)
            rounds.append({"replay": replay, "get_many": reads})
    return Row.over(kind, "replay", "get_many", "get_many of as many values", rounds)


async def _replay(state: StateManager, cursor: str, count: int) -> int:
    """Read `count` changes after `cursor`, resuming after an overflow; return how many."""
    seen = 0
    position = cursor
    while seen < count:
        try:
            async with state.changes("*", since=position, max_buffer=BATCH * 10) as changes:
                async for change in changes:
                    seen += 1
                    position = change.cursor or position
                    if seen >= count:
                        break
        except SubscriptionClosedError as exc:
            if exc.reason != "overflow":
                raise
    return seen


# ---------------------------------------------------------------- 3. commits of a scope


async def commit_cost(stores: Stores, kind: str) -> list[Row]:
    """A commit with 1% of a scope changed against writing the changed keys; the first commit."""
    scope = "doc:"
    keys = [f"{scope}{i:05d}" for i in range(SCOPE_KEYS)]
    rounds: list[dict[str, float]] = []
    async with StateManager(backend=stores.backend(kind)) as state:
        start = time.perf_counter()
        for first in range(0, SCOPE_KEYS, BATCH):
            await state.save_many(dict.fromkeys(keys[first : first + BATCH], VALUE))
        whole = time.perf_counter() - start
        start = time.perf_counter()
        await state.commit(scope, message="first")
        first_commit = time.perf_counter() - start
        for round_ in range(ROUNDS):
            # Each round changes other keys: 1% one save at a time, then 1% in one save_many.
            one_by_one = keys[2 * round_ * CHANGED : (2 * round_ + 1) * CHANGED]
            together = keys[(2 * round_ + 1) * CHANGED : (2 * round_ + 2) * CHANGED]
            value = {**VALUE, "round": round_}
            start = time.perf_counter()
            for key in one_by_one:
                await state.save(key, value)
            saves = time.perf_counter() - start
            start = time.perf_counter()
            await state.commit(scope, message=f"round {round_}: one by one")
            after_saves = time.perf_counter() - start
            start = time.perf_counter()
            await state.save_many(dict.fromkeys(together, value))
            many = time.perf_counter() - start
            start = time.perf_counter()
            await state.commit(scope, message=f"round {round_}: save_many")
            after_many = time.perf_counter() - start
            rounds.append(
                {
                    "commit_saves": 1 / after_saves,
                    "saves": 1 / saves,
                    "commit_many": 1 / after_many,
                    "many": 1 / many,
                }
            )
    pct = f"{CHANGED / SCOPE_KEYS:.0%}"
    return [
        Row.over(
            f"{kind}: commit, {pct} changed",
            "commit_saves",
            "saves",
            f"{CHANGED} saves one by one",
            rounds,
        ),
        Row.over(
            f"{kind}: commit, {pct} changed",
            "commit_many",
            "many",
            f"save_many of {CHANGED}",
            rounds,
        ),
        Row.over(
            f"{kind}: first commit ({SCOPE_KEYS:,} keys)",
            "first",
            "whole",
            f"save_many of {SCOPE_KEYS:,}",
            [{"first": 1 / first_commit, "whole": 1 / whole}],
        ),
    ]


# ---------------------------------------------------------------- the run


@contextmanager
def servers() -> Iterator[tuple[str, str]]:
    """A redis-server and a 3-primary cluster for the run: their URLs."""
    sys.path.insert(0, str(ROOT))
    from tests._redis_cluster import RedisClusterServers

    with redis_server() as url, tempfile.TemporaryDirectory() as directory:
        if "cluster" not in KINDS:
            yield url, ""
            return
        cluster = RedisClusterServers(Path(directory), primaries=3)
        cluster.start()
        try:
            yield url, cluster.url
        finally:
            cluster.stop()


async def measure(stores: Stores) -> tuple[list[Row], list[Row], list[Row]]:
    costs = [await feed_cost(stores, kind) for kind in KINDS]
    replays = [await replay_rate(stores, kind) for kind in KINDS]
    commits = [row for kind in KINDS for row in await commit_cost(stores, kind)]
    return costs, replays, commits


def run() -> tuple[str, list[tuple[str, float]]]:
    with ExitStack() as stack:
        redis_url, cluster_url = stack.enter_context(servers())
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        costs, replays, commits = anyio.run(measure, Stores(directory, redis_url, cluster_url))
    redis = next((row.ratio for row in costs if row.label == "redis"), None)
    verdict = "not measured" if redis is None else "met" if redis >= 0.8 else "NOT met"
    text = table(
        "The change feed: save with the feed on against off",
        ["backend", "feed on saves/s", "baseline saves/s", "baseline", "on / baseline (range)"],
        [
            [
                row.label,
                f"{row.rate:,.0f}",
                f"{row.base:,.0f}",
                row.base_label,
                f"{row.ratio:.2f}x ({row.low:.2f}-{row.high:.2f})",
            ]
            for row in costs
        ],
        [
            f"One StateManager.save at a time over 100 keys, {SAVES} per side per round "
            f"({SQLITE_SAVES} on SQLite, where each one fsyncs), the sides alternating every "
            f"{SLICE}; {ROUNDS} rounds, each ratio taken within its round: the median and the "
            "range. A ratio of rates: 0.80x means the feed makes a save cost 1.25x.",
            "Feed on: the backend's default FeedRetention() (the last 10,000 changes); off: the "
            "same backend built with feed=None. SQLite's feed cannot be off (its subscriptions "
            "read the changes table): its row compares with plain sqlite3 autocommit "
            "INSERT OR REPLACE in WAL at synchronous=FULL, the backend's default.",
            "Target: on Redis the feed costs at most 1.25x a save without it: "
            f"{verdict} on this run" + ("." if redis is None else f" ({redis:.2f}x)."),
        ],
    )
    text += "\n" + table(
        f"The change feed: replay from a cursor {REPLAY:,} changes back",
        ["backend", "replay changes/s", "get_many values/s", "replay / get_many (range)"],
        [
            [
                row.label,
                f"{row.rate:,.0f}",
                f"{row.base:,.0f}",
                f"{row.ratio:.2f}x ({row.low:.2f}-{row.high:.2f})",
            ]
            for row in replays
        ],
        [
            f"{REPLAY:,} changes written with save_many in batches of {BATCH:,} over "
            f"{min(REPLAY, SCOPE_KEYS):,} keys, the feed retaining {REPLAY + REPLAY // 2:,}; "
            "then StateManager.changes('*', since=<the cursor before them>) read until "
            f"{REPLAY:,} changes came (values decoded), against get_many of as many values in "
            f"batches of {BATCH:,}; rounds: {max(1, ROUNDS // 2)}.",
        ],
    )
    verdicts = []
    for base in (f"{CHANGED} saves one by one", f"save_many of {CHANGED}"):
        over = {row.label.split(":")[0]: 1 / row.ratio for row in commits if row.base_label == base}
        missed = [f"{kind} {ratio:.2f}x" for kind, ratio in over.items() if ratio >= 3]
        verdicts.append(
            f"against {base}: " + (f"NOT met on {', '.join(missed)}" if missed else "met")
        )
    text += "\n" + table(
        f"Commits of a {SCOPE_KEYS:,}-key scope",
        ["backend and commit", "commit", "baseline", "baseline time", "commit / baseline"],
        [
            [
                row.label,
                seconds(row.rate),
                row.base_label,
                seconds(row.base),
                f"{1 / row.ratio:.2f}x ({1 / row.high:.2f}-{1 / row.low:.2f})",
            ]
            for row in commits
        ],
        [
            f"A scope of {SCOPE_KEYS:,} keys, committed once (the first commit stores every "
            f"value); then {ROUNDS} rounds, each changing {CHANGED} other keys one save at a "
            f"time and committing, then {CHANGED} more in one save_many and committing. Times "
            "are medians; the ratio is the commit's time over the writes' (the range over the "
            "rounds).",
            "Target: a commit with 1% changed under 3x the cost of writing the "
            f"changed keys, on this run: {'; '.join(verdicts)}.",
        ],
    )
    bars = [(f"feed on vs off: {row.label}", row.ratio) for row in costs]
    return text, bars


def main(argv: list[str] | None = None) -> None:
    """Run and publish; `argv` (when run as a script): `--quick` and the backends to measure."""
    global KINDS
    argv = argv or []  # `python -m bench` runs every part at full size
    if "--quick" in argv:
        quick()
    KINDS = [kind for kind in KINDS if kind in argv] or KINDS
    text, bars = run()
    publish("feed", text, bars)


if __name__ == "__main__":
    main(sys.argv[1:])
