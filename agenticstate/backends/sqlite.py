"""SQLiteBackend: an embedded store in one SQLite file that several processes on a host share.

On disk, one database file (plus SQLite's `-wal` and `-shm` files next to it) with three tables:

- `kv`: one row per key (with the backend's `key_prefix`): value bytes, version, created, updated
  and expiry times in microseconds since the epoch. The key is the primary key, so a pattern with
  a literal prefix (`agent:*`) reads a range of the index, never the whole table.
- `changes`: every committed change (key, old and new bytes, version, time) under a sequence
  number, written in the same transaction as the value it describes. Subscribers in any process
  read it in sequence order (see `agenticstate.backends._sqlite_feed`).
- `idx`: the sorted indexes (`index_add` / `index_range`).

Durability. The database runs in WAL mode with `synchronous=FULL` by default: a write is
acknowledged only after its transaction's commit record is fsynced to the WAL, so an acknowledged
write survives a process crash (kill -9) and a power loss. `synchronous="normal"` skips that fsync:
a process crash still loses nothing, a power loss may lose the last commits.

Threads, not the event loop. Each instance has one writer thread (its own connection) and one
reader thread (another connection); the first subscription adds a notifier thread. The event loop
only queues calls and is woken with the results. The writer takes every write waiting in its
queue and runs them in one `BEGIN IMMEDIATE` transaction (each checks versions before it writes,
so one write's conflict touches nothing of the others), then commits once: concurrent writers
share the fsync (group commit). The rows a batch reads are read in one query and its writes go
out in one `executemany` per table. `BEGIN IMMEDIATE` takes SQLite's write lock for the whole
transaction, so compare-and-set, `update(fn)` and every manager's atomic step are atomic across
processes too.

Several processes. Any number of processes open the same file; writes are serialized by SQLite's
lock (a writer waits up to `lock_timeout`, then raises `BackendTimeoutError`), reads never wait
for writes. Expired keys read as missing and are swept by the writer about once a second.

Retention. The `changes` table keeps the last `change_retention` changes (trimmed by the writer).
A subscriber that comes back with `since=cursor` catches up from there while the table still holds
it; beyond that it receives a `RESYNC` change per matching key.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import anyio
import anyio.to_thread

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._tasks import current_loop, event_factory, threadsafe_scheduler
from agenticstate.backends import _sqlite_schema as schema
from agenticstate.backends._local import run_transaction
from agenticstate.backends._sqlite_feed import Feed, SQLiteChangeStream, from_us, key_range
from agenticstate.backends._sqlite_schema import SCHEMA_VERSION
from agenticstate.backends._sqlite_worker import Job, Worker, connect, translate, translated
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    backoff,
    check_expected_version,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
)
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    ConfigurationError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence

    from agenticstate._glob import GlobMatcher
    from agenticstate._tasks import EventLike
    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult

__all__ = ["SCHEMA_VERSION", "SQLiteBackend", "SQLiteChangeStream"]


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


class SQLiteBackend(Backend):
    """Keep state in one SQLite database file that every process on the host can open.

    Args:
        path: The database file (created with its directory if missing).
        key_prefix: A namespace before every key; several prefixes share one file.
        synchronous: `"full"` (default: an acknowledged write survives a power loss) or
            `"normal"` (survives a process crash; a power loss may lose the last commits).
        change_retention: How many of the latest changes the `changes` table keeps for
            subscribers catching up (`since=`).
        poll_interval: How often a subscribed process checks for other processes' commits.
        lock_timeout: How long a write waits for another process's transaction.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key_prefix: str = "",
        synchronous: Literal["full", "normal"] = "full",
        change_retention: int = 10_000,
        poll_interval: timedelta = timedelta(milliseconds=2),
        lock_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        if synchronous not in ("full", "normal"):
            raise ConfigurationError(f"synchronous must be 'full' or 'normal', not {synchronous!r}")
        if type(change_retention) is not int or change_retention < 1:
            raise ConfigurationError(
                f"change_retention must be an int >= 1, not {change_retention!r}"
            )
        if str(path) in ("", ":memory:"):
            raise ConfigurationError("SQLiteBackend needs a database file path")
        self.path = Path(path)
        self.key_prefix = key_prefix
        self.synchronous = synchronous
        self.change_retention = change_retention
        self._poll = poll_interval.total_seconds()
        self._lock_timeout = lock_timeout.total_seconds()
        self._low, self._high = key_range(key_prefix)
        self._writer: Worker | None = None
        self._reader: Worker | None = None
        self._feed: Feed | None = None
        self._new_event: Callable[[], EventLike] = anyio.Event
        self._open_lock: anyio.Lock | None = None
        self._loop: object = None
        self._is_open = False
        self._closed = False
        self._commits = 0
        # The writer thread's batch in progress: rows as the batch has them, staged writes.
        self._rows: dict[str, schema.Row | None] = {}
        self._puts: list[tuple[str, bytes, int, int, int, int | None]] = []
        self._logs: list[tuple[str, int, bytes | None, bytes | None, int, int]] = []
        self._logged = 0  # changes written since the last trim
        self._trim_every = max(64, change_retention // 8)
        self._swept_at = 0.0

    def __repr__(self) -> str:
        return f"SQLiteBackend(path={str(self.path)!r}, key_prefix={self.key_prefix!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteBackend:
        """Create a backend from `sqlite:///absolute/file.db` or `sqlite://relative/file.db`.

        Query parameters `synchronous` and `change_retention` set those options.
        """
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigurationError(f"sqlite URL {url!r} names no database file")
        for name, value in parse_qsl(parts.query):
            if name == "synchronous":
                options.setdefault("synchronous", value.lower())
            elif name == "change_retention" and value.isdigit():
                options.setdefault("change_retention", int(value))
            else:
                raise ConfigurationError(f"unknown sqlite URL parameter {name!r}")
        return cls(path, **options)

    # ---------------------------------------------------------------- opening and closing

    async def open(self) -> None:
        """Create or open the database and start the writer and reader threads. Idempotent."""
        if self._is_open:
            return
        if self._closed:
            raise BackendError("this SQLiteBackend is closed")
        if self._open_lock is None:
            self._open_lock = anyio.Lock()
        async with self._open_lock:
            if self._is_open:
                return
            schedule = threadsafe_scheduler()
            writer = Worker(
                "agenticstate-sqlite-write", self._open_writer, self._write_batch, schedule
            )
            reader = Worker(
                "agenticstate-sqlite-read", self._open_reader, self._read_batch, schedule
            )
            await anyio.to_thread.run_sync(writer.start)
            try:
                await anyio.to_thread.run_sync(reader.start)
            except BaseException:
                await anyio.to_thread.run_sync(writer.stop)
                raise
            self._writer, self._reader = writer, reader
            self._feed = Feed(self._open_reader, schedule, self.key_prefix, self._poll)
            self._new_event = event_factory()
            self._loop = current_loop()  # its threads hand results back to this loop only
            self._is_open = True

    def _open_writer(self) -> sqlite3.Connection:
        with translate(f"open the database {self.path}"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = connect(self.path, synchronous=self.synchronous, busy_ms=10_000)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                self._begin(conn)
                try:
                    found = conn.execute("PRAGMA user_version").fetchone()[0]
                    if found > SCHEMA_VERSION:
                        raise BackendError(
                            f"{self.path} has schema version {found}; this agenticstate "
                            f"reads up to {SCHEMA_VERSION}: upgrade agenticstate"
                        )
                    if found < SCHEMA_VERSION:
                        for statement in schema.SCHEMA.split(";"):
                            if statement.strip():
                                conn.execute(statement)
                        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("PRAGMA busy_timeout=0")  # BEGIN IMMEDIATE waits in _begin
            except BaseException:
                conn.close()
                raise
        return conn

    def _open_reader(self) -> sqlite3.Connection:
        with translate(f"open the database {self.path}"):
            return connect(self.path, synchronous=self.synchronous, busy_ms=10_000)

    async def aclose(self) -> None:
        """Finish queued writes, end every subscription and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._is_open:
            return
        self._is_open = False
        feed, writer, reader = self._feed, self._writer, self._reader
        assert feed is not None  # noqa: S101  # set by open()
        assert writer is not None  # noqa: S101
        assert reader is not None  # noqa: S101
        feed.close()

        def stop() -> None:
            writer.stop()
            reader.stop()
            feed.join()

        await anyio.to_thread.run_sync(stop)

    # ---------------------------------------------------------------- calls into the threads

    async def _call(
        self, write: bool, fn: Callable[[sqlite3.Connection], Any], key: str | None = None
    ) -> Any:
        if not self._is_open:
            await self.open()
        if current_loop() is not self._loop:
            raise BackendError(
                "this SQLiteBackend was opened on another event loop; open one per event loop"
            )
        worker = self._writer if write else self._reader
        assert worker is not None  # noqa: S101  # set by open()
        job = Job(fn, self._new_event(), key)
        worker.submit(job)
        await job.event.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _begin(self, conn: sqlite3.Connection) -> None:
        """Take the write lock (`BEGIN IMMEDIATE`), waiting for other processes' transactions.

        Runs in the writer thread only (opening its connection, and each batch), never on the
        event loop: the blocking `time.sleep` between tries waits there.
        """
        deadline = time.monotonic() + self._lock_timeout
        attempt = 0
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _is_locked(exc):
                    raise
                if time.monotonic() > deadline:
                    raise BackendTimeoutError(
                        f"another process held the write lock on {self.path} for over "
                        f"{self._lock_timeout:g} s"
                    ) from exc
                time.sleep(backoff(attempt, base=0.0002, cap=0.004))
                attempt += 1
            else:
                return

    def _write_batch(self, conn: sqlite3.Connection, jobs: list[Job]) -> None:
        """Run `jobs` in one transaction and commit once (in the writer thread).

        The rows the jobs read are read together first, and their writes go out together
        (`executemany`) before the commit: a batch of single-key writes costs a few statements,
        not three per write. Every job checks (versions, the user's `fn`) before it writes, so a
        job that raises has written nothing and the others go on; an SQLite error fails the
        whole batch, which is rolled back.
        """
        try:
            self._begin(conn)
            if len(jobs) > 1:
                self._prefetch(conn, [job.key for job in jobs if job.key is not None])
            for job in jobs:
                try:
                    job.result = job.fn(conn)
                except sqlite3.Error:
                    raise
                except Exception as exc:  # noqa: BLE001  # a conflict or the user's fn: its caller's
                    job.error = exc
            self._flush_writes(conn)
            self._maintain(conn)
            conn.execute("COMMIT")
        except (sqlite3.Error, BackendError) as exc:
            error = translated(exc, f"write to {self.path}")
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            for job in jobs:
                job.result, job.error = None, job.error or error
            return
        finally:
            self._rows.clear()
            self._puts.clear()
            self._logs.clear()
        feed = self._feed
        if feed is not None and feed.active:
            feed.nudge()

    def _prefetch(self, conn: sqlite3.Connection, keys: list[str]) -> None:
        wanted = list(dict.fromkeys(keys))
        rows = self._rows
        for start in range(0, len(wanted), schema.CHUNK):
            chunk = wanted[start : start + schema.CHUNK]
            rows.update(dict.fromkeys(chunk))
            for full, *row in conn.execute(
                f"{schema.SELECT_MANY} ({','.join('?' * len(chunk))})", chunk
            ):
                rows[full] = tuple(row)

    def _flush_writes(self, conn: sqlite3.Connection) -> None:
        """Write the batch's staged rows and changes, in order (before anything else writes)."""
        if self._puts:
            conn.executemany(schema.PUT, self._puts)
            conn.executemany(schema.LOG, self._logs)
            self._logged += len(self._logs)
            self._puts.clear()
            self._logs.clear()

    def _maintain(self, conn: sqlite3.Connection) -> None:
        """Trim the changes table every `change_retention / 8` changes; sweep expiries each 1 s."""
        self._commits += 1
        if self._logged >= self._trim_every:
            self._logged = 0
            conn.execute(
                "DELETE FROM changes WHERE seq <= (SELECT max(seq) FROM changes) - ?",
                (self.change_retention,),
            )
        moment = time.monotonic()
        if moment - self._swept_at > 1.0:
            self._swept_at = moment
            conn.execute(
                "DELETE FROM kv WHERE expires_at IS NOT NULL AND expires_at <= ?",
                (schema.now_us(),),
            )

    @staticmethod
    def _read_batch(conn: sqlite3.Connection, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                job.result = job.fn(conn)
            except (sqlite3.Error, OSError) as exc:
                job.error = translated(exc, "read the database")
            except Exception as exc:  # noqa: BLE001  # raised to the caller on the loop
                job.error = exc

    # ---------------------------------------------------------------- reads

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired."""
        full = self.key_prefix + validate_key(key)

        def run(conn: sqlite3.Connection) -> Entry | None:
            row = schema.live(conn.execute(schema.GET, (full,)).fetchone(), schema.now_us())
            return schema.entry(key, row) if row is not None else None

        result: Entry | None = await self._call(False, run)
        return result

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order, in one read."""
        for key in keys:
            validate_key(key)
        prefix, wanted = self.key_prefix, list(dict.fromkeys(keys))

        def run(conn: sqlite3.Connection) -> list[Entry | None]:
            now, found = schema.now_us(), {}
            conn.execute("BEGIN")
            try:
                for start in range(0, len(wanted), schema.CHUNK):
                    chunk = [prefix + key for key in wanted[start : start + schema.CHUNK]]
                    marks = ",".join("?" * len(chunk))
                    sql = f"{schema.SELECT_MANY} ({marks})"
                    for full, *row in conn.execute(sql, chunk):
                        live = schema.live(tuple(row), now)
                        if live is not None:
                            found[full[len(prefix) :]] = schema.entry(full[len(prefix) :], live)
            finally:
                conn.execute("COMMIT")
            return [found.get(key) for key in keys]

        result: list[Entry | None] = await self._call(False, run)
        return result

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`, reading the key range its prefix allows.

        A pattern that is a literal prefix and `*` (`agent:*`) is answered by the index range
        alone; any other is filtered by the glob matcher after the range is read.
        """
        async with contextlib.aclosing(self._scan_pages(pattern)) as pages:
            async for page in pages:
                for key in page:
                    yield key

    async def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        """Yield the present keys matching `pattern` a page at a time, in key order."""
        async with contextlib.aclosing(self._scan_pages(pattern)) as pages:
            async for page in pages:
                if page:
                    yield page

    async def _scan_pages(self, pattern: str) -> AsyncGenerator[list[str]]:
        matcher = compile_glob(validate_pattern(pattern))
        low, high = key_range(self.key_prefix + matcher.literal_prefix)
        every = schema.is_prefix_pattern(pattern, matcher)
        after: str | None = None
        while True:
            run = self._scan_page(None if every else matcher, low, high, after)
            page, after = await self._call(False, run)
            yield page
            if after is None:
                return

    def _scan_page(
        self, matcher: GlobMatcher | None, low: str, high: str | None, after: str | None
    ) -> Callable[[sqlite3.Connection], tuple[list[str], str | None]]:
        cut = len(self.key_prefix)

        def run(conn: sqlite3.Connection) -> tuple[list[str], str | None]:
            # Only placeholders and constants are joined into the SQL below.
            sql = "SELECT key FROM kv WHERE key " + (">= ?" if after is None else "> ?")  # noqa: S608
            params: list[object] = [low if after is None else after]
            if high is not None:
                sql += " AND key < ?"
                params.append(high)
            sql += " AND (expires_at IS NULL OR expires_at > ?)"
            params.append(schema.now_us())
            rows = conn.execute(sql + f" ORDER BY key LIMIT {schema.PAGE}", params).fetchall()
            if matcher is None:
                page = [key[cut:] for (key,) in rows]
            else:
                match = matcher.match
                page = [key[cut:] for (key,) in rows if match(key[cut:])]
            return page, rows[-1][0] if len(rows) == schema.PAGE else None

        return run

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Read a sorted index, lowest score first; see `Backend.index_range`."""
        name = self.key_prefix + validate_key(index)
        check_limit(limit)

        def run(conn: sqlite3.Connection) -> list[tuple[str, float]]:
            sql = "SELECT member, score FROM idx WHERE name = ? ORDER BY score, member LIMIT ?"
            return list(conn.execute(sql, (name, -1 if limit is None else limit)))

        result: list[tuple[str, float]] = await self._call(False, run)
        return result

    async def index_names(self) -> list[str]:
        """Return the names of the sorted indexes under this backend's prefix (for transfers)."""
        low, high = self._low, self._high
        cut = len(self.key_prefix)

        def run(conn: sqlite3.Connection) -> list[str]:
            sql = "SELECT DISTINCT name FROM idx WHERE name >= ?"
            params: list[object] = [low]
            if high is not None:
                sql += " AND name < ?"
                params.append(high)
            return [name[cut:] for (name,) in conn.execute(sql, params)]

        result: list[str] = await self._call(False, run)
        return result

    # ---------------------------------------------------------------- writes (writer thread)

    def _put(
        self,
        key: str,
        value: bytes,
        ttl_us: int | None,
        current: schema.Row | None,
        now: int,
    ) -> Change:
        """Stage a write of `key` (flushed with the batch) and return its change."""
        version = current[1] + 1 if current is not None else 1
        created = current[2] if current is not None else now
        old = current[0] if current is not None else None
        full = self.key_prefix + key
        expires = now + ttl_us if ttl_us else None
        self._puts.append((full, value, version, created, now, expires))
        self._logs.append((full, schema.SET, old, value, version, now))
        self._rows[full] = (value, version, created, now, expires)
        return new_change(key, ChangeOp.SET, old, value, version, from_us(now))

    def _current(self, conn: sqlite3.Connection, key: str, now: int) -> schema.Row | None:
        """The live row at `key` as this batch has it so far."""
        full = self.key_prefix + key
        rows = self._rows
        if full in rows:
            return schema.live(rows[full], now)
        row: schema.Row | None = conn.execute(schema.GET, (full,)).fetchone()
        rows[full] = row
        return schema.live(row, now)

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
    ) -> Change:
        """Store `value` at `key`; see `Backend.set`."""
        validate_key(key)
        ttl_us = schema.ttl_us(check_ttl(ttl))
        check_expected_version(expected_version)
        value = schema.as_bytes(value)

        def run(conn: sqlite3.Connection) -> Change:
            now = schema.now_us()
            current = self._current(conn, key, now)
            version = current[1] if current is not None else 0
            if expected_version is not None and expected_version != version:
                raise conflict(key, expected_version, version)
            return self._put(key, value, ttl_us, current, now)

        result: Change = await self._call(True, run, self.key_prefix + key)
        return result

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values in one transaction (and one fsync)."""
        for key, _ in items:
            validate_key(key)
        ttl_us = schema.ttl_us(check_ttl(ttl))
        batch = [(key, schema.as_bytes(value)) for key, value in items]
        prefix = self.key_prefix

        def run(conn: sqlite3.Connection) -> list[Change]:
            self._flush_writes(conn)
            now = schema.now_us()
            keys = list(dict.fromkeys(key for key, _ in batch))
            current: dict[str, schema.Row | None] = {}
            for start in range(0, len(keys), schema.CHUNK):
                chunk = [prefix + key for key in keys[start : start + schema.CHUNK]]
                marks = ",".join("?" * len(chunk))
                sql = f"{schema.SELECT_MANY} ({marks})"
                for full, *row in conn.execute(sql, chunk):
                    current[full[len(prefix) :]] = schema.live(tuple(row), now)
            expires = now + ttl_us if ttl_us else None
            stamp = from_us(now)
            puts, logs, changes = [], [], []
            for key, value in batch:
                row = current.get(key)
                version = row[1] + 1 if row is not None else 1
                created = row[2] if row is not None else now
                old = row[0] if row is not None else None
                puts.append((prefix + key, value, version, created, now, expires))
                logs.append((prefix + key, schema.SET, old, value, version, now))
                current[key] = (value, version, created, now, expires)
                changes.append(new_change(key, ChangeOp.SET, old, value, version, stamp))
            conn.executemany(schema.PUT, puts)
            conn.executemany(schema.LOG, logs)
            self._logged += len(logs)
            self._rows.update((prefix + key, row) for key, row in current.items())
            return changes

        result: list[Change] = await self._call(True, run)
        return result

    async def delete(self, key: str, *, expected_version: int | None = None) -> Change | None:
        """Delete `key`; see `Backend.delete`."""
        validate_key(key)
        check_expected_version(expected_version)

        def run(conn: sqlite3.Connection) -> Change | None:
            now = schema.now_us()
            current = self._current(conn, key, now)
            version = current[1] if current is not None else 0
            if expected_version is not None and expected_version != version:
                raise conflict(key, expected_version, version)
            if current is None:
                return None
            return self._drop(conn, key, current, now)

        result: Change | None = await self._call(True, run, self.key_prefix + key)
        return result

    def _drop(self, conn: sqlite3.Connection, key: str, current: schema.Row, now: int) -> Change:
        """Delete the live row `current` of `key` and log the change (in the writer thread)."""
        full = self.key_prefix + key
        self._flush_writes(conn)  # the staged writes come first, in order
        self._rows[full] = None
        conn.execute("DELETE FROM kv WHERE key = ?", (full,))
        conn.execute(schema.LOG, (full, schema.DELETE, current[0], None, current[1], now))
        self._logged += 1
        return new_change(key, ChangeOp.DELETE, current[0], None, current[1], from_us(now))

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Compare, then write, in one transaction of the writer thread; see `Backend.transact`.

        The step runs inside the batch's `BEGIN IMMEDIATE` transaction, so no other process
        writes between its compares and its writes; its changes go to the `changes` table in
        that same transaction, as `set`'s do.
        """
        checked = check_transaction(compare, then, orelse)

        def run(conn: sqlite3.Connection) -> TxnResult:
            return run_transaction(_SQLiteStep(self, conn, schema.now_us()), *checked)

        result: TxnResult = await self._call(True, run)
        return result

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(entry)` under the database's write lock.

        `fn` runs in the writer thread inside the transaction, so no other process or task
        writes in between: it never needs a retry.
        """
        validate_key(key)
        ttl_us = schema.ttl_us(check_ttl(ttl))

        def run(conn: sqlite3.Connection) -> Change:
            now = schema.now_us()
            current = self._current(conn, key, now)
            value = schema.as_bytes(fn(schema.entry(key, current) if current is not None else None))
            return self._put(key, value, ttl_us, current, now)

        result: Change = await self._call(True, run, self.key_prefix + key)
        return result

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members to a sorted index; see `Backend.index_add`."""
        name = self.key_prefix + validate_key(index)
        checked = check_index_members(members)

        result: int = await self._call(True, lambda conn: _index_add(conn, name, checked))
        return result

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """Remove members from a sorted index; see `Backend.index_remove`."""
        name = self.key_prefix + validate_key(index)
        wanted = list(dict.fromkeys(members))

        result: int = await self._call(True, lambda conn: _index_remove(conn, name, wanted))
        return result

    # ---------------------------------------------------------------- subscriptions

    def changes(
        self,
        pattern: str,
        *,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        since: str | int | None = None,
    ) -> contextlib.AbstractAsyncContextManager[SQLiteChangeStream]:
        """Subscribe to changes of keys matching `pattern`, from every process on the file.

        Args:
            pattern: A Redis glob.
            max_buffer: Changes buffered before the subscription overflows.
            since: A stream's `cursor` from an earlier subscription: first deliver the changes
                committed after it (or, if retention has dropped them, a `RESYNC` change per
                matching key), then the live ones. `None` starts from now.
        """
        if isinstance(since, str):  # until #23 gives SQLite's cursors their own form
            since = int(since) if since.isdigit() else since
        return self._changes(compile_glob(validate_pattern(pattern)), max_buffer, since)  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def _changes(
        self, matcher: GlobMatcher, max_buffer: int, since: int | None
    ) -> AsyncIterator[SQLiteChangeStream]:
        if not self._is_open:
            await self.open()
        assert self._feed is not None  # noqa: S101  # set by open()
        async with self._feed.subscribe(matcher, max_buffer, since) as stream:
            yield stream


class _SQLiteStep:
    """A `TxnTarget` over one write transaction of a `SQLiteBackend` (in its writer thread)."""

    __slots__ = ("_backend", "_conn", "_now")

    def __init__(self, backend: SQLiteBackend, conn: sqlite3.Connection, now: int) -> None:
        self._backend = backend
        self._conn = conn
        self._now = now

    def _name(self, index: str) -> str:
        return self._backend.key_prefix + index

    def txn_get(self, key: str) -> Entry | None:
        row = self._backend._current(self._conn, key, self._now)
        return schema.entry(key, row) if row is not None else None

    def txn_put(self, key: str, value: bytes, ttl: timedelta | None) -> Change:
        backend, now = self._backend, self._now
        current = backend._current(self._conn, key, now)
        return backend._put(key, value, schema.ttl_us(ttl), current, now)

    def txn_delete(self, key: str) -> Change | None:
        backend, now = self._backend, self._now
        current = backend._current(self._conn, key, now)
        return None if current is None else backend._drop(self._conn, key, current, now)

    def txn_score(self, index: str, member: str) -> float | None:
        row = self._conn.execute(
            "SELECT score FROM idx WHERE name = ? AND member = ?", (self._name(index), member)
        ).fetchone()
        return None if row is None else float(row[0])

    def txn_index_add(self, index: str, members: dict[str, float]) -> int:
        return _index_add(self._conn, self._name(index), members)

    def txn_index_remove(self, index: str, members: list[str]) -> int:
        return _index_remove(self._conn, self._name(index), members)

    def txn_index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        sql = "SELECT member, score FROM idx WHERE name = ? ORDER BY score, member LIMIT ?"
        return list(self._conn.execute(sql, (self._name(index), -1 if limit is None else limit)))


def _index_add(conn: sqlite3.Connection, name: str, members: Mapping[str, float]) -> int:
    """Add (or move) members of the index `name`; return how many were new (writer thread)."""
    added = 0
    for member in members:
        found = conn.execute(
            "SELECT 1 FROM idx WHERE name = ? AND member = ?", (name, member)
        ).fetchone()
        added += found is None
    conn.executemany(
        "INSERT OR REPLACE INTO idx VALUES (?, ?, ?)",
        [(name, member, score) for member, score in members.items()],
    )
    return added


def _index_remove(conn: sqlite3.Connection, name: str, members: Sequence[str]) -> int:
    """Remove members of the index `name`; return how many were there (writer thread)."""
    before = conn.total_changes
    conn.executemany("DELETE FROM idx WHERE name = ? AND member = ?", [(name, m) for m in members])
    return conn.total_changes - before
