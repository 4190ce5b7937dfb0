"""The storage contract: versions, expected_version, bytes, batches and atomic updates."""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import (
    ChangeOp,
    ConflictError,
    InvalidArgumentError,
    InvalidKeyError,
)

if TYPE_CHECKING:
    from agenticstate.backends import Backend, Entry


class StorageContract:
    """The storage contract: versions, expected_version, bytes, batches and atomic updates.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_get_missing_returns_none(self, backend: Backend) -> None:
        """A key that was never set reads as None."""
        assert await backend.get("missing") is None

    async def test_set_then_get_round_trips_bytes(self, backend: Backend) -> None:
        """Arbitrary bytes, NUL and high bytes included, read back exactly."""
        value = bytes(range(256)) * 3
        change = await backend.set("k", value)
        assert change.op is ChangeOp.SET
        assert change.version == 1
        assert change.old is None
        assert change.new == value
        entry = await backend.get("k")
        assert entry is not None
        assert entry.key == "k"
        assert entry.value == value
        assert entry.version == 1
        assert entry.expires_at is None
        assert entry.ttl() is None

    async def test_versions_grow_by_one_per_write(self, backend: Backend) -> None:
        """Every write adds exactly one to the version."""
        versions = [(await backend.set("k", str(i).encode())).version for i in range(5)]
        assert versions == [1, 2, 3, 4, 5]
        entry = await backend.get("k")
        assert entry is not None
        assert entry.version == 5
        assert entry.value == b"4"

    async def test_timestamps_are_aware_and_created_at_is_kept(self, backend: Backend) -> None:
        """created_at stays at the first write; updated_at moves forward; both are UTC."""
        await backend.set("k", b"1")
        first = await backend.get("k")
        await backend.set("k", b"2")
        second = await backend.get("k")
        assert first is not None
        assert second is not None
        assert first.created_at.tzinfo is not None
        assert first.created_at.utcoffset() == UTC.utcoffset(None)
        assert second.created_at == first.created_at
        assert second.updated_at >= first.updated_at

    async def test_set_returns_old_value_in_change(self, backend: Backend) -> None:
        """The change from a write carries the exact previous bytes."""
        await backend.set("k", b"before")
        change = await backend.set("k", b"after")
        assert change.old == b"before"
        assert change.new == b"after"
        assert change.version == 2

    async def test_expected_version_zero_creates_only_if_missing(self, backend: Backend) -> None:
        """expected_version=0 writes a missing key and refuses an existing one."""
        await backend.set("k", b"first", expected_version=0)
        with pytest.raises(ConflictError) as caught:
            await backend.set("k", b"second", expected_version=0)
        assert caught.value.expected == 0
        assert caught.value.actual == 1
        assert caught.value.key == "k"
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"first"
        assert entry.version == 1

    async def test_expected_version_mismatch_changes_nothing(self, backend: Backend) -> None:
        """A stale expected_version raises ConflictError and leaves value and version alone."""
        await backend.set("k", b"a")
        await backend.set("k", b"b")
        with pytest.raises(ConflictError) as caught:
            await backend.set("k", b"c", expected_version=1)
        assert (caught.value.expected, caught.value.actual) == (1, 2)
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"b", 2)
        change = await backend.set("k", b"c", expected_version=2)
        assert change.version == 3

    async def test_expected_version_on_missing_key_conflicts(self, backend: Backend) -> None:
        """expected_version=n > 0 on a missing key is a conflict with actual=0."""
        with pytest.raises(ConflictError) as caught:
            await backend.set("nope", b"x", expected_version=3)
        assert caught.value.actual == 0
        assert await backend.get("nope") is None

    @pytest.mark.parametrize("bad", [-1, "1", 1.0, True])
    async def test_invalid_expected_version_is_rejected(
        self, backend: Backend, bad: object
    ) -> None:
        """expected_version must be None or an int >= 0."""
        with pytest.raises(InvalidArgumentError):
            await backend.set("k", b"x", expected_version=bad)  # type: ignore[arg-type]
        assert await backend.get("k") is None

    async def test_delete_returns_change_with_deleted_version(self, backend: Backend) -> None:
        """Deleting reports the old bytes and the version that was deleted."""
        await backend.set("k", b"a")
        await backend.set("k", b"b")
        change = await backend.delete("k")
        assert change is not None
        assert change.op is ChangeOp.DELETE
        assert (change.old, change.new, change.version) == (b"b", None, 2)
        assert await backend.get("k") is None

    async def test_delete_missing_returns_none(self, backend: Backend) -> None:
        """Deleting a missing key returns None (and expected_version=0 agrees it is missing)."""
        assert await backend.delete("missing") is None
        assert await backend.delete("missing", expected_version=0) is None

    async def test_delete_with_wrong_version_changes_nothing(self, backend: Backend) -> None:
        """A stale expected_version on delete raises ConflictError and keeps the key."""
        await backend.set("k", b"a")
        with pytest.raises(ConflictError):
            await backend.delete("k", expected_version=5)
        with pytest.raises(ConflictError):
            await backend.delete("k", expected_version=0)
        assert await backend.get("k") is not None
        assert await backend.delete("k", expected_version=1) is not None

    async def test_recreated_key_starts_at_version_one(self, backend: Backend) -> None:
        """A deleted key written again starts over at version 1."""
        await backend.set("k", b"a")
        await backend.set("k", b"b")
        await backend.delete("k")
        change = await backend.set("k", b"c")
        assert change.version == 1
        assert change.old is None

    async def test_get_many_keeps_order_and_reports_missing(self, backend: Backend) -> None:
        """get_many returns one entry per key, in order, None for missing keys."""
        await backend.set("a", b"1")
        await backend.set("c", b"3")
        entries = await backend.get_many(["c", "b", "a", "c"])
        assert [e.value if e else None for e in entries] == [b"3", None, b"1", b"3"]
        assert await backend.get_many([]) == []

    async def test_set_many_writes_each_key(self, backend: Backend) -> None:
        """set_many writes every item and returns one change each, in order."""
        await backend.set("b", b"old")
        changes = await backend.set_many([("a", b"1"), ("b", b"2")])
        assert [(c.key, c.version, c.old) for c in changes] == [("a", 1, None), ("b", 2, b"old")]
        assert [e.value if e else None for e in await backend.get_many(["a", "b"])] == [b"1", b"2"]

    async def test_update_applies_function_to_current_entry(self, backend: Backend) -> None:
        """Update passes the current entry (None when missing) and stores what fn returns."""
        seen: list[Entry | None] = []

        def bump(entry: Entry | None) -> bytes:
            seen.append(entry)
            return b"1" if entry is None else str(int(entry.value) + 1).encode()

        first = await backend.update("n", bump)
        second = await backend.update("n", bump)
        assert (first.version, second.version) == (1, 2)
        assert (second.old, second.new) == (b"1", b"2")
        assert seen[0] is None

    async def test_update_that_raises_writes_nothing(self, backend: Backend) -> None:
        """If fn raises, the exception propagates and the value is unchanged."""
        await backend.set("k", b"keep")

        def boom(entry: Entry | None) -> bytes:
            raise RuntimeError("no")

        with pytest.raises(RuntimeError):
            await backend.update("k", boom)
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"keep", 1)

    async def test_update_loses_nothing_under_50_concurrent_tasks(self, backend: Backend) -> None:
        """50 tasks x 100 read-modify-write increments through update() add up to 5000."""

        def increment(entry: Entry | None) -> bytes:
            return b"1" if entry is None else str(int(entry.value) + 1).encode()

        async def worker() -> None:
            for _ in range(100):
                await backend.update("counter", increment, max_attempts=10_000)

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(worker)
        entry = await backend.get("counter")
        assert entry is not None
        assert entry.value == b"5000"
        assert entry.version == 5000

    @pytest.mark.parametrize(
        "bad_key",
        ["", 1, None, b"bytes", "a\x00b", "line\nbreak", "tab\tkey", "\x7f", "x" * 1025, "\ud800"],
    )
    async def test_invalid_keys_are_rejected_everywhere(
        self, backend: Backend, bad_key: object
    ) -> None:
        """Empty, non-str, control-character, overlong and non-UTF-8 keys raise InvalidKeyError."""
        with pytest.raises(InvalidKeyError):
            await backend.set(bad_key, b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await backend.get(bad_key)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await backend.delete(bad_key)  # type: ignore[arg-type]
        assert [key async for key in backend.scan("*")] == []

    async def test_unusual_but_valid_keys_work(self, backend: Backend) -> None:
        """Unicode, spaces, glob metacharacters and path-like keys are ordinary keys."""
        keys = [
            "é:ü:中文",
            "with space",
            "a*b?c[d]e\\f^g",
            "../../etc/passwd",
            "/abs",
            "..",
            "x" * 1024,
        ]
        for index, key in enumerate(keys):
            await backend.set(key, str(index).encode())
        for index, key in enumerate(keys):
            entry = await backend.get(key)
            assert entry is not None
            assert entry.value == str(index).encode()
        assert sorted([key async for key in backend.scan("*")]) == sorted(keys)

    @pytest.mark.parametrize("bad_ttl", [timedelta(0), timedelta(seconds=-1), 5, "5"])
    async def test_invalid_ttl_is_rejected(self, backend: Backend, bad_ttl: object) -> None:
        """A TTL that is not a positive timedelta raises InvalidArgumentError and writes nothing."""
        with pytest.raises(InvalidArgumentError):
            await backend.set("k", b"x", ttl=bad_ttl)  # type: ignore[arg-type]
        assert await backend.get("k") is None
