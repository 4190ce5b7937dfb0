"""Revisions where one backend keeps them: reopened, compacted, trimmed, migrated, restarted.

The contract (`agenticstate.testing.RevisionContract`) holds revisions within one open store;
these tests hold them across what only a backend's own storage goes through: a file store's log
replay and compaction, an SQLite file's feed trimming, reopening and migration from an older
schema, a Redis server's restart (with and without persistence), records written before
revisions, and key prefixes that nest.
"""

from __future__ import annotations

import importlib
import json
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agenticstate import ConflictError, StateConfig, StateManager, UnsupportedOperationError, txn
from agenticstate.backends import FeedRetention, FileBackend, RedisBackend, SQLiteBackend
from agenticstate.backends._file_format import (
    decode_snapshot,
    encode_frame,
    snapshot_checksum,
)
from agenticstate.backends._redis_revision import REVISION_NAMESPACE, RevisionNames
from agenticstate.backends._redis_slots import slot_tag
from agenticstate.backends._redis_wire import key_slot
from agenticstate.backends.base import backoff
from tests._redis_server import RedisServer
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from agenticstate.backends import Backend, Change

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "docs" / "examples"


async def _history_of_writes(backend: Backend, key: str = "k") -> list[int]:
    """Write, delete and write `key` again: the revisions of the five changes."""
    changes: list[Change | None] = [
        await backend.set(key, b"1"),
        await backend.set(key, b"2"),
        await backend.delete(key),
        await backend.set(key, b"3"),
        await backend.set(key, b"4"),
    ]
    return [change.revision for change in changes if change is not None]


# ---------------------------------------------------------------- the file store


@pytest.mark.parametrize("compact", [False, True], ids=["log", "snapshot"])
async def test_file_revisions_survive_reopen_and_compaction(tmp_path: Path, compact: bool) -> None:
    """Entries keep revision and create_revision through a log replay or a snapshot, and the
    next write after reopening gets a larger revision than any before."""
    keys = 0 if not compact else 10_000  # close_snapshot_keys: 0 leaves the log to replay
    async with FileBackend(tmp_path, close_snapshot_keys=keys) as backend:
        made = await _history_of_writes(backend)
        await backend.set("other", b"x")
        before = await backend.get("k")
        if compact:
            await backend.flush()
    assert before is not None
    assert (before.revision, before.create_revision) == (made[4], made[3])
    async with FileBackend(tmp_path) as backend:
        assert await backend.get("k") == before
        after = await backend.set("k", b"5")
        assert after.revision > max(made)
        entry = await backend.get("k")
        assert entry is not None
        assert entry.create_revision == made[3]
        deleted = await backend.delete("other")
        assert deleted is not None
        assert deleted.revision > after.revision


async def test_file_store_written_before_revisions_gets_them_on_open(tmp_path: Path) -> None:
    """A snapshot without revisions and a log of 8-field records (an older release's) open
    with a distinct revision for every entry, after every logged one, kept on the next open."""
    async with FileBackend(tmp_path, close_snapshot_keys=10_000) as backend:
        await backend.set("a", b"1")
        await backend.set("b", b"1")
    snapshot = tmp_path / "state.json"
    document = json.loads(snapshot.read_bytes())
    for item in document["entries"].values():
        del item["revision"], item["create_revision"]
    document["checksum"] = snapshot_checksum(document["entries"], document["indexes"])
    del document["header_checksum"]  # an older release's snapshot has none
    snapshot.write_text(json.dumps(document))
    lsn = document["lsn"]
    # An older release's log: a write of "a" at version 2 and a new key "c", 8 fields each.
    records = [
        [lsn + 1, "s", "a", b"2", 2, 1000, 2000, None],
        [lsn + 2, "s", "c", b"1", 1, 3000, 3000, None],
    ]
    (tmp_path / "state.json.log").write_bytes(encode_frame(records, compress=False))
    async with FileBackend(tmp_path) as backend:
        a, b, c = await backend.get_many(["a", "b", "c"])
        assert a is not None
        assert b is not None
        assert c is not None
        assert (a.version, a.revision) == (2, lsn + 1)  # a logged write: its lsn
        assert (c.revision, c.create_revision) == (lsn + 2, lsn + 2)
        assert b.revision == b.create_revision > lsn + 2  # given on open, after the log
        assert a.create_revision == lsn + 1  # its life began before revisions: its first known
        later = await backend.set("d", b"1")
        assert later.revision > max(a.create_revision, b.revision)
    _, entries, _, _ = decode_snapshot(snapshot.read_bytes())  # written on open, then closed
    assert all(item["revision"] >= 1 for item in entries.values())
    async with FileBackend(tmp_path) as backend:
        assert (await backend.get("b")) == b


# ---------------------------------------------------------------- SQLite


async def test_sqlite_revisions_survive_trimming_and_reopen(tmp_path: Path) -> None:
    """The feed trimmed down to its newest change and the file reopened, the next write still
    gets a revision above every earlier one; two openers of one file never share one."""
    path = tmp_path / "s.db"
    feed = FeedRetention(max_changes=1)
    async with SQLiteBackend(path, feed=feed) as first, SQLiteBackend(path, feed=feed) as second:
        made = await _history_of_writes(first)
        made += [(await second.set(f"k{n}", b"x")).revision for n in range(20)]
        made += await _history_of_writes(second, "j")
        assert made == sorted(set(made))
        entry = await first.get("k")
    conn = sqlite3.connect(path)
    try:
        (rows,) = conn.execute("SELECT count(*) FROM changes").fetchone()
    finally:
        conn.close()
    assert rows < 10  # trimmed
    async with SQLiteBackend(path) as backend:
        assert await backend.get("k") == entry
        after = await backend.set("k", b"again")
        assert after.revision > max(made)


SCHEMA_2_HISTORY = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS history (
    key TEXT NOT NULL, version INTEGER NOT NULL, value BLOB NOT NULL,
    updated_at INTEGER NOT NULL, expires_at INTEGER, PRIMARY KEY (key, version)
) WITHOUT ROWID;
"""


async def test_sqlite_schema_2_file_is_migrated_to_revisions(tmp_path: Path) -> None:
    """A schema 2 file (no revision columns) opens with a distinct revision per row, above the
    newest change, and its history rows (revision 0: written before) still read back."""
    from tests.backends.test_sqlite_feed import SCHEMA_1  # the tables schema 1 and 2 share

    path = tmp_path / "s.db"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA_1 + SCHEMA_2_HISTORY)
    conn.execute("INSERT INTO kv VALUES ('h', x'02', 2, 1000, 2000, NULL)")
    conn.execute("INSERT INTO kv VALUES ('z', x'01', 1, 1000, 1000, NULL)")
    conn.execute("INSERT INTO history VALUES ('h', 1, x'01', 1000, NULL)")
    conn.execute("INSERT INTO history VALUES ('h', 2, x'02', 2000, NULL)")
    conn.execute("INSERT INTO changes VALUES (7, 'h', 0, x'01', x'02', 2, 2000)")
    conn.execute("INSERT INTO meta VALUES ('db_id', 'abcdef0123456789')")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    async with SQLiteBackend(path, history={"h": 5}) as backend:
        h, z = await backend.get_many(["h", "z"])
        assert h is not None
        assert z is not None
        assert (h.revision, z.revision) == (8, 9)  # in key order, after change 7
        assert (h.create_revision, z.create_revision) == (8, 9)
        history = await backend.history("h")
        assert [(e.version, e.revision) for e in history] == [(2, 8), (1, 0)]
        written = await backend.set("h", b"\x03")
        assert written.revision == 10
        await backend.delete("z")
    async with SQLiteBackend(path) as backend:
        assert (await backend.set("z", b"new")).revision == 12


# ---------------------------------------------------------------- Redis


@pytest.mark.redis
@pytest.mark.parametrize("persistence", [True, False], ids=["aof", "none"])
async def test_redis_revisions_increase_across_a_server_restart(
    tmp_path: Path, persistence: bool
) -> None:
    """After a restart, with the counter kept (AOF) or lost with everything (no persistence),
    a write gets a revision above every one before: the counter, or the server's clock."""
    extra = ("--appendonly", "yes", "--appendfsync", "always") if persistence else ()
    server = RedisServer(tmp_path / "redis", extra_args=extra)
    server.start()
    try:
        async with RedisBackend(url=server.unix_url, key_prefix="app:") as backend:
            made = await _history_of_writes(backend)
            entry = await backend.get("k")
        server.restart()
        async with RedisBackend(url=server.unix_url, key_prefix="app:") as backend:
            assert (await backend.get("k")) == (entry if persistence else None)
            after = await backend.set("k", b"again")
            assert after.revision > max(made)
            if persistence:
                assert after.version == 3
                with pytest.raises(ConflictError):
                    await backend.set("k", b"stale", expected_revision=made[1])
    finally:
        server.stop()


@pytest.mark.redis
async def test_redis_nested_prefixes_never_repeat_a_revision(redis_url: str) -> None:
    """A key written through `P` and through `P + "prod:"` (two counters) gets, in each new
    life, a revision above its earlier lives': a stale token of either store is refused."""
    outer = unique_prefix()
    async with (
        RedisBackend(url=redis_url, key_prefix=outer) as wide,
        RedisBackend(url=redis_url, key_prefix=outer + "prod:") as narrow,
    ):
        seen = [(await wide.set("prod:x", b"1")).revision]
        for n in range(20):
            through, other = (narrow, wide) if n % 2 else (wide, narrow)
            name = "x" if through is narrow else "prod:x"
            deleted = await through.delete(name)
            assert deleted is not None
            seen.append(deleted.revision)
            seen.append((await other.set("x" if other is narrow else "prod:x", b"%d" % n)).revision)
        assert seen == sorted(set(seen))
        with pytest.raises(ConflictError):
            await wide.set("prod:x", b"stale", expected_revision=seen[0])
        entry = await narrow.get("x")
        assert entry is not None
        assert entry.revision == seen[-1]


@pytest.mark.redis
async def test_redis_record_written_before_revisions(redis_url: str) -> None:
    """A record with the old 65-byte header reads as revision `updated ms * 1000`, is compared
    as such (get, expected_revision, a Revision compare, STRLEN sizes), and its next write
    gives it the new header and a larger revision."""
    prefix = unique_prefix()
    async with RedisBackend(url=redis_url, key_prefix=prefix) as backend:
        await backend.set("probe", b"")  # a connection, and the server's clock
        header = b"%020d%015d%015d%015d" % (3, 1_700_000_000_000, 1_700_000_000_500, 0)
        await backend._execute("SET", prefix + "{o}old", header + b"value")
        entry = await backend.get("{o}old")
        assert entry is not None
        assert (entry.value, entry.version) == (b"value", 3)
        assert (entry.revision, entry.create_revision) == (
            1_700_000_000_500_000,
            1_700_000_000_000_000,
        )
        assert await backend.value_sizes(["{o}old", "probe", "missing"]) == [5, 0, None]
        stale = await backend.transact([txn.Revision("{o}old", entry.revision - 1)], [])
        assert not stale.succeeded
        held = await backend.transact([txn.Revision("{o}old", entry.revision)], [])
        assert held.succeeded
        written = await backend.set("{o}old", b"new", expected_revision=entry.revision)
        assert written.version == 4
        assert written.revision > entry.revision
        raw = await backend._execute("GET", prefix + "{o}old")
        assert raw.startswith(b"+")
        again = await backend.get("{o}old")
        assert again is not None
        assert again.create_revision == entry.create_revision


@pytest.mark.redis
async def test_redis_revision_counter_names(redis_url: str) -> None:
    """The counter is `__agenticstate_rev__:<prefix>` on one server, never listed as a key."""
    prefix = unique_prefix()
    async with RedisBackend(url=redis_url, key_prefix=prefix) as backend:
        change = await backend.set("k", b"1")
        assert int(await backend._execute("GET", REVISION_NAMESPACE + prefix)) == change.revision
        assert [key async for key in backend.scan("*")] == ["k"]
    async with RedisBackend(url=redis_url) as root:  # the empty prefix: SCAN sees everything
        await root.set(prefix + "k", b"2")
        assert not [key async for key in root.scan("__agenticstate*")]


def test_cluster_revision_counters_sit_in_the_written_slot() -> None:
    """On a cluster each slot has its counter, named after the prefix and a tag of that slot."""
    names = RevisionNames("app:", cluster=True)
    for key in ("app:a", "app:{t}b", "app:zz"):
        slot = key_slot(key)
        name = names.for_slot(slot)
        assert key_slot(name) == slot
        assert name == f"{REVISION_NAMESPACE}app:{{{slot_tag(slot)}}}"
    braced = RevisionNames("a{b:", cluster=True).for_slot(5)
    assert braced.startswith(REVISION_NAMESPACE + "{")
    assert key_slot(braced) == 5
    assert RevisionNames("app:", cluster=False).for_slot(5) == REVISION_NAMESPACE + "app:"


# ---------------------------------------------------------------- a backend without revisions


async def test_a_backend_without_revisions_refuses_revision_conditions() -> None:
    """A backend written before revisions (the docs' DictBackend) reports revision 0, and
    expected_revision and Revision compares raise UnsupportedOperationError, writing nothing."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        dict_backend = importlib.import_module("dict_backend")
    finally:
        sys.path.remove(str(EXAMPLES))
    DictBackend = dict_backend.DictBackend  # noqa: N806  # a class

    async with StateManager(StateConfig(), backend=DictBackend()) as state:
        await state.save("k", 1)
        entry = await state.get_entry("k")
        assert entry is not None
        assert (entry.revision, entry.create_revision) == (0, 0)
        with pytest.raises(UnsupportedOperationError, match="keeps no revisions"):
            await state.save("k", 2, expected_revision=0)
        with pytest.raises(UnsupportedOperationError, match="keeps no revisions"):
            await state.delete("k", expected_revision=0)
        with pytest.raises(UnsupportedOperationError, match="keeps no revisions"):
            await state.transact([txn.Revision("k", 0)], [txn.Put("k", 3)])
        assert await state.get("k") == 1
        done = await state.transact([txn.Version("k", 1)], [txn.Put("k", 4)])
        assert done.revisions == [0]


@pytest.mark.parametrize("attempt", [0, 1, 10, 1023, 1024, 10_000])
def test_backoff_stays_bounded_however_many_attempts(attempt: int) -> None:
    """A retry loop that runs long (SQLite's wait for the write lock counts its tries for up to
    `lock_timeout`) gets a delay within the cap, never an OverflowError from 2 ** attempt."""
    delay = backoff(attempt, base=0.0002, cap=0.004)
    assert 0 <= delay <= 0.004
