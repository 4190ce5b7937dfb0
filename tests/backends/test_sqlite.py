"""Behaviour only the SQLite backend has: its file, URL, registry entry, group commit, feed."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agenticstate import (
    ConfigurationError,
    CursorExpiredError,
    InvalidArgumentError,
    SQLiteBackend,
    StateConfig,
    StateManager,
    WorkflowState,
    WorkflowStateManager,
    open_backend,
)
from agenticstate._glob import glob_match
from agenticstate._registry import remove_backend
from agenticstate.backends import open_config_backend, register_backend
from agenticstate.backends.memory import MemoryBackend
from agenticstate.backends.sqlite import SCHEMA_VERSION
from agenticstate.exceptions import BackendError
from tests.helpers import LineProcess
from tests.test_cli import cli

if TYPE_CHECKING:
    from agenticstate.backends import Backend


async def test_url_config_and_persistence_all_build_it(tmp_path: Path) -> None:
    """sqlite:// URLs, StateConfig(backend="sqlite") and persistence="sqlite" reach one file."""
    by_url = open_backend(f"sqlite://{tmp_path}/a.db?synchronous=normal", key_prefix="p:")
    assert isinstance(by_url, SQLiteBackend)
    assert (by_url.path, by_url.synchronous, by_url.key_prefix) == (
        tmp_path / "a.db",
        "normal",
        "p:",
    )
    by_config = open_config_backend(StateConfig(backend="sqlite", sqlite_path=tmp_path / "a.db"))
    assert isinstance(by_config, SQLiteBackend)
    assert by_config.path == tmp_path / "a.db"
    async with WorkflowStateManager(persistence="sqlite", base_path=tmp_path) as workflows:
        await workflows.create(WorkflowState(workflow_id="wf", total_steps=3))
    assert (tmp_path / "state.db").exists()
    async with WorkflowStateManager(persistence="sqlite", base_path=tmp_path) as workflows:
        found = await workflows.get("wf")
    assert found is not None
    assert found.total_steps == 3


def test_unknown_names_list_every_registered_backend() -> None:
    """An unknown backend name or scheme names every known one, sqlite among them."""
    with pytest.raises(ConfigurationError, match=r"unknown backend 'mongodb'.*'sqlite'"):
        StateConfig(backend="mongodb")
    with pytest.raises(ConfigurationError, match=r"unknown backend scheme 'pg'.*sqlite://"):
        open_backend("pg://x")
    with pytest.raises(ConfigurationError, match="unknown sqlite URL parameter"):
        open_backend("sqlite:///tmp/x.db?journal=off")
    with pytest.raises(ConfigurationError, match="names no database"):
        open_backend("sqlite://")


async def test_a_registered_backend_is_known_everywhere(request: pytest.FixtureRequest) -> None:
    """One register_backend call reaches open_backend, StateConfig and persistence=."""
    made: list[str] = []

    def factory(url: str, **options: object) -> Backend:
        made.append(url)
        return MemoryBackend(key_prefix=str(options.get("key_prefix", "")))

    register_backend("h20test", factory)
    request.addfinalizer(lambda: remove_backend("h20test"))
    assert isinstance(open_backend("h20test://somewhere"), MemoryBackend)
    async with StateManager(StateConfig(backend="h20test", key_prefix="x:")) as state:
        await state.save("k", 1)
    async with WorkflowStateManager(persistence="h20test") as workflows:
        await workflows.create(WorkflowState(workflow_id="wf", total_steps=1))
    assert made == ["h20test://somewhere", "h20test://", "h20test://"]


async def test_key_prefixes_share_one_file_without_seeing_each_other(tmp_path: Path) -> None:
    """Two prefixes in one file: each lists, reads and hears only its own keys."""
    db = tmp_path / "s.db"
    async with SQLiteBackend(db, key_prefix="a:") as a, SQLiteBackend(db, key_prefix="b:") as b:
        async with b.changes("*") as b_changes:
            await a.set("k", b"from a")
            await b.set("k", b"from b")
            with anyio.fail_after(5):
                change = await b_changes.__anext__()
        assert (change.key, change.new) == ("k", b"from b")
        assert [key async for key in a.scan("*")] == ["k"]
        entry = await a.get("k")
        assert entry is not None
        assert entry.value == b"from a"


async def test_two_instances_in_one_process_hear_each_other(tmp_path: Path) -> None:
    """A change written through one instance reaches a subscriber on another (the feed)."""
    db = tmp_path / "s.db"
    async with (
        SQLiteBackend(db) as writer,
        SQLiteBackend(db) as reader,
        reader.changes("agent:*") as changes,
    ):
        await writer.set("other", b"x")
        await writer.set("agent:1", b"y")
        with anyio.fail_after(5):
            change = await changes.__anext__()
    assert (change.key, change.old, change.new, change.version) == ("agent:1", None, b"y", 1)


async def test_concurrent_writes_share_commits(tmp_path: Path) -> None:
    """200 concurrent saves commit in far fewer transactions (group commit)."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("warm", b"up")
        before = backend._commits  # the writer's commit count
        async with anyio.create_task_group() as tg:
            for n in range(200):
                tg.start_soon(backend.set, f"k{n}", b"v")
        commits = backend._commits - before
        assert len([key async for key in backend.scan("k*")]) == 200
    assert commits < 100


async def test_a_literal_prefix_reads_an_index_range(tmp_path: Path) -> None:
    """The scan SQL for `agent:*` searches the primary key; it never scans the table."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("agent:1", b"x")
    conn = sqlite3.connect(tmp_path / "s.db")
    try:
        plan = " ".join(
            str(row[-1])
            for row in conn.execute(
                "EXPLAIN QUERY PLAN SELECT key, expires_at FROM kv WHERE key >= ? AND key < ? "
                "ORDER BY key LIMIT 2000",
                ("agent:", "agent;"),
            )
        )
    finally:
        conn.close()
    assert "SEARCH kv USING PRIMARY KEY" in plan, plan


async def test_expired_keys_read_as_missing_and_are_swept(tmp_path: Path) -> None:
    """An expired key is missing at once and its row is deleted by a later write."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("short", b"x", ttl=timedelta(milliseconds=5))
        await anyio.sleep(0.02)  # let the TTL pass (time is what is under test)
        assert await backend.get("short") is None
        backend._swept_at = 0.0  # make the next write sweep
        await backend.set("other", b"y")
        rows = await backend._call(  # the table itself
            False, lambda conn: conn.execute("SELECT key FROM kv").fetchall()
        )
    assert rows == [("other",)]


async def test_since_is_validated_and_a_future_cursor_is_refused(tmp_path: Path) -> None:
    """A bad cursor is refused, and so is one beyond this file's head: an s1 cursor (forged)
    or a bare sequence number (another file's, say)."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        change = await backend.set("k", b"v")
        assert change.cursor is not None
        tag, db_id, seq = change.cursor.split(":")
        for bad in (-1, "m1:x:1", "s1:x", "s1::1", "s1:x:-1", "s1:x:1:2", "", True, 1.5):
            with pytest.raises(InvalidArgumentError, match="since"):
                async with backend.changes("*", since=bad):  # type: ignore[arg-type]
                    pass
        with pytest.raises(InvalidArgumentError, match="beyond"):
            async with backend.changes("*", since=10_000):
                pass
        with pytest.raises(InvalidArgumentError, match="beyond"):
            async with backend.changes("*", since=f"{tag}:{db_id}:{int(seq) + 5}"):
                pass
    assert (tag, seq) == ("s1", "1")


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file written by a newer agenticstate is refused with a clear error, not misread."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("k", b"v")
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(BackendError, match="schema version"):
        await SQLiteBackend(tmp_path / "s.db").open()


async def test_closed_backend_refuses_calls(tmp_path: Path) -> None:
    """After aclose, calls raise BackendError instead of hanging."""
    backend = SQLiteBackend(tmp_path / "s.db")
    await backend.set("k", b"v")
    await backend.aclose()
    with pytest.raises(BackendError, match="closed"):
        await backend.get("k")


def test_bad_options_are_configuration_errors(tmp_path: Path) -> None:
    """Invalid constructor options raise ConfigurationError before any file is touched."""
    with pytest.raises(ConfigurationError, match="synchronous"):
        SQLiteBackend(tmp_path / "s.db", synchronous="off")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="change_retention"):
        SQLiteBackend(tmp_path / "s.db", change_retention=0)
    with pytest.raises(ConfigurationError, match="file path"):
        SQLiteBackend(":memory:")
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("synchronous", ["full", "normal"])
async def test_durability_level_is_what_the_database_runs(tmp_path: Path, synchronous: str) -> None:
    """The documented synchronous level is the one the writer uses, in WAL mode."""
    async with SQLiteBackend(tmp_path / "s.db", synchronous=synchronous) as backend:  # type: ignore[arg-type]
        await backend.set("k", b"v")
        mode, level = await backend._call(  # reading the live connection
            True,
            lambda conn: (
                conn.execute("PRAGMA journal_mode").fetchone()[0],
                conn.execute("PRAGMA synchronous").fetchone()[0],
            ),
        )
    assert (mode, level) == ("wal", {"full": 2, "normal": 1}[synchronous])


@pytest.mark.parametrize(
    "pattern",
    ["*", "a*", "a\\*", "a\\\\*", "a\\[b\\]*", "a[b]*", "a?*", "a\\", "ab", "\\*", "é*", "a*b*"],
)
async def test_prefix_patterns_select_what_the_matcher_selects(
    tmp_path: Path, pattern: str
) -> None:
    """Patterns answered by the key range alone (and their escaped look-alikes) agree with
    the glob matcher."""
    keys = ["a", "a*", "a*x", "a\\", "a\\x", "ab", "a[b]c", "a[b]", "b", "é", "éa", "a\U0010ffff"]
    async with SQLiteBackend(tmp_path / "s.db", key_prefix="p:") as backend:
        for key in keys:
            await backend.set(key, b"1")
        found = sorted([key async for key in backend.scan(pattern)])
    assert found == sorted(key for key in keys if glob_match(pattern, key))


async def test_a_file_that_is_not_a_database_is_a_backend_error(tmp_path: Path) -> None:
    """Opening a file that is not an SQLite database raises BackendError and leaves it alone."""
    (tmp_path / "s.db").write_bytes(b"this is not a database, just text" * 100)
    with pytest.raises(BackendError, match="not an SQLite database"):
        await SQLiteBackend(tmp_path / "s.db").open()
    assert (tmp_path / "s.db").read_bytes().startswith(b"this is not a database")


async def test_a_failing_update_function_writes_nothing_and_others_commit(tmp_path: Path) -> None:
    """In one group commit, a raising update fn fails alone; the other writes commit."""

    def boom(entry: object) -> bytes:
        raise ValueError("no")

    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("k", b"before")
        results: dict[str, object] = {}

        async def attempt(name: str, call: Any) -> None:
            try:
                results[name] = await call
            except ValueError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(attempt, "bad", backend.update("k", boom))
            for n in range(20):
                tg.start_soon(attempt, f"ok{n}", backend.set(f"other{n}", b"x"))
        entry = await backend.get("k")
        others = [key async for key in backend.scan("other*")]
    assert isinstance(results["bad"], ValueError)
    assert entry is not None
    assert (entry.value, entry.version) == (b"before", 1)
    assert len(others) == 20


def test_use_from_another_event_loop_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """An instance opened under one event loop refuses calls from another instead of hanging."""
    backend = SQLiteBackend(tmp_path / "s.db")

    async def first() -> None:
        await backend.set("k", b"v")

    async def second() -> None:
        with pytest.raises(BackendError, match="another event loop"):
            await backend.get("k")
        await backend.aclose()

    anyio.run(first)
    anyio.run(second)


def test_cli_watch_on_sqlite_leaves_other_writers_free(tmp_path: Path) -> None:
    """`agenticstate watch` on an SQLite store streams what other processes write, while they
    write (a file store's watch would hold its one-owner lock)."""
    url = f"sqlite://{tmp_path / 'state.db'}"
    assert cli("--url", url, "set", "agent:0", "0", cwd=tmp_path).returncode == 0
    watcher = LineProcess(
        "agenticstate.cli", "--url", url, "--json", "watch", "agent:*", "--count", "2"
    )
    try:
        with watcher.changed:
            subscribed = watcher.changed.wait_for(
                lambda: any("watching" in line for line in watcher.errors), 30
            )
        assert subscribed, watcher.close()
        first = cli("--url", url, "set", "agent:1", '{"n": 1}', cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        second = cli("--url", url, "delete", "agent:0", cwd=tmp_path)
        assert second.returncode == 0, second.stderr
        assert watcher.wait_lines(2, timeout=30), watcher.close()
        changes = [json.loads(line) for line in watcher.lines[:2]]
        assert watcher.process.wait(timeout=30) == 0
    finally:
        watcher.close()
    assert [(c["key"], c["op"]) for c in changes] == [("agent:1", "set"), ("agent:0", "delete")]


@settings(max_examples=25, deadline=None)
@given(
    writes=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.booleans()), min_size=70, max_size=160
    ),
    away_from=st.integers(0, 100),
    retention=st.integers(1, 40),
)
def test_a_cursor_catches_up_exactly_or_has_expired(
    writes: list[tuple[str, bool]], away_from: int, retention: int
) -> None:
    """Generated: a subscriber leaves after some changes and comes back with its cursor. If
    retention kept what it missed, it receives exactly that, in order; if not, entering raises
    CursorExpiredError. Never a gap, never a duplicate. (Up to 160 writes with retention 1-40
    and a subscriber away from any of them reach both cases.)"""

    async def main(directory: Path) -> None:
        backend = SQLiteBackend(directory / "s.db", change_retention=retention)
        async with backend:
            cursor: str | None = await backend.feed_cursor()
            for n, (key, delete) in enumerate(writes[:away_from]):
                made = await (backend.delete(key) if delete else backend.set(key, b"%d" % n))
                if made is not None:
                    cursor = made.cursor  # the cursor of the last change the subscriber read
            missed = []
            for n, (key, delete) in enumerate(writes[away_from:], away_from):
                change = await (backend.delete(key) if delete else backend.set(key, b"%d" % n))
                if change is not None:
                    missed.append(change)
            oldest = await backend._call(  # what retention kept
                False, lambda conn: conn.execute("SELECT min(seq) FROM changes").fetchone()[0]
            )
            assert cursor is not None
            trimmed = bool(missed) and oldest > int(cursor.rsplit(":", 1)[1]) + 1
            got = []
            try:
                async with backend.changes("*", since=cursor) as again:
                    await backend.set("zzz-marker", b"end")  # the first live change after
                    with anyio.fail_after(5):
                        async for change in again:
                            if change.key == "zzz-marker":
                                break
                            got.append(change)
            except CursorExpiredError:
                expired = True
            else:
                expired = False
        event("trimmed" if trimmed else "caught up")
        assert expired == trimmed
        if not trimmed:
            assert got == missed

    with tempfile.TemporaryDirectory() as directory:
        anyio.run(main, Path(directory))
