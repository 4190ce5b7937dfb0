"""Exact delivery to callbacks: issue #15's cases, each a regression test, on every backend.

- An `on_overflow` handler that reads and writes state runs while writers keep going (it used to
  wait 30 s for the pump it runs in, and every writer with it).
- A callback that unsubscribes (itself, or from elsewhere while it runs) finishes its call;
  later changes stop.
- `await state.subscribe(...)` and `watch()` are live: another manager's (or process's) write
  made right after is delivered.
- The `subscriber_overflow` log names the user's pattern.
- The prefix index of the in-process fan-out delivers exactly what a glob match per
  subscription would (hypothesis), and a fresh process subscribed to 100 patterns receives
  every change of another process once, in version order per key.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import agenticstate.manager as manager_module
from agenticstate import (
    BackendTimeoutError,
    FileBackend,
    MemoryBackend,
    RedisBackend,
    StateConfig,
    StateManager,
    Subscription,
    SubscriptionClosedError,
)
from agenticstate._glob import glob_match
from agenticstate.backends.base import Change, ChangeOp, FeedRetention
from agenticstate.events import ChangeFanout
from tests.helpers import LineProcess, unique_prefix
from tests.integration._exact_worker import process_patterns, process_writes
from tests.reliability._fault_server import running_server
from tests.reliability._proxy import FaultProxy, Faults

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from agenticstate.backends import Backend

WAIT = 10.0  # seconds a delivery may take; a stall (the 30 s of #15) exceeds it

KINDS = [
    "memory",
    "file",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.redis),
]


def _url(kind: str, request: pytest.FixtureRequest) -> str:
    return str(
        request.getfixturevalue("redis_cluster_url" if kind == "redis-cluster" else "redis_url")
    )


FEED = FeedRetention()  # the backends' default feed


class Store:
    """Makes backends of one kind on one store: several managers can share it."""

    def __init__(self, kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.kind = kind
        self.url = _url(kind, request) if kind.startswith("redis") else ""
        self.prefix = unique_prefix()
        self.path = tmp_path / "store"
        self.shared: Backend | None = None

    def backend(self, feed: FeedRetention | None = FEED) -> Backend:
        """A new client on the store (Redis), or the one in-process backend (memory, file)."""
        if self.url:
            return RedisBackend(url=self.url, key_prefix=self.prefix, feed=feed)
        if self.shared is None:
            self.shared = (
                MemoryBackend(feed=feed)
                if self.kind == "memory"
                else FileBackend(base_path=self.path, feed=feed)
            )
        return self.shared

    @asynccontextmanager
    async def manager(self, **config: Any) -> AsyncIterator[StateManager]:
        """A manager on the store; `feed=` (a `StateConfig` field) also builds its backend."""
        backend = self.backend(config.get("feed", FEED))
        owns = backend is not self.shared
        async with StateManager(StateConfig(**config), backend=backend, close_backend=owns) as m:
            yield m

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """One store of each kind; managers made from it see each other's writes."""
    made = Store(request.param, request, tmp_path)
    try:
        yield made
    finally:
        await made.aclose()


# ---------------------------------------------------------------- 5: overflow handler


async def test_overflow_handler_reads_and_writes_while_writers_go_on(store: Store) -> None:
    """An on_overflow handler that re-reads state runs at once; other writers never stall.

    With the feed off: with a feed, the pump resumes from its cursor and needs no handler.
    """
    release = anyio.Event()
    handled = anyio.Event()
    seen_in_handler: list[Any] = []
    got_last = anyio.Event()

    async with store.manager(subscriber_buffer=4, feed=None) as state:

        async def slow(key: str, old: Any, new: Any) -> None:
            if new == "last":
                got_last.set()
            await release.wait()

        async def on_overflow(pattern: str) -> None:
            # What the docs tell users to do: re-read, and write if need be.
            seen_in_handler.append(await state.get("k"))
            if seen_in_handler[-1] == "last":
                got_last.set()
            await state.save("handled", pattern)
            handled.set()

        await state.subscribe("k", slow, on_overflow=on_overflow)
        async with state.watch("*", max_buffer=10_000) as everything:
            for i in range(40):
                await state.save("k", i)
            await state.save("sentinel", 1)
            # The watch and the slow subscription get the changes in the same order: once the
            # watch has the sentinel, the slow one's buffer has overflowed.
            with anyio.fail_after(WAIT):
                async for change in everything:
                    if change.key == "sentinel":
                        break
            release.set()
            with anyio.fail_after(WAIT):
                await handled.wait()
                # An unrelated write goes through at once.
                await state.save("unrelated", 1)
            assert seen_in_handler[0] == 39  # a later overflow may run it again (see below)
            assert await state.get("handled") == "k"
            # Subscribed again before the handler ran: later changes are delivered.
            await state.save("k", "last")
            # Delivered, or (if the subscription overflowed again meanwhile) missed and told:
            # never dropped silently.
            with anyio.move_on_after(WAIT):
                await got_last.wait()  # set by the callback, or by a handler that read "last"
            assert got_last.is_set(), state.stats()
            assert state.stats().overflows >= 1


async def test_callback_that_closes_its_manager_does_not_stall(store: Store) -> None:
    """A callback that closes its own manager returns without waiting for itself."""
    closed = anyio.Event()
    async with store.manager() as state:

        async def close_it(key: str, old: Any, new: Any) -> None:
            await state.aclose()
            closed.set()

        await state.subscribe("k", close_it)
        await state.save("k", 1)
        with anyio.fail_after(3):  # aclose() lets other callbacks finish for up to 5 s
            await closed.wait()


# ---------------------------------------------------------------- 6: unsubscribe in a call


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
async def test_unsubscribe_inside_the_callback_finishes_the_call(
    store: Store, is_async: bool
) -> None:
    """A callback that unsubscribes itself runs to its end; no later change reaches it."""
    calls: list[Any] = []
    finished = anyio.Event()
    async with store.manager() as state:

        def sync_callback(key: str, old: Any, new: Any) -> None:
            calls.append(new)
            state.unsubscribe("k*", sync_callback)
            finished.set()

        async def async_callback(key: str, old: Any, new: Any) -> None:
            calls.append(new)
            state.unsubscribe("k*", async_callback)
            # Awaits after unsubscribing: a cancelled scope would end the call here.
            await anyio.lowlevel.checkpoint()
            await state.save("k-written-in-callback", new)
            await anyio.lowlevel.checkpoint()
            finished.set()

        callback = async_callback if is_async else sync_callback
        await state.subscribe("k*", callback)
        async with state.watch("k*", max_buffer=100) as changes:
            await state.save("k", 1)
            with anyio.fail_after(WAIT):
                await finished.wait()
            await state.save("k", 2)
            await state.save("k", 3)
            # The watch sees every later change; the callback none of them.
            wanted = {2, 3, 1} if is_async else {2, 3}
            got: set[Any] = set()
            with anyio.fail_after(WAIT):
                async for change in changes:
                    if change.key == "k" or change.key == "k-written-in-callback":
                        got.add(change.new_value)
                    if wanted <= got and 3 in got:
                        break
        assert calls == [1]
        if is_async:
            assert await state.get("k-written-in-callback") == 1


async def test_unsubscribe_from_elsewhere_lets_the_running_call_finish(store: Store) -> None:
    """Unsubscribing while the callback awaits lets that call finish; later changes stop."""
    entered, proceed, finished = anyio.Event(), anyio.Event(), anyio.Event()
    calls: list[Any] = []
    async with store.manager() as state:

        async def callback(key: str, old: Any, new: Any) -> None:
            calls.append(new)
            entered.set()
            await proceed.wait()
            finished.set()

        subscription = await state.subscribe("k", callback)
        await state.save("k", 1)
        with anyio.fail_after(WAIT):
            await entered.wait()
        assert subscription.unsubscribe()
        assert not subscription.is_live
        proceed.set()
        with anyio.fail_after(WAIT):
            await finished.wait()
        async with state.watch("k") as changes:
            await state.save("k", 2)
            with anyio.fail_after(WAIT):
                assert (await changes.__anext__()).new_value == 2
    assert calls == [1]
    with pytest.raises(SubscriptionClosedError):
        await subscription.wait_live()


# ---------------------------------------------------------------- 8: live subscriptions


async def test_awaited_subscribe_receives_another_managers_next_write(store: Store) -> None:
    """`await state.subscribe(...)` returns live: another manager's write right after arrives."""
    async with store.manager() as reader, store.manager() as writer:
        for i in range(10):
            send, inbox = anyio.create_memory_object_stream[Any](math.inf)

            def record(key: str, old: Any, new: Any, send: Any = send) -> None:
                send.send_nowait(new)

            with send, inbox:
                subscription = await reader.subscribe(f"r{i}:*", record)
                assert isinstance(subscription, Subscription)
                assert subscription.is_live
                assert subscription.pattern == f"r{i}:*"
                await writer.save(f"r{i}:x", i)
                with anyio.fail_after(WAIT):
                    assert await inbox.receive() == i
                assert subscription.unsubscribe()
            assert not subscription.unsubscribe()


async def test_watch_is_live_on_entry_for_another_managers_write(store: Store) -> None:
    """A watch entered with `async with` receives another manager's write made right after."""
    async with store.manager() as reader, store.manager() as writer:
        for i in range(10):
            async with reader.watch(f"w{i}:*") as changes:
                await writer.save(f"w{i}:x", i)
                with anyio.fail_after(WAIT):
                    change = await changes.__anext__()
            assert (change.key, change.new_value, change.version) == (f"w{i}:x", i, 1)


async def test_subscribe_without_await_still_works_and_returns_a_handle(store: Store) -> None:
    """The seed's plain `subscribe(pattern, cb)` keeps working: own writes are delivered."""
    got: list[Any] = []
    done = anyio.Event()
    async with store.manager() as state:

        def on_change(key: str, old: Any, new: Any) -> None:
            got.append((key, old, new))
            done.set()

        handle = state.subscribe("agent:*", on_change)
        assert state.subscribe("agent:*", on_change) is handle  # twice: no further effect
        await state.save("agent:1", {"s": 1})
        with anyio.fail_after(WAIT):
            await done.wait()
        await handle.wait_live()
    assert got == [("agent:1", None, {"s": 1})]
    assert not handle.is_live
    with pytest.raises(SubscriptionClosedError):
        await handle


async def test_callback_subscribes_another_and_writes_to_it(store: Store) -> None:
    """A callback may subscribe another callback and write: the write reaches the new one."""
    got: list[Any] = []
    done = anyio.Event()
    async with store.manager() as state:

        def second(key: str, old: Any, new: Any) -> None:
            got.append(new)
            done.set()

        async def first(key: str, old: Any, new: Any) -> None:
            await state.subscribe("b", second)
            await state.save("b", new * 10)

        state.subscribe("a", first)
        await state.save("a", 4)
        with anyio.fail_after(WAIT):
            await done.wait()
    assert got == [40]


# ---------------------------------------------------------------- 9: the overflow log


@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_overflow_log_names_the_users_pattern(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The `subscriber_overflow` log names the pattern the user subscribed, not an internal one."""
    store = Store(kind, request, tmp_path)
    try:
        async with store.manager() as state:
            with capture_logs() as logs:
                async with state.watch("agent:*", max_buffer=2) as slow:
                    async with state.watch("*", max_buffer=100) as everything:
                        for i in range(5):
                            await state.save("agent:1", i)
                        with anyio.fail_after(WAIT):
                            for _ in range(5):
                                await everything.__anext__()
                    with pytest.raises(SubscriptionClosedError, match="agent:"):  # noqa: PT012
                        with anyio.fail_after(WAIT):
                            async for _ in slow:
                                pass
    finally:
        await store.aclose()
    overflows = [entry for entry in logs if entry["event"] == "subscriber_overflow"]
    assert overflows
    assert {entry["pattern"] for entry in overflows} == {"agent:*"}


# ---------------------------------------------------------------- the fan-out's index

_PATTERNS = st.sampled_from(
    [
        "*",
        "a*",
        "a:*",
        "a:1:*",
        "a:12:*",
        "a:1*",
        "a:1",
        "a:1:x",
        "*:x",
        "?:1:*",
        "[ab]:*",
        "a:\\*",
        "a:[0-9]:*",
        "b*x",
        "*1:x",
        "*\\*",
        "*[ab",
        "*é:1:x",
        "",
    ]
)
# Generated globs and keys over the metacharacters: any pattern, however odd.
_ALPHABET = "ab1:x*?[]\\^-é"
_ANY_PATTERNS = _PATTERNS | st.text(alphabet=_ALPHABET, max_size=6)
_ANY_KEYS = st.text(alphabet="ab1:x*?[]\\é", max_size=6)
_KEYS = st.sampled_from(
    ["a", "a:", "a:1", "a:1:x", "a:12:x", "a:2:x", "b:1:x", "a:*", "bx", "é:1:x"]
)


@settings(max_examples=400, deadline=None, database=None)
@given(
    patterns=st.lists(_ANY_PATTERNS, min_size=1, max_size=8),
    keys=st.lists(_KEYS | _ANY_KEYS, min_size=1, max_size=12),
    gone=st.lists(_PATTERNS, max_size=4),
)
def test_fanout_index_delivers_what_a_glob_per_subscription_would(
    patterns: list[str], keys: list[str], gone: list[str]
) -> None:
    """Each subscription of the indexed fan-out gets exactly the keys its glob matches, in order."""

    async def main() -> dict[int, list[str]]:
        fanout = ChangeFanout()
        got: dict[int, list[str]] = {}
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(fanout.subscribe(p, 100)) for p in patterns]
            # Others come and leave before the writes: the index is rebuilt without them.
            async with contextlib.AsyncExitStack() as leaving:
                for pattern in gone:
                    await leaving.enter_async_context(fanout.subscribe(pattern, 1))
            for version, key in enumerate(keys, 1):
                fanout.publish(Change(key, ChangeOp.SET, None, b"v", version, datetime.now(UTC)))
            fanout.close()
            for number, stream in enumerate(streams):
                got[number] = [change.key async for change in stream]
        return got

    got = anyio.run(main)
    for number, pattern in enumerate(patterns):
        assert got[number] == [key for key in keys if glob_match(pattern, key)], pattern


# ---------------------------------------------------------------- across processes


def Worker(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._exact_worker", *args)


PROCESS_PATTERNS = 100
PROCESS_WRITES = 600


@pytest.mark.redis
@pytest.mark.parametrize(
    "when",
    ["after_open", "before_open"],
)
def test_fresh_process_with_100_patterns_gets_every_change_once_in_order(
    redis_url: str, when: str
) -> None:
    """A fresh process subscribed to 100 patterns gets each change of another process once."""
    prefix = f"x{uuid.uuid4().hex[:10]}:"
    reader = Worker("subscribe", redis_url, prefix, str(PROCESS_PATTERNS), when)
    try:
        assert reader.wait_until(lambda lines: "live" in lines, timeout=20), reader.errors
        writer = Worker("write", redis_url, prefix, str(PROCESS_PATTERNS), str(PROCESS_WRITES))
        try:
            assert writer.wait_until(lambda lines: "done" in lines, timeout=60), writer.errors
        finally:
            assert not writer.close()
        patterns = process_patterns(PROCESS_PATTERNS)
        writes = process_writes(PROCESS_PATTERNS, PROCESS_WRITES)
        wanted = {
            pattern: [(key, seq) for key, seq in writes if glob_match(pattern, key)]
            for pattern in patterns
        }
        total = sum(len(changes) for changes in wanted.values())
        reader.wait_lines(1 + total, timeout=60)
    finally:
        errors = reader.close()
    got: dict[str, list[tuple[str, int]]] = {pattern: [] for pattern in patterns}
    for line in reader.lines[1:]:
        pattern, key, seq = json.loads(line)
        got[pattern].append((key, seq))
    for pattern in patterns:
        by_key: dict[str, list[int]] = {}
        for key, seq in got[pattern]:
            by_key.setdefault(key, []).append(seq)
        wanted_by_key: dict[str, list[int]] = {}
        for key, seq in wanted[pattern]:
            wanted_by_key.setdefault(key, []).append(seq)
        assert by_key == wanted_by_key, f"{pattern!r}: {errors}"


# ---------------------------------------------------------------- typed errors, never a bare one


@pytest.mark.redis
async def test_write_waiting_on_a_stuck_subscription_raises_a_typed_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write whose manager cannot start a new subscription fails typed and writes nothing."""
    monkeypatch.setattr(manager_module, "_SUBSCRIBE_WAIT", 0.3)
    prefix = unique_prefix()
    with running_server(tmp_path / "redis") as server:
        async with FaultProxy("127.0.0.1", server.port, seed=3) as proxy:
            backend = RedisBackend(
                url=proxy.url, key_prefix=prefix, socket_timeout=2, connect_timeout=2
            )
            async with StateManager(StateConfig(), backend=backend) as state:
                await state.save("k", "before")
                proxy.faults = Faults(blackhole=True)  # the pub/sub connection never answers
                state.subscribe("k", lambda key, old, new: None)
                with pytest.raises(BackendTimeoutError) as raised:
                    await state.save("k", "after")
                assert type(raised.value) is not TimeoutError
                proxy.faults = Faults()
                await proxy.sever()
            async with StateManager(
                StateConfig(backend="redis", redis_url=server.unix_url, key_prefix=prefix)
            ) as direct:
                assert await direct.get("k") == "before"


async def test_overflow_handler_that_unsubscribes_ends_the_subscription(store: Store) -> None:
    """An on_overflow handler may unsubscribe: it finishes, and no later change is delivered
    (with the feed off, where overflows call the handler)."""
    release, handled = anyio.Event(), anyio.Event()
    calls: list[Any] = []
    async with store.manager(subscriber_buffer=2, feed=None) as state:

        async def slow(key: str, old: Any, new: Any) -> None:
            calls.append(new)
            await release.wait()

        async def on_overflow(pattern: str) -> None:
            assert state.unsubscribe(pattern, slow)
            await anyio.lowlevel.checkpoint()
            handled.set()

        subscription = await state.subscribe("k", slow, on_overflow=on_overflow)
        async with state.watch("*", max_buffer=1000) as everything:
            for i in range(20):
                await state.save("k", i)
            await state.save("sentinel", 1)
            with anyio.fail_after(WAIT):
                async for change in everything:
                    if change.key == "sentinel":
                        break
            release.set()
            with anyio.fail_after(WAIT):
                await handled.wait()
            before = list(calls)
            await state.save("k", "later")
            with anyio.fail_after(WAIT):
                async for change in everything:
                    if change.new_value == "later":
                        break
        assert not subscription.is_live
    assert "later" not in calls
    assert calls == before


def test_live_subscriptions_unsubscribe_and_overflow_under_trio(tmp_path: Path) -> None:
    """Under trio: awaited subscribe, unsubscribing in a call, an overflow handler that reads
    (with the feed off, where overflows call the handler)."""

    async def main(backend: Backend) -> tuple[list[Any], list[Any]]:
        calls: list[Any] = []
        read: list[Any] = []
        finished, handled, release = anyio.Event(), anyio.Event(), anyio.Event()
        async with StateManager(StateConfig(subscriber_buffer=2), backend=backend) as state:

            async def once(key: str, old: Any, new: Any) -> None:
                calls.append(new)
                state.unsubscribe("a", once)
                await anyio.lowlevel.checkpoint()
                finished.set()

            async def slow(key: str, old: Any, new: Any) -> None:
                await release.wait()

            async def on_overflow(pattern: str) -> None:
                read.append(await state.get("b"))
                handled.set()

            await state.subscribe("a", once)
            await state.subscribe("b", slow, on_overflow=on_overflow)
            await state.save("a", 1)
            with anyio.fail_after(WAIT):
                await finished.wait()
            await state.save("a", 2)
            for i in range(10):
                await state.save("b", i)
            release.set()
            with anyio.fail_after(WAIT):
                await handled.wait()
        return calls, read

    for backend in (MemoryBackend(feed=None), FileBackend(base_path=tmp_path / "store", feed=None)):
        calls, read = anyio.run(main, backend, backend="trio")
        assert calls == [1]
        assert read == [9]


async def test_callback_that_resubscribes_itself_gets_each_later_change_once(store: Store) -> None:
    """Unsubscribing and subscribing again inside the call: each later change arrives once."""
    calls: list[Any] = []
    again, done = anyio.Event(), anyio.Event()
    async with store.manager() as state:

        async def callback(key: str, old: Any, new: Any) -> None:
            calls.append(new)
            if new == 0:
                state.unsubscribe("k", callback)
                await state.subscribe("k", callback)  # live before this call returns
                again.set()
            if new == 5:
                done.set()

        await state.subscribe("k", callback)
        await state.save("k", 0)
        with anyio.fail_after(WAIT):
            await again.wait()
        for i in range(1, 6):
            await state.save("k", i)
        with anyio.fail_after(WAIT):
            await done.wait()
        async with state.watch("k") as changes:
            await state.save("k", "end")
            with anyio.fail_after(WAIT):
                await changes.__anext__()
    # The old subscription delivered 0 and stopped; the new one every later change, once.
    assert calls[:6] == [0, 1, 2, 3, 4, 5]
    assert calls[6:] in ([], ["end"])
