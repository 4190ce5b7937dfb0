"""The SQLite backend's durable feed (cursors, replay, retention, migration) and its history."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import (
    ConfigurationError,
    CursorExpiredError,
    SQLiteBackend,
    SubscriptionClosedError,
    open_backend,
)
from agenticstate.backends import EARLIEST, Change, Delete, FeedRetention, Put
from agenticstate.backends.sqlite import SCHEMA_VERSION

if TYPE_CHECKING:
    from pathlib import Path

# The layout main's code wrote (schema version 1), to check that such a file is migrated.
SCHEMA_1 = """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, expires_at INTEGER
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_expiry ON kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY, key TEXT NOT NULL, op INTEGER NOT NULL,
    old BLOB, new BLOB, version INTEGER NOT NULL, ts INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idx (
    name TEXT NOT NULL, member TEXT NOT NULL, score REAL NOT NULL, PRIMARY KEY (name, member)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_order ON idx (name, score, member);
"""


async def take(changes: object, count: int) -> list[Change]:
    """The next `count` changes of a stream (failing after 10 s)."""
    got: list[Change] = []
    with anyio.fail_after(10):
        while len(got) < count:
            got.append(await changes.__anext__())  # type: ignore[attr-defined]
    return got


async def test_every_change_carries_its_cursor_and_any_cursor_resumes(tmp_path: Path) -> None:
    """Returned and delivered changes carry the same s1 cursor; resuming from any one of them
    yields exactly the later changes; feed_cursor is the head (a fresh file's too)."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        head = await backend.feed_cursor()
        assert head.startswith("s1:")
        assert head.endswith(":0")
        async with backend.changes("*") as live:
            made: list[Change] = []
            for n in range(30):
                key = f"k{n % 4}"
                if n % 7 == 6:
                    deleted = await backend.delete(key)
                    if deleted is not None:
                        made.append(deleted)
                elif n % 5 == 4:
                    made.append(await backend.update(key, lambda e: (e.value if e else b"") + b"+"))
                else:
                    made.append(await backend.set(key, b"%d" % n))
            made += (await backend.set_many([("a", b"1"), ("b", b"2")])).copy()
            delivered = await take(live, len(made))
        assert delivered == made
        assert all(c.cursor and c.cursor.startswith(head[:-1]) for c in made)
        assert await backend.feed_cursor() == made[-1].cursor
        for n in (0, 5, len(made) - 1):
            async with backend.changes("*", since=made[n].cursor) as again:
                assert await take(again, len(made) - n - 1) == made[n + 1 :]
                await backend.set("after", b"x")
                (after,) = await take(again, 1)
            assert after.key == "after"
            made.append(after)
        async with backend.changes("k1", since=head) as only_k1:
            wanted = [c for c in made if c.key == "k1"]
            assert await take(only_k1, len(wanted)) == wanted


async def test_earliest_replays_what_is_retained(tmp_path: Path) -> None:
    """EARLIEST replays every retained change (after a trim too) and never expires."""
    async with SQLiteBackend(tmp_path / "s.db", feed=FeedRetention(max_changes=10)) as backend:
        made = [await backend.set(f"k{n}", b"v") for n in range(100)]
        async with backend.changes("*", since=EARLIEST) as changes:
            first = await take(changes, 1)
            oldest = made.index(first[0])
            rest = await take(changes, len(made) - oldest - 1)
        assert [first[0], *rest] == made[oldest:]
        assert 10 <= len(made) - oldest < 100  # trimmed, keeping at least max_changes
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=made[0].cursor):
                pass


async def test_a_long_replay_never_overflows_and_meets_live_exactly(tmp_path: Path) -> None:
    """5,000 changes back with a buffer of 400: the replay reads pages as it is consumed, then
    joins the live changes another task keeps writing: no overflow, no gap, no duplicate.

    The buffer holds the 300 live writes (a writer faster than its reader may outrun a smaller
    one, which is an overflow by design) and a twelfth of the replay, which never overflows."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        start = await backend.feed_cursor()
        await backend.set_many([(f"k{n % 50}", b"%d" % n) for n in range(5000)])
        written: list[Change] = []

        async def writer() -> None:
            for n in range(300):
                written.append(await backend.set(f"live{n % 3}", b"%d" % n))

        async with backend.changes("*", since=start, max_buffer=400) as changes:
            got = await take(changes, 1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                got += await take(changes, 5000 + 300 - 1)
    assert [c.cursor for c in got[:5000]] == [f"{start[:-1]}{n}" for n in range(1, 5001)]
    assert got[5000:] == written


async def test_a_recreated_file_expires_old_cursors(tmp_path: Path) -> None:
    """A file deleted and made again has a new id: a cursor of the old one has expired."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        old = (await backend.set("k", b"v")).cursor
    for name in ("s.db", "s.db-wal", "s.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("k", b"v")
        new = await backend.feed_cursor()
        assert old is not None
        assert old.split(":")[1] != new.split(":")[1]
        assert old.rsplit(":", 1)[1] == new.rsplit(":", 1)[1]  # the same sequence number
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=old):
                pass


async def test_max_age_trims_old_changes(tmp_path: Path) -> None:
    """Changes older than max_age are dropped as writes happen (the newest always stays)."""
    retention = FeedRetention(max_changes=None, max_age=timedelta(milliseconds=50))
    async with SQLiteBackend(tmp_path / "s.db", feed=retention) as backend:
        old = [await backend.set(f"k{n}", b"v") for n in range(5)]
        await anyio.sleep(0.1)  # let them age (time is what is under test)
        fresh = await backend.set("fresh", b"v")
        async with backend.changes("*", since=EARLIEST) as changes:
            assert await take(changes, 1) == [fresh]
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=old[0].cursor):
                pass
        async with backend.changes("*", since=old[-1].cursor) as changes:
            assert await take(changes, 1) == [fresh]  # nothing after it was trimmed


def test_feed_options_and_url_parameters(tmp_path: Path) -> None:
    """feed=, change_retention= (its old spelling) and the URL's feed parameters agree; the
    feed cannot be turned off."""
    db = tmp_path / "s.db"
    assert SQLiteBackend(db).feed == FeedRetention()
    assert SQLiteBackend(db, change_retention=5).feed == FeedRetention(max_changes=5)
    assert SQLiteBackend(db, change_retention=5).change_retention == 5
    by_url = open_backend(f"sqlite://{db}?feed_max_changes=100000&feed_max_age=2.5")
    assert by_url.feed == FeedRetention(max_changes=100_000, max_age=timedelta(seconds=2.5))
    assert open_backend(f"sqlite://{db}?change_retention=7").feed == FeedRetention(7)
    with pytest.raises(ConfigurationError, match="cannot turn"):
        SQLiteBackend(db, feed=None)
    with pytest.raises(ConfigurationError, match="cannot turn"):
        open_backend(f"sqlite://{db}?feed=off")
    with pytest.raises(ConfigurationError, match="not both"):
        SQLiteBackend(db, feed=FeedRetention(5), change_retention=5)
    with pytest.raises(ConfigurationError, match="feed_max_age"):
        open_backend(f"sqlite://{db}?feed_max_age=soon")
    with pytest.raises(ConfigurationError, match="max_changes"):
        open_backend(f"sqlite://{db}?feed_max_changes=0")
    assert not db.exists()


async def test_a_version_1_database_is_migrated_in_place(tmp_path: Path) -> None:
    """A file main's code made (schema 1, with keys, changes and an index) opens, keeps its
    data, gets an id and a history table, and works: reads, writes, the feed, history."""
    db = tmp_path / "s.db"
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA_1)
    conn.execute("INSERT INTO kv VALUES ('k', x'01', 3, 1000, 2000, NULL)")
    conn.execute("INSERT INTO changes VALUES (41, 'k', 0, x'00', x'01', 3, 2000)")
    conn.execute("INSERT INTO idx VALUES ('queue', 'a', 1.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    async with SQLiteBackend(db, history={"k": 3}) as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"\x01", 3)
        # The row got a revision of its own after the newest change (its life began before).
        assert (entry.revision, entry.create_revision) == (42, 42)
        assert await backend.index_range("queue") == [("a", 1.0)]
        head = await backend.feed_cursor()
        assert head.endswith(":41")
        change = await backend.set("k", b"\x02")
        assert change.cursor is not None
        assert change.cursor.endswith(":43")  # after the migrated row's revision
        written = await backend.get("k")
        assert written is not None
        assert (change.revision, written.create_revision) == (43, 42)
        async with backend.changes("*", since=head) as changes:
            assert await take(changes, 1) == [change]
        assert [e.version for e in await backend.history("k")] == [4, 3]
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
        (db_id,) = conn.execute("SELECT value FROM meta WHERE name = 'db_id'").fetchone()
    finally:
        conn.close()
    assert head.split(":")[1] == db_id


# ------------------------------------------------------------------ history


async def test_history_keeps_the_depth_newest_first(tmp_path: Path) -> None:
    """Every kind of write keeps its version (set, set_many, update, transact's Put); history is
    newest first with the current version equal to get; get_version reads one version."""
    async with SQLiteBackend(tmp_path / "s.db", history={"agent:*": 3}) as backend:
        await backend.set("agent:1", b"1")
        await backend.set_many([("agent:1", b"2"), ("other", b"x")])
        await backend.update("agent:1", lambda e: b"3")
        await backend.transact([], [Put("agent:1", b"4", ttl=timedelta(hours=1))])
        found = await backend.history("agent:1")
        assert found[0] == await backend.get("agent:1")
        assert [(e.version, e.value) for e in found] == [(4, b"4"), (3, b"3"), (2, b"2")]
        assert found[0].expires_at is not None
        assert found[1].expires_at is None
        assert len({e.created_at for e in found}) == 1
        assert [e.version for e in await backend.history("agent:1", limit=2)] == [4, 3]
        assert await backend.history("agent:1", limit=0) == []
        assert [e.version for e in await backend.history("other")] == [1]  # no rule: current
        version_3 = await backend.get_version("agent:1", 3)
        assert version_3 is not None
        assert (version_3.value, version_3.updated_at) == (b"3", found[1].updated_at)
        assert await backend.get_version("agent:1", 1) is None  # beyond the depth
        assert await backend.get_version("agent:1", 5) is None
        rows = await backend._call(  # the table keeps no more than the depth
            False, lambda conn: conn.execute("SELECT count(*) FROM history").fetchone()[0]
        )
        assert rows == 3
    async with SQLiteBackend(tmp_path / "s.db", history={"agent:*": 3}) as again:
        assert await again.history("agent:1") == found


async def test_a_delete_or_expiry_ends_a_history(tmp_path: Path) -> None:
    """After a delete (or transact's Delete, or expiry) a key has no history; written again,
    it starts over at version 1 with only its new versions."""
    async with SQLiteBackend(tmp_path / "s.db", history={"*": 5}) as backend:
        for n in range(3):
            await backend.set("a", b"%d" % n)
            await backend.set("b", b"%d" % n)
            await backend.set("c", b"%d" % n, ttl=timedelta(milliseconds=30))
        await backend.delete("a")
        await backend.transact([], [Delete("b")])
        assert await backend.history("a") == []
        assert await backend.history("b") == []
        assert await backend.get_version("a", 1) is None
        await backend.set("a", b"again")
        assert [(e.version, e.value) for e in await backend.history("a")] == [(1, b"again")]
        await anyio.sleep(0.05)  # let c expire (time is what is under test)
        assert await backend.history("c") == []
        backend._swept_at = 0.0  # the next write sweeps c and its history
        await backend.set("c", b"new")
        assert [(e.version, e.value) for e in await backend.history("c")] == [(1, b"new")]
        keys = await backend._call(
            False, lambda conn: conn.execute("SELECT DISTINCT key FROM history").fetchall()
        )
        assert sorted(keys) == [("a",), ("c",)]


async def test_a_writer_without_rules_leaves_no_stale_history(tmp_path: Path) -> None:
    """A version written by a process with no rule is not in history, and an earlier life of
    a key (deleted and written again without rules) never shows as its older versions."""
    db = tmp_path / "s.db"
    async with SQLiteBackend(db, history={"*": 5}) as keeper, SQLiteBackend(db) as plain:
        for n in range(3):
            await keeper.set("k", b"old %d" % n)
        await plain.delete("k")
        await plain.set("k", b"new 1")
        await plain.set("k", b"new 2")
        await anyio.sleep(0.001)  # the new life starts on a later microsecond
        found = await keeper.history("k")
        assert [(e.version, e.value) for e in found] == [(2, b"new 2")]
        assert await keeper.get_version("k", 1) is None


async def test_a_replay_outrun_by_retention_ends_as_an_overflow(tmp_path: Path) -> None:
    """If retention trims changes a replay has yet to read, the subscription ends as an
    overflow (never a silent gap), and resuming from its last cursor raises
    CursorExpiredError."""
    async with SQLiteBackend(tmp_path / "s.db", feed=FeedRetention(max_changes=3000)) as backend:
        start = await backend.feed_cursor()
        await backend.set_many([(f"k{n}", b"v") for n in range(2500)])
        async with backend.changes("*", since=start) as changes:
            (first,) = await take(changes, 1)  # the first page is read
            await backend.set_many([(f"later{n}", b"v") for n in range(5000)])
            with pytest.raises(SubscriptionClosedError) as caught:
                await take(changes, 2500)
        assert caught.value.reason == "overflow"
        assert first.cursor is not None
        with pytest.raises(CursorExpiredError):
            async with backend.changes("*", since=first.cursor):
                pass


async def test_a_live_subscription_outrun_by_retention_ends_as_an_overflow(
    tmp_path: Path,
) -> None:
    """Another instance commits more changes at once than retention keeps: a live subscriber
    missed some, so it ends as an overflow (never a silent gap), and its cursor has expired."""
    db = tmp_path / "s.db"
    small = FeedRetention(max_changes=5)
    async with SQLiteBackend(db, feed=small) as reader, SQLiteBackend(db, feed=small) as writer:
        async with reader.changes("*") as changes:
            first = await writer.set("first", b"v")
            assert await take(changes, 1) == [first]
            await writer.set_many([(f"k{n}", b"v") for n in range(50)])  # trimmed to 5
            with pytest.raises(SubscriptionClosedError) as caught:
                await take(changes, 50)
        assert caught.value.reason == "overflow"
        assert first.cursor is not None
        with pytest.raises(CursorExpiredError):
            async with reader.changes("*", since=first.cursor):
                pass


async def test_a_replay_survives_cancelled_reads(tmp_path: Path) -> None:
    """A consumer whose every other read is cancelled at once (a timeout of 0) still gets the
    replay and the switch to live exactly: reads and the joining are taken up again."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        start = await backend.feed_cursor()
        made = await backend.set_many([(f"k{n % 7}", b"%d" % n) for n in range(4500)])
        got: list[Change] = []
        async with backend.changes("*", since=start, max_buffer=10) as changes:
            for attempt in range(20_000):
                if len(got) == 4500 and len(made) == 4500:  # replayed: now some live ones
                    made += [await backend.set("live", b"%d" % n) for n in range(3)]
                if len(got) == 4503:
                    break
                with anyio.move_on_after(0 if attempt % 2 else 10):
                    got.append(await changes.__anext__())
    assert got == made


async def test_history_set_later_starts_with_the_version_replaced(tmp_path: Path) -> None:
    """Rules set after a key was written: its history starts with the version the next write
    replaces (as on the memory and file backends)."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("a:1", b"1")
        await backend.set("a:1", b"2")
        backend.keep_history({"a:*": 5})
        await backend.set("a:1", b"3")
        found = await backend.history("a:1")
        assert [(e.version, e.value) for e in found] == [(3, b"3"), (2, b"2")]
        assert found[1].updated_at < found[0].updated_at
