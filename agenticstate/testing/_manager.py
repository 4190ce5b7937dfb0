"""StateManager on every backend: values, isolation, updates, subscriptions, TTL, bad input."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
import pytest
import pytest_asyncio
from pydantic import BaseModel
from structlog.testing import capture_logs

from agenticstate import (
    ChangeOp,
    ConflictError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidPatternError,
    MergeError,
    NotFoundError,
    SerializationError,
    StateConfig,
    StateManager,
    SubscriptionClosedError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Backend


class Profile(BaseModel):
    name: str
    joined: datetime
    tags: list[str] = []


VALUES: list[tuple[str, Any]] = [
    ("dict", {"status": "running", "progress": 0.45, "nested": {"a": [1, 2, {"b": None}]}}),
    ("list", [1, "two", 3.0, True, None]),
    ("str", "héllo wörld ✓"),
    ("empty_str", ""),
    ("int", 42),
    ("big_int", 2**63 - 1),
    ("negative_int", -(2**63)),
    ("float", 0.1),
    ("bool", False),
    ("none", None),
    ("naive_datetime", datetime(2026, 11, 22, 10, 30, 15, 123456)),  # noqa: DTZ001
    ("aware_datetime", datetime(2026, 11, 22, 10, 30, tzinfo=timezone(timedelta(hours=5)))),
    ("utc_datetime", datetime(2026, 1, 1, tzinfo=UTC)),
    ("date", date(2026, 2, 28)),
    ("uuid", UUID("12345678-1234-5678-1234-567812345678")),
    ("bytes", b"\x00\xffbinary"),
    ("tag_lookalike", {"$dt": "not a date"}),
    ("map_lookalike", {"$map": [["a", 1]]}),
    ("dollar_keys", {"$dt": 1, "$uuid": 2}),
    ("ellipsis", {"results": [...]}),
]


class ManagerContract:
    """StateManager on every backend: values, isolation, updates, subscriptions, TTL, bad input.

    Its tests take a `backend` fixture (a fresh, empty, open backend) and the `state` fixture
    below (a `StateManager` over it).
    """

    @pytest_asyncio.fixture
    async def state(self, backend: Backend) -> AsyncIterator[StateManager]:
        """A `StateManager` over `backend` (which it does not close)."""
        manager = StateManager(StateConfig(), backend=backend, close_backend=False)
        try:
            yield manager
        finally:
            await manager.aclose()

    @pytest.mark.parametrize(("name", "value"), VALUES, ids=[name for name, _ in VALUES])
    async def test_every_value_type_round_trips(
        self, state: StateManager, name: str, value: Any
    ) -> None:
        """Each supported type reads back equal and of the same type (naive stays naive)."""
        await state.save(f"value:{name}", value)
        got = await state.get(f"value:{name}")
        assert got == value
        assert type(got) is type(value)
        if isinstance(value, datetime):
            assert got.tzinfo == value.tzinfo or got.utcoffset() == value.utcoffset()
            assert (got.tzinfo is None) == (value.tzinfo is None)

    async def test_tuple_reads_back_as_list(self, state: StateManager) -> None:
        """Tuples are stored as lists."""
        await state.save("t", (1, (2, 3)))
        assert await state.get("t") == [1, [2, 3]]

    async def test_pydantic_model_round_trips(self, state: StateManager) -> None:
        """A model is stored as its JSON form and validates back with model=."""
        profile = Profile(name="ada", joined=datetime(2026, 1, 2, 3, 4, 5), tags=["x"])  # noqa: DTZ001
        await state.save("profile", profile)
        assert await state.get("profile", model=Profile) == profile
        raw = await state.get("profile")
        assert raw["name"] == "ada"
        assert await state.get("missing", model=Profile) is None

    async def test_get_returns_default_for_missing_key(self, state: StateManager) -> None:
        """A missing key returns the default."""
        assert await state.get("missing") is None
        assert await state.get("missing", {"fallback": True}) == {"fallback": True}

    async def test_saved_value_is_isolated_from_the_caller(self, state: StateManager) -> None:
        """Mutating a dict after save, or after get, changes nothing stored."""
        value: dict[str, Any] = {"list": [1, 2], "inner": {"a": 1}}
        await state.save("iso", value)
        value["list"].append(3)
        value["inner"]["a"] = 99
        first = await state.get("iso")
        assert first == {"list": [1, 2], "inner": {"a": 1}}
        first["list"].append(4)
        assert await state.get("iso") == {"list": [1, 2], "inner": {"a": 1}}

    async def test_save_returns_versions_and_get_entry_reports_them(
        self, state: StateManager
    ) -> None:
        """Save returns the new version; get_entry has value, version, timestamps and ttl."""
        assert await state.save("v", 1) == 1
        assert await state.save("v", 2) == 2
        entry = await state.get_entry("v")
        assert entry is not None
        assert (entry.key, entry.value, entry.version) == ("v", 2, 2)
        assert entry.ttl is None
        assert entry.expires_at is None
        assert entry.created_at <= entry.updated_at
        assert await state.get_entry("missing") is None

    async def test_expected_version_conflicts_change_nothing(self, state: StateManager) -> None:
        """Save and delete with a stale expected_version raise ConflictError and change nothing."""
        await state.save("cas", "a")
        with pytest.raises(ConflictError):
            await state.save("cas", "b", expected_version=7)
        with pytest.raises(ConflictError):
            await state.delete("cas", expected_version=7)
        assert await state.get("cas") == "a"
        assert await state.save("cas", "b", expected_version=1) == 2
        assert await state.delete("cas", expected_version=2) is True
        assert state.stats().conflicts == 2

    async def test_update_deep_merges_dicts(self, state: StateManager) -> None:
        """Update with a dict merges nested dicts and replaces everything else."""
        await state.save("agent", {"status": "running", "meta": {"a": 1, "b": {"c": 2}}, "l": [1]})
        new = await state.update("agent", {"meta": {"b": {"d": 3}}, "l": [2], "progress": 0.75})
        expected = {
            "status": "running",
            "meta": {"a": 1, "b": {"c": 2, "d": 3}},
            "l": [2],
            "progress": 0.75,
        }
        assert new == expected
        assert await state.get("agent") == expected

    async def test_update_with_function(self, state: StateManager) -> None:
        """Update with a function stores fn(old) and returns it."""
        await state.save("n", 1)
        assert await state.update("n", lambda n: n * 10) == 10
        assert await state.get("n") == 10

    async def test_update_missing_key_needs_a_default(self, state: StateManager) -> None:
        """Update of a missing key raises NotFoundError unless a default is given."""
        with pytest.raises(NotFoundError):
            await state.update("absent", {"a": 1})
        with pytest.raises(NotFoundError):
            await state.update("absent", lambda v: v)
        assert await state.get("absent") is None
        assert await state.update("absent", lambda n: n + 1, default=0) == 1
        assert await state.update("absent2", {"a": 1}, default={}) == {"a": 1}

    async def test_update_default_is_not_shared(self, state: StateManager) -> None:
        """The default passed to update is copied, never mutated."""
        default: dict[str, list[int]] = {"items": []}

        def add(value: dict[str, list[int]]) -> dict[str, list[int]]:
            value["items"].append(1)
            return value

        await state.update("d1", add, default=default)
        assert default == {"items": []}

    async def test_merge_into_non_dict_is_refused(self, state: StateManager) -> None:
        """Merging a dict into a stored list raises MergeError and changes nothing."""
        await state.save("l", [1, 2])
        with pytest.raises(MergeError):
            await state.update("l", {"a": 1})
        assert await state.get("l") == [1, 2]

    async def test_update_refuses_async_functions(self, state: StateManager) -> None:
        """Update takes a synchronous function; an async one is refused and nothing changes."""
        await state.save("n", 1)

        async def bump(n: int) -> int:
            return n + 1

        with pytest.raises(InvalidArgumentError):
            await state.update("n", bump)
        assert await state.get("n") == 1

    async def test_update_increments_lose_nothing(self, state: StateManager) -> None:
        """50 concurrent tasks x 100 increments through update() give exactly 5000."""
        await state.save("counter", 0)

        async def worker() -> None:
            for _ in range(100):
                await state.update("counter", lambda n: n + 1)

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(worker)
        assert await state.get("counter") == 5000

    async def test_delete_reports_whether_key_existed(self, state: StateManager) -> None:
        """Delete returns True once, then False."""
        await state.save("d", 1)
        assert await state.delete("d") is True
        assert await state.delete("d") is False
        assert await state.exists("d") is False

    async def test_list_keys_is_sorted_and_globbed(self, state: StateManager) -> None:
        """list_keys returns the matching keys, sorted."""
        for key in ("agent:b", "agent:a", "workflow:1", "agent:c:x"):
            await state.save(key, 1)
        assert await state.list_keys("agent:*") == ["agent:a", "agent:b", "agent:c:x"]
        assert await state.list_keys("agent:?") == ["agent:a", "agent:b"]
        assert await state.list_keys() == ["agent:a", "agent:b", "agent:c:x", "workflow:1"]

    async def test_get_many_and_save_many(self, state: StateManager) -> None:
        """save_many writes several values; get_many returns those that exist."""
        versions = await state.save_many({"a": 1, "b": {"x": [1]}})
        assert versions == {"a": 1, "b": 1}
        assert await state.get_many(["a", "b", "c"]) == {"a": 1, "b": {"x": [1]}}

    async def test_save_many_validates_everything_first(self, state: StateManager) -> None:
        """One bad value in save_many means nothing is written."""
        with pytest.raises(SerializationError):
            await state.save_many({"ok": 1, "bad": {1, 2}})
        assert await state.exists("ok") is False

    async def test_ttl_default_and_override(self, backend: Backend) -> None:
        """The config ttl applies by default; ttl= overrides it; ttl=None never expires."""
        manager = StateManager(StateConfig(ttl=0.2), backend=backend, close_backend=False)
        try:
            await manager.save("default", 1)
            await manager.save("forever", 1, ttl=None)
            await manager.save("long", 1, ttl=timedelta(seconds=60))
            entry = await manager.get_entry("default")
            assert entry is not None
            assert entry.ttl is not None
            assert entry.ttl <= timedelta(seconds=0.2)
            await anyio.sleep(0.3)  # wall-clock expiry: wait for the time itself
            assert await manager.get("default") is None
            assert await manager.get("forever") == 1
            assert await manager.get("long") == 1
        finally:
            await manager.aclose()

    @pytest.mark.parametrize("bad", [0, -1, timedelta(seconds=-5), "10", True])
    async def test_bad_ttl_is_refused(self, state: StateManager, bad: object) -> None:
        """A TTL that is not positive seconds or a timedelta raises InvalidArgumentError."""
        with pytest.raises(InvalidArgumentError):
            await state.save("k", 1, ttl=bad)  # type: ignore[arg-type]
        assert await state.exists("k") is False

    @pytest.mark.parametrize("bad", ["", 3, None, "a\nb", "x" * 2000])
    async def test_bad_keys_are_refused(self, state: StateManager, bad: Any) -> None:
        """Invalid keys raise InvalidKeyError from every call."""
        for call in (
            lambda: state.save(bad, 1),
            lambda: state.get(bad),
            lambda: state.update(bad, {"a": 1}),
            lambda: state.delete(bad),
            lambda: state.exists(bad),
        ):
            with pytest.raises(InvalidKeyError):
                await call()

    async def test_bad_patterns_are_refused(self, state: StateManager) -> None:
        """Invalid patterns raise InvalidPatternError from list_keys, subscribe and watch."""
        with pytest.raises(InvalidPatternError):
            await state.list_keys("")
        with pytest.raises(InvalidPatternError):
            state.subscribe("a\x00", lambda k, o, n: None)
        with pytest.raises(InvalidPatternError):
            state.watch("")

    async def test_unstorable_value_changes_nothing(self, state: StateManager) -> None:
        """A value that cannot be stored raises before anything is written."""
        await state.save("keep", {"a": 1})
        with pytest.raises(SerializationError) as caught:
            await state.save("keep", {"a": [1, 2, {3, 4}]})
        assert caught.value.path == "$.a[2]"
        assert await state.get("keep") == {"a": 1}
        entry = await state.get_entry("keep")
        assert entry is not None
        assert entry.version == 1

    async def test_callback_receives_key_old_and_new(self, state: StateManager) -> None:
        """A subscribed callback gets (key, old_value, new_value) for each change, in order."""
        received: list[tuple[str, Any, Any]] = []
        done = anyio.Event()

        async def on_change(key: str, old: Any, new: Any) -> None:
            received.append((key, old, new))
            if len(received) == 3:
                done.set()

        state.subscribe("agent:*", on_change)
        await state.save("agent:r", {"status": "running"})
        await state.save("other", 1)
        await state.update("agent:r", {"progress": 0.5})
        await state.delete("agent:r")
        with anyio.fail_after(5):
            await done.wait()
        assert received == [
            ("agent:r", None, {"status": "running"}),
            ("agent:r", {"status": "running"}, {"status": "running", "progress": 0.5}),
            ("agent:r", {"status": "running", "progress": 0.5}, None),
        ]

    async def test_sync_callback_and_unsubscribe(self, state: StateManager) -> None:
        """Sync callbacks work; after unsubscribe the callback is not called again."""
        calls: list[str] = []
        first = anyio.Event()

        def on_change(key: str, old: Any, new: Any) -> None:
            calls.append(key)
            first.set()

        state.subscribe("s:*", on_change)
        state.subscribe("s:*", on_change)  # a second subscribe is a no-op
        assert state.stats().subscriptions == 1
        await state.save("s:1", 1)
        with anyio.fail_after(5):
            await first.wait()
        assert state.unsubscribe("s:*", on_change) is True
        assert state.unsubscribe("s:*", on_change) is False
        # A sentinel subscription proves later changes were delivered before we check.
        seen = anyio.Event()
        state.subscribe("s:*", lambda k, o, n: seen.set() if k == "s:3" else None)
        await state.save("s:2", 2)
        await state.save("s:3", 3)
        with anyio.fail_after(5):
            await seen.wait()
        assert calls == ["s:1"]

    async def test_raising_callback_is_logged_and_never_fails_the_write(
        self, state: StateManager
    ) -> None:
        """A callback that raises is logged and counted; the write succeeds and others still run."""
        good = anyio.Event()

        def bad(key: str, old: Any, new: Any) -> None:
            raise RuntimeError("boom")

        def fine(key: str, old: Any, new: Any) -> None:
            good.set()

        state.subscribe("e:*", bad)
        state.subscribe("e:*", fine)
        with capture_logs() as logs:
            await state.save("e:1", {"secret": "s3cr3t"})
            with anyio.fail_after(5):
                await good.wait()
        assert await state.get("e:1") == {"secret": "s3cr3t"}
        failures = [entry for entry in logs if entry["event"] == "subscriber_callback_failed"]
        assert len(failures) == 1
        assert failures[0]["error"] == "RuntimeError"
        assert "s3cr3t" not in repr(logs)
        assert state.stats().callback_errors == 1

    async def test_slow_callback_overflow_is_reported_and_recovers(self, backend: Backend) -> None:
        """A callback that falls behind its buffer is logged and counted, then keeps receiving.

        With a change feed the pump resumes from its last cursor: nothing is missed, so
        `on_overflow` is not called. Without one it is, once subscribed again.
        """
        manager = StateManager(
            StateConfig(subscriber_buffer=2), backend=backend, close_backend=False
        )
        release = anyio.Event()
        overflowed = anyio.Event()
        later = anyio.Event()
        patterns: list[str] = []

        async def slow(key: str, old: Any, new: Any) -> None:
            await release.wait()
            if key == "after":
                later.set()

        def on_overflow(pattern: str) -> None:
            patterns.append(pattern)
            overflowed.set()

        try:
            manager.subscribe("*", slow, on_overflow=on_overflow)
            with capture_logs() as logs:
                for i in range(20):
                    await manager.save(f"flood:{i}", i)
                release.set()
                if backend.feed is None:
                    with anyio.fail_after(10):
                        await overflowed.wait()
                # Writes after an overflow wait for the re-subscription, so this one is delivered.
                # (On a cluster, events of the flood published on other nodes may still be crossing
                # the cluster bus and overflow the tiny buffer once more: write until one gets in.)
                with anyio.fail_after(20):
                    while not later.is_set():
                        await manager.save("after", 1)
                        with anyio.move_on_after(1):
                            await later.wait()
            if backend.feed is None:
                assert set(patterns) == {"*"}
                assert manager.stats().overflows == len(patterns) >= 1
            else:
                assert patterns == []
                assert manager.stats().overflows >= 1
            assert any(entry["event"] == "subscription_reopened" for entry in logs)
        finally:
            await manager.aclose()

    async def test_watch_yields_state_changes(self, state: StateManager) -> None:
        """watch() yields StateChange records with decoded old and new values."""
        async with state.watch("w:*") as changes:
            await state.save("w:1", {"a": 1})
            await state.update("w:1", {"b": 2})
            await state.delete("w:1")
            got = []
            with anyio.fail_after(5):
                async for change in changes:
                    got.append(change)
                    if len(got) == 3:
                        break
        assert [(c.key, c.op, c.old_value, c.new_value, c.version) for c in got] == [
            ("w:1", ChangeOp.SET, None, {"a": 1}, 1),
            ("w:1", ChangeOp.SET, {"a": 1}, {"a": 1, "b": 2}, 2),
            ("w:1", ChangeOp.DELETE, {"a": 1, "b": 2}, None, 2),
        ]

    async def test_watch_overflow_raises(self, state: StateManager) -> None:
        """A watcher that falls behind gets SubscriptionClosedError(reason='overflow')."""
        async with state.watch("o:*", max_buffer=3) as changes:
            for i in range(10):
                await state.save(f"o:{i}", i)

            async def drain() -> None:
                async for _ in changes:
                    pass

            with anyio.fail_after(5), pytest.raises(SubscriptionClosedError) as caught:
                await drain()
        assert caught.value.reason == "overflow"

    async def test_stats_count_operations(self, state: StateManager) -> None:
        """stats() counts saves, reads, updates and deletes."""
        await state.save("a", 1)
        await state.get("a")
        await state.update("a", lambda n: n + 1)
        await state.delete("a")
        stats = state.stats()
        assert (stats.saves, stats.reads, stats.updates, stats.deletes) == (1, 1, 1, 1)
