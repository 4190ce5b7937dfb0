"""The events contract: exact old/new, commit order per key, bounded buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import ChangeOp, SubscriptionClosedError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Backend, Change


async def _take(changes: AsyncIterator[Change], count: int) -> list[Change]:
    out: list[Change] = []
    with anyio.fail_after(5):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


class EventsContract:
    """The events contract: exact old/new, commit order per key, bounded buffers.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_subscription_sees_set_and_delete_with_old_and_new(
        self, backend: Backend
    ) -> None:
        """Each change carries the op, the exact old and new bytes, and the version."""
        async with backend.changes("agent:*") as changes:
            await backend.set("agent:1", b"a")
            await backend.set("agent:1", b"b")
            await backend.delete("agent:1")
            got = await _take(changes, 3)
        assert [(c.key, c.op, c.old, c.new, c.version) for c in got] == [
            ("agent:1", ChangeOp.SET, None, b"a", 1),
            ("agent:1", ChangeOp.SET, b"a", b"b", 2),
            ("agent:1", ChangeOp.DELETE, b"b", None, 2),
        ]
        assert all(c.timestamp.tzinfo is not None for c in got)

    async def test_subscription_only_sees_matching_keys(self, backend: Backend) -> None:
        """Changes to keys outside the pattern are not delivered."""
        async with backend.changes("agent:?") as changes:
            await backend.set("workflow:1", b"w")
            await backend.set("agent:10", b"no")
            await backend.set("agent:1", b"yes")
            got = await _take(changes, 1)
        assert [c.key for c in got] == ["agent:1"]

    async def test_escaped_metacharacters_in_patterns(self, backend: Backend) -> None:
        """A subscription to an escaped pattern sees only the literal key."""
        async with backend.changes("job\\*") as changes:
            await backend.set("jobs", b"no")
            await backend.set("job*", b"yes")
            got = await _take(changes, 1)
        assert [c.key for c in got] == ["job*"]

    async def test_changes_arrive_in_commit_order_per_key(self, backend: Backend) -> None:
        """Interleaved writes to several keys arrive with versions ascending per key."""
        async with backend.changes("order:*") as changes:
            for i in range(60):
                await backend.set(f"order:{i % 3}", str(i).encode())
            got = await _take(changes, 60)
        for key in ("order:0", "order:1", "order:2"):
            mine = [c for c in got if c.key == key]
            assert [c.version for c in mine] == list(range(1, 21))
            assert [c.old for c in mine[1:]] == [c.new for c in mine[:-1]]

    async def test_update_and_set_many_emit_changes(self, backend: Backend) -> None:
        """update() and set_many() emit a change for each key they write."""
        async with backend.changes("*") as changes:
            await backend.update("u", lambda entry: b"1")
            await backend.set_many([("m1", b"1"), ("m2", b"2")])
            got = await _take(changes, 3)
        assert sorted(c.key for c in got) == ["m1", "m2", "u"]

    async def test_two_subscriptions_both_receive(self, backend: Backend) -> None:
        """Every matching subscription receives the change."""
        async with backend.changes("k*") as first, backend.changes("*") as second:
            await backend.set("k1", b"x")
            one = await _take(first, 1)
            two = await _take(second, 1)
        assert one[0].new == two[0].new == b"x"

    async def test_subscription_is_active_when_entered(self, backend: Backend) -> None:
        """A write made right after entering the subscription is delivered."""
        for i in range(5):
            async with backend.changes(f"now:{i}") as changes:
                await backend.set(f"now:{i}", b"x")
                got = await _take(changes, 1)
            assert got[0].key == f"now:{i}"

    async def test_slow_subscriber_is_told_it_overflowed(self, backend: Backend) -> None:
        """A subscriber that falls more than max_buffer behind gets what was buffered, then an
        error."""
        async with backend.changes("flood:*", max_buffer=5) as changes:
            for i in range(20):
                await backend.set(f"flood:{i}", b"x")
            received: list[Change] = []

            async def drain() -> None:
                async for change in changes:
                    received.append(change)

            with anyio.fail_after(5), pytest.raises(SubscriptionClosedError) as caught:
                await drain()
        assert caught.value.reason == "overflow"
        # Each change at most once; no order across keys is promised (a cluster's shards publish
        # on their own paths), only per key.
        keys = [c.key for c in received]
        assert len(set(keys)) == len(keys)
        assert set(keys) <= {f"flood:{i}" for i in range(20)}
        assert 1 <= len(received) < 20

    async def test_writes_succeed_while_a_subscriber_is_stalled(self, backend: Backend) -> None:
        """A subscriber that never reads does not block or fail writers."""
        async with backend.changes("*", max_buffer=1):
            with anyio.fail_after(10):
                for i in range(50):
                    await backend.set("busy", str(i).encode())
        entry = await backend.get("busy")
        assert entry is not None
        assert entry.version == 50

    async def test_closed_subscription_stops_receiving(self, backend: Backend) -> None:
        """After leaving the context manager the subscription is gone and writes still work."""
        async with backend.changes("gone:*") as changes:
            await backend.set("gone:1", b"x")
            await _take(changes, 1)
        await backend.set("gone:2", b"y")
        entry = await backend.get("gone:2")
        assert entry is not None

    async def test_backend_close_ends_iteration(self, backend: Backend) -> None:
        """Closing the backend ends every open subscription's iteration."""
        async with backend.changes("*") as changes:
            await backend.set("k", b"x")
            await backend.aclose()
            with anyio.fail_after(5):
                leftover = [change async for change in changes]
        assert [c.key for c in leftover] in ([], ["k"])
