"""`ChangeFanout` and `ChangeStream` in `backends/_fanout.py`, and under their old path."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
import pytest

from agenticstate import events
from agenticstate.backends import ChangeFanout, ChangeStream
from agenticstate.backends._fanout import ChangeFanout as Moved
from agenticstate.backends.base import Change, ChangeOp
from agenticstate.exceptions import SubscriptionClosedError


def _change(key: str, version: int) -> Change:
    return Change(key, ChangeOp.SET, None, b"x", version, datetime.now(UTC))


def test_the_old_import_path_is_the_same_class() -> None:
    assert events.ChangeFanout is Moved is ChangeFanout
    assert events.ChangeStream is ChangeStream


async def test_buffered_counts_unread_changes() -> None:
    """`buffered` is what waits unread: it grows with publishes, shrinks with reads, and is 0
    while a subscription that starts closed is not open yet."""
    fanout = ChangeFanout()
    async with (
        fanout.subscribe("a:*", 10) as stream,
        fanout.subscribe("a:*", 10, start_open=False) as closed,
    ):
        for version in range(1, 4):
            fanout.publish(_change("a:1", version))
        fanout.publish(_change("b:1", 1))  # not matching
        assert stream.buffered == 3
        assert closed.buffered == 0
        with anyio.fail_after(5):
            first = await stream.__anext__()
        assert first.version == 1
        assert stream.buffered == 2
        closed.open()
        fanout.publish(_change("a:2", 1))
        assert closed.buffered == 1
        assert stream.buffered == 3


async def test_buffered_changes_are_taken_without_the_event_loop() -> None:
    """A consumer that finds changes buffered takes them all, in order, before any other task
    runs (batch draining: no checkpoint per change)."""
    fanout = ChangeFanout()
    ran: list[str] = []
    async with fanout.subscribe("a:*", 100) as stream:
        for version in range(1, 51):
            fanout.publish(_change("a:1", version))

        async def other() -> None:
            ran.append("other")

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            versions = [(await stream.__anext__()).version for _ in range(50)]
            assert ran == []  # the other task never got a turn
        assert versions == list(range(1, 51))
        assert stream.buffered == 0


async def test_a_cancelled_wait_loses_no_change() -> None:
    """Cancelling a consumer while it waits takes nothing from the buffer: the next read gets
    the next change, exactly once."""
    fanout = ChangeFanout()
    async with fanout.subscribe("a:*", 10) as stream:
        with anyio.move_on_after(0.01) as scope:
            await stream.__anext__()
        assert scope.cancelled_caught
        fanout.publish(_change("a:1", 1))
        fanout.publish(_change("a:1", 2))
        with anyio.fail_after(5):
            assert (await stream.__anext__()).version == 1
            assert (await stream.__anext__()).version == 2
        assert stream.buffered == 0


async def test_a_waiting_consumer_is_woken_and_overflow_follows_the_buffer() -> None:
    """A consumer waiting is woken by a publish; one more change than `max_buffer` unread ends
    the stream with an overflow after the buffered changes, and later publishes are dropped."""
    fanout = ChangeFanout()
    async with fanout.subscribe("a:*", 3) as stream:
        got: list[int] = []

        async def consume() -> None:
            got.append((await stream.__anext__()).version)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            fanout.publish(_change("a:1", 1))
        assert got == [1]
        for version in range(2, 7):  # 2, 3, 4 fit; 5 overflows; 6 is dropped
            fanout.publish(_change("a:1", version))
        with anyio.fail_after(5):
            assert [(await stream.__anext__()).version for _ in range(3)] == [2, 3, 4]
            with pytest.raises(SubscriptionClosedError) as caught:
                await stream.__anext__()
        assert caught.value.reason == "overflow"


async def test_close_wakes_every_waiting_consumer() -> None:
    """Two tasks waiting on one stream both end when the fan-out closes."""
    fanout = ChangeFanout()
    ended: list[str] = []
    async with fanout.subscribe("a:*", 10) as stream:

        async def consume(name: str) -> None:
            async for _ in stream:
                pass
            ended.append(name)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, "one")
                tg.start_soon(consume, "two")
                await anyio.wait_all_tasks_blocked()
                fanout.close()
    assert sorted(ended) == ["one", "two"]


def test_the_fanout_runs_under_trio() -> None:
    """Waiting, waking, draining and the end of a stream work under trio too."""
    pytest.importorskip("trio")
    got: list[int] = []

    async def main() -> None:
        fanout = ChangeFanout()
        async with fanout.subscribe("a:*", 10) as stream:

            async def consume() -> None:
                async for change in stream:
                    got.append(change.version)

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()
                fanout.publish(_change("a:1", 1))
                await anyio.wait_all_tasks_blocked()
                fanout.publish(_change("a:1", 2))
                fanout.publish(_change("a:1", 3))
                stream.end()

    anyio.run(main, backend="trio")
    assert got == [1, 2, 3]


async def test_publish_to_all_skips_matching_but_keeps_the_rest() -> None:
    """`publish_to_all` hands a change to every open subscription whatever its key, and keeps
    the overflow rule; a subscription not open yet gets nothing."""
    fanout = ChangeFanout()
    async with (
        fanout.subscribe("a:*", 1) as small,
        fanout.subscribe("a:*", 10) as large,
        fanout.subscribe("a:*", 10, start_open=False) as closed,
    ):
        fanout.publish_to_all(_change("a:1", 1))
        fanout.publish_to_all(_change("a:1", 2))  # `small` overflows: the others still get it
        assert (large.buffered, closed.buffered) == (2, 0)
        with anyio.fail_after(5):
            assert (await small.__anext__()).version == 1
            with pytest.raises(SubscriptionClosedError):
                await small.__anext__()
            assert [(await large.__anext__()).version for _ in range(2)] == [1, 2]
