"""The SQLite backend's table layout, its statements, and the helpers for its rows."""

from __future__ import annotations

import secrets
import sqlite3
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from agenticstate._glob import compile_glob
from agenticstate.backends._sqlite_feed import from_us
from agenticstate.backends.base import Entry, new_entry
from agenticstate.exceptions import BackendError, ConfigurationError, InvalidArgumentError

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate._glob import GlobMatcher

__all__ = [
    "APPLICATION_ID",
    "BRACED",
    "CHANGES_KEY",
    "CHUNK",
    "DELETE",
    "FEED_BYTES",
    "GET",
    "HISTORY_PUT",
    "HISTORY_TRIM",
    "INLINE_MAX",
    "KEY_INDEXES",
    "LENGTH_LIMIT",
    "LOG",
    "MAX_VALUE_SIZE",
    "PAGE",
    "PUT",
    "REVISION",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SELECT_MANY",
    "SET",
    "WAL_SIZE_LIMIT",
    "Layout",
    "Row",
    "as_bytes",
    "check_header",
    "entry",
    "inspect_layout",
    "install_layout",
    "is_prefix_pattern",
    "live",
    "max_value_size",
    "migrate_revisions",
    "now_us",
    "revision_views",
    "ttl_us",
]

SCHEMA_VERSION = 4
"""The layout this module writes (`PRAGMA user_version`); a newer file is refused.

1: `kv`, `changes`, `idx`. 2 adds `meta` (the database's id, for feed cursors) and `history`;
a version 1 file is migrated in place (the new tables are created, nothing is rewritten).
3 adds revisions: `kv.revision` and `kv.create_revision`, `history.revision`
(`migrate_revisions` gives the rows of an older file revisions of their own).
4 adds the partial index `kv_braced` (`KEY_INDEXES`; built from the keys once, when an older
file is first opened writable).
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, expires_at INTEGER,
    revision INTEGER NOT NULL DEFAULT 0, create_revision INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_expiry ON kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY, key TEXT NOT NULL, op INTEGER NOT NULL,
    old BLOB, new BLOB, version INTEGER NOT NULL, ts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS changes_key ON changes (key, seq);
CREATE TABLE IF NOT EXISTS idx (
    name TEXT NOT NULL, member TEXT NOT NULL, score REAL NOT NULL, PRIMARY KEY (name, member)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_order ON idx (name, score, member);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS history (
    key TEXT NOT NULL, version INTEGER NOT NULL, value BLOB NOT NULL,
    updated_at INTEGER NOT NULL, expires_at INTEGER, revision INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (key, version)
) WITHOUT ROWID;
"""
BRACED = "instr(substr(key, instr(key, '}') + 1), '}') > 0"
"""The keys holding two `}` or more (the SQL of `_keyorder.is_braced`)."""
KEY_INDEXES = f"CREATE INDEX IF NOT EXISTS kv_braced ON kv (key) WHERE {BRACED}"
"""Layout 4's index of the keys with two `}` or more: a listing across entities
(`agents:{*}:recovery`) reads it over each entity's range to find the keys whose `*` crosses a
second `}` (`_keyorder.skip_scan`), instead of reading every key of the entity."""
APPLICATION_ID = 0x41675374
"""`PRAGMA application_id` of an agenticstate store ("AgSt" in the file's header).

Set with the schema, with the `meta` row `MARK`: a store is told from any other SQLite file by
its header, and a file that is neither empty nor ours is refused untouched.
"""
MARK = ("format", "agenticstate")
WAL_SIZE_LIMIT = 16 * 1024 * 1024
"""`PRAGMA journal_size_limit`: the size the `-wal` file is cut back to once a checkpoint has
copied it into the database (a long reader can make it grow past this meanwhile)."""
LEGACY_VERSIONS = (1, 2)
"""Layouts written before stores were marked (`application_id` 0): recognized by their tables
(and marked when first opened writable)."""
KV_COLUMNS = ("key", "value", "version", "created_at", "updated_at", "expires_at")
"""The first columns of `kv` in every layout (later layouts may add columns after them)."""
TABLES = frozenset({"kv", "changes", "idx", "meta", "history"})
INDEXES = frozenset({"kv_expiry", "idx_order", "kv_braced", "changes_key"})
CHANGES_KEY = "CREATE INDEX IF NOT EXISTS changes_key ON changes (key, seq)"
"""The index a change's new value is found by (the key's next change), made on open if missing."""
INLINE_MAX = 1024
"""A written value this size or larger (bytes, as stored) is held by reference in its change row
(`new` is NULL) unless the write sets a TTL: `NEW_VALUE` reads it back."""
FEED_BYTES = "length(key) + coalesce(length(old), 0) + coalesce(length(new), 0)"
"""What a change row holds, in bytes, as `FeedRetention.max_bytes` counts it."""

_ROW = "value, version, created_at, updated_at, expires_at, revision, create_revision"
GET = f"SELECT {_ROW} FROM kv WHERE key = ?"  # noqa: S608  # constants
SELECT_MANY = f"SELECT key, {_ROW} FROM kv WHERE key IN"  # noqa: S608  # constants
PUT = (
    "INSERT OR REPLACE INTO kv (key, value, version, created_at, updated_at, expires_at, "
    "revision, create_revision) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
LOG = "INSERT INTO changes (seq, key, op, old, new, version, ts) VALUES (?, ?, ?, ?, ?, ?, ?)"
HISTORY_PUT = (
    "INSERT OR REPLACE INTO history (key, version, value, updated_at, expires_at, revision) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
REVISION = (
    "SELECT max(coalesce((SELECT max(seq) FROM changes), 0), "
    "coalesce((SELECT CAST(value AS INTEGER) FROM meta WHERE name = 'revision'), 0))"
)
"""The last revision given: the newest change's sequence number (a change's sequence number is
its revision, and trimming always keeps the newest change), or the floor a migration set."""
HISTORY_TRIM = "DELETE FROM history WHERE key = ? AND version < ?"
SET, DELETE = 0, 1
CHUNK = 1000  # bound parameters per IN (...) query
PAGE = 50_000  # keys per scan page (one hop to the reader thread each)
Row = tuple[bytes, int, int, int, int | None, int, int]
"""A `kv` row: value, version, created, updated, expires, revision, create revision."""


def now_us() -> int:
    """Microseconds since the epoch, now."""
    return time.time_ns() // 1000


def live(row: Row | None, now: int) -> Row | None:
    """`row` unless it is missing or expired at `now`."""
    if row is None or (row[4] is not None and row[4] <= now):
        return None
    return row


def entry(key: str, row: Row) -> Entry:
    """The `Entry` a `kv` row holds."""
    value, version, created, updated, expires, revision, create_revision = row
    return new_entry(
        key,
        value,
        version,
        from_us(created),
        from_us(updated),
        from_us(expires) if expires is not None else None,
        revision,
        create_revision,
    )


def ttl_us(ttl: timedelta | None) -> int | None:
    """A TTL in whole microseconds (at least 1)."""
    return None if ttl is None else ttl // timedelta(microseconds=1) or 1


def is_prefix_pattern(pattern: str, matcher: GlobMatcher) -> bool:
    r"""Whether `pattern` is a literal prefix followed by one unescaped `*` (`agent:\[1\]:*`)."""
    if not pattern.endswith("*"):
        return False
    head = pattern[:-1]
    escapes = len(head) - len(head.rstrip("\\"))
    if escapes % 2:
        return False  # the star is escaped: a literal `*`
    literal = compile_glob(head) if head else None
    return literal is None or (
        literal.is_literal and literal.literal_prefix == matcher.literal_prefix
    )


def as_bytes(value: object) -> bytes:
    """`value` as `bytes`; anything but bytes-like raises `InvalidArgumentError`."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgumentError(f"a backend stores bytes, not {type(value).__name__}")


def revision_views(conn: sqlite3.Connection) -> None:
    """Read a layout-2 store without migrating it (it is read-only): revisions read as 0.

    Temporary views named `kv` and `history` add the revision columns; SQLite looks names up in
    the connection's `temp` schema first, so every statement reads them in place of the tables.
    """
    conn.execute(
        "CREATE TEMP VIEW IF NOT EXISTS kv AS SELECT key, value, version, created_at, "
        "updated_at, expires_at, 0 AS revision, 0 AS create_revision FROM main.kv"
    )
    conn.execute(
        "CREATE TEMP VIEW IF NOT EXISTS history AS SELECT key, version, value, updated_at, "
        "expires_at, 0 AS revision FROM main.history"
    )


def migrate_revisions(conn: sqlite3.Connection, found: int) -> None:
    """Bring a file of schema `found` (0: new) to revisions, after `SCHEMA`, in one transaction.

    Adds the columns, then gives every row a revision of its own: the next numbers after the
    newest change, in key order (its `create_revision` too: its life began before revisions).
    The `revision` row of `meta` records the last of them, so no write gets one again (`REVISION`).
    """
    if found < 1:
        return  # a new file: the tables were just made, with the columns
    conn.execute("ALTER TABLE kv ADD COLUMN revision INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE kv ADD COLUMN create_revision INTEGER NOT NULL DEFAULT 0")
    if found >= 2:  # schema 1 had no history table: `SCHEMA` just made it, with the column
        conn.execute("ALTER TABLE history ADD COLUMN revision INTEGER NOT NULL DEFAULT 0")
    (last,) = conn.execute(REVISION).fetchone()
    keys = [key for (key,) in conn.execute("SELECT key FROM kv ORDER BY key")]
    conn.executemany(
        "UPDATE kv SET revision = ?, create_revision = ? WHERE key = ?",
        ((last + n, last + n, key) for n, key in enumerate(keys, 1)),
    )
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('revision', ?)", (str(last + len(keys)),))


# ---------------------------------------------------------------- the layout of a file


@dataclass(frozen=True)
class Layout:
    """What an SQLite file holds, as far as opening it as a store is concerned.

    Attributes:
        kind: `"empty"` (no tables and no marks: a new file), `"current"` (a marked store of
            this layout) or `"older"` (a store to migrate or mark: an earlier layout, or one
            written before stores were marked).
        version: Its `PRAGMA user_version`.
        db_id: The database's id (`meta`), or `""` if it has none yet.
    """

    kind: Literal["empty", "current", "older"]
    version: int
    db_id: str

    @property
    def is_readable(self) -> bool:
        """Whether reads work before any migration (a read-only store cannot be migrated).

        Layout 2 reads through `revision_views` (it has no revision columns).
        """
        return self.kind == "current" or (self.kind == "older" and self.version >= 2)

    @property
    def needs_views(self) -> bool:
        """Whether a read-only connection reads it through `revision_views` (layout 2)."""
        return self.kind == "older" and self.version < 3


ROW_MARGIN = 65_536
"""Bytes of a change row that are not its two values: the key (at most 1 KiB), the other
columns, the record's header, with room to spare."""


def _length_limit() -> int:
    """SQLite's largest string, BLOB or row, in bytes (`SQLITE_MAX_LENGTH`: 10**9 by default)."""
    conn = sqlite3.connect(":memory:")
    try:
        return int(conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH))
    finally:
        conn.close()


LENGTH_LIMIT = _length_limit()
MAX_VALUE_SIZE = (LENGTH_LIMIT - ROW_MARGIN) // 2
"""The largest value every write can store and overwrite: an overwrite's change row holds the
old and the new value, and a row is at most `LENGTH_LIMIT` (499,967,232 bytes with SQLite's
default build)."""


def max_value_size(key_prefix: str) -> int:
    """`MAX_VALUE_SIZE` for keys under `key_prefix` (it is in each change row too)."""
    return MAX_VALUE_SIZE - (len(key_prefix.encode()) + 1) // 2


SQLITE_MAGIC = b"SQLite format 3\x00"


def check_header(path: Path) -> None:
    """Refuse, before SQLite opens it, a file whose header says it is not a store.

    Reads the first 100 bytes: a file that is not SQLite, or an SQLite database with another
    application's id, is refused without a connection ever touching it. (A store's own header
    may still show id 0 while its first commits are in the `-wal` alone: `inspect_layout`
    decides those.)

    Raises:
        BackendError: Not SQLite (a damaged store, or no store at all).
        ConfigurationError: Another application's database.
    """
    with path.open("rb") as file:
        head = file.read(100)
    if not head:
        return  # empty, or its content is in the -wal so far
    if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
        raise BackendError(
            f"{path} is not an SQLite database (its first bytes are not SQLite's header): a "
            "damaged store, or not a store at all; it was left as it is"
        )
    app = int.from_bytes(head[68:72], "big", signed=True)
    newer = wal_page_one(path)  # a commit not yet copied into the file: what SQLite reads
    if newer is not None and len(newer) == 100 and newer.startswith(SQLITE_MAGIC):
        app = int.from_bytes(newer[68:72], "big", signed=True)
    if app not in (0, APPLICATION_ID):
        raise _foreign(path, f"its application_id is {app:#x}")


def wal_page_one(path: Path) -> bytes | None:
    """The first 100 bytes of page 1 as the last commit in `path`'s `-wal` left it, if there.

    Read from the file, without SQLite (which would rewrite the `-shm`, or checkpoint the
    `-wal` into the database when its connection closes). Frames count only up to the last
    commit frame whose salts are the header's (earlier frames of an older generation of the
    log have other salts). `None`: no `-wal`, or page 1 is not in it.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        with wal.open("rb") as file:
            header = file.read(32)
            if len(header) < 32 or header[:4] not in (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83"):
                return None
            page_size = int.from_bytes(header[8:12], "big") or 65536
            salts = header[16:24]
            found = committed = None
            while len(frame := file.read(24)) == 24:
                page = file.read(page_size)
                if len(page) < page_size or frame[8:16] != salts:
                    break
                if int.from_bytes(frame[0:4], "big") == 1:
                    found = page[:100]
                if int.from_bytes(frame[4:8], "big"):  # a commit frame
                    committed = found
            return committed
    except FileNotFoundError:
        return None


def wal_hides_header(path: Path) -> bool:
    """Whether `path` is unmarked as far as SQLite would read it, and has a `-wal`.

    Such a file is another application's or a store of an earlier layout; only its tables
    tell, and reading them through SQLite would change the `-wal` and `-shm` (see
    `wal_page_one`). The caller reads a private copy instead.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        if wal.stat().st_size == 0:
            return False
    except FileNotFoundError:
        return False
    head = wal_page_one(path)
    if head is None:
        with path.open("rb") as file:
            head = file.read(100)
    if len(head) < 100:
        return True
    return int.from_bytes(head[68:72], "big", signed=True) != APPLICATION_ID


def inspect_layout(conn: sqlite3.Connection, path: Path) -> Layout:
    """Read what the file at `path` holds, without writing or waiting for a writer.

    Reads only, in one snapshot (inside the caller's transaction if it has one), so another
    process's write transaction never delays it.

    Raises:
        ConfigurationError: The file is an SQLite database of another application (its
            application id, or tables that are not a store's); it is left as it is.
        sqlite3.DatabaseError: The file is not an SQLite database (`open_errors` says so).
        BackendError: The file is a store of a newer layout than this agenticstate reads.
    """
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")
    try:
        return _classify(conn, path)
    finally:
        if own and conn.in_transaction:
            conn.execute("ROLLBACK")  # a read: nothing to keep


def _classify(conn: sqlite3.Connection, path: Path) -> Layout:
    (app,) = conn.execute("PRAGMA application_id").fetchone()
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    names = {
        name
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
    }
    if app not in (0, APPLICATION_ID):
        raise _foreign(path, f"its application_id is {app:#x}")
    if app == 0 and version == 0 and not names:
        return Layout("empty", 0, "")
    if app == APPLICATION_ID and version > SCHEMA_VERSION:
        raise BackendError(
            f"{path} has schema version {version}; this agenticstate reads up to "
            f"{SCHEMA_VERSION}: upgrade agenticstate"
        )
    if not _has_store_tables(conn, names):
        found = ", ".join(sorted(names)[:6]) or "none"
        raise _foreign(path, f"user_version {version}, tables {found}")
    meta = _meta(conn) if "meta" in names else {}
    if app == APPLICATION_ID:
        if meta.get(MARK[0]) != MARK[1] or version < 1:
            raise _foreign(path, "agenticstate's application_id but not its meta row")
        kind: Literal["current", "older"] = "current" if version == SCHEMA_VERSION else "older"
        return Layout(kind, version, meta.get("db_id", ""))
    if version not in LEGACY_VERSIONS:
        raise _foreign(path, f"user_version {version} with tables named like a store's")
    return Layout("older", version, meta.get("db_id", ""))


def _has_store_tables(conn: sqlite3.Connection, names: set[str]) -> bool:
    """Only tables and indexes a store has, with `kv`'s columns (and `meta`'s) as a store's."""
    if "kv" not in names or not names <= TABLES | INDEXES:
        return False
    kv = tuple(row[1] for row in conn.execute("PRAGMA table_info(kv)"))
    if kv[: len(KV_COLUMNS)] != KV_COLUMNS:
        return False
    if "meta" in names:
        meta = tuple(row[1] for row in conn.execute("PRAGMA table_info(meta)"))
        return meta == ("name", "value")
    return True


def _meta(conn: sqlite3.Connection) -> dict[str, str]:
    rows = conn.execute("SELECT name, value FROM meta WHERE name IN ('db_id', ?)", (MARK[0],))
    return {str(name): str(value) for name, value in rows}


def _foreign(path: Path, detail: str) -> ConfigurationError:
    return ConfigurationError(
        f"{path} is an SQLite database of another application, not an agenticstate store "
        f"({detail}); it was left as it is: give the store a file of its own"
    )


def install_layout(conn: sqlite3.Connection, layout: Layout) -> str:
    """Make the file a marked store of this layout; return its database id.

    Runs inside the caller's write transaction (`BEGIN IMMEDIATE`, after `inspect_layout`
    read the file again under the lock): creates what is missing, migrates an older layout,
    and marks the file. Nothing that is there is rewritten.
    """
    _migrate(conn, layout.version)
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('db_id', ?)", (secrets.token_hex(8),))
    _mark(conn)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    (db_id,) = conn.execute("SELECT value FROM meta WHERE name = 'db_id'").fetchone()
    return str(db_id)


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """Bring a layout of `version` (0: a new file) to `SCHEMA_VERSION`.

    0 and 1 to 2: create the tables and indexes a file lacks (`meta` and `history` for 1);
    then to 3: the revision columns, and a revision for every row (`migrate_revisions`);
    then to 4: the index `kv_braced` (`KEY_INDEXES`: one pass over the keys).
    """
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    if version < 3:
        migrate_revisions(conn, version)
    conn.execute(KEY_INDEXES)


def _mark(conn: sqlite3.Connection) -> None:
    """Mark the file as a store: the header's application id and the `meta` row."""
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", MARK)
