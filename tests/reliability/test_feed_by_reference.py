"""Model-based: a feed that holds large values by reference still replays every change exactly.

Two stores whose prefixes nest (an outer one and one nested in it, with feeds of different
retention, so each trims on its own) write keys of both ranges: large values (held by
reference: the key, then whatever displaces them) and small ones (inline), writes with a TTL
(inline) left to expire, overwrites, deletes and re-creates, `save_many` and two-key
`transact`s. After every step each store takes a cursor; a `replay` rule, and the end of each
example, replays from every cursor taken through its store and checks what comes against the
model's changes after it: exactly, or `CursorExpiredError` for a cursor older than retention
keeps (never for one of the last few writes). At the end of a Redis example, enough small writes
push every large change out of both feeds: no hash of references may be left (nothing leaks).
"""

from __future__ import annotations

import functools
import uuid
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import anyio
import anyio.from_thread
import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from agenticstate import (
    ChangeOp,
    CursorExpiredError,
    FeedRetention,
    RedisBackend,
    SQLiteBackend,
    StateManager,
)
from agenticstate.backends._redis_feed import INLINE_MAX, REFS_NAMESPACE
from agenticstate.txn import Put
from tests._redis_cluster import RedisClusterServers

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from pathlib import Path

    from anyio.from_thread import BlockingPortal

SETTINGS = settings(
    max_examples=8, stateful_step_count=30, deadline=None, derandomize=True, database=None
)
DB = 8  # the plain Redis database the machine owns (flushed before each example)
RETAIN = (9, 6)  # SQLite: max changes kept (the smaller: one file, one feed)
# Redis: max bytes kept by the outer store's feed and the nested store's (a change holds at
# most about 2 KB here: a displaced value and a small new one), so each trims every few writes.
RETAIN_BYTES = (24_000, 16_000)
SAFE = 5  # a cursor fewer changes old than this is always retained
TAG = "{t}"  # one hash slot on a cluster: replays are ordered within a slot
KEYS = [f"x{TAG}", f"y{TAG}", f"n:x{TAG}", f"n:y{TAG}"]  # relative to the outer store
WAIT = 10.0

Change = tuple[str, ChangeOp, int, Any, Any]  # (outer-relative key, op, version, old, new)
Stores = tuple[list[StateManager], list[str], str]  # the stores, their prefixes, the Redis url


class FeedMachine(RuleBasedStateMachine):
    """Writes through two nested stores; every retained cursor replays the model exactly."""

    portal: ClassVar[BlockingPortal]
    factory: ClassVar[Callable[[], Coroutine[Any, Any, tuple[list[Any], list[str], str]]]]

    def __init__(self) -> None:
        super().__init__()
        backends, self.prefixes, self.url = self.call(type(self).factory)
        self.stack = ExitStack()
        self.states = [
            self.stack.enter_context(
                self.portal.wrap_async_context_manager(StateManager(backend=backend))
            )
            for backend in backends
        ]
        self.log: list[Change] = []
        self.values: dict[str, tuple[Any, int]] = {}  # outer-relative key -> (value, version)
        self.cursors: list[tuple[int, str, int]] = []  # (store, cursor, log length)
        self.counter = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(functools.partial(fn, *args))

    # the model

    def _value(self, large: bool) -> str:
        self.counter += 1
        return f"v{self.counter}:" + ("L" * (INLINE_MAX + 50 * (self.counter % 7)) if large else "")

    def _local(self, store: int, key: str) -> str | None:
        """The key as store `store` names it, or `None` when outside its range."""
        cut = len(self.prefixes[store]) - len(self.prefixes[0])
        return key[cut:] if key.startswith(self.prefixes[store][len(self.prefixes[0]) :]) else None

    def _store_for(self, key: str, nested: bool) -> int:
        return 1 if nested and self._local(1, key) is not None else 0

    def _wrote(self, key: str, value: Any) -> None:
        old = self.values.get(key)
        version = 1 if old is None else old[1] + 1
        self.log.append((key, ChangeOp.SET, version, None if old is None else old[0], value))
        self.values[key] = (value, version)

    def _deleted(self, key: str) -> None:
        old = self.values.pop(key, None)
        if old is not None:
            self.log.append((key, ChangeOp.DELETE, old[1], old[0], None))

    def _mark(self) -> None:
        for store, state in enumerate(self.states):
            self.cursors.append((store, self.call(state.feed_cursor), len(self.log)))

    # rules

    @rule(key=st.sampled_from(KEYS), large=st.booleans(), nested=st.booleans())
    def write(self, key: str, large: bool, nested: bool) -> None:
        store = self._store_for(key, nested)
        value = self._value(large)
        self.call(self.states[store].save, self._local(store, key), value)
        self._wrote(key, value)
        self._mark()

    @rule(key=st.sampled_from(KEYS), nested=st.booleans())
    def delete(self, key: str, nested: bool) -> None:
        store = self._store_for(key, nested)
        self.call(self.states[store].delete, self._local(store, key))
        self._deleted(key)
        self._mark()

    @rule(key=st.sampled_from(KEYS), large=st.booleans())
    def expire(self, key: str, large: bool) -> None:
        """A write with a short TTL, then its silent expiry (the model forgets the key)."""
        state = self.states[0]
        value = self._value(large)
        self.call(functools.partial(state.save, key, value, ttl=timedelta(milliseconds=30)))
        self._wrote(key, value)

        async def gone() -> None:
            # The clock has to pass the expiry: there is no event to wait on.
            with anyio.fail_after(WAIT):
                await anyio.sleep(0.03)
                while await state.exists(key):  # noqa: ASYNC110  # a clock, not an event
                    await anyio.sleep(0.01)

        self.call(gone)
        self.values.pop(key)
        self._mark()

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def save_many(self, keys: list[str]) -> None:
        values = {key: self._value(large=index % 2 == 0) for index, key in enumerate(keys)}
        self.call(self.states[0].save_many, values)
        for key, value in values.items():
            self._wrote(key, value)
        self._mark()

    @rule(first=st.sampled_from(KEYS), second=st.sampled_from(KEYS))
    def transact(self, first: str, second: str) -> None:
        """Two puts in one step (the same key twice: the second displaces the first)."""
        values = [self._value(large=True), self._value(large=False)]
        then = [Put(first, values[0]), Put(second, values[1])]
        assert self.call(functools.partial(self.states[0].transact, [], then)).succeeded
        self._wrote(first, values[0])
        self._wrote(second, values[1])
        self._mark()

    @rule()
    def replay(self) -> None:
        self._replay_all()

    # checks

    def _expected(self, store: int, at: int) -> list[Change]:
        found = []
        for key, op, version, old, new in self.log[at:]:
            local = self._local(store, key)
            if local is not None:
                found.append((local, op, version, old, new))
        return found

    def _replay_all(self) -> None:
        for index, (store, cursor, at) in enumerate(self.cursors):
            expected = self._expected(store, at)
            recent = len(self.log) - at < SAFE

            async def read(
                state: StateManager = self.states[store],
                count: int = len(expected),
                cursor: str = cursor,
            ) -> list[Change]:
                got: list[Change] = []
                async with state.changes("*", since=cursor) as changes:
                    if count == 0:
                        return got
                    with anyio.fail_after(WAIT):
                        async for change in changes:
                            got.append(
                                (
                                    change.key,
                                    change.op,
                                    change.version,
                                    change.old_value,
                                    change.new_value,
                                )
                            )
                            if len(got) == count:
                                break
                return got

            try:
                got = self.call(read)
            except CursorExpiredError:
                assert not recent, f"a recent cursor ({index} of {len(self.cursors)}) expired"
                continue
            assert got == expected, (cursor, got, expected)

    def teardown(self) -> None:
        try:
            self._replay_all()
            if self.url:
                self._check_no_leak()
        finally:
            self.stack.close()

    def _check_no_leak(self) -> None:
        """Small writes push every change out of both feeds: no hash of references stays."""
        for store, state in enumerate(self.states):
            for n in range(RETAIN_BYTES[0] // 10):  # small changes: well over max_bytes
                self.call(state.save, f"push{n % 10}{TAG}", n)  # the same slot, so stream
            del store

        async def refs() -> list[bytes]:
            parts = urlsplit(self.url)
            if parts.scheme.endswith("+cluster"):
                nodes = [n.rpartition(":") for n in parts.netloc.rpartition("@")[2].split(",")]
                clients = [aioredis.Redis(host=host, port=int(port)) for host, _, port in nodes]
            else:
                clients = [aioredis.Redis.from_url(self.url, db=DB)]
            found = []
            for client in clients:
                async with client:
                    found += [n async for n in client.scan_iter(match=REFS_NAMESPACE + "*")]
            return [n for n in found if self.prefixes[0].encode() in n]

        assert self.call(refs) == []


def _run(kind: str, url: str, tmp_path: Path) -> None:
    async def factory() -> tuple[list[Any], list[str], str]:
        if kind == "sqlite":
            path = tmp_path / f"{uuid.uuid4().hex}.db"
            prefixes = ["", "n:"]
            # One file, one feed: it keeps the smaller count (the two stores trim it alike).
            backends: list[Any] = [
                SQLiteBackend(path, key_prefix=p, feed=FeedRetention(max_changes=min(RETAIN)))
                for p in prefixes
            ]
            return backends, prefixes, ""
        root = f"m{uuid.uuid4().hex[:8]}:"
        prefixes = [root, root + "n:"]
        cluster = kind == "redis-cluster"
        if not cluster:
            async with aioredis.Redis.from_url(url, db=DB) as admin:
                await admin.flushdb()
        backends = [
            RedisBackend(
                url=url,
                key_prefix=prefix,
                db=None if cluster else DB,
                feed=FeedRetention(max_bytes=retain),
            )
            for prefix, retain in zip(prefixes, RETAIN_BYTES, strict=True)
        ]
        return backends, prefixes, url

    with anyio.from_thread.start_blocking_portal(backend="asyncio") as portal:
        FeedMachine.portal = portal
        FeedMachine.factory = factory
        run_state_machine_as_test(FeedMachine, settings=SETTINGS)


def test_sqlite_feed_by_reference_replays_exactly(tmp_path: Path) -> None:
    """SQLite: nested stores on one file; every retained cursor replays the model exactly."""
    _run("sqlite", "", tmp_path)


@pytest.mark.redis
@pytest.mark.slow
def test_redis_feed_by_reference_replays_exactly(redis_url: str, tmp_path: Path) -> None:
    """Redis: nested stores with their own retention; every retained cursor replays the model
    exactly, and no hash of references outlives the changes that held it."""
    _run("redis", redis_url, tmp_path)


@pytest.mark.redis
@pytest.mark.slow
def test_cluster_feed_by_reference_replays_exactly(tmp_path: Path) -> None:
    """Redis Cluster: the same, in one slot of a cluster of its own."""
    cluster = RedisClusterServers(tmp_path / "cluster", primaries=3)
    try:
        cluster.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        pytest.fail(f"no Redis Cluster could start: {exc}")
    try:
        _run("redis-cluster", cluster.url, tmp_path)
    finally:
        cluster.stop()
