"""PostgresBackend beyond the contract: the feed's commit order, schema, URLs, reconnects.

Every test runs against the session's private PostgreSQL cluster, each in a schema of its own.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import psycopg
import pytest

from agenticstate import PostgresBackend, StateConfig, StateManager
from agenticstate.backends import EARLIEST, open_backend
from agenticstate.exceptions import BackendError, BackendUnavailableError, ConfigurationError
from tests._redis_server import free_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from agenticstate.backends import Change, Entry

pytestmark = pytest.mark.postgres


@pytest.fixture
def schema(postgres_url: str) -> Iterator[str]:
    """A fresh schema name, dropped after the test."""
    name = "t" + uuid.uuid4().hex[:16]
    yield name
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'.encode())


@pytest.fixture
async def backend(postgres_url: str, schema: str) -> AsyncIterator[PostgresBackend]:
    """A PostgresBackend over a fresh schema."""
    async with PostgresBackend(postgres_url, schema=schema) as made:
        yield made


async def _take(changes: AsyncIterator[Change], count: int) -> list[Change]:
    out: list[Change] = []
    with anyio.fail_after(30):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


async def _waiting_on_locks(url: str, schema: str) -> int:
    """How many sessions wait for a lock on the schema's head row right now."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s",
            (f'%"{schema}".head%',),
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def _until_waiting(url: str, schema: str, count: int) -> None:
    """Return once `count` sessions wait for the schema's head row (30 s at most)."""
    with anyio.fail_after(30):
        for _ in range(100_000):
            if await _waiting_on_locks(url, schema) >= count:
                return
            await anyio.sleep(0.01)


class _HeldWriter:
    """A writer in a thread of its own (its own event loop and backend) whose `update` blocks
    inside its transaction until released: a transaction held open while others commit."""

    def __init__(self, url: str, schema: str) -> None:
        self.url, self.schema = url, schema
        self.inside = threading.Event()
        self.release = threading.Event()
        self.change: Change | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        def hold(entry: Entry | None) -> bytes:
            self.inside.set()
            self.release.wait(60)  # blocks this thread's loop only, inside the transaction
            return b"slow"

        async def main() -> None:
            async with PostgresBackend(self.url, schema=self.schema) as backend:
                self.change = await backend.update("slow", hold)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001  # handed to the test
            self.error = exc


async def test_a_transaction_held_open_keeps_the_feed_in_commit_order(
    postgres_url: str, schema: str, backend: PostgresBackend
) -> None:
    """One writer holds its transaction open while three others try to commit: they wait for
    it, and once it commits, a live subscriber and a replay from before see all four changes
    exactly once, in commit order, with consecutive revisions."""
    start = await backend.feed_cursor()
    held = _HeldWriter(postgres_url, schema)
    others = [PostgresBackend(postgres_url, schema=schema) for _ in range(3)]
    async with backend.changes("*") as live:
        held.thread.start()
        try:
            assert await anyio.to_thread.run_sync(held.inside.wait, 30)
            results: list[Change] = []
            async with anyio.create_task_group() as tg:
                for number, other in enumerate(others):

                    async def write(other: PostgresBackend = other, number: int = number) -> None:
                        results.append(await other.set(f"fast{number}", b"x"))

                    tg.start_soon(write)
                # All three wait on the held transaction's lock: none has committed.
                await _until_waiting(postgres_url, schema, 3)
                assert await backend.feed_cursor() == start
                held.release.set()
            seen = await _take(live, 4)
        finally:
            held.release.set()
            await anyio.to_thread.run_sync(held.thread.join, 60)
            for other in others:
                await other.aclose()
    assert held.error is None
    assert held.change is not None
    assert seen[0].key == "slow"  # the held writer took the lock first, so it commits first
    revisions = [change.revision for change in seen]
    assert revisions == list(range(revisions[0], revisions[0] + 4))
    assert sorted(change.key for change in seen) == ["fast0", "fast1", "fast2", "slow"]
    assert {change.revision for change in results} == set(revisions[1:])
    async with backend.changes("*", since=start) as replay:
        replayed = await _take(replay, 4)
    assert [(c.key, c.revision) for c in replayed] == [(c.key, c.revision) for c in seen]


async def test_concurrent_writers_never_commit_out_of_revision_order(
    postgres_url: str, schema: str, backend: PostgresBackend
) -> None:
    """Eight backends x 25 writes at once: the feed, read live and replayed, holds every
    revision once, consecutive, and each key's versions in order."""
    start = await backend.feed_cursor()
    writers = [PostgresBackend(postgres_url, schema=schema) for _ in range(8)]
    async with backend.changes("*") as live:
        try:
            async with anyio.create_task_group() as tg:
                for number, writer in enumerate(writers):

                    async def write(writer: PostgresBackend = writer, number: int = number) -> None:
                        for i in range(25):
                            await writer.set(f"w{number}:{i % 5}", b"%d" % i)

                    tg.start_soon(write)
            seen = await _take(live, 200)
        finally:
            for writer in writers:
                await writer.aclose()
    revisions = [change.revision for change in seen]
    assert revisions == list(range(revisions[0], revisions[0] + 200))
    async with backend.changes("*", since=start) as replay:
        assert [c.revision for c in await _take(replay, 200)] == revisions


async def test_several_openers_of_a_new_schema_create_it_once(
    postgres_url: str, schema: str
) -> None:
    """Six backends opening one new schema at once all open the same store (one db id)."""
    backends = [PostgresBackend(postgres_url, schema=schema) for _ in range(6)]
    try:
        async with anyio.create_task_group() as tg:
            for made in backends:
                tg.start_soon(made.open)
        cursors = {(await made.feed_cursor()).rsplit(":", 1)[0] for made in backends}
    finally:
        for made in backends:
            await made.aclose()
    assert len(cursors) == 1


async def test_a_foreign_schema_is_refused_and_left_as_it_is(
    postgres_url: str, schema: str
) -> None:
    """A schema with another application's `kv` table is refused (ConfigurationError), and
    nothing in it changes."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        await conn.execute(f'CREATE TABLE "{schema}".kv (id int)'.encode())
    with pytest.raises(ConfigurationError, match="not an agenticstate store"):
        async with PostgresBackend(postgres_url, schema=schema):
            pass
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (schema,),
        )
        assert [row[0] for row in await cur.fetchall()] == ["kv"]


_FOREIGN = {
    "unrelated table": ["CREATE TABLE {s}.users (id int PRIMARY KEY)"],
    "sequence named kv": ["CREATE SEQUENCE {s}.kv"],
    "index named idx_order": [
        "CREATE TABLE {s}.other (a int)",
        "CREATE INDEX idx_order ON {s}.other (a)",
    ],
    "type named history": ["CREATE TYPE {s}.history AS (a int)"],
    "enum type": ["CREATE TYPE {s}.mood AS ENUM ('ok')"],
    "view": ["CREATE VIEW {s}.head AS SELECT 1 AS seq"],
    "function": ["CREATE FUNCTION {s}.f() RETURNS int LANGUAGE sql AS 'SELECT 1'"],
}


async def _objects_in(url: str, schema: str) -> list[tuple[str, str]]:
    """Every relation, type and function in `schema`, by kind and name."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT 'class', c.relname::text FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %(s)s UNION ALL "
            "SELECT 'type', t.typname::text FROM pg_type t JOIN pg_namespace n "
            "ON n.oid = t.typnamespace WHERE n.nspname = %(s)s UNION ALL "
            "SELECT 'proc', p.proname::text FROM pg_proc p JOIN pg_namespace n "
            "ON n.oid = p.pronamespace WHERE n.nspname = %(s)s ORDER BY 1, 2",
            {"s": schema},
        )
        return [(str(kind), str(name)) for kind, name in await cur.fetchall()]


@pytest.mark.parametrize("case", sorted(_FOREIGN))
async def test_a_non_empty_schema_without_a_store_is_refused_and_left_as_it_is(
    postgres_url: str, schema: str, case: str
) -> None:
    """A schema holding anything but no store (a table, sequence, index, type, view or function,
    named like ours or not) is refused with ConfigurationError, and nothing in it changes."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        for statement in _FOREIGN[case]:
            await conn.execute(statement.format(s=f'"{schema}"').encode())
    before = await _objects_in(postgres_url, schema)
    with pytest.raises(ConfigurationError, match="choose another schema") as caught:
        async with PostgresBackend(postgres_url, schema=schema):
            pass
    assert "connect" not in str(caught.value)
    assert await _objects_in(postgres_url, schema) == before


async def test_an_empty_existing_schema_gets_a_store(postgres_url: str, schema: str) -> None:
    """A schema that exists but holds nothing (as `public` of a new database) gets a store."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
    async with PostgresBackend(postgres_url, schema=schema) as made:
        await made.set("k", b"v")
    async with PostgresBackend(postgres_url, schema=schema) as again:
        entry = await again.get("k")
        assert entry is not None


async def test_a_newer_layout_is_refused(postgres_url: str, schema: str) -> None:
    """A store whose schema_version is newer than this library's is refused (BackendError)."""
    async with PostgresBackend(postgres_url, schema=schema) as made:
        await made.set("k", b"v")
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(
            f"UPDATE \"{schema}\".meta SET value = '99' WHERE name = 'schema_version'".encode()  # noqa: S608
        )
    with pytest.raises(BackendError, match="newer"):
        async with PostgresBackend(postgres_url, schema=schema):
            pass


@pytest.mark.parametrize("name", ["", "Upper", "a-b", "1abc", 'x"y', "a" * 64, 5])
def test_a_bad_schema_name_is_refused(name: Any) -> None:
    """A schema name that is not a plain lower-case identifier is a ConfigurationError."""
    with pytest.raises(ConfigurationError, match="Postgres schema"):
        PostgresBackend("postgresql://", schema=name)


async def test_url_parameters_reach_the_backend_and_libpq(postgres_url: str, schema: str) -> None:
    """`schema`, `key_prefix`, `pool_size` and the feed's retention are ours; libpq's
    (`application_name`) go to the server; an unknown one is refused."""
    url = (
        f"{postgres_url}&schema={schema}&key_prefix=app:&pool_size=3&feed_max_changes=50"
        "&application_name=agenticstate-test"
    )
    made = open_backend(url)
    assert isinstance(made, PostgresBackend)
    async with made:
        assert (made.schema, made.key_prefix, made.pool_size) == (schema, "app:", 3)
        assert made.feed.max_changes == 50
        await made.set("k", b"v")
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                ("agenticstate-test",),
            )
            row = await cur.fetchone()
            assert row is not None
            assert row[0] >= 1
            cur = await conn.execute(f'SELECT key FROM "{schema}".kv'.encode())  # noqa: S608
            assert await cur.fetchall() == [("app:k",)]
    with pytest.raises(ConfigurationError, match="no_such"):
        open_backend(f"{postgres_url}&no_such=1")


async def test_state_config_and_persistence_name_open_postgres(
    postgres_url: str, schema: str
) -> None:
    """`StateConfig(backend="postgres", postgres_url=...)` and the `postgres://` spelling open
    a PostgresBackend; the URL's password never shows in the config's repr."""
    url = f"{postgres_url}&schema={schema}"
    async with StateManager(StateConfig(backend="postgres", postgres_url=url)) as state:
        assert isinstance(state.backend, PostgresBackend)
        await state.save("k", {"n": 1})
        assert await state.get("k") == {"n": 1}
    other = open_backend(url.replace("postgresql://", "postgres://", 1))
    assert isinstance(other, PostgresBackend)
    async with other:
        assert (await other.get("k")) is not None
    shown = repr(StateConfig(backend="postgres", postgres_url="postgresql://u:s3cr3tpw@h/db"))
    assert "s3cr3tpw" not in shown


async def test_an_unreachable_server_is_a_typed_error_at_once() -> None:
    """A closed port raises BackendUnavailableError on open, not after a pool's timeout, and
    the error shows no password."""
    url = f"postgresql://app:Sekr1tPass@127.0.0.1:{free_port()}/db"
    with anyio.fail_after(20):
        with pytest.raises(BackendUnavailableError) as caught:
            async with PostgresBackend(url):
                pass
    assert "Sekr1tPass" not in str(caught.value)
    assert "Sekr1tPass" not in repr(PostgresBackend(url))


async def test_a_subscriber_survives_its_listen_connection_being_terminated(
    postgres_url: str, backend: PostgresBackend
) -> None:
    """`pg_terminate_backend` of the LISTEN connection: the subscriber reconnects and
    delivers every change, those written while it was away included, exactly once."""
    async with backend.changes("*") as live:
        await backend.set("a", b"1")
        assert [c.key for c in await _take(live, 1)] == ["a"]
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN agenticstate_%' AND pid <> pg_backend_pid()"
            )
            assert [row[0] for row in await cur.fetchall()] == [True]
        for key in ("b", "c", "d"):
            await backend.set(key, b"2")
        seen = await _take(live, 3)
        assert [c.key for c in seen] == ["b", "c", "d"]
        await backend.set("e", b"3")
        assert [c.key for c in await _take(live, 1)] == ["e"]
    async with backend.changes("*", since=EARLIEST) as replay:
        assert [c.key for c in await _take(replay, 5)] == ["a", "b", "c", "d", "e"]


async def test_copy_between_postgres_and_sqlite_keeps_keys_ttls_and_indexes(
    postgres_url: str, schema: str, tmp_path: Any
) -> None:
    """`copy_state` from Postgres to SQLite and back: values, TTLs and every index (listed by
    `index_names`) arrive."""
    from datetime import timedelta

    from agenticstate import SQLiteBackend
    from agenticstate.transfer import copy_state

    async with (
        PostgresBackend(postgres_url, schema=schema, key_prefix="src:") as source,
        SQLiteBackend(tmp_path / "copy.db") as middle,
        PostgresBackend(postgres_url, schema=schema, key_prefix="back:") as back,
    ):
        await source.set("a", b"1")
        await source.set("b", b"2", ttl=timedelta(hours=1))
        await source.index_add("i1", {"x": 1.0, "y": float("inf")})
        await source.index_add("i2", {"z": -2.0})
        assert await source.index_names() == ["i1", "i2"]
        await copy_state(source, middle)
        await copy_state(middle, back)
        entry = await back.get("b")
        assert entry is not None
        assert entry.expires_at is not None
        assert (await back.get("a")) is not None
        assert await back.index_range("i1") == [("x", 1.0), ("y", float("inf"))]
        assert await back.index_names() == ["i1", "i2"]


def test_under_trio_every_entry_refuses_before_the_network() -> None:
    """Under trio, opening a PostgresBackend raises ConfigurationError naming asyncio."""
    pytest.importorskip("trio")

    async def main() -> None:
        backend = PostgresBackend(f"postgresql://u@127.0.0.1:{free_port()}/db")
        with pytest.raises(ConfigurationError, match="asyncio"):
            await backend.open()
        with pytest.raises(ConfigurationError, match="asyncio"):
            await backend.get("k")
        await backend.aclose()

    anyio.run(main, backend="trio")


async def test_an_exhausted_pool_is_a_timeout_error(postgres_url: str, schema: str) -> None:
    """With its one connection held, a call waits `pool_timeout` and raises
    BackendTimeoutError; once the connection is back, calls work."""
    from datetime import timedelta

    from agenticstate.exceptions import BackendTimeoutError

    async with PostgresBackend(
        postgres_url, schema=schema, pool_size=1, pool_timeout=timedelta(milliseconds=200)
    ) as made:
        await made.set("k", b"v")
        async with made._connection("hold the only connection"):
            with pytest.raises(BackendTimeoutError, match="pool_size=1"):
                await made.get("k")
        assert (await made.get("k")) is not None


async def test_a_statement_timeout_is_a_timeout_error_and_writes_nothing(
    postgres_url: str, schema: str
) -> None:
    """A write stuck behind another session's lock past `statement_timeout` (set through the
    URL's libpq `options`) raises BackendTimeoutError and leaves the key as it was."""
    from agenticstate.exceptions import BackendTimeoutError

    async with PostgresBackend(postgres_url, schema=schema) as made:
        await made.set("k", b"before")
    url = f"{postgres_url}&options=-c%20statement_timeout%3D200"
    async with (
        PostgresBackend(url, schema=schema) as timed,
        await psycopg.AsyncConnection.connect(postgres_url) as blocker,
    ):
        await blocker.execute(f'SELECT seq FROM "{schema}".head FOR UPDATE'.encode())  # noqa: S608
        with pytest.raises(BackendTimeoutError, match="cancel"):
            await timed.set("k", b"after")
        await blocker.rollback()
        entry = await timed.get("k")
        assert entry is not None
        assert entry.value == b"before"
        await timed.set("k", b"after")


async def test_a_lock_timeout_on_the_head_row_is_a_timeout_error_and_writes_nothing(
    postgres_url: str, schema: str
) -> None:
    """With libpq's `options=-c lock_timeout=...`, a write behind a stuck writer holding the head
    row raises BackendTimeoutError at once (not retried, not 'unavailable'), writing nothing."""
    from agenticstate.exceptions import BackendTimeoutError

    async with PostgresBackend(postgres_url, schema=schema) as made:
        await made.set("k", b"before")
    url = f"{postgres_url}&options=-c%20lock_timeout%3D200"
    async with (
        PostgresBackend(url, schema=schema) as timed,
        await psycopg.AsyncConnection.connect(postgres_url) as blocker,
    ):
        await blocker.execute(f'SELECT seq FROM "{schema}".head FOR UPDATE'.encode())  # noqa: S608
        with pytest.raises(BackendTimeoutError, match="lock"):
            await timed.set("k", b"after")
        await blocker.rollback()
        entry = await timed.get("k")
        assert entry is not None
        assert entry.value == b"before"
        await timed.set("k", b"after")


async def test_the_persistence_shorthand_opens_postgres_from_libpq_environment(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`WorkflowStateManager(persistence="postgres")` with no URL connects where libpq's
    environment (PGHOST, PGPORT, PGUSER, PGDATABASE) points, in the default schema."""
    from urllib.parse import parse_qs, urlsplit

    from agenticstate import WorkflowStateManager

    query = parse_qs(urlsplit(postgres_url).query)
    monkeypatch.setenv("PGHOST", query["host"][0])
    monkeypatch.setenv("PGPORT", query["port"][0])
    monkeypatch.setenv("PGUSER", "postgres")
    monkeypatch.setenv("PGDATABASE", "postgres")
    try:
        async with WorkflowStateManager(persistence="postgres") as workflows:
            backend = workflows.state.backend
            assert isinstance(backend, PostgresBackend)
            assert backend.schema == "agenticstate"
            await workflows.state.save("probe", 1)
            assert await workflows.state.get("probe") == 1
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(b"DROP SCHEMA IF EXISTS agenticstate CASCADE")


@pytest.mark.parametrize("how", ["set", "update", "transact", "delete"])
async def test_large_values_are_written_and_never_stall_other_writers(
    postgres_url: str, schema: str, how: str
) -> None:
    """An 8 MiB value is set, replaced and deleted by every kind of write while a second
    writer of the store proceeds; no transaction is left open afterwards."""
    from agenticstate.backends import Put

    big = b"a" * (8 << 20)
    async with (
        PostgresBackend(postgres_url, schema=schema) as made,
        PostgresBackend(postgres_url, schema=schema) as other,
    ):
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                if how == "set":
                    group.start_soon(made.set, "big", big)
                elif how == "update":
                    group.start_soon(made.update, "big", lambda _entry: big)
                else:
                    group.start_soon(made.transact, [], [Put("big", big)])
                await other.set("small", b"1")
            if how == "delete":
                await made.delete("big")
                assert await made.get("big") is None
            else:
                await made.set("big", big[:-1] + b"b")  # replaces a large value with one
                entry = await made.get("big")
                assert entry is not None
                assert entry.value == big[:-1] + b"b"
                await made.set("big", b"small again")  # the old value is large
            await other.set("small", b"2")
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
        )
        row = await cur.fetchone()
        assert row is not None
        assert row[0] == 0


async def test_changes_without_a_listen_connection_is_a_typed_error_leaving_nothing_running(
    postgres_url: str, schema: str
) -> None:
    """When the LISTEN connection cannot be made, `changes()` raises BackendUnavailableError
    (with the server's reason), leaves no task retrying, and a later call tries again."""
    from datetime import timedelta

    role = f"r{schema}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1'.encode())
        await conn.execute(f'GRANT CREATE ON DATABASE postgres TO "{role}"'.encode())
    limited = postgres_url.replace("postgres@", f"{role}@", 1)
    try:
        async with PostgresBackend(
            limited, schema=schema, pool_size=1, pool_timeout=timedelta(seconds=5)
        ) as made:
            await made.set("a", b"1")  # the pool holds the role's one connection
            for _ in range(2):
                with pytest.raises(BackendUnavailableError, match="too many connections"):
                    async with made.changes("*"):
                        pass
                feed = made._feed_state
                assert feed is not None
                assert feed._tasks == []
            async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as c:
                await c.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 2'.encode())
            async with made.changes("*") as stream:
                await made.set("b", b"2")
                assert [change.key for change in await _take(stream, 1)] == ["b"]
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())
            await conn.execute(f'DROP OWNED BY "{role}"'.encode())
            await conn.execute(f'DROP ROLE "{role}"'.encode())


@pytest.mark.parametrize("first", ["read", "write"])
async def test_calls_succeed_after_the_server_dropped_every_idle_pooled_connection(
    postgres_url: str, schema: str, first: str
) -> None:
    """Reads and writes on a healthy server succeed after every idle connection of the pool
    was terminated (a restart, a proxy's idle timeout): broken ones are replaced, not used."""
    import contextlib

    async with PostgresBackend(postgres_url, schema=schema, pool_size=4) as made:
        await made.set("a", b"1")
        async with contextlib.AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(made._connection("hold")) for _ in range(4)]
            pids = [conn.info.backend_pid for conn in conns]
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,)
            )
            with anyio.fail_after(30):
                while True:
                    cur = await conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
                    )
                    row = await cur.fetchone()
                    assert row is not None
                    if row[0] == 0:
                        break
                    await anyio.sleep(0.01)
        if first == "write":
            await made.set("c", b"3")
            assert (await made.get("c")) is not None
        for _ in range(6):
            entry = await made.get("a")
            assert entry is not None
        assert "a" in [key async for key in made.scan("*")]
        await made.set("b", b"2")
        assert (await made.get_many(["a", "b"]))[1] is not None


_DROPPED_CONNECTIONS_SCRIPT = """
import asyncio, sys
import psycopg
from agenticstate import PostgresBackend

async def main(url, schema):
    async with PostgresBackend(url, schema=schema, pool_size=2) as made:
        await made.set("a", b"1")
        async with made._connection("hold") as one, made._connection("hold") as two:
            pids = [one.info.backend_pid, two.info.backend_pid]
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            sql = "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid"
            await conn.execute(sql, (pids,))
        assert (await made.get("a")) is not None

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_psycopg_warnings_stay_off_stderr_when_logging_is_not_configured(
    postgres_url: str, schema: str
) -> None:
    """A process that configures no logging prints nothing when the pool discards connections
    the server dropped (psycopg's own warnings do not reach Python's last-resort handler)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _DROPPED_CONNECTIONS_SCRIPT, postgres_url, schema],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == ""


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user:pa%zzword@localhost/db",
        "postgresql://user:secret%@localhost/db",
        "postgresql://us%4user:x@localhost/db",
        "postgres://localhost/d%b",
    ],
)
def test_a_url_with_an_invalid_percent_encoding_is_a_configuration_error(url: str) -> None:
    """A '%' not followed by two hex digits (libpq refuses it) is a ConfigurationError at
    construction, and the message shows no password."""
    with pytest.raises(ConfigurationError, match="%25") as caught:
        PostgresBackend(url)
    assert "secret" not in str(caught.value)
    assert "pa%zz" not in str(caught.value)


async def test_a_cancelled_large_write_releases_the_head_row(
    postgres_url: str, schema: str
) -> None:
    """A large `set` cancelled at any point of its transaction leaves no lock behind: another
    writer of the store proceeds, and the key holds the old value or the new one."""
    big = b"x" * (4 << 20)
    async with (
        PostgresBackend(postgres_url, schema=schema) as made,
        PostgresBackend(postgres_url, schema=schema) as other,
    ):
        for turns in (0, 1, 2, 3, 5, 8, 13, 21, 34):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(made.set, "big", big)
                    for _ in range(turns):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
            with anyio.fail_after(30):
                await other.set("small", str(turns).encode())
                entry = await other.get("big")
            assert entry is None or entry.value == big
        with anyio.fail_after(30):
            await made.set("big", b"after")
