r"""Listings that read only what they return: the ordered keys of the memory and file stores,
the skip-scan across entities (`ns:{*}:part`) on memory, file and SQLite, and what they cost.

- `SortedKeys` against a sorted list under generated adds and removes (chunks split and merge).
- `skip_plan` on a table of patterns (escapes, `\}`, stars, no `}`).
- A hypothesis state machine per local backend (memory; file, with reopening): under generated
  writes, `set_many`, deletes, transactions and writes that expire at once, the ordered keys
  equal the dict's keys (and the braced ones those with two `}`), and every listing equals a
  brute-force glob filter of the live keys, for generated patterns with glob metacharacters,
  `{`, `}`, U+10FFFF, and `{*}` shapes.
- A file store whose writer is killed (SIGKILL) reopens with its ordered keys rebuilt from the
  snapshot and log, equal to its dict.
- SQLite: the skip-scan equals a brute-force filter (generated keys and patterns, with a
  `key_prefix`), and its cost, counted in SQLite virtual-machine steps (a progress handler on
  the reader's connection), does not grow with 1,000,000 unrelated keys nor with the entities'
  other keys; every statement of a listing and of the expiry sweep searches an index (no table
  scan), the sweep through `kv_expiry`.
- The expiry sweep of the local stores takes only due heap items, however many keys live.
"""

from __future__ import annotations

import math
import random
import shutil
import sqlite3
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agenticstate import FileBackend, MemoryBackend, SQLiteBackend
from agenticstate._glob import compile_glob, glob_match
from agenticstate._keys import escape_glob
from agenticstate.backends import _keyorder
from agenticstate.backends._keyorder import SortedKeys, is_braced, skip_plan
from agenticstate.backends._local import LocalStore
from agenticstate.backends.base import Delete, Entry, Put
from tests.helpers import LineProcess

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agenticstate.backends.base import Backend

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CHARS = ["a", "b", ":", "{", "}", "*", "?", "[", "]", "\\", "^", "\U0010ffff", "~"]
tags = st.sampled_from(["t1", "t2", "t10", "", "a}b", "\U0010ffff"])
parts = st.sampled_from(["meta", "m", "msg:1", "msg:2", "x}:meta", "}", "", ":meta"])
structured = st.builds(
    lambda ns, tag, part: f"{ns}:{{{tag}}}:{part}", st.sampled_from(["ns", "nt", "n"]), tags, parts
)
free = st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=6)
keys = st.one_of(structured, structured, free)
TAILS = ["*", "*}*", "*}:meta", "*}:*", "**}:m*", "*\\}:meta", "?*", "[a-t]*", "*:meta", "*}", ""]
heads = st.one_of(
    st.sampled_from(["ns:{", "ns:", "n", "", "ns:{t1", "nt:{", "\U0010ffff", "ns:{a}"]),
    st.text(alphabet=st.sampled_from(CHARS), max_size=3),
)
patterns = st.one_of(
    st.builds(lambda head, tail: escape_glob(head) + tail, heads, st.sampled_from(TAILS)),
    structured.map(escape_glob),
).filter(bool)


def brute(live: set[str] | dict[str, Any], pattern: str) -> list[str]:
    """The keys `pattern` selects, by trying every one."""
    return sorted(key for key in live if glob_match(pattern, key))


# ------------------------------------------------------------------ SortedKeys and skip_plan


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), free), max_size=400), load=st.sampled_from([2, 4, 512])
)
def test_sorted_keys_follow_a_sorted_list(ops: list[tuple[bool, str]], load: int) -> None:
    """Adds and removes keep `SortedKeys` equal to a sorted set; ranges and seeks agree."""
    saved = _keyorder._LOAD
    _keyorder._LOAD = load  # small chunks: splits and merges at every few changes
    try:
        ordered = SortedKeys()
        model: set[str] = set()
        for add, key in ops:
            if add and key not in model:
                ordered.add(key)
                model.add(key)
            elif not add:
                assert ordered.discard(key) == (key in model)
                model.discard(key)
            assert len(ordered) == len(model)
        expected = sorted(model)
        assert list(ordered) == expected
        for low in ["", "a", ":", "{", "}", "\U0010ffff"]:
            for high in [None, "b", "}", "\U0010ffff"]:
                want = [key for key in expected if key >= low and (high is None or key < high)]
                assert ordered.range(low, high) == want
                assert ordered.first(low, high) == (want[0] if want else None)
                above = [key for key in want if key > low]
                assert ordered.first(low, high, above=True) == (above[0] if above else None)
        for key in {key for _, key in ops}:
            assert (key in ordered) == (key in model)
    finally:
        _keyorder._LOAD = saved


@pytest.mark.parametrize(
    ("pattern", "plan"),
    [
        ("agents:{*}:recovery", ("agents:{", ":recovery")),
        ("agents:{*}:*", ("agents:{", ":*")),
        ("a:{**}", ("a:{", "")),
        ("a:{*\\}:x", ("a:{", ":x")),
        ("\\*x\\{*}y", ("*x{", "y")),
        ("*}:m", ("", ":m")),
        ("agents:{*}", ("agents:{", "")),
        ("agents:{*:x", None),
        ("agents:{?}:x", None),
        ("agents:{a}:*", None),
        ("agents:{[ab]*}:x", None),
        ("agents:{a}", None),
        ("a\\", None),
    ],
)
def test_skip_plan_takes_a_literal_prefix_stars_and_a_brace(
    pattern: str, plan: tuple[str, str] | None
) -> None:
    """`skip_plan` splits `<prefix>*}<rest>` and declines every other shape."""
    assert skip_plan(pattern) == plan


# ------------------------------------------------------------------ the local stores' model


def _spin_past(moment: datetime) -> None:
    """Return once every store's clock is past `moment` plus 1 us (a TTL of 1 us has run out).

    The file store reads a clock cut to the millisecond, so this waits up to a millisecond.
    """
    deadline = moment + timedelta(milliseconds=1, microseconds=1)
    while datetime.now(UTC) <= deadline:
        pass


class LocalKeysMachine(RuleBasedStateMachine):
    """A memory or file store against a set of live keys: ordered keys and listings."""

    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.directory = Path(tempfile.mkdtemp(prefix="agenticstate-keyorder-"))
        self.live: set[str] = set()
        self.backend = self._open()

    def _open(self) -> Backend:
        if self.kind == "memory":
            backend: Backend = MemoryBackend()
        else:
            backend = FileBackend(
                base_path=self.directory, format="msgpack", durability="none", auto_save=False
            )
        self.portal.call(backend.open)
        return backend

    def _local(self) -> LocalStore:
        local: LocalStore = self.backend._local  # type: ignore[attr-defined]
        return local

    @rule(key=keys)
    def write(self, key: str) -> None:
        self.portal.call(self.backend.set, key, b"v")
        self.live.add(key)

    @rule(items=st.lists(keys, max_size=4))
    def write_many(self, items: list[str]) -> None:
        self.portal.call(self.backend.set_many, [(key, b"m") for key in items])
        self.live.update(items)

    @rule(key=keys)
    def delete(self, key: str) -> None:
        self.portal.call(self.backend.delete, key)
        self.live.discard(key)

    @rule(key=keys)
    def expire(self, key: str) -> None:
        """Write `key` with a TTL of one microsecond: it is gone by the next step."""
        change = self.portal.call(
            lambda: self.backend.set(key, b"e", ttl=timedelta(microseconds=1))
        )
        _spin_past(change.timestamp)
        self.live.discard(key)

    @rule(ops=st.lists(st.tuples(st.booleans(), keys), min_size=1, max_size=4))
    def transact(self, ops: list[tuple[bool, str]]) -> None:
        steps = [Put(key, b"t") if put else Delete(key) for put, key in ops]
        self.portal.call(self.backend.transact, [], steps)
        for put, key in ops:
            (self.live.add if put else self.live.discard)(key)

    @rule(pattern=patterns)
    def list_keys(self, pattern: str) -> None:
        async def listed() -> list[str]:
            return [key async for batch in self.backend.scan_batches(pattern) for key in batch]

        assert self.portal.call(listed) == brute(self.live, pattern), pattern

    @invariant()
    def index_equals_the_dict(self) -> None:
        local = self._local()
        ordered, braced = local.ordered_keys()
        assert ordered == sorted(local.data)
        assert braced == [key for key in ordered if is_braced(key)]

    def teardown(self) -> None:
        try:
            self.portal.call(self.backend.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)
            shutil.rmtree(self.directory, ignore_errors=True)


class FileKeysMachine(LocalKeysMachine):
    """The same on a file store, closed and reopened mid-example."""

    kind = "file"

    @rule()
    def reopen(self) -> None:
        """Close and reopen: the ordered keys are rebuilt from the snapshot and the log."""
        self.portal.call(self.backend.aclose)
        self.backend = self._open()
        ordered, _ = self._local().ordered_keys()
        assert set(ordered) >= self.live  # expired entries may wait for the next sweep


@pytest.mark.parametrize("machine", [LocalKeysMachine, FileKeysMachine], ids=["memory", "file"])
def test_ordered_keys_and_listings_follow_the_model(machine: type[LocalKeysMachine]) -> None:
    """Under generated changes the ordered keys equal the dict, listings a brute-force filter."""
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40 if machine is LocalKeysMachine else 15,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_killed_file_writer_leaves_keys_the_reopened_store_orders(
    tmp_path: Path, seed: int
) -> None:
    """After SIGKILL mid-writes, the reopened store orders its keys as its dict; listings agree."""
    writer = LineProcess("tests.backends._keyorder_writer", str(tmp_path), str(seed))
    try:
        assert writer.wait_until(lambda lines: "ack 300" in lines, timeout=120), writer.close()
    finally:
        writer.kill()
    backend = FileBackend(base_path=tmp_path, format="msgpack")
    async with backend:
        local: LocalStore = backend._local
        ordered, braced = local.ordered_keys()
        assert ordered == sorted(local.data)
        assert braced == [key for key in ordered if is_braced(key)]
        now = datetime.now(UTC)
        live = {
            key
            for key, entry in local.data.items()
            if entry.expires_at is None or entry.expires_at > now
        }
        assert live, "the writer's changes were replayed"
        for pattern in ["ns:{*}:m", "ns:{*}:*", "n*}:m", "ns:{t1}:*", "*}", "ns:{*}x}:m"]:
            listed = [key async for batch in backend.scan_batches(pattern) for key in batch]
            assert listed == brute(live, pattern), pattern


class Counted(str):
    """A key that counts the comparisons made with it (what a listing reads of the order)."""

    compared = 0

    def __lt__(self, other: object) -> bool:
        Counted.compared += 1
        return str.__lt__(self, other)  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        Counted.compared += 1
        return str.__gt__(self, other)  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        Counted.compared += 1
        return str.__ge__(self, other)  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        Counted.compared += 1
        return str.__le__(self, other)  # type: ignore[operator]

    __hash__ = str.__hash__


def _local_costs(unrelated: int, messages: int) -> dict[str, tuple[int, int]]:
    """Key comparisons a `LocalStore`'s listings make, each after a write, and the keys stored."""
    store = LocalStore()
    for i in range(unrelated):
        store.store(_entry(Counted(f"zz:{i:07d}"), None))
    for s in range(20):
        for part in ["meta", *(f"msg:{m:05d}" for m in range(messages))]:
            store.store(_entry(Counted(f"sess:{{s{s:02d}}}:{part}"), None))
    costs: dict[str, tuple[int, int]] = {}
    for n, pattern in enumerate(["sess:{*}:meta", "sess:{s07}:*", "sess:{s07}:meta"]):
        store.matching(compile_glob(pattern), T0)
        store.store(_entry(Counted(f"zz:new:{n}"), None))  # a write between listings
        Counted.compared = 0
        listed = store.matching(compile_glob(pattern), T0)
        costs[pattern] = (Counted.compared, len(store.data))
        assert listed == brute(set(store.data), pattern)
    return costs


@pytest.mark.slow
@pytest.mark.parametrize(("unrelated", "messages"), [(0, 2), (200_000, 2), (0, 500)])
def test_local_listing_cost_is_log_n_per_entity(unrelated: int, messages: int) -> None:
    """A listing compares O(log n) keys per entity it returns (or per range), never scans."""
    costs = _local_costs(unrelated, messages)
    # Seeks (bisects over the chunks' last keys, then in a chunk): 3 per entity for the
    # skip-scan (its first key, `<group>:meta`, the braced keys), 2 for a range.
    for pattern, seeks, result in [
        ("sess:{*}:meta", 3 * 20, 20),
        ("sess:{s07}:*", 2, messages + 1),
        ("sess:{s07}:meta", 1, 1),
    ]:
        compared, size = costs[pattern]
        assert compared <= 2 * seeks * (math.log2(size) + 2) + 2 * result, (pattern, costs)


# ------------------------------------------------------------------ SQLite


TRICKY = ["ns:{a}b}:meta", "ns:{t1}:x}:meta", "ns:{}:meta", "ns:{t1}}:meta", "ns:{t2}:meta"]
"""Keys whose `*` in `ns:{*}:meta` crosses a second `}` (or matches nothing), always stored."""
TRICKY_PATTERNS = ["ns:{*}:meta", "ns:{*}:*", "*}:meta", "ns:{*}}:meta", "ns:{*}"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stored=st.lists(st.tuples(keys, st.booleans()), max_size=40),
    wanted=st.lists(patterns, min_size=1, max_size=6),
    prefix=st.sampled_from(["", "p:", "q}:"]),
)
def test_sqlite_listings_equal_a_brute_force_filter(
    stored: list[tuple[str, bool]], wanted: list[str], prefix: str
) -> None:
    """SQLite's listings (skip-scans included) equal a filter of the live keys, with a prefix."""

    async def main(directory: Path) -> None:
        async with SQLiteBackend(directory / "s.db", key_prefix=prefix) as backend:
            live: set[str] = set(TRICKY)
            await backend.set_many([(key, b"t") for key in TRICKY])
            for key, expires in stored:
                if expires:
                    change = await backend.set(key, b"e", ttl=timedelta(microseconds=1))
                    _spin_past(change.timestamp)
                    live.discard(key)
                else:
                    await backend.set(key, b"v")
                    live.add(key)
            for pattern in [*wanted, *TRICKY_PATTERNS]:
                listed = [key async for batch in backend.scan_batches(pattern) for key in batch]
                assert listed == brute(live, pattern), pattern

    with tempfile.TemporaryDirectory() as directory:
        anyio.run(main, Path(directory))


UNRELATED = 1_000_000


def _fill(path: Path, rows: Iterator[str] | str, count: int = 0) -> None:
    """Insert keys into a store's `kv` table directly, in one transaction.

    `rows` is an iterable of keys, or a `printf` format filled with 1..`count` by SQLite itself
    (a million keys in about a second).
    """
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        if isinstance(rows, str):
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                "INSERT INTO kv (key, value, version, created_at, updated_at) "
                "SELECT printf(?, i), x'76', 1, 0, 0 FROM n",
                (count, rows),
            )
        else:
            conn.executemany(
                "INSERT INTO kv (key, value, version, created_at, updated_at) "
                "VALUES (?, x'76', 1, 0, 0)",
                ((key,) for key in rows),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()


async def _steps(backend: SQLiteBackend, pattern: str) -> tuple[list[str], int]:
    """List `pattern`; return the keys and the SQLite VM steps the reader ran meanwhile."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    await backend._call(False, lambda conn: conn.set_progress_handler(count, 1))
    try:
        listed = [key async for batch in backend.scan_batches(pattern) for key in batch]
    finally:
        await backend._call(False, lambda conn: conn.set_progress_handler(None, 1))
    return listed, counted[0]


async def _cost_store(path: Path, sessions: int, messages: int) -> SQLiteBackend:
    backend = SQLiteBackend(path)
    await backend.open()
    await backend.aclose()
    _fill(
        path,
        (
            f"sess:{{s{s:03d}}}:{part}"
            for s in range(sessions)
            for part in ["meta", *(f"msg:{m:06d}" for m in range(messages))]
        ),
    )
    return SQLiteBackend(path)


@pytest.mark.slow
async def test_sqlite_listing_cost_ignores_unrelated_keys_and_other_keys_of_an_entity(
    tmp_path: Path,
) -> None:
    """A skip-scan's VM steps stay flat with 1M unrelated keys and 2,000 keys per entity."""
    cases = {
        "small": (20, 2, 0),
        "unrelated": (20, 2, UNRELATED),
        "deep": (20, 2000, 0),
    }
    costs: dict[str, dict[str, int]] = {}
    for name, (sessions, messages, unrelated) in cases.items():
        path = tmp_path / f"{name}.db"
        backend = await _cost_store(path, sessions, messages)
        if unrelated:
            _fill(path, "zz:%08d", unrelated)
        async with backend:
            costs[name] = {}
            for pattern, expected in [
                ("sess:{*}:meta", [f"sess:{{s{s:03d}}}:meta" for s in range(sessions)]),
                ("sess:{s007}:meta", ["sess:{s007}:meta"]),
                ("sess:{s007}:m*", None),
            ]:
                listed, steps = await _steps(backend, pattern)
                if expected is not None:
                    assert listed == expected
                costs[name][pattern] = steps
    small = costs["small"]["sess:{*}:meta"]
    assert costs["unrelated"]["sess:{*}:meta"] <= 1.5 * small + 200, costs
    assert costs["deep"]["sess:{*}:meta"] <= 1.5 * small + 200, costs
    assert costs["unrelated"]["sess:{s007}:meta"] <= 1.5 * costs["small"]["sess:{s007}:meta"] + 50


def _plans(path: Path, statements: list[str]) -> dict[str, str]:
    """Each statement's `EXPLAIN QUERY PLAN`, its lines joined."""
    conn = sqlite3.connect(path)
    try:
        return {
            sql: " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql))
            for sql in statements
        }
    finally:
        conn.close()


async def _traced(backend: SQLiteBackend, write: bool, action: Callable[[], Any]) -> list[str]:
    """The statements (values expanded) the reader or writer ran during `action()`."""
    seen: list[str] = []
    await backend._call(write, lambda conn: conn.set_trace_callback(seen.append))
    try:
        await action()
    finally:
        await backend._call(write, lambda conn: conn.set_trace_callback(None))
    return [
        sql
        for sql in seen
        if sql.lstrip().upper().startswith(("SELECT", "DELETE", "UPDATE", "WITH"))
    ]


async def test_sqlite_listings_and_the_sweep_search_indexes(tmp_path: Path) -> None:
    """Every statement of a listing and of the expiry sweep searches an index, never scans kv."""
    path = tmp_path / "s.db"
    async with SQLiteBackend(path) as backend:
        await backend.set_many([(f"sess:{{s{i}}}:meta", b"m") for i in range(5)])
        await backend.set_many([(f"sess:{{s{i}}}:x}}:meta", b"m") for i in range(2)])
        await backend.set("gone", b"e", ttl=timedelta(microseconds=1))

        async def lists() -> None:
            for pattern in ["sess:{*}:meta", "sess:{*}:*", "sess:{s1}:*", "sess:{s1}:meta"]:
                [key async for batch in backend.scan_batches(pattern) for key in batch]

        reads = await _traced(backend, False, lists)
        backend._swept_at = 0.0  # the next write sweeps

        async def sweep() -> None:
            await backend.set("after", b"v")

        writes = await _traced(backend, True, sweep)
    plans = _plans(path, reads + writes)
    assert reads
    assert all("SEARCH" in plan and "SCAN kv" not in plan for plan in plans.values())
    sweeps = [sql for sql in writes if "expires_at" in sql and "<=" in sql]
    assert len(sweeps) == 2, writes  # the history of expired keys, then the keys
    for sql in sweeps:
        assert "kv_expiry" in plans[sql], plans[sql]
        assert "SCAN" not in plans[sql], plans[sql]
    braced = [sql for sql in reads if "instr" in sql]
    assert braced
    assert all("kv_braced" in plans[sql] for sql in braced)


def test_a_layout_3_store_gains_kv_braced_when_opened_writable(tmp_path: Path) -> None:
    """A store written before layout 4 is migrated: `kv_braced` is built, the data untouched."""
    path = tmp_path / "s.db"

    async def write() -> None:
        async with SQLiteBackend(path) as backend:
            await backend.set("ns:{a}x}:m", b"v")
            await backend.set("ns:{b}:m", b"v")

    anyio.run(write)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP INDEX kv_braced")
    conn.execute("PRAGMA user_version = 3")
    conn.close()

    async def read(**options: Any) -> list[str]:
        async with SQLiteBackend(path, **options) as backend:
            return [key async for batch in backend.scan_batches("ns:{*}:m") for key in batch]

    assert anyio.run(lambda: read(read_only=True)) == ["ns:{a}x}:m", "ns:{b}:m"]
    assert anyio.run(read) == ["ns:{a}x}:m", "ns:{b}:m"]
    conn = sqlite3.connect(path)
    try:
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        assert "kv_braced" in names
        assert conn.execute("PRAGMA user_version").fetchone() == (4,)
        assert conn.execute("SELECT revision FROM kv WHERE key = 'ns:{b}:m'").fetchone() == (2,)
    finally:
        conn.close()


# ------------------------------------------------------------------ expiry costs what expires


def _entry(key: str, expires_at: datetime | None) -> Entry:
    return Entry(key, b"v", 1, T0, T0, expires_at)


@pytest.mark.parametrize("live", [1_000, 200_000])
def test_a_local_sweep_takes_only_due_heap_items(live: int) -> None:
    """With many live keys (TTL or none) and 10 due, a sweep pops 10 heap items."""
    store = LocalStore()
    store.unordered()  # a bulk load
    later = T0 + timedelta(hours=1)
    for i in range(live):
        store.store(_entry(f"k:{i}", later if i % 2 else None))
    for i in range(10):
        store.store(_entry(f"due:{i}", T0 + timedelta(seconds=1)))
    store.reorder()
    assert store.sweep(T0) == 0
    assert store.sweep(T0 + timedelta(seconds=2)) == 10
    assert len(store.data) == live
    assert store.matching(compile_glob("due:*"), T0 + timedelta(seconds=2)) == []


async def test_file_sweep_of_ten_expired_among_many_takes_ten(tmp_path: Path) -> None:
    """A file store's sweep with 20,000 live keys takes the 10 due heap items, not more."""
    async with FileBackend(
        base_path=tmp_path, format="msgpack", durability="none", auto_save=False
    ) as backend:
        await backend.set_many([(f"k:{i}", b"v") for i in range(20_000)], ttl=timedelta(hours=1))
        changes = await backend.set_many(
            [(f"due:{i}", b"v") for i in range(10)], ttl=timedelta(microseconds=1)
        )
        _spin_past(changes[-1].timestamp)
        local: LocalStore = backend._local
        assert local.sweep(datetime.now(UTC)) == 10
        assert local.sweep(datetime.now(UTC)) == 0
        assert len(local.data) == 20_000


def test_random_keys_through_many_chunks_stay_ordered() -> None:
    """Thousands of random adds and removes through the default chunk size keep the order."""
    rng = random.Random(7)
    ordered, model = SortedKeys(), set()
    for _ in range(20_000):
        key = f"{rng.randrange(5000):x}"
        if key in model:
            ordered.discard(key)
            model.discard(key)
        else:
            ordered.add(key)
            model.add(key)
    assert list(ordered) == sorted(model)


# ------------------------------------------------------------------ tags: one seek per id


def _tag_keys(checkpoints: int) -> list[str]:
    """20 agents, each with a state and `checkpoints` checkpoints (as `AgentStateStore`)."""
    return [
        f"agents:{{a{n:02d}}}:{part}"
        for n in range(20)
        for part in ["state", *(f"checkpoints:{c:05d}" for c in range(checkpoints))]
    ]


def test_local_tag_listing_compares_log_n_keys_per_tag() -> None:
    """Listing 20 agents' ids compares about as many keys with 2,000 checkpoints each as with
    one: one seek per agent, never a read of its checkpoints."""
    costs = {}
    for checkpoints in (1, 2000):
        store = LocalStore()
        for key in _tag_keys(checkpoints):
            store.store(_entry(Counted(key), None))
        Counted.compared = 0
        assert store.tags("agents:", T0) == [f"a{n:02d}" for n in range(20)]
        costs[checkpoints] = (Counted.compared, len(store.data))
    few, _ = costs[1]
    many, size = costs[2000]
    assert many <= 2 * 21 * (math.log2(size) + 2), costs  # 21 seeks of O(log n)
    assert many <= 2 * few + 100, costs


async def _tag_steps(backend: SQLiteBackend, prefix: str) -> tuple[list[str], int]:
    """`scan_tags(prefix)`; the tags and the SQLite VM steps the reader ran meanwhile."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    await backend._call(False, lambda conn: conn.set_progress_handler(count, 1))
    try:
        tags = await backend.scan_tags(prefix)
    finally:
        await backend._call(False, lambda conn: conn.set_progress_handler(None, 1))
    return tags, counted[0]


async def test_sqlite_tag_listing_cost_ignores_the_keys_of_each_tag(tmp_path: Path) -> None:
    """Listing 20 agents' ids runs about as many SQLite VM steps with 2,000 checkpoints each
    as with one (and with 100,000 unrelated keys): one index seek per agent."""
    costs = {}
    for name, checkpoints, unrelated in [("few", 1, 0), ("many", 2000, 0), ("other", 1, 100_000)]:
        path = tmp_path / f"{name}.db"
        backend = SQLiteBackend(path)
        await backend.open()
        await backend.aclose()
        _fill(path, iter(_tag_keys(checkpoints)))
        if unrelated:
            _fill(path, "zz:%08d", unrelated)
        async with SQLiteBackend(path) as backend:
            tags, costs[name] = await _tag_steps(backend, "agents:")
        assert tags == [f"a{n:02d}" for n in range(20)]
    assert costs["many"] <= 1.5 * costs["few"] + 200, costs
    assert costs["other"] <= 1.5 * costs["few"] + 200, costs
