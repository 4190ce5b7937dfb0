"""Opening an SQLite store: whose file it is, what may create it, and what an open error says.

- A store marks its file (`PRAGMA application_id` and a `meta` row). A file that is neither empty
  nor a store, generated in every shape (foreign tables, a foreign `kv`, other application ids,
  user versions, journal modes), is refused with `ConfigurationError` and left byte for byte as
  it was, with nothing new beside it.
- Stores of the earlier layouts (user_version 1 and 2, unmarked) open, keep their data and their
  database id, and are migrated and marked.
- `create=False` / `read_only=True` / `?mode=rw|ro` never create a file or a directory.
- Files the backend creates are 0600, with their `-wal` and `-shm`.
- An open that cannot work names its cause (a directory, permission denied, a path through a
  file) with a `ConfigurationError`, not the retryable `BackendUnavailableError`; a store it can
  only read (a read-only file, directory or mount, or `?mode=ro`) serves reads and refuses
  writes with a `BackendError` that says why. Permission tests run as `nobody` when the suite
  runs as root (root reads and writes any file).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from agenticstate import SQLiteBackend, open_backend
from agenticstate.backends._sqlite_schema import APPLICATION_ID, KV_COLUMNS, MARK, SCHEMA_VERSION
from agenticstate.exceptions import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
    NotFoundError,
)
from tests.helpers import ROOT

if TYPE_CHECKING:
    from collections.abc import Iterator

# The layouts of earlier releases, as they wrote them (application_id 0, no mark).
V1_SCHEMA = """
CREATE TABLE kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, expires_at INTEGER
) WITHOUT ROWID;
CREATE INDEX kv_expiry ON kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE changes (
    seq INTEGER PRIMARY KEY, key TEXT NOT NULL, op INTEGER NOT NULL,
    old BLOB, new BLOB, version INTEGER NOT NULL, ts INTEGER NOT NULL
);
CREATE TABLE idx (
    name TEXT NOT NULL, member TEXT NOT NULL, score REAL NOT NULL, PRIMARY KEY (name, member)
) WITHOUT ROWID;
CREATE INDEX idx_order ON idx (name, score, member);
"""
V2_EXTRA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE history (
    key TEXT NOT NULL, version INTEGER NOT NULL, value BLOB NOT NULL,
    updated_at INTEGER NOT NULL, expires_at INTEGER, PRIMARY KEY (key, version)
) WITHOUT ROWID;
"""
NOW_US = 1_700_000_000_000_000


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _header(path: Path) -> tuple[int, int, dict[str, str]]:
    conn = sqlite3.connect(path)
    try:
        (app,) = conn.execute("PRAGMA application_id").fetchone()
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    finally:
        conn.close()
    return app, version, meta


def _legacy_store(path: Path, version: int) -> None:
    """A store as release `version` of the layout left it: one key, one change, WAL mode."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(V1_SCHEMA + (V2_EXTRA if version == 2 else ""))
    conn.execute("INSERT INTO kv VALUES ('old', x'6f6c64', 3, ?, ?, NULL)", (NOW_US, NOW_US))
    conn.execute("INSERT INTO changes VALUES (7, 'old', 0, NULL, x'6f6c64', 3, ?)", (NOW_US,))
    if version == 2:
        conn.execute("INSERT INTO meta VALUES ('db_id', 'feedfacefeedface')")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()


# ---------------------------------------------------------------- whose file it is


@dataclass(frozen=True)
class Foreign:
    """An SQLite file another application made."""

    tables: tuple[tuple[str, tuple[str, ...]], ...]
    user_version: int
    application_id: int
    journal: str

    def make(self, path: Path) -> None:
        if self.journal == "wal-kept":
            self._make_with_wal(path)
            return
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute(f"PRAGMA journal_mode={self.journal}")
        for name, columns in self.tables:
            conn.execute(f"CREATE TABLE {name} ({', '.join(columns)})")
            marks = ", ".join("?" * len(columns))
            insert = f"INSERT INTO {name} VALUES ({marks})"  # noqa: S608  # generated names
            conn.execute(insert, [f"{name}-{c}" for c in columns])
        conn.execute(f"PRAGMA user_version = {self.user_version}")
        conn.execute(f"PRAGMA application_id = {self.application_id}")
        conn.close()

    def _make_with_wal(self, path: Path) -> None:
        """The file and its `-wal` as a crash (or a copy of the files) leaves them: the commits
        in the `-wal` alone, not checkpointed, no `-shm`."""
        with tempfile.TemporaryDirectory() as elsewhere:
            source = Path(elsewhere) / "app.db"
            conn = sqlite3.connect(source, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA wal_autocheckpoint=0")
            for name, columns in self.tables:
                conn.execute(f"CREATE TABLE {name} ({', '.join(columns)})")
                marks = ", ".join("?" * len(columns))
                insert = f"INSERT INTO {name} VALUES ({marks})"  # noqa: S608  # generated names
                conn.execute(insert, [f"{name}-{c}" for c in columns])
            conn.execute(f"PRAGMA user_version = {self.user_version}")
            conn.execute(f"PRAGMA application_id = {self.application_id}")
            shutil.copyfile(source, path)
            shutil.copyfile(f"{source}-wal", f"{path}-wal")
            conn.close()


COLUMN = st.sampled_from(["key", "value", "id", "name", "data", "version", "expires_at", "x"])
foreign_files = st.builds(
    Foreign,
    tables=st.lists(
        st.tuples(
            st.sampled_from(["kv", "changes", "idx", "meta", "history", "users", "kv2", "t"]),
            st.lists(COLUMN, min_size=1, max_size=6, unique=True).map(tuple),
        ),
        max_size=4,
        unique_by=lambda table: table[0],
    ).map(tuple),
    user_version=st.sampled_from([0, 1, 2, SCHEMA_VERSION + 1, 7, 2**31 - 1]),
    application_id=st.sampled_from([0, 0, APPLICATION_ID, 0x53514C69, -1]),
    journal=st.sampled_from(["delete", "wal", "truncate", "wal-kept"]),
)
OPEN_OPTIONS: list[dict[str, Any]] = [{}, {"create": False}, {"read_only": True}]


def _open(path: Path, **options: Any) -> None:
    async def main() -> None:
        async with SQLiteBackend(path, **options) as backend:
            await backend.get("k")

    anyio.run(main)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(foreign=foreign_files, options=st.sampled_from(OPEN_OPTIONS))
def test_a_file_that_is_not_a_store_is_refused_and_left_untouched(
    foreign: Foreign, options: dict[str, Any]
) -> None:
    """Any SQLite file that is neither empty nor a store: a ConfigurationError saying so, and
    the file and its directory byte for byte as they were."""
    names = {name for name, _ in foreign.tables}
    assume(names or foreign.user_version or foreign.application_id)  # else: an empty database
    assume(dict(foreign.tables).get("kv", ())[: len(KV_COLUMNS)] != KV_COLUMNS)
    # A file marked as a store whose commits are in its -wal is read as a store is (through
    # SQLite, which may checkpoint it): only unmarked and other applications' files are copied.
    assume(foreign.journal != "wal-kept" or foreign.application_id != APPLICATION_ID)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "other.db"
        foreign.make(path)
        before = _files(Path(directory))
        newer = foreign.application_id == APPLICATION_ID and foreign.user_version > SCHEMA_VERSION
        with pytest.raises(BackendError if newer else ConfigurationError) as raised:
            _open(path, **options)
        assert _files(Path(directory)) == before
    if not newer:
        assert "not an agenticstate store" in str(raised.value)
        assert "left as it is" in str(raised.value)


@pytest.mark.parametrize(
    "content",
    [b"plain text, not a database\n" * 50, b"SQLite format 2\x00" + b"\x00" * 4000, b"\x00"],
    ids=["text", "bad-magic", "one-byte"],
)
@pytest.mark.parametrize("options", OPEN_OPTIONS, ids=["default", "create-false", "read-only"])
def test_a_file_that_is_not_sqlite_is_refused_untouched(
    tmp_path: Path, content: bytes, options: dict[str, Any]
) -> None:
    """A file that is not SQLite: a BackendError (it may be a damaged store: the CLI's 'corrupt'
    exit code), and the file is left as it was."""
    path = tmp_path / "s.db"
    path.write_bytes(content)
    with pytest.raises(BackendError, match=r"not an SQLite database.*left as it is"):
        _open(path, **options)
    assert _files(tmp_path) == {"s.db": content}


def test_a_foreign_kv_table_is_named_not_misread(tmp_path: Path) -> None:
    """A file with its own `kv` table (the old 'no such column' failure) is refused by name."""
    Foreign((("kv", ("k", "v")),), 0, 0, "delete").make(tmp_path / "s.db")
    with pytest.raises(ConfigurationError, match=r"another application.*tables kv"):
        _open(tmp_path / "s.db")


def test_the_cli_refuses_a_foreign_file_and_leaves_it(tmp_path: Path) -> None:
    """`agenticstate keys` on another application's database: an error, the file unchanged."""
    Foreign((("users", ("id", "name")),), 0, 0, "delete").make(tmp_path / "app.db")
    before = _files(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "agenticstate", "--url", "sqlite://app.db", "keys", "*"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "not an agenticstate store" in done.stderr
    assert _files(tmp_path) == before


async def test_a_new_store_is_marked_as_ours(tmp_path: Path) -> None:
    """A store's file carries agenticstate's application_id and its meta row."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("k", b"v")
    app, version, meta = _header(tmp_path / "s.db")
    assert (app, version, meta[MARK[0]]) == (APPLICATION_ID, SCHEMA_VERSION, MARK[1])


async def test_an_empty_file_becomes_a_store(tmp_path: Path) -> None:
    """A 0-byte file (made by `touch`) is a new store, as a missing one is."""
    (tmp_path / "s.db").touch()
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("k", b"v")
        assert (await backend.get("k")) is not None
    assert _header(tmp_path / "s.db")[0] == APPLICATION_ID


@pytest.mark.parametrize("version", [1, 2])
async def test_a_store_of_an_earlier_release_opens_and_is_migrated(
    tmp_path: Path, version: int
) -> None:
    """Unmarked stores of layout 1 and 2 keep their data (and 2 its database id), and are
    migrated and marked on their first writable open."""
    path = tmp_path / "s.db"
    _legacy_store(path, version)
    async with SQLiteBackend(path) as backend:
        entry = await backend.get("old")
        assert entry is not None
        assert (entry.value, entry.version) == (b"old", 3)
        change = await backend.set("old", b"new")
        assert change.version == 4
        cursor = change.cursor or ""
        if version == 2:
            assert cursor.startswith("s1:feedfacefeedface:")
        # After the feed's sequence 7 and the revisions the migration gave each row.
        assert int(cursor.rsplit(":", 1)[1]) == change.revision > 7
    app, found, meta = _header(path)
    assert (app, found, meta[MARK[0]]) == (APPLICATION_ID, SCHEMA_VERSION, MARK[1])
    async with SQLiteBackend(path) as backend:  # and again, now current
        assert (await backend.get("old")) is not None


async def test_a_read_only_open_of_an_earlier_release_reads_it_unchanged(tmp_path: Path) -> None:
    """`read_only=True` on an unmarked layout-2 store reads it and leaves it unmarked."""
    path = tmp_path / "s.db"
    _legacy_store(path, 2)
    before = path.read_bytes()
    async with SQLiteBackend(path, read_only=True) as backend:
        entry = await backend.get("old")
        assert entry is not None
        assert entry.value == b"old"
    assert path.read_bytes() == before


# ---------------------------------------------------------------- what may create a file


@pytest.mark.parametrize(
    "make",
    [
        lambda path: SQLiteBackend(path, create=False),
        lambda path: SQLiteBackend(path, read_only=True),
        lambda path: open_backend(f"sqlite:///{path}?mode=rw"),
        lambda path: open_backend(f"sqlite:///{path}?mode=ro"),
    ],
    ids=["create-false", "read-only", "url-mode-rw", "url-mode-ro"],
)
async def test_opening_without_create_makes_no_file(tmp_path: Path, make: Any) -> None:
    """Without create, a missing store is NotFoundError, and no file or directory appears;
    an empty file stays empty."""
    path = tmp_path / "sub" / "s.db"
    with pytest.raises(NotFoundError, match="does not exist"):
        async with make(path) as backend:
            await backend.get("k")
    assert [p async for p in anyio.Path(tmp_path).iterdir()] == []
    await anyio.Path(path.parent).mkdir()
    await anyio.Path(path).touch()
    with pytest.raises(NotFoundError, match="is empty"):
        async with make(path) as backend:
            await backend.get("k")
    assert _files(path.parent) == {"s.db": b""}


@pytest.mark.parametrize("name", ["a#1.db", "b?x=1.db", "c%20d.db", "e f.db", "g&mode=ro.db"])
async def test_a_file_name_with_uri_characters_opens_that_file(tmp_path: Path, name: str) -> None:
    """Connections open the file by an SQLite URI: `#`, `?`, `%`, `&` in a name stay the name."""
    async with SQLiteBackend(tmp_path / name) as backend:
        await backend.set("k", b"v")
    assert sorted([p.name async for p in anyio.Path(tmp_path).iterdir()]) == [name]


def test_a_bad_url_mode_is_a_configuration_error(tmp_path: Path) -> None:
    """`?mode=` takes rwc, rw or ro."""
    with pytest.raises(ConfigurationError, match="mode"):
        open_backend(f"sqlite:///{tmp_path}/s.db?mode=memory")


async def test_read_only_serves_reads_and_refuses_writes_untouched(tmp_path: Path) -> None:
    """`?mode=ro` reads the store, refuses writes with a BackendError naming why, and changes
    nothing in the file."""
    path = tmp_path / "s.db"
    async with SQLiteBackend(path) as backend:
        await backend.set("k", b"v")
    before = path.read_bytes()
    async with open_backend(f"sqlite:///{path}?mode=ro") as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"v"
        assert [key async for key in backend.scan("*")] == ["k"]
        with pytest.raises(BackendError, match=r"opened read-only.*serves reads only"):
            await backend.set("k", b"w")
    assert path.read_bytes() == before


# ---------------------------------------------------------------- permissions


@pytest.mark.parametrize("umask", [0o022, 0o000])
async def test_a_new_store_and_its_wal_and_shm_are_private(tmp_path: Path, umask: int) -> None:
    """The database, -wal and -shm files are created 0600, whatever the umask."""
    old = os.umask(umask)
    try:
        async with SQLiteBackend(tmp_path / "s.db") as backend:
            await backend.set("k", b"v")
            modes = {
                p.name: stat.S_IMODE((await p.stat()).st_mode)
                async for p in anyio.Path(tmp_path).iterdir()
            }
    finally:
        os.umask(old)
    assert modes == {"s.db": 0o600, "s.db-wal": 0o600, "s.db-shm": 0o600}


async def test_a_directory_path_is_a_configuration_error(tmp_path: Path) -> None:
    """A path that is a directory: ConfigurationError naming it, not 'unable to open'."""
    with pytest.raises(ConfigurationError, match="is a directory"):
        async with SQLiteBackend(tmp_path) as backend:
            await backend.get("k")


async def test_a_path_through_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    """A path whose directory is a file: ConfigurationError naming the cause."""
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ConfigurationError, match="not a directory") as raised:
        async with SQLiteBackend(tmp_path / "plain" / "s.db") as backend:
            await backend.get("k")
    assert not isinstance(raised.value, BackendUnavailableError)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory outside pytest's private tmp tree, so that `nobody` can reach it."""
    directory = Path(tempfile.mkdtemp(prefix="agenticstate-perm-"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        directory.chmod(0o700)
        shutil.rmtree(directory)


def _as_user(path: Path, **options: Any) -> dict[str, Any]:
    """What `get` and `set` do as an unprivileged user (see `_sqlite_as_user`)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.backends._sqlite_as_user", str(path), json.dumps(options)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def _make_store(path: Path) -> None:
    async with SQLiteBackend(path) as backend:
        await backend.set("k", b"hello")


async def test_permission_denied_is_named_and_not_retryable(shared_dir: Path) -> None:
    """A store this user cannot read: ConfigurationError 'permission denied', on every call."""
    path = shared_dir / "s.db"
    await _make_store(path)  # 0600, owned by the suite's user
    await anyio.Path(path).chmod(0o000 if os.geteuid() != 0 else 0o600)
    report = _as_user(path)
    for step in ("get", "set"):
        assert report[step]["error"] == "ConfigurationError", report
        assert "permission denied" in report[step]["message"]


@pytest.mark.parametrize("blocked", ["file", "directory"])
async def test_a_store_this_user_cannot_write_serves_reads(shared_dir: Path, blocked: str) -> None:
    """A read-only file, or a directory this user cannot write: reads work, and a write is a
    BackendError saying why (never 'unable to open database file')."""
    path = shared_dir / "s.db"
    await _make_store(path)
    if blocked == "file":
        await anyio.Path(path).chmod(0o444)
    else:
        await anyio.Path(path).chmod(0o666)
        await anyio.Path(shared_dir).chmod(0o555)
    report = _as_user(path)
    assert report["get"] == {"ok": "hello"}
    assert report["set"]["error"] == "BackendError", report
    reason = "read-only for this user" if blocked == "file" else "directory this user cannot write"
    assert reason in report["set"]["message"]


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """A small tmpfs (root only), and a function that remounts it read-only; unmounted after."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    tool, untool = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or tool is None or untool is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    made = subprocess.run(
        [tool, "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")

    def remount() -> None:
        subprocess.run([tool, "-o", "remount,ro", str(mount)], check=True)

    try:
        yield mount, remount
    finally:
        subprocess.run([untool, "-l", str(mount)], check=False)


async def test_a_store_on_a_read_only_mount_serves_reads(read_only_mount: tuple[Path, Any]) -> None:
    """On a read-only file system the store opens (as a snapshot) and reads; a write is a
    BackendError naming the read-only file system."""
    mount, remount = read_only_mount
    path = mount / "s.db"
    await _make_store(path)
    remount()
    async with SQLiteBackend(path) as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"hello"
        with pytest.raises(BackendError, match="read-only file system"):
            await backend.set("k", b"w")
    with pytest.raises(NotFoundError):  # nothing can be created there either
        async with SQLiteBackend(mount / "other.db", create=False) as backend:
            await backend.get("k")
    with pytest.raises(ConfigurationError, match="read-only file system"):
        async with SQLiteBackend(mount / "new.db") as backend:
            await backend.get("k")
