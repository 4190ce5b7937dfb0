"""`ChangeFanout` and `ChangeStream` in `backends/_fanout.py`, and under their old path."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio

from agenticstate import events
from agenticstate.backends import ChangeFanout, ChangeStream
from agenticstate.backends._fanout import ChangeFanout as Moved
from agenticstate.backends.base import Change, ChangeOp


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
