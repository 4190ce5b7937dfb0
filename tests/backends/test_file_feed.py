"""FileBackend's change feed and history across close, compaction, recreation and old stores."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import CursorExpiredError, FileBackend
from agenticstate.backends import EARLIEST, ChangeOp, FeedRetention, open_backend
from agenticstate.backends._file_format import (
    OP_DELETE,
    OP_SET,
    decode_snapshot,
    encode_frame,
    encode_snapshot,
)
from agenticstate.backends._shared import SharedFileBackend
from agenticstate.backends.base import new_entry, utcnow

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend, Change


async def _feed(backend: Backend, since: str = EARLIEST) -> list[Change]:
    """Every change after `since`, up to a mark written now (not returned)."""
    got: list[Change] = []
    async with backend.changes("*", since=since) as changes:
        mark = await backend.set("~mark", b"")
        with anyio.fail_after(10):
            async for change in changes:
                if change.key == "~mark" and change.version == mark.version:
                    break
                got.append(change)
    return [c for c in got if c.key != "~mark"]


def _facts(changes: list[Change]) -> list[tuple[object, ...]]:
    return [(c.key, c.op, c.old, c.new, c.version, c.cursor) for c in changes]


async def _write_some(backend: Backend) -> None:
    await backend.set("a", b"1")
    await backend.set("a", b"2")
    await backend.set_many([("b", b"1"), ("c", b"1")])
    await backend.delete("b")
    await backend.update("a", lambda entry: b"3")


@pytest.mark.parametrize("compact", [False, True], ids=["log", "snapshot"])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
async def test_the_feed_and_history_survive_reopening(
    tmp_path: Path, compact: bool, fmt: str
) -> None:
    """After close and reopen (the log replayed, or the snapshot's journal read), the feed holds
    the same changes with the same cursors, old and new bytes; history is intact."""
    options = {"format": fmt, "close_snapshot_keys": 10**6 if compact else 0}
    async with FileBackend(tmp_path, history={"a": 5}, **options) as backend:  # type: ignore[arg-type]
        await _write_some(backend)
        before = await _feed(backend)
        head = await backend.feed_cursor()
        history = await backend.history("a")
        if compact:
            await backend.flush()
    assert [(c.key, c.op, c.old, c.new) for c in before] == [
        ("a", ChangeOp.SET, None, b"1"),
        ("a", ChangeOp.SET, b"1", b"2"),
        ("b", ChangeOp.SET, None, b"1"),
        ("c", ChangeOp.SET, None, b"1"),
        ("b", ChangeOp.DELETE, b"1", None),
        ("a", ChangeOp.SET, b"2", b"3"),
    ]
    async with FileBackend(tmp_path, **options) as backend:  # type: ignore[arg-type]
        after = await _feed(backend)
        assert _facts(after)[: len(before)] == _facts(before)
        assert [c.timestamp for c in after[: len(before)]] == [c.timestamp for c in before]
        assert await backend.history("a") == history
        assert [e.version for e in history] == [3, 2, 1]
        assert head is not None
        assert [c.key for c in await _feed(backend, head)] == []  # only the mark came after
        # A cursor from before the reopen resumes exactly where it was.
        resumed = await _feed(backend, before[2].cursor or "")
        assert _facts(resumed[:3]) == _facts(before[3:])


async def test_a_recreated_store_has_a_new_id(tmp_path: Path) -> None:
    """A cursor of a store that was removed and made again raises CursorExpiredError."""
    async with FileBackend(tmp_path / "s") as backend:
        await backend.set("k", b"1")
        cursor = await backend.feed_cursor()
    assert cursor is not None
    assert cursor.startswith("f1:")
    shutil.rmtree(tmp_path / "s")
    async with FileBackend(tmp_path / "s") as backend:
        await backend.set("k", b"1")
        assert cursor != await backend.feed_cursor()
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=cursor):
                pass


async def test_retention_is_kept_through_compaction(tmp_path: Path) -> None:
    """The snapshot keeps only the retained changes, and a trimmed cursor stays expired."""
    async with FileBackend(tmp_path, feed=FeedRetention(max_changes=3)) as backend:
        old = await backend.feed_cursor()
        for n in range(10):
            await backend.set("k", b"%d" % n)
        await backend.flush()
    async with FileBackend(tmp_path, feed=FeedRetention(max_changes=3)) as backend:
        assert old is not None
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=old):
                pass
        assert [c.version for c in await _feed(backend)] == [8, 9, 10]


async def test_a_store_written_before_the_feed_opens(tmp_path: Path) -> None:
    """A store of the previous release (a snapshot without a journal, a log of eight-field
    records, deletes without a time) opens with its data; the log's writes form the feed (old
    values found from the snapshot), and it gets a store id."""
    moment = utcnow()
    stamp = round(moment.timestamp() * 1000)
    entries = {"a": new_entry("a", b"a1", 1, moment, moment, None)}
    entries["b"] = new_entry("b", b"b1", 1, moment, moment, None)
    (tmp_path / "state.json").write_bytes(
        encode_snapshot(entries, {}, 2, format="json", compression=False)
    )
    records = [
        [3, OP_SET, "a", b"a2", 2, stamp, stamp, None],
        [4, OP_DELETE, "b", None, 1, None, None, None],
        [5, OP_SET, "c", b"c1", 1, stamp, stamp, None],
    ]
    (tmp_path / "state.json.log").write_bytes(encode_frame(records, compress=False))
    async with FileBackend(tmp_path) as backend:
        assert [e.value if e else None for e in await backend.get_many(["a", "b", "c"])] == [
            b"a2",
            None,
            b"c1",
        ]
        feed = await _feed(backend)
        assert [(c.key, c.op, c.old, c.new, c.version) for c in feed] == [
            ("a", ChangeOp.SET, b"a1", b"a2", 2),
            ("b", ChangeOp.DELETE, b"b1", None, 1),
            ("c", ChangeOp.SET, None, b"c1", 1),
        ]
        cursor = feed[0].cursor
    assert cursor is not None
    _, _, _, journal = decode_snapshot((tmp_path / "state.json").read_bytes())
    assert journal is not None
    async with FileBackend(tmp_path) as backend:
        assert [c.key for c in await _feed(backend, cursor)] == ["b", "c"]


async def test_expired_keys_give_later_changes_their_old_value(tmp_path: Path) -> None:
    """A key that expired after a write logged on it: replay still knows the old value."""
    moment = utcnow()
    stamp = round(moment.timestamp() * 1000)
    records = [
        [1, OP_SET, "k", b"v1", 1, stamp, stamp, stamp + 50],
        [2, OP_SET, "k", b"v2", 2, stamp, stamp + 1, stamp + 100],
    ]
    (tmp_path / "state.json.log").write_bytes(encode_frame(records, compress=False))
    await anyio.sleep(0.2)  # both versions expire: wall-clock time
    async with FileBackend(tmp_path) as backend:
        assert await backend.get("k") is None
        assert [(c.old, c.new) for c in await _feed(backend)] == [(None, b"v1"), (b"v1", b"v2")]


async def test_history_depth_is_in_the_log(tmp_path: Path) -> None:
    """History kept by a writer reads back after a reopen by an opener without rules."""
    async with FileBackend(tmp_path, history={"h:*": 3}, close_snapshot_keys=0) as backend:
        for n in range(5):
            await backend.set("h:1", b"%d" % n)
    async with FileBackend(tmp_path) as backend:
        assert [e.value for e in await backend.history("h:1")] == [b"4", b"3", b"2"]
        await backend.delete("h:1")
        assert await backend.history("h:1") == []


async def test_feed_off_keeps_no_journal(tmp_path: Path) -> None:
    """feed=None: no cursors, and the snapshot holds no feed."""
    async with FileBackend(tmp_path, feed=None) as backend:
        change = await backend.set("k", b"1")
        assert change.cursor is None
        assert await backend.feed_cursor() is None
        await backend.flush()
    _, _, _, journal = decode_snapshot((tmp_path / "state.json").read_bytes())
    assert journal is None


def test_url_parameters_set_the_feed(tmp_path: Path) -> None:
    """file:// URLs take the feed parameters."""
    backend = open_backend(f"file://{tmp_path}?feed_max_changes=9")
    assert backend.feed == FeedRetention(max_changes=9)
    assert open_backend(f"file://{tmp_path}?feed=off").feed is None


async def test_shared_leases_share_the_feed_and_history(tmp_path: Path) -> None:
    """Two leases of one store: one's writes are in the other's feed and history."""
    first = SharedFileBackend(tmp_path, history={"k": 3})
    second = SharedFileBackend(tmp_path)
    async with first, second:
        head = await second.feed_cursor()
        assert head is not None
        for n in range(4):
            await first.set("k", b"%d" % n)
        assert [c.new for c in await _feed(second, head)] == [b"0", b"1", b"2", b"3"]
        assert [e.value for e in await second.history("k")] == [b"3", b"2", b"1"]
        found = await second.get_version("k", 2)
        assert found is not None
        assert found.value == b"1"
