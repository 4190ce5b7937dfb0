"""The SQLite backend's table layout, its statements, and the helpers for its rows."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from agenticstate._glob import compile_glob
from agenticstate.backends._sqlite_feed import from_us
from agenticstate.backends.base import Entry, new_entry
from agenticstate.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    import sqlite3

    from agenticstate._glob import GlobMatcher

__all__ = [
    "CHUNK",
    "DELETE",
    "GET",
    "HISTORY_PUT",
    "HISTORY_TRIM",
    "LOG",
    "PAGE",
    "PUT",
    "REVISION",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SELECT_MANY",
    "SET",
    "Row",
    "as_bytes",
    "entry",
    "is_prefix_pattern",
    "live",
    "migrate_revisions",
    "now_us",
    "ttl_us",
]

SCHEMA_VERSION = 3
"""The layout this module writes (`PRAGMA user_version`); a newer file is refused.

1: `kv`, `changes`, `idx`. 2 adds `meta` (the database's id, for feed cursors) and `history`;
a version 1 file is migrated in place (the new tables are created, nothing is rewritten).
3 adds revisions: `kv.revision` and `kv.create_revision`, `history.revision`
(`migrate_revisions` gives the rows of an older file revisions of their own).
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
