"""Model-based: stores whose key prefixes nest, open at once, against one model of the keys.

Three stores share one place: on SQLite one file, on Redis one database, on Redis Cluster one
cluster, under the prefixes `""`, `"a:"` and `"a:b:"` (on the cluster, whose database other
tests share, `""`, `"<root>"` and `"<root>a:"`, the outer one reading only `<root>*`). Prefixes
nest: a store sees every key under its prefix, whichever store wrote it. A hypothesis
`RuleBasedStateMachine` writes and deletes keys through any store (keys chosen under that
store: some fall in a nested store's range), takes cursors, and checks every path against the
model: `get_many` and `list_keys`; a key's `history` (every store keeps 3 versions of every
key); a live `changes()` per store, opened at the start (exact
changes, in commit order, nothing missed or extra); a replay from each cursor taken; a reconnect
of every pub/sub connection (`CLIENT KILL TYPE pubsub`: the changes of the outage come from the
feed, exactly, never as a `RESYNC`); and a commit of each store's whole scope (its checkout
holds what the model holds under it).

Markers: to know that a read has caught up, the machine writes a marker key through a store and
reads until it comes; markers are writes like any other (in the model too).
"""

from __future__ import annotations

import functools
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import anyio
import anyio.from_thread
import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agenticstate import ChangeOp, RedisBackend, SQLiteBackend, StateConfig, StateManager
from agenticstate._keys import escape_glob
from tests._redis_cluster import RedisClusterServers

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from pathlib import Path

    from anyio.from_thread import BlockingPortal

    from agenticstate import StateChange

EXAMPLES = 6
STEPS = 25
WAIT = 15.0  # seconds a read may take to reach its marker
KEYS = ["x", "y", "a:x", "a:y", "a:b:x", "a:b:y"]  # relative to the root
NESTING = ["", "a:", "a:b:"]
SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    database=None,
)
DB = 7  # the plain Redis database the machine owns (flushed before each example)
DEPTH = 3  # versions of each key's history kept (by every store: the rules agree)

Change = tuple[str, ChangeOp, int, Any]  # (root-relative key, op, version, new value)


@dataclass
class World:
    """The stores of one example and how to reach their servers."""

    kind: str
    url: str
    root: str  # what every key the machine writes starts with (a Redis key, or SQLite's)
    states: list[StateManager] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)  # each store's key prefix

    def pattern(self, store: int) -> str:
        """The store's pattern for the machine's keys."""
        return escape_glob(self.local(store, "")) + "*"

    def covers(self, store: int) -> str:
        """What the root-relative keys a store sees start with."""
        prefix = self.prefixes[store]
        return prefix[len(self.root) :] if len(prefix) >= len(self.root) else ""

    def full(self, store: int, key: str) -> str:
        """A store's key as a root-relative key."""
        return (self.prefixes[store] + key)[len(self.root) :]

    def local(self, store: int, key: str) -> str:
        """A root-relative key as the store names it."""
        return (self.root + key)[len(self.prefixes[store]) :]


@dataclass
class Watcher:
    """A live `changes()` of one store, opened when the example began."""

    store: int
    start: int  # the model log's length when it opened
    seen: list[Change] = field(default_factory=list)
    stream: Any = None


class NestedMachine(RuleBasedStateMachine):
    """Writes through nested stores; every path of every store checked against the model."""

    portal: ClassVar[BlockingPortal]
    world_factory: ClassVar[Callable[[], Coroutine[Any, Any, tuple[World, list[Any]]]]]

    def __init__(self) -> None:
        super().__init__()
        self.world, backends = self.call(type(self).world_factory)
        self.stack = ExitStack()
        for backend in backends:
            self.stack.enter_context(self.portal.wrap_async_context_manager(backend))
            config = StateConfig(history={"*": DEPTH})
            state = StateManager(config, backend=backend, close_backend=False)
            self.world.states.append(
                self.stack.enter_context(self.portal.wrap_async_context_manager(state))
            )
        self.log: list[Change] = []
        self.values: dict[str, tuple[Any, int]] = {}  # root-relative key -> (value, version)
        self.lives: dict[str, list[tuple[int, Any]]] = {}  # each key's versions since created
        self.cursors: list[tuple[int, str, int]] = []  # (store, cursor, log length)
        self.watchers = [Watcher(store, 0) for store in range(3)]
        self.markers = 0
        self.commits = 0
        for watcher in self.watchers:
            state = self.world.states[watcher.store]
            changes = state.changes(self.world.pattern(watcher.store), max_buffer=100_000)
            watcher.stream = self.stack.enter_context(
                self.portal.wrap_async_context_manager(changes)
            )

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(functools.partial(fn, *args))

    def teardown(self) -> None:
        self.stack.close()

    # ------------------------------------------------------------------ the model

    def _keys_of(self, store: int) -> list[str]:
        prefix = self.world.covers(store)
        return [key for key in KEYS if key.startswith(prefix)]

    def _record(self, key: str, op: ChangeOp, version: int, value: Any) -> None:
        self.log.append((key, op, version, value))
        if op is ChangeOp.DELETE:
            self.values.pop(key, None)
            self.lives.pop(key, None)
        else:
            self.values[key] = (value, version)
            self.lives.setdefault(key, []).append((version, value))

    def _expected(self, store: int, start: int) -> list[Change]:
        prefix = self.world.covers(store)
        return [change for change in self.log[start:] if change[0].startswith(prefix)]

    # ------------------------------------------------------------------ rules

    @rule(store=st.integers(0, 2), pick=st.integers(0, 5), value=st.integers(0, 9))
    def write(self, store: int, pick: int, value: int) -> None:
        """A save through `store` of one of its keys (maybe in a nested store's range)."""
        keys = self._keys_of(store)
        key = keys[pick % len(keys)]
        state = self.world.states[store]
        version = self.call(state.save, self.world.local(store, key), value)
        expected = self.values.get(key, (None, 0))[1] + 1
        assert version == expected, (key, version, expected)
        self._record(key, ChangeOp.SET, version, value)

    @rule(store=st.integers(0, 2), pick=st.integers(0, 5))
    def delete(self, store: int, pick: int) -> None:
        """A delete through `store`."""
        keys = self._keys_of(store)
        key = keys[pick % len(keys)]
        existed = self.call(self.world.states[store].delete, self.world.local(store, key))
        assert existed == (key in self.values)
        if existed:
            self._record(key, ChangeOp.DELETE, self.values[key][1], None)

    @rule(store=st.integers(0, 2))
    def take_cursor(self, store: int) -> None:
        """The store's head cursor, to replay from later."""
        cursor = self.call(self.world.states[store].feed_cursor)
        assert cursor is not None
        self.cursors.append((store, cursor, len(self.log)))

    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """From a cursor taken earlier, and from a change's cursor: exactly what came after."""
        if not self.cursors:
            return
        store, cursor, start = data.draw(st.sampled_from(self.cursors))
        wanted = len(self._expected(store, start))  # with the marker this read writes
        got = self._replay_to_marker(store, cursor, wanted)
        self._same([entry for entry, _ in got], self._expected(store, start)[:-1])
        if got:
            # Resuming from any change's own cursor yields exactly what came after it.
            index = data.draw(st.integers(0, len(got) - 1))
            after = self._replay_to_marker(store, got[index][1], len(got) - index)
            expected = self._expected(store, start)
            # (each replay wrote a marker: the second read holds the first one's)
            self._same(
                [entry for entry, _ in after],
                [entry for entry, _ in got[index + 1 :]] + expected[-2:-1],
            )

    def _same(self, got: list[Change], expected: list[Change]) -> None:
        """Equal; on a cluster, per key (slots are not ordered with each other)."""
        if self.world.kind != "redis-cluster":
            assert got == expected
            return
        assert sorted(map(repr, got)) == sorted(map(repr, expected))
        for key in {change[0] for change in expected}:
            assert [c for c in got if c[0] == key] == [c for c in expected if c[0] == key]

    def _marker(self, store: int) -> tuple[str, int]:
        """Write a marker through `store`: its root-relative key and value."""
        self.markers += 1
        key = self.world.covers(store) + "m"
        version = self.call(
            self.world.states[store].save, self.world.local(store, key), self.markers
        )
        self._record(key, ChangeOp.SET, version, self.markers)
        return key, self.markers

    def _replay_to_marker(self, store: int, cursor: str, wanted: int) -> list[tuple[Change, str]]:
        """Replay from `cursor` up to a marker written once entered, and at least `wanted`
        changes in all (on a cluster the marker may come before changes of other slots)."""
        state = self.world.states[store]

        async def read() -> list[tuple[Change, str]]:
            got: list[tuple[Change, str]] = []
            marked = False
            async with state.changes(self.world.pattern(store), since=cursor) as changes:
                key, value = await anyio.to_thread.run_sync(self._marker, store)
                with anyio.fail_after(WAIT):
                    async for change in changes:
                        if _internal(change.key):
                            continue  # a commit's own keys
                        entry = self._entry(store, change)
                        if entry[0] == key and entry[3] == value:
                            marked = True
                        else:
                            assert change.cursor is not None
                            got.append((entry, change.cursor))
                        if marked and len(got) >= wanted - 1:
                            return got
            raise AssertionError("the replay ended before its marker")

        result: list[tuple[Change, str]] = self.call(read)
        return result

    def _entry(self, store: int, change: StateChange) -> Change:
        assert change.op is not ChangeOp.RESYNC, "a change came as a RESYNC"
        return (self.world.full(store, change.key), change.op, change.version, change.new_value)

    @rule(store=st.integers(0, 2), pick=st.integers(0, 5))
    def history(self, store: int, pick: int) -> None:
        """A key's history through any store that sees it: its last versions, whoever wrote."""
        keys = self._keys_of(store)
        key = keys[pick % len(keys)]
        entries = self.call(self.world.states[store].history, self.world.local(store, key))
        expected = self.lives.get(key, [])[-DEPTH:][::-1]
        assert [(entry.version, entry.value) for entry in entries] == expected, key

    @rule()
    def drop_pubsub(self) -> None:
        """Every pub/sub connection is killed; the next checks need the feed's catch-up."""
        if self.world.kind == "sqlite":
            return
        self.call(_kill_pubsub, self.world.url)

    @rule(store=st.integers(0, 2))
    def commit(self, store: int) -> None:
        """A commit of the store's whole scope holds what the model holds under it."""
        state = self.world.states[store]
        scope = self.world.local(store, "")

        async def commit_and_read() -> dict[str, Any]:
            info = await state.commit(scope)
            checkout = await state.checkout(info.id)
            held = await checkout.items()
            # (a nested store's commits are keys under this one's scope: not the model's)
            return {key: value for key, value in held.items() if not _internal(key)}

        self.commits += 1
        held = self.call(commit_and_read)
        prefix = self.world.covers(store)
        expected = {
            self.world.local(store, key): value
            for key, (value, _) in self.values.items()
            if key.startswith(prefix)
        }
        assert held == expected

    @invariant()
    def reads_match(self) -> None:
        """`get_many` and `list_keys` of every store hold what the model holds under it."""
        for store, state in enumerate(self.world.states):
            prefix = self.world.covers(store)
            expected = {
                self.world.local(store, key): value
                for key, (value, _) in self.values.items()
                if key.startswith(prefix)
            }
            pattern = self.world.pattern(store)

            async def read(state: StateManager = state, pattern: str = pattern) -> dict[str, Any]:
                keys = [key for key in await state.list_keys(pattern) if not _internal(key)]
                return dict(await state.get_many(keys))

            assert self.call(read) == expected, f"store {store} reads"

    @rule()
    def check_live(self) -> None:
        """Each live watcher got exactly the changes under its store since it opened."""
        for watcher in self.watchers:
            key, value = self._marker(watcher.store)

            expected = self._expected(watcher.store, watcher.start)

            async def drain(
                watcher: Watcher = watcher, key: str = key, value: int = value, wanted: int = 0
            ) -> None:
                stream = watcher.stream
                marked = False
                with anyio.fail_after(WAIT):
                    async for change in stream:
                        if _internal(change.key):
                            continue  # a commit's own keys
                        entry = self._entry(watcher.store, change)
                        watcher.seen.append(entry)
                        marked = marked or (entry[0] == key and entry[3] == value)
                        if marked and len(watcher.seen) >= wanted:
                            return

            self.call(functools.partial(drain, wanted=len(expected)))
            self._same(watcher.seen, expected)


def _internal(key: str) -> bool:
    return key.startswith("_commits:") or "_commits:" in key


async def _kill_pubsub(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme.endswith("+cluster"):
        nodes = [hp.rpartition(":") for hp in parts.netloc.rpartition("@")[2].split(",")]
        admins = [aioredis.Redis(host=host, port=int(port)) for host, _, port in nodes]
    else:
        admins = [aioredis.Redis.from_url(url)]
    for admin in admins:
        async with admin:
            await admin.client_kill_filter(_type="pubsub")


def _run(kind: str, url: str, tmp_path: Path) -> None:
    async def world() -> tuple[World, list[Any]]:
        backends: list[Any]
        if kind == "sqlite":
            path = tmp_path / f"{uuid.uuid4().hex}.db"
            world = World(kind, str(path), "", prefixes=list(NESTING))
            backends = [SQLiteBackend(path, key_prefix=prefix) for prefix in NESTING]
        else:
            cluster = kind == "redis-cluster"
            root = f"t{uuid.uuid4().hex[:10]}:" if cluster else ""
            prefixes = ["", root, root + "a:"] if cluster else NESTING
            world = World(kind, url, root, prefixes=list(prefixes))
            if not cluster:
                async with aioredis.Redis.from_url(url, db=DB) as admin:
                    await admin.flushdb()
            backends = [
                RedisBackend(url=url, key_prefix=prefix, db=None if cluster else DB)
                for prefix in prefixes
            ]
        return world, backends

    with anyio.from_thread.start_blocking_portal(backend="asyncio") as portal:
        NestedMachine.portal = portal
        NestedMachine.world_factory = world
        run_state_machine_as_test(NestedMachine, settings=SETTINGS)


def test_nested_sqlite_stores_match_the_model(tmp_path: Path) -> None:
    """SQLite: three nested prefixes in one file; every path of every store is exact."""
    _run("sqlite", "", tmp_path)


@pytest.mark.redis
@pytest.mark.slow
def test_nested_redis_stores_match_the_model(redis_url: str, tmp_path: Path) -> None:
    """Redis: three nested prefixes (the empty one outermost) on one database; every path of
    every store is exact, across killed pub/sub connections."""
    _run("redis", redis_url, tmp_path)


@pytest.mark.redis
@pytest.mark.slow
def test_nested_cluster_stores_match_the_model(tmp_path: Path) -> None:
    """Redis Cluster: the empty prefix and two nested ones; every path of every store is exact,
    across killed pub/sub connections. On a cluster of its own: the empty prefix reads every
    stream of the cluster, and the session's shared one holds other tests' (trimmed) feeds."""
    cluster = RedisClusterServers(tmp_path / "cluster", primaries=3)
    try:
        cluster.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        pytest.fail(f"no Redis Cluster could start: {exc}")
    try:
        _run("redis-cluster", cluster.url, tmp_path)
    finally:
        cluster.stop()
