"""`agenticstate history`, `changes`, `log` and `diff`, as real processes on SQLite and Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import (
    ChangeOp,
    FeedRetention,
    FileBackend,
    RedisBackend,
    SQLiteBackend,
    StateChange,
    StateManager,
)
from agenticstate._cli_history import _after, _empty
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from agenticstate.backends import Backend


class Store:
    """One store the tests write to (in this process) and the command reads (in its own)."""

    def __init__(self, kind: str, url: str, options: tuple[str, ...], make: Any) -> None:
        self.kind = kind
        self.url = url
        self.options = options  # --url, and --prefix on Redis
        self._make: Callable[..., Backend] = make

    def backend(self, **options: Any) -> Backend:
        return self._make(**options)

    def run(self, body: Callable[[StateManager], Awaitable[Any]], **options: Any) -> Any:
        """Run `body(state)` on a StateManager over this store, in this process."""

        async def main() -> Any:
            async with StateManager(backend=self.backend(**options)) as state:
                return await body(state)

        return anyio.run(main)

    def cli(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return cli(*self.options, *args, cwd=cwd)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m agenticstate ARGS...`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """An empty SQLite database or Redis namespace."""
    if request.param == "sqlite":
        path = tmp_path / "state.db"
        return Store(
            "sqlite",
            f"sqlite://{path}",
            ("--url", f"sqlite://{path}"),
            lambda **options: SQLiteBackend(path, **options),
        )
    url: str = request.getfixturevalue("redis_url")
    prefix = unique_prefix()
    return Store(
        "redis",
        url,
        ("--url", url, "--prefix", prefix),
        lambda **options: RedisBackend(url=url, key_prefix=prefix, **options),
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def resume_cursor(stderr: str) -> str:
    """The cursor `changes` says to go on from (its last line on stderr)."""
    return stderr.strip().splitlines()[-1].rsplit("--since ", 1)[1]


# ---------------------------------------------------------------- history


def test_history_lists_the_retained_versions_newest_first(store: Store, tmp_path: Path) -> None:
    """history shows the versions a history rule kept, newest first, as a table or JSON."""

    async def write(state: StateManager) -> None:
        for n in range(1, 8):
            await state.save("agent:1", {"n": n})

    store.run(write, history={"agent:*": 5})
    shown = store.cli("history", "agent:1", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["version", "updated", "value"]
    assert [line.split()[0] for line in lines[2:]] == ["7", "6", "5", "4", "3"]
    assert lines[2].endswith('{"n": 7}')
    entries = json.loads(
        store.cli("--json", "history", "agent:1", "--limit", "2", cwd=tmp_path).stdout
    )
    assert [(entry["version"], entry["value"]) for entry in entries] == [
        (7, {"n": 7}),
        (6, {"n": 6}),
    ]


def test_history_of_a_key_without_a_rule_or_missing(store: Store, tmp_path: Path) -> None:
    """A key no rule names shows its current version and says why; a missing key exits 1."""

    async def write(state: StateManager) -> None:
        await state.save("plain", 1)
        await state.save("plain", 2)

    store.run(write)
    shown = store.cli("history", "plain", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[0] for line in shown.stdout.splitlines()[2:]] == ["2"]
    assert "history" in shown.stderr
    missing = store.cli("history", "missing", cwd=tmp_path)
    assert missing.returncode == 1
    assert "no state at key 'missing'" in missing.stderr
    assert missing.stdout == ""


# ---------------------------------------------------------------- changes


def test_changes_replays_to_the_head_and_resumes(store: Store, tmp_path: Path) -> None:
    """changes prints the retained changes matching the pattern as JSON lines, stops at the head,
    and names the cursor to go on from; from it, only the later changes come."""

    async def first(state: StateManager) -> None:
        await state.save("agent:1", {"status": "idle"})
        await state.save("other", 1)
        await state.save("agent:2", {"status": "busy"})
        await state.save("agent:1", {"status": "busy"})
        await state.delete("agent:2")
        await state.save("other", 2)  # the head: not one of the pattern's

    store.run(first)
    replay = store.cli("changes", "agent:*", cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
    changes = json_lines(replay.stdout)
    assert [(c["key"], c["op"], c["version"]) for c in changes] == [
        ("agent:1", "set", 1),
        ("agent:2", "set", 1),
        ("agent:1", "set", 2),
        ("agent:2", "delete", 1),
    ]
    assert changes[2]["old_value"] == {"status": "idle"}
    assert changes[2]["new_value"] == {"status": "busy"}
    assert all(isinstance(c["cursor"], str) and c["timestamp"] for c in changes)
    assert "4 changes" in replay.stderr
    cursor = resume_cursor(replay.stderr)

    async def more(state: StateManager) -> None:
        await state.save("agent:3", {"status": "idle"})
        await state.save("agent:1", {"status": "done"})

    store.run(more)
    later = store.cli("changes", "agent:*", "--since", cursor, cwd=tmp_path)
    assert later.returncode == 0, later.stderr
    assert [(c["key"], c["version"]) for c in json_lines(later.stdout)] == [
        ("agent:3", 1),
        ("agent:1", 3),
    ]
    limited = store.cli("changes", "agent:*", "--since", cursor, "--limit", "1", cwd=tmp_path)
    assert [c["key"] for c in json_lines(limited.stdout)] == ["agent:3"]
    # Resuming from a printed change's own cursor yields exactly the changes after it.
    after = store.cli(
        "changes", "agent:*", "--since", json_lines(limited.stdout)[0]["cursor"], cwd=tmp_path
    )
    assert [(c["key"], c["version"]) for c in json_lines(after.stdout)] == [("agent:1", 3)]
    at_head = store.cli("changes", "*", "--since", resume_cursor(later.stderr), cwd=tmp_path)
    assert at_head.returncode == 0, at_head.stderr
    assert at_head.stdout == ""


def test_changes_follow_goes_on_with_live_changes(store: Store, tmp_path: Path) -> None:
    """--follow replays after the cursor, then follows live changes, here until --limit."""
    head: str = store.run(lambda state: state.feed_cursor())
    follow = ("changes", "agent:*", "--since", head, "--follow", "--limit", "3")
    follower = subprocess.Popen(
        [sys.executable, "-m", "agenticstate", *store.options, *follow],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        async def write(state: StateManager) -> None:
            # Written while the command starts, or after: the cursor covers both.
            for n in range(1, 4):
                await state.save("agent:1", {"n": n})
                await state.save("skip", n)

        store.run(write)
        out, err = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    assert [c["new_value"] for c in json_lines(out)] == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_changes_from_a_trimmed_cursor_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    """A cursor whose changes were trimmed exits 2 with what to do; a malformed one exits 2."""
    retention = FeedRetention(max_changes=10)

    async def write(state: StateManager) -> str:
        await state.save("k", 0)
        cursor = await state.feed_cursor()
        assert cursor is not None
        for n in range(600):
            await state.save(f"k{n % 7}", n)
        return cursor

    old = store.run(write, feed=retention)
    expired = store.cli("changes", "*", "--since", old, cwd=tmp_path)
    assert expired.returncode == 2, expired.stderr
    assert "no longer retained" in expired.stderr
    assert "--since earliest" in expired.stderr
    assert expired.stdout == ""
    bogus = store.cli("changes", "*", "--since", "not-a-cursor", cwd=tmp_path)
    assert bogus.returncode == 2, bogus.stderr
    assert bogus.stdout == ""


def test_changes_on_a_file_store_after_an_index_update(tmp_path: Path) -> None:
    """A head no change carries (a file store's last log record updated an index) still ends
    the replay, which names the last change read as the cursor to go on from."""
    store = tmp_path / "store"

    async def write() -> None:
        async with StateManager(backend=FileBackend(base_path=store)) as state:
            await state.save("agent:1", 1)
            await state.save("agent:1", 2)
            await state.backend.index_add("queue", {"task": 1.0})

    anyio.run(write)
    replay = cli("--url", f"file://{store}", "changes", "*", cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
    changes = json_lines(replay.stdout)
    assert [c["new_value"] for c in changes] == [1, 2]
    assert resume_cursor(replay.stderr) == changes[-1]["cursor"]


def test_changes_on_a_missing_sqlite_store_exits_1(tmp_path: Path) -> None:
    """Like the other read-only commands, the new ones never create a store."""
    url = f"sqlite://{tmp_path / 'none.db'}"
    for args in (("changes", "*"), ("history", "k"), ("log", "s:"), ("diff", "a", "b")):
        result = cli("--url", url, *args, cwd=tmp_path)
        assert result.returncode == 1, (args, result.stderr)
        assert "no store at" in result.stderr
    assert not (tmp_path / "none.db").exists()


# ---------------------------------------------------------------- log, diff


def test_log_and_diff_of_commits(store: Store, tmp_path: Path) -> None:
    """log lists a scope's commits newest first; diff names the keys added, removed, changed."""

    async def commits(state: StateManager) -> tuple[str, str]:
        await state.save("doc:a", 1)
        await state.save("doc:b", 1)
        first = await state.commit("doc:", message="first draft")
        await state.save("doc:a", 2)
        await state.delete("doc:b")
        await state.save("doc:c", 1)
        second = await state.commit("doc:", message="second draft")
        return first.id, second.id

    first, second = store.run(commits)
    log = store.cli("log", "doc:", cwd=tmp_path)
    assert log.returncode == 0, log.stderr
    lines = log.stdout.splitlines()
    assert lines[0].split() == ["commit", "time", "keys", "+", "~", "-", "message"]
    assert lines[2].startswith(second[:12])
    assert lines[2].endswith("second draft")
    assert lines[2].split()[2:6] == ["2", "1", "1", "1"]  # keys, added, changed, removed
    assert lines[3].startswith(first[:12])
    records = json.loads(store.cli("--json", "log", "doc:", "--limit", "1", cwd=tmp_path).stdout)
    assert [record["id"] for record in records] == [second]
    diff = store.cli("diff", first[:12], second, cwd=tmp_path)  # a unique prefix will do
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.splitlines() == ["+ doc:c", "- doc:b", "~ doc:a"]
    assert "1 added, 1 removed, 1 changed" in diff.stderr
    difference = json.loads(store.cli("--json", "diff", first, second, cwd=tmp_path).stdout)
    assert sorted(difference["added"]) == ["doc:c"]
    unknown = store.cli("diff", first, "no-such-commit", cwd=tmp_path)
    assert unknown.returncode in (1, 2)
    assert unknown.stdout == ""
    empty = store.cli("log", "nothing:", cwd=tmp_path)
    assert empty.returncode == 0, empty.stderr
    assert "no commits" in empty.stdout


def test_help_names_the_commands(tmp_path: Path) -> None:
    """The new commands are listed in --help, each with its options."""
    shown = cli("--help", cwd=tmp_path)
    for name in ("history", "changes", "log", "diff"):
        assert f"    {name} " in shown.stdout
    changes = " ".join(cli("changes", "--help", cwd=tmp_path).stdout.split())
    for option in ("--since CURSOR", "--follow", "--limit LIMIT"):
        assert option in changes


@pytest.mark.parametrize(
    ("cursor", "head", "after"),
    [
        ("s1:ab:5", "s1:ab:4", True),
        ("s1:ab:4", "s1:ab:4", False),
        ("s1:ab:3", "s1:ab:4", False),
        ("m1:ab:10", "m1:ab:9", True),  # numbers, not text
        ("r1:17-3", "r1:17-2", True),
        ("r1:18-1", "r1:17-2", True),
        ("r1:16-9", "r1:17-2", False),
        ("c1:10:5=190.3,7=90.1", "c1:200:", True),  # its own slot's id, against the floor
        ("c1:10:5=189.3", "c1:200:", False),
        ("c1:300:5=-20.3", "c1:200:", True),
        ("m1:ab:5", "s1:ab:4", False),  # of another feed: unknown
        ("x", "s1:ab:4", False),
    ],
)
def test_changes_orders_a_change_against_the_head(cursor: str, head: str, after: bool) -> None:
    """Without --follow, a change after the head taken at the start ends the replay."""
    change = StateChange(
        key="k",
        old_value=None,
        new_value=1,
        version=1,
        op=ChangeOp.SET,
        timestamp=datetime.now(UTC),
        cursor=cursor,
    )
    assert _after(change, head) is after
    assert _empty("r1:0-0")
    assert _empty("s1:ab:0")
    assert not _empty("s1:ab:1")
    assert not _empty("c1:5:")
