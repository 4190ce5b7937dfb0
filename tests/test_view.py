"""LocalView (issue 21, point 3): a pattern's keys held locally, `update` in one conditional write.

Every test runs on each backend (memory, file, SQLite, Redis, Redis Cluster). The Redis tests at
the end count the commands an update sends (`INFO commandstats` deltas). Cross-process tests are
in `tests/integration/test_view_processes.py`.
"""

from __future__ import annotations

import random
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis

from agenticstate import (
    AgenticStateError,
    ConflictError,
    Encryption,
    InvalidArgumentError,
    LocalView,
    MergeError,
    NotFoundError,
    RedisBackend,
    StateConfig,
    StateManager,
    SubscriptionClosedError,
    ViewEntry,
    sync,
)
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

    from agenticstate.backends import Backend


@pytest.fixture
async def other(backend: Backend) -> AsyncIterator[StateManager]:
    """A second manager over the same store: writes the view did not make."""
    manager = StateManager(StateConfig(), backend=backend, close_backend=False)
    try:
        yield manager
    finally:
        await manager.aclose()


async def _until(view: LocalView, predicate: Callable[[LocalView], bool]) -> None:
    with anyio.fail_after(10):
        await view.wait_until(predicate)


async def _poll(condition: Callable[[], bool], seconds: float = 10) -> None:
    """Wait for a condition that no change announces (an expiry), with a deadline."""
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110  # expiry emits no change to wait on
            await anyio.sleep(0.01)


def _at(view: LocalView, key: str, version: int) -> bool:
    entry = view.entry(key)
    return entry is not None and entry.version == version


async def test_view_loads_keys_and_follows_another_manager(
    state: StateManager, other: StateManager
) -> None:
    """The view holds what was there when it opened, then every later write, delete and create."""
    await state.save("agent:1", {"status": "idle"})
    await state.save("agent:2", {"status": "busy"})
    await state.save("agent:2", {"status": "done"})
    await state.save("job:1", "elsewhere")
    async with state.view("agent:*") as view:
        assert view.keys() == ["agent:1", "agent:2"]
        assert len(view) == 2
        assert view.entry("agent:2") == ViewEntry(
            key="agent:2", value={"status": "done"}, version=2
        )
        assert "job:1" not in view
        with pytest.raises(InvalidArgumentError):
            view.get("job:1")  # outside the pattern: the view cannot know it
        assert view.is_live
        await other.save("agent:1", {"status": "running"})
        await other.save("agent:3", [1, 2])
        await other.delete("agent:2")
        await _until(view, lambda v: _at(v, "agent:1", 2) and "agent:3" in v and "agent:2" not in v)
        assert view.get("agent:1") == {"status": "running"}
        assert view.get("agent:3") == [1, 2]
        assert view.get("agent:2", "gone") == "gone"
        assert view.keys() == ["agent:1", "agent:3"]


async def test_reads_return_the_callers_own_copy(state: StateManager) -> None:
    """Changing a value read from the view changes neither the view nor the next read."""
    await state.save("agent:1", {"tags": ["a"]})
    async with state.view("agent:*") as view:
        value = view.get("agent:1")
        value["tags"].append("b")
        assert view.get("agent:1") == {"tags": ["a"]}

        def grow(current: Any) -> Any:
            current["tags"].append("c")
            return current

        result = await view.update("agent:1", grow)
        result["tags"].append("mutated after")
        assert view.get("agent:1") == {"tags": ["a", "c"]}


async def test_update_has_the_semantics_of_state_update(state: StateManager) -> None:
    """Dicts deep-merge, functions map, `default` fills a missing key; errors as `update`'s."""
    await state.save("agent:1", {"a": {"b": 1, "c": 2}, "n": 1})
    await state.save("agent:n", 5)
    async with LocalView(state, "agent:*") as view:
        assert await view.update("agent:1", {"a": {"b": 10}}) == {"a": {"b": 10, "c": 2}, "n": 1}
        assert await view.update("agent:n", lambda n: n * 2) == 10
        assert await view.update("agent:new", {"x": 1}, default={"y": 2}) == {"y": 2, "x": 1}
        assert await state.get("agent:1") == {"a": {"b": 10, "c": 2}, "n": 1}
        assert await state.get("agent:n") == 10
        assert (await state.get_entry("agent:new")).version == 1  # type: ignore[union-attr]
        with pytest.raises(NotFoundError):
            await view.update("agent:missing", {"x": 1})
        with pytest.raises(MergeError):
            await view.update("agent:n", {"x": 1})

        async def not_sync(current: Any) -> Any:
            return current

        with pytest.raises(InvalidArgumentError):
            await view.update("agent:n", not_sync)
        with pytest.raises(InvalidArgumentError):
            await view.update("agent:n", 3)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            await view.update("job:1", {"x": 1}, default={})  # outside the pattern
        assert await state.get("agent:n") == 10  # nothing was written by a failed update


async def test_own_update_is_seen_at_once(state: StateManager) -> None:
    """After `update` returns, the view already holds the new value and version."""
    async with state.view("counter:*") as view:
        for expected in range(1, 21):
            assert await view.update("counter:a", lambda n: n + 1, default=0) == expected
            assert view.entry("counter:a") == ViewEntry(
                key="counter:a", value=expected, version=expected
            )
    assert await state.get("counter:a") == 20


async def test_stale_view_retries_and_never_writes_over_a_change(
    state: StateManager, other: StateManager
) -> None:
    """Updates racing another writer lose nothing: each write is conditional on what it read."""
    async with state.view("counter:*") as view:

        async def through_view() -> None:
            for _ in range(25):
                await view.update("counter:x", lambda n: n + 1, default=0)

        async def through_state() -> None:
            for _ in range(25):
                await other.update("counter:x", lambda n: n + 1, default=0)

        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(through_view)
            group.start_soon(through_state)
        assert await state.get("counter:x") == 100
        await _until(view, lambda v: v.get("counter:x") == 100)


async def test_update_gives_up_after_max_attempts(backend: Backend) -> None:
    """A key that changes under every attempt ends in ConflictError, like `StateManager.update`."""
    config = StateConfig(update_max_attempts=3)
    async with StateManager(config, backend=backend, close_backend=False) as state:
        await state.save("agent:1", 0)
        async with state.view("agent:*") as view:
            calls = 0

            def meddle(current: Any) -> Any:
                # Another write lands between each read and its conditional write.
                nonlocal calls
                calls += 1
                return current + 1

            async def racing_update() -> None:
                await view.update("agent:1", meddle)

            original = state.save

            async def save_after_a_rival(key: str, value: object, **kwargs: Any) -> int:
                await original(key, -100)
                return await original(key, value, **kwargs)

            state.save = save_after_a_rival  # type: ignore[method-assign]
            try:
                with pytest.raises(ConflictError):
                    await racing_update()
            finally:
                del state.save
            assert calls == 3
            assert await state.get("agent:1") == -100


async def test_overflow_reloads_the_view(backend: Backend, other: StateManager) -> None:
    """A view that falls more than its buffer behind subscribes again and reloads every key."""
    async with StateManager(StateConfig(), backend=backend, close_backend=False) as state:
        await state.save("agent:gone", 1)
        async with state.view("agent:*", max_buffer=1) as view:
            round_ = 0
            while view.reloads == 0:
                round_ += 1
                assert round_ <= 20, "the view never overflowed"
                await other.save_many({f"agent:{round_}:{i}": {"i": i} for i in range(100)})
            await other.delete("agent:gone")
            expected = {f"agent:{r}:{i}" for r in range(1, round_ + 1) for i in range(100)}
            await _until(view, lambda v: set(v.keys()) == expected)
            assert view.get(f"agent:{round_}:7") == {"i": 7}


async def test_expired_keys_leave_the_view(state: StateManager, other: StateManager) -> None:
    """Keys that expire (no change is announced) read as missing: loaded, written elsewhere,
    or written by the view itself."""
    # Long enough that each key is seen before it expires on a loaded machine (0.3 s was not:
    # the key had expired before the view loaded); the test then waits this long.
    ttl = 2.0
    await state.save("agent:loaded", 1, ttl=ttl)
    await state.save("agent:kept", 1)
    async with state.view("agent:*") as view:
        assert "agent:loaded" in view
        await other.save("agent:other", 2, ttl=ttl)
        await view.update("agent:own", lambda n: n + 1, default=0, ttl=timedelta(seconds=ttl))
        await _until(view, lambda v: "agent:other" in v)
        await _poll(lambda: view.keys() == ["agent:kept"])
        assert view.get("agent:other") is None
        # Written again after it expired: a new life, at version 1.
        assert await view.update("agent:own", lambda n: n + 1, default=0) == 1
        assert view.entry("agent:own") == ViewEntry(key="agent:own", value=1, version=1)


async def test_a_later_write_without_ttl_keeps_the_key(
    state: StateManager, other: StateManager
) -> None:
    """Every write states its TTL: a key rewritten without one no longer expires in the view."""
    async with state.view("agent:*") as view:
        await other.save("agent:1", 1, ttl=0.5)
        await _until(view, lambda v: "agent:1" in v)
        await other.save("agent:1", 2)
        await _until(view, lambda v: _at(v, "agent:1", 2))
        await _poll(lambda: view._entries["agent:1"].expiry_known)
        await anyio.sleep(0.6)  # past the first TTL: the key must still be there
        assert view.get("agent:1") == 2


async def test_a_closed_view_refuses_reads(state: StateManager) -> None:
    """After aclose() (or before open), reads and updates raise SubscriptionClosedError."""
    view = state.view("agent:*")
    with pytest.raises(SubscriptionClosedError):
        view.get("agent:1")
    await view.open()
    assert view.keys() == []
    await view.aclose()
    with pytest.raises(SubscriptionClosedError):
        view.keys()
    with pytest.raises(SubscriptionClosedError):
        await view.update("agent:1", {}, default={})


async def test_the_view_closes_with_its_manager() -> None:
    """When the manager closes (and its backend with it), the view stops and says so instead
    of going stale."""
    state = StateManager(StateConfig())
    view = await state.view("agent:*").open()
    await state.aclose()
    with anyio.fail_after(5):
        while view.is_live:  # noqa: ASYNC110  # the view's task ends on its own
            await anyio.sleep(0.01)
    with pytest.raises(SubscriptionClosedError):
        view.get("agent:1")
    await view.aclose()


# ---------------------------------------------------------------- commands sent (Redis)


def _admin_clients(url: str) -> list[aioredis.Redis]:
    """A plain client to every server behind `url` (each node of a cluster)."""
    parts = urlsplit(url)
    if parts.scheme.endswith("+cluster"):
        nodes = [hp.rpartition(":") for hp in parts.netloc.rpartition("@")[2].split(",")]
        return [aioredis.Redis(host=host, port=int(port)) for host, _, port in nodes]
    return [aioredis.Redis.from_url(url)]


# Our own INFO and connection handshakes; pub/sub keepalives.
_NOT_COUNTED = {"cmdstat_info", "cmdstat_hello", "cmdstat_client|setinfo", "cmdstat_ping"}


async def _commands(url: str) -> Counter[str]:
    """Calls per command, summed over every server behind `url` (INFO commandstats)."""
    total: Counter[str] = Counter()
    for admin in _admin_clients(url):
        async with admin:
            stats = await admin.info("commandstats")
        for name, fields in stats.items():
            if name not in _NOT_COUNTED:
                total[name] += int(fields["calls"])
    return total


async def _sent(url: str, operation: Awaitable[object], state: StateManager) -> Counter[str]:
    """The commands the server ran for `operation`, and for delivering what it changed.

    Redis counts the commands a script runs (GET, SET, PUBLISH, TIME inside the write script)
    beside the EVALSHA that ran it, so tests compare with the profile of a known operation (one
    `save`: one round trip) rather than with a bare count. A subscription reads each change it
    is told of back from the feed (one script): the count is taken once the backend has
    delivered what came before a barrier (white box), so each profile holds that too.
    """
    before = await _commands(url)
    await operation
    backend = state.backend
    assert isinstance(backend, RedisBackend)
    await backend._go_live(None)
    after = await _commands(url)
    return after - before


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_any_url(request: pytest.FixtureRequest) -> str:
    """A plain redis-server, then the 3-primary cluster."""
    name = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(name))


@pytest.mark.redis
async def test_update_with_a_known_version_is_one_command(redis_any_url: str) -> None:
    """With the view current, `update` sends exactly what one conditional `save` sends (one
    EVALSHA), merge or function alike; `StateManager.update` sends a read more."""
    config = StateConfig(backend="redis", redis_url=redis_any_url, key_prefix=unique_prefix())
    async with StateManager(config) as state:
        assert isinstance(state.backend, RedisBackend)
        await state.save("agent:1", {"n": 0})
        async with state.view("agent:*") as view:
            await view.update("agent:1", {"warm": True})  # loads the script once
            # On a cluster the first write into a slot starts its stream (and reads the feed's
            # epoch once): profiles are of a key whose stream exists.
            await state.save("other:1", {"n": -1})
            # Profiles taken on a key outside the view (a change the view sees costs it a read).
            one_save = await _sent(redis_any_url, state.save("other:1", {"n": 0}), state)
            assert one_save["cmdstat_evalsha"] == 1
            for change in ({"n": 1}, lambda value: {**value, "n": value["n"] + 1}):
                sent = await _sent(redis_any_url, view.update("agent:1", change), state)
                assert sent == one_save + _read_back(redis_any_url)
            through_state = await _sent(redis_any_url, state.update("other:1", {"n": 5}), state)
            assert through_state == one_save + Counter(cmdstat_get=1)
            assert view.get("agent:1") == {"n": 2, "warm": True}


@pytest.mark.redis
async def test_a_stale_update_costs_one_read_and_a_retry(redis_any_url: str) -> None:
    """A view that has not yet seen another writer's change: the write is refused, the key read
    fresh (one GET), and the update written on what was read, keeping the other change."""
    config = StateConfig(backend="redis", redis_url=redis_any_url, key_prefix=unique_prefix())
    async with StateManager(config) as state:
        await state.save("agent:1", {"n": 0})
        async with state.view("agent:*") as view:
            await view.update("agent:1", {"warm": True})
            await state.save("agent:1", {"n": 10, "warm": True, "rival": True})
            await _until(view, lambda v: _at(v, "agent:1", 3))
            await _poll(lambda: view._entries["agent:1"].expiry_known)  # its read is done
            await state.save("other:1", {"n": -1})  # its slot's stream exists (see above)
            one_save = await _sent(redis_any_url, state.save("other:1", {"n": 0}), state)
            one_refusal = await _refusal(redis_any_url, state)
            # As if the rival's change were still on its way: the view holds version 2.
            view._entries["agent:1"] = _stale_copy(view, "agent:1", {"n": 0, "warm": True}, 2)
            sent = await _sent(
                redis_any_url,
                view.update("agent:1", lambda value: {**value, "n": value["n"] + 1}),
                state,
            )
            assert sent == one_refusal + Counter(cmdstat_get=1) + one_save + _read_back(
                redis_any_url
            )
            assert await state.get("agent:1") == {"n": 11, "warm": True, "rival": True}
            assert view.entry("agent:1") == ViewEntry(
                key="agent:1", value={"n": 11, "warm": True, "rival": True}, version=4
            )


def _read_back(url: str) -> Counter[str]:
    """What the view's subscription runs to read one change it was told of from the feed.

    One script, one XRANGE; on a cluster it also publishes a marker (the change is delivered
    once that is heard).
    """
    script = Counter(cmdstat_evalsha=1, cmdstat_xrange=1)
    return script + Counter(cmdstat_publish=1) if "+cluster" in url else script


async def _refusal(url: str, state: StateManager) -> Counter[str]:
    """What a conditional save that is refused sends."""
    before = await _commands(url)
    with pytest.raises(ConflictError):
        await state.save("other:1", {"n": 1}, expected_version=5)
    return await _commands(url) - before


def _stale_copy(view: LocalView, key: str, value: object, version: int) -> Any:
    """A cache entry for `key` at an older `version` (white box: a view lagging its feed)."""
    cached = view._entries[key]
    return type(cached)(
        view._serializer.dumps(value),
        version,
        cached.expires_at,
        expiry_known=True,
        revision=min(cached.revision, 1),  # an older revision (0 where the backend has none)
    )


async def test_a_stale_view_reads_fresh_on_conflict(state: StateManager) -> None:
    """On every backend: an update computed from an old version is refused, and retried on the
    value read fresh, which the view keeps."""
    await state.save("agent:1", {"n": 0})
    async with state.view("agent:*") as view:
        await state.save("agent:1", {"n": 10})
        await _until(view, lambda v: _at(v, "agent:1", 2))
        view._entries["agent:1"] = _stale_copy(view, "agent:1", {"n": 0}, 1)
        assert await view.update("agent:1", {"m": 1}) == {"n": 10, "m": 1}
        assert view.entry("agent:1") == ViewEntry(key="agent:1", value={"n": 10, "m": 1}, version=3)
        assert state.stats().conflicts == 1


async def test_an_encrypted_store_is_read_through_its_keys(backend: Backend) -> None:
    """Changes from another writer arrive encrypted; the view decrypts them with the manager's
    keys, and a view without the keys leaves the values out instead of showing ciphertext."""
    encryption = Encryption({"k1": Encryption.generate_key()})
    config = StateConfig(encryption=encryption)
    async with (
        StateManager(config, backend=backend, close_backend=False) as state,
        StateManager(config, backend=backend, close_backend=False) as writer,
        StateManager(StateConfig(), backend=backend, close_backend=False) as keyless,
    ):
        await writer.save("agent:1", {"secret": 1})
        async with state.view("agent:*") as view, keyless.view("agent:*") as blind:
            assert view.get("agent:1") == {"secret": 1}
            assert blind.keys() == []
            await writer.save("agent:2", {"secret": 2})
            await _until(view, lambda v: "agent:2" in v)
            assert view.get("agent:2") == {"secret": 2}
            assert await view.update("agent:2", {"more": True}) == {"secret": 2, "more": True}
            assert await writer.get("agent:2") == {"secret": 2, "more": True}
            assert blind.keys() == []


@pytest.mark.redis
@pytest.mark.parametrize("feed", [False, True], ids=["no-feed", "feed"])
async def test_a_redis_reconnect_misses_nothing_in_the_view(redis_any_url: str, feed: bool) -> None:
    """Changes made while the pub/sub connection was down reach the view. Without a feed they
    come back as a resync and the view reloads every key, so even a delete of a key it never saw
    change is not missed; with the feed, the backend catches up from it and the view receives
    the very changes, with no reload."""
    config = StateConfig(
        backend="redis",
        redis_url=redis_any_url,
        key_prefix=unique_prefix(),
        **({} if feed else {"feed": None}),
    )
    async with StateManager(config) as state:
        await state.save("agent:{a}", 1)  # loaded, never changed while the view is open
        async with state.view("agent:*") as view:
            assert view.keys() == ["agent:{a}"]
            killed = 0
            for admin in _admin_clients(redis_any_url):
                async with admin:
                    killed += int(await admin.client_kill_filter(_type="pubsub"))
            assert killed >= 1
            await state.delete("agent:{a}")  # in the gap: lost with the connection
            await state.save("agent:{a}c", 3)  # also in the gap
            if feed:
                await _until(view, lambda v: v.keys() == ["agent:{a}c"])
                assert view.reloads == 0  # caught up change by change
            else:
                await _until(view, lambda v: v.reloads >= 1 and v.keys() == ["agent:{a}c"])
            assert view.get("agent:{a}c") == 3
            assert view.is_live


async def _snapshot(state: StateManager, pattern: str) -> dict[str, tuple[Any, int]]:
    found = {}
    for key in await state.list_keys(pattern):
        entry = await state.get_entry(key)
        if entry is not None:
            found[key] = (entry.value, entry.version)
    return found


def _holds(view: LocalView, expected: dict[str, tuple[Any, int]]) -> bool:
    held = {}
    for key in view:
        entry = view.entry(key)
        if entry is not None:
            held[key] = (entry.value, entry.version)
    return held == expected


@pytest.mark.parametrize("seed", [1, 2])
async def test_views_converge_under_a_random_mix_of_writers(
    backend: Backend, other: StateManager, seed: int
) -> None:
    """Updates through three views (two on one manager), saves, deletes and plain updates from
    other tasks, on a few keys: every counter is exact, and every view ends holding exactly what
    the store holds (values and versions)."""
    rng = random.Random(seed)
    state = StateManager(StateConfig(), backend=backend, close_backend=False)
    async with (
        state,
        state.view("k:*") as first,
        state.view("k:*", max_buffer=5) as second,
        other.view("k:*") as third,
    ):
        views = [first, second, third]
        keys = [f"k:{i}" for i in range(4)]
        added = dict.fromkeys(keys, 0)

        def bump(value: Any) -> Any:
            return {"n": value.get("n", 0) + 1, "by": "view"}

        async def updater(view: LocalView) -> None:
            for _ in range(40):
                key = rng.choice(keys)
                await view.update(key, bump, default={})
                added[key] += 1

        async def meddler() -> None:
            for _ in range(40):
                key = rng.choice(keys[2:])  # only these are ever deleted or overwritten
                roll = rng.random()
                if roll < 0.2:
                    await state.delete(key)
                elif roll < 0.4:
                    await other.save(key, {"n": -1000, "by": "save"})
                else:
                    await other.update(key, {"by": "merge"}, default={})
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as group:
            for view in views:
                group.start_soon(updater, view)
            group.start_soon(meddler)
        expected = await _snapshot(state, "k:*")
        for key in keys[:2]:  # never deleted or overwritten: every increment is there
            assert expected[key][0]["n"] == added[key]
        for view in views:
            with anyio.fail_after(10):
                await view.wait_until(lambda v: _holds(v, expected))


def test_a_view_runs_under_trio() -> None:
    """On trio (memory backend): load, follow a write, update in one write, close."""

    async def main() -> None:
        async with StateManager(StateConfig()) as state:
            await state.save("agent:1", {"n": 1})
            async with state.view("agent:*") as view:
                assert view.get("agent:1") == {"n": 1}
                await state.save("agent:2", {"n": 2})
                with anyio.fail_after(5):
                    await view.wait_until(lambda v: "agent:2" in v)
                assert await view.update("agent:1", {"m": 1}) == {"n": 1, "m": 1}
                assert view.entry("agent:1") == ViewEntry(
                    key="agent:1", value={"n": 1, "m": 1}, version=2
                )

    anyio.run(main, backend="trio")


def test_a_view_can_be_built_outside_the_event_loop() -> None:
    """Building a view needs no running loop (opening it does)."""
    view = StateManager().view("agent:*")
    assert view.pattern == "agent:*"
    assert not view.is_live


async def test_opening_fails_cleanly_when_the_store_is_unreachable(tmp_path: Path) -> None:
    """A view whose first load fails raises from open() and keeps nothing running."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    config = StateConfig(backend="sqlite", sqlite_path=str(blocker / "state.db"))
    state = StateManager(config)
    view = state.view("agent:*")
    with pytest.raises(AgenticStateError):
        await view.open()
    assert not view.is_live
    with pytest.raises(SubscriptionClosedError):
        view.keys()


def test_the_blocking_api_has_views() -> None:
    """`agenticstate.sync`: `with state.view(...) as view` opens a blocking view."""
    with sync.StateManager() as state:
        state.save("agent:1", {"n": 1})
        with state.view("agent:*") as view:
            assert isinstance(view, sync.LocalView)
            assert view.get("agent:1") == {"n": 1}
            assert (len(view), "agent:1" in view, list(view)) == (1, True, ["agent:1"])
            assert view.update("agent:1", {"m": 2}) == {"n": 1, "m": 2}
            assert view.entry("agent:1") == ViewEntry(
                key="agent:1", value={"n": 1, "m": 2}, version=2
            )
        assert not view.is_live


async def test_an_error_from_a_stale_copy_is_confirmed_on_the_store(state: StateManager) -> None:
    """A view that has not yet seen a key created, or a value change type, reads the key before
    raising NotFoundError or MergeError: it fails only if the stored value fails too."""
    async with state.view("agent:*") as view:
        await state.save("agent:new", {"n": 1})
        await state.save("agent:typed", {"n": 1})
        await _until(view, lambda v: "agent:new" in v and "agent:typed" in v)
        del view._entries["agent:new"]  # as if its creation were still on its way
        view._entries["agent:typed"] = _stale_copy(view, "agent:typed", "a string", 1)
        assert await view.update("agent:new", {"m": 2}) == {"n": 1, "m": 2}
        assert await view.update("agent:typed", {"m": 2}) == {"n": 1, "m": 2}
        assert view.entry("agent:typed") == ViewEntry(
            key="agent:typed", value={"n": 1, "m": 2}, version=2
        )
        await state.save("agent:text", "plain")
        await _until(view, lambda v: "agent:text" in v)
        with pytest.raises(MergeError):
            await view.update("agent:text", {"m": 2})  # the stored value is not a dict either
        with pytest.raises(NotFoundError):
            await view.update("agent:nowhere", {"m": 2})


async def test_a_key_rewritten_after_it_expired_is_shown_whatever_the_view_knew(
    state: StateManager, other: StateManager
) -> None:
    """Another writer's key at version 3 expires unseen (the view never learned its expiry) and
    is written again at version 1: the view shows the new life, its revision being newer."""
    async with state.view("agent:*") as view:
        for n in range(3):
            await other.save("agent:1", {"life": 1, "n": n}, ttl=0.15)
        await _until(view, lambda v: _at(v, "agent:1", 3) and v._entries["agent:1"].expiry_known)
        held = view._entries["agent:1"]  # white box: as if the expiry read had found none
        held.expires_at = None
        await anyio.sleep(0.25)  # expiry is wall-clock time: let it pass (no change announces it)
        assert await other.get("agent:1") is None
        await other.save("agent:1", {"life": 2})
        await _until(view, lambda v: v.get("agent:1") == {"life": 2})
        entry = view.entry("agent:1")
        assert entry is not None
        assert entry.version == 1
        assert await view.update("agent:1", {"n": 1}) == {"life": 2, "n": 1}
        assert await other.get("agent:1") == {"life": 2, "n": 1}
