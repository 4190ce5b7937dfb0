"""The Postgres backend's tables, their versions, and how a store is created or migrated.

Every table lives in one Postgres schema the user names (`agenticstate` by default). Keys and
index members are `text COLLATE "C"`: byte order, which for UTF-8 is code point order, the order
Python sorts `str` in (listings and range scans rely on it). Times are microseconds since the
epoch (`bigint`), as on SQLite.

- `meta`: `app` (`agenticstate`: what tells our schema from another application's),
  `schema_version` and `db_id` (a random id feed cursors name, so a cursor of a dropped and
  recreated store is told apart).
- `head`: one row, the store's last revision. Every write transaction locks it first and holds
  it to commit: revisions (= feed sequence numbers) are handed out in commit order.
- `kv`, `changes`, `idx`, `history`: the entries, the change feed, sorted indexes and retained
  versions, as the SQLite backend has them.

`install` runs under a transaction-scoped advisory lock keyed by the schema's name, so several
processes opening one store at once create it once: the first makes the tables, the others wait
and then find them. A store is created only in a schema that is missing or empty (no table,
sequence, index, view, type or function: the name may be shared, e.g. `public`, as long as
nothing is in it yet). A schema holding anything else but no store, any of these tables without
our `meta` row, or a `meta` of another application, is refused with `ConfigurationError` and
left as it is; a store of a newer layout than this library knows is refused with `BackendError`.
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Any

from agenticstate.exceptions import BackendError, ConfigurationError, CorruptStoreError

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["APP", "SCHEMA_VERSION", "TABLES", "check_schema_name", "install"]

APP = "agenticstate"
SCHEMA_VERSION = 1
TABLES = ("meta", "head", "kv", "changes", "idx", "history")
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_schema_name(name: object) -> str:
    """Return `name` if it is a plain lower-case Postgres identifier (so it needs no quoting).

    Raises:
        ConfigurationError: It is not one.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            "the Postgres schema must be a lower-case identifier (letters, digits, _; at most "
            f"63 characters; not starting with a digit), not {name!r}"
        )
    return name


def _ddl(schema: str) -> list[str]:
    s = f'"{schema}"'
    return [
        f"CREATE SCHEMA IF NOT EXISTS {s}",
        f"CREATE TABLE {s}.meta (name text PRIMARY KEY, value text NOT NULL)",
        f"CREATE TABLE {s}.head (id int PRIMARY KEY CHECK (id = 1), seq bigint NOT NULL)",
        f"INSERT INTO {s}.head VALUES (1, 0)",
        f'CREATE TABLE {s}.kv (key text COLLATE "C" PRIMARY KEY, value bytea NOT NULL, '
        "version bigint NOT NULL, created_at bigint NOT NULL, updated_at bigint NOT NULL, "
        "expires_at bigint, revision bigint NOT NULL, create_revision bigint NOT NULL)",
        f"CREATE INDEX kv_expiry ON {s}.kv (expires_at) WHERE expires_at IS NOT NULL",
        f'CREATE TABLE {s}.changes (seq bigint PRIMARY KEY, key text COLLATE "C" NOT NULL, '
        "op smallint NOT NULL, old bytea, new bytea, version bigint NOT NULL, "
        "ts bigint NOT NULL)",
        f'CREATE TABLE {s}.idx (name text COLLATE "C" NOT NULL, member text COLLATE "C" '
        "NOT NULL, score double precision NOT NULL, PRIMARY KEY (name, member))",
        f"CREATE INDEX idx_order ON {s}.idx (name, score, member)",
        f'CREATE TABLE {s}.history (key text COLLATE "C" NOT NULL, version bigint NOT NULL, '
        "value bytea NOT NULL, updated_at bigint NOT NULL, expires_at bigint, "
        "revision bigint NOT NULL, PRIMARY KEY (key, version))",
    ]


async def _objects(conn: AsyncConnection[Any], schema: str) -> list[str]:
    """A few of the objects in `schema` (relations, types, routines), by name; none if empty."""
    cur = await conn.execute(
        "SELECT name FROM ("
        " SELECT c.relname::text AS name FROM pg_class c JOIN pg_namespace n"
        "  ON n.oid = c.relnamespace WHERE n.nspname = %(s)s"
        " UNION ALL SELECT t.typname::text FROM pg_type t JOIN pg_namespace n"
        "  ON n.oid = t.typnamespace WHERE n.nspname = %(s)s"
        " UNION ALL SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n"
        "  ON n.oid = p.pronamespace WHERE n.nspname = %(s)s"
        ") o ORDER BY name LIMIT 5",
        {"s": schema},
    )
    return sorted({str(row[0]) for row in await cur.fetchall()})


# Migrations from each older layout to the next, in one transaction each: none yet (layout 1 is
# the first). A later layout adds `MIGRATIONS[1] = [...]`, statements taking `{s}`.
MIGRATIONS: dict[int, list[str]] = {}


async def install(conn: AsyncConnection[Any], schema: str) -> str:
    """Make `schema` a current store if it is not one (under an advisory lock); its db id.

    Runs in the caller's transaction (which must be open on `conn`).

    Raises:
        ConfigurationError: The schema holds no store and is not empty, holds tables of ours
            without our `meta`, or is another application's.
        BackendError: The store's layout is newer than this library's.
    """
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"agenticstate:{schema}",)
    )
    cur = await conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') "
        "AND c.relname = ANY(%s)",
        (schema, list(TABLES)),
    )
    present = {str(row[0]) for row in await cur.fetchall()}
    s = f'"{schema}"'
    if not present:
        foreign = await _objects(conn, schema)
        if foreign:
            raise ConfigurationError(
                f"the Postgres schema {schema!r} is not empty and holds no agenticstate store "
                f"({', '.join(foreign)}); a store is created only in an empty or missing "
                "schema, and this one was left as it is: choose another schema"
            )
        db_id = secrets.token_hex(8)
        for statement in _ddl(schema):
            await conn.execute(statement.encode())
        await conn.execute(
            f"INSERT INTO {s}.meta VALUES ('app', %s), ('schema_version', %s), "
            "('db_id', %s)".encode(),
            (APP, str(SCHEMA_VERSION), db_id),
        )
        return db_id
    meta: dict[str, str] = {}
    if "meta" in present:
        try:
            cur = await conn.execute(f"SELECT name, value FROM {s}.meta".encode())
            meta = {str(name): str(value) for name, value in await cur.fetchall()}
        except Exception:  # noqa: BLE001  # another application's table named meta
            meta = {}
    if meta.get("app") != APP or "db_id" not in meta:
        raise ConfigurationError(
            f"the Postgres schema {schema!r} holds tables that are not an agenticstate store "
            f"({', '.join(sorted(present))}); it was left as it is: choose another schema"
        )
    version = int(meta.get("schema_version", "0") or 0)
    if version > SCHEMA_VERSION:
        raise BackendError(
            f"the store in Postgres schema {schema!r} has layout {version}, newer than this "
            f"agenticstate's ({SCHEMA_VERSION}): upgrade agenticstate to open it"
        )
    while version < SCHEMA_VERSION:
        for statement in MIGRATIONS.get(version, []):
            await conn.execute(statement.format(s=s).encode())
        version += 1
        await conn.execute(
            f"UPDATE {s}.meta SET value = %s WHERE name = 'schema_version'".encode(),
            (str(version),),
        )
    missing = set(TABLES) - present
    if missing:
        raise CorruptStoreError(
            f"the agenticstate store in Postgres schema {schema!r} lacks its tables "
            f"{', '.join(sorted(missing))} (dropped outside agenticstate); it was left as it is"
        )
    return meta["db_id"]
