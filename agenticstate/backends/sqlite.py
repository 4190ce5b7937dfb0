"""SQLiteBackend: an embedded store in one SQLite file that several processes on a host share.

On disk, one database file (plus SQLite's `-wal` and `-shm` files next to it) with three tables:

- `kv`: one row per key (with the backend's `key_prefix`): value bytes, version, created, updated
  and expiry times in microseconds since the epoch, revision and create revision. The key is the
  primary key, so a pattern with a literal prefix (`agent:*`) reads a range of the index, never the
  whole table: O(log n + the range). A listing across entities (`agents:{*}:recovery`) is a
  skip-scan in one read transaction, O(entities x log n + result) (`_keyorder.skip_scan`, with
  the partial index `kv_braced` for keys holding two `}` or more); a pattern with no literal
  prefix reads every key. Expiry is swept through the partial index `kv_expiry`: what expired.
- `changes`: every committed change (key, old and new bytes, version, time) under a sequence
  number, written in the same transaction as the value it describes. The sequence number is the
  change's revision (one sequence per file, shared by every prefix and process on it; trimming keeps
  the newest change, so it never goes back). Subscribers in any process read it in sequence order
  (see `agenticstate.backends._sqlite_feed`).
- `idx`: the sorted indexes (`index_add` / `index_range`).
- `history`: the retained older versions of keys a history rule names (`keep_history`), written
  in the same transaction as the value.
- `meta`: the database's id (`db_id`), a random string made with the schema: feed cursors
  (`s1:<db id>:<seq>`) name it, so a cursor of a deleted and recreated file is recognized.

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

Retention. The `changes` table keeps what the backend's `FeedRetention` says: the last
`max_changes` changes, none older than `max_age` (trimmed by the writer, lazily: a little more is
kept between trims, and the newest change is always kept so that sequence numbers are never
reused). A subscriber that comes back with `since=cursor` replays from there while the table
still holds it; beyond that, `changes` raises `CursorExpiredError` on entry.

Schema versions. `PRAGMA user_version` records the layout; a file of an older layout (version 1,
before the feed cursors and history; version 2, before revisions; version 3, before the index
`kv_braced`) is migrated in place when it is opened writable, in one transaction, and a file of a
newer one is refused.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import anyio
import anyio.to_thread

from agenticstate._checks import duration
from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_key_prefix, validate_pattern
from agenticstate._log import get_logger
from agenticstate._tasks import current_loop, event_factory, threadsafe_scheduler
from agenticstate.backends import _sqlite_schema as schema
from agenticstate.backends._keyorder import skip_plan, skip_scan, tag_scan
from agenticstate.backends._local import feed_from_query, run_transaction
from agenticstate.backends._paths import check_path_text
from agenticstate.backends._sqlite_feed import (
    Feed,
    SQLiteChangeStream,
    format_cursor,
    from_us,
    key_range,
    parse_since,
)
from agenticstate.backends._sqlite_schema import SCHEMA_VERSION
from agenticstate.backends._sqlite_worker import (
    Access,
    Job,
    Worker,
    connect,
    open_errors,
    prepare,
    translated,
)
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    EntryStat,
    FeedRetention,
    FeedSize,
    HistoryRules,
    Put,
    backoff,
    check_expected,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
)
from agenticstate.config import redact_url
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    ConfigurationError,
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence

    from agenticstate._glob import GlobMatcher
    from agenticstate._tasks import EventLike
    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult

__all__ = ["SCHEMA_VERSION", "SQLiteBackend", "SQLiteChangeStream"]


log = get_logger(__name__)

_FEED_DEFAULT = FeedRetention()
_MODES = {  # a URL's ?mode=, as in SQLite's URIs
    "rwc": {"create": True, "read_only": False},
    "rw": {"create": False, "read_only": False},
    "ro": {"create": False, "read_only": True},
}
_ALL_VERSIONS = 1 << 62  # HISTORY_TRIM below this: every version of a key


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def _stop_workers(*workers: Worker) -> None:
    for worker in workers:
        worker.stop()


_T = TypeVar("_T")

_STAT_MANY = (
    "SELECT key, length(value), version, created_at, updated_at, expires_at FROM kv WHERE key IN"
)


class SQLiteBackend(Backend):
    """Keep state in one SQLite database file that every process on the host can open.

    Args:
        path: The database file (created with its directory if missing).
        key_prefix: A namespace before every key; several prefixes share one file.
        synchronous: `"full"` (default: an acknowledged write survives a power loss) or
            `"normal"` (survives a process crash; a power loss may lose the last commits).
        feed: How much of the change feed the `changes` table keeps for subscribers resuming
            with `since=` (the last 10,000 changes by default). SQLite's subscriptions read
            that table, so the feed cannot be turned off: `None` raises `ConfigurationError`.
        history: Keys that keep their older versions: glob patterns to depths (see
            `keep_history`).
        change_retention: The old spelling of `feed=FeedRetention(max_changes=N)`.
        poll_interval: How often a subscribed process checks for other processes' commits.
        lock_timeout: How long a write waits for another process's transaction before it
            raises `BackendTimeoutError`.
        create: Create the database (and its directory) if it is missing (the default). With
            `False`, opening a missing or empty file raises `NotFoundError` and creates
            nothing: what a command that only reads wants.
        read_only: Serve reads only (implies `create=False`): writes raise `BackendError`.
            A store SQLite cannot write (a read-only file, directory or mount) is opened so
            by itself.
        max_value_size: The largest value accepted, in bytes; by default, and at most, the
            largest every write can store and overwrite (`MAX_VALUE_SIZE` less half the key
            prefix's length: a change row holds the old and the new value). A larger value
            raises `TooLargeError` before anything is written.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key_prefix: str = "",
        synchronous: Literal["full", "normal"] = "full",
        feed: FeedRetention | None = _FEED_DEFAULT,
        history: Mapping[str, int] | HistoryRules | None = None,
        change_retention: int | None = None,
        poll_interval: timedelta = timedelta(milliseconds=2),
        lock_timeout: timedelta = timedelta(seconds=30),
        create: bool = True,
        read_only: bool = False,
        max_value_size: int | None = None,
    ) -> None:
        if synchronous not in ("full", "normal"):
            raise ConfigurationError(f"synchronous must be 'full' or 'normal', not {synchronous!r}")
        if change_retention is not None:
            if type(change_retention) is not int or change_retention < 1:
                raise ConfigurationError(
                    f"change_retention must be an int >= 1, not {change_retention!r}"
                )
            if feed is not _FEED_DEFAULT:
                raise ConfigurationError("give feed= or change_retention=, not both")
            feed = FeedRetention(max_changes=change_retention)
        if feed is None:
            raise ConfigurationError(
                "SQLiteBackend cannot turn its change feed off (feed=None): its subscriptions "
                "read the changes table; bound it with FeedRetention(max_changes=, max_age=)"
            )
        if not isinstance(feed, FeedRetention):
            raise ConfigurationError(f"feed must be a FeedRetention, not {feed!r}")
        if str(path) in ("", ":memory:"):
            raise ConfigurationError("SQLiteBackend needs a database file path")
        check_path_text(path, "SQLite database")
        if not isinstance(create, bool) or not isinstance(read_only, bool):
            raise ConfigurationError("create and read_only must be bools")
        self.path = Path(path)
        self.key_prefix = validate_key_prefix(key_prefix)
        self.create = create and not read_only
        self.read_only = read_only
        largest = schema.max_value_size(key_prefix)
        if max_value_size is None:
            max_value_size = largest
        elif type(max_value_size) is not int or not 0 < max_value_size <= largest:
            raise ConfigurationError(
                f"max_value_size must be an int from 1 to {largest} (the most the SQLite "
                f"backend can store and overwrite), not {max_value_size!r}"
            )
        self.max_value_size: int = max_value_size
        """The largest value a write accepts, in bytes (see the `max_value_size` option)."""
        self._access = Access("mode=rw")  # set by the writer thread when it opens the file
        self.synchronous = synchronous
        self.feed: FeedRetention = feed
        if history is not None:
            self.keep_history(history)
        self._poll = duration(poll_interval, "poll_interval", optional=False).total_seconds()
        self._lock_timeout = duration(lock_timeout, "lock_timeout", optional=False).total_seconds()
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
        self._puts: list[tuple[str, bytes, int, int, int, int | None, int, int]] = []
        self._logs: list[tuple[int, str, int, bytes | None, bytes | None, int, int]] = []
        self._history: dict[str, list[tuple[str, int, bytes, int, int | None, int]]] = {}
        self._history_trims: dict[str, int] = {}  # key: drop its versions below this
        self._seq = 0  # the batch's last change sequence number
        self._views = False  # a read-only store of layout 2: read through `revision_views`
        self._db_id = ""
        self._logged = 0  # changes written since the last trim
        self._logged_bytes = 0  # their bytes (values as written), since the last trim by size
        self._bytes_every = max(1, (feed.max_bytes or 0) // 8)  # keeps at most 1/8 more
        self._trim_every = max(1, (feed.max_changes or 0) // 8)  # keeps at most 1/8 more
        self._swept_at = 0.0
        self._aged_at = 0.0
        age = feed.max_age.total_seconds() if feed.max_age is not None else 0.0
        self._age_every = min(1.0, age / 8)  # seconds between trims by age

    @property
    def change_retention(self) -> int | None:
        """The most changes the feed keeps (`feed.max_changes`; the old option's name)."""
        return self.feed.max_changes

    has_revisions = True

    def __repr__(self) -> str:
        return f"SQLiteBackend(path={str(self.path)!r}, key_prefix={self.key_prefix!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteBackend:
        """Create a backend from `sqlite:///absolute/file.db` or `sqlite://relative/file.db`.

        Query parameters: `synchronous`; the feed's retention, `feed_max_changes=N`,
        `feed_max_age=SECONDS` and `feed_max_bytes=N`; `change_retention=N` (the old spelling of
        `feed_max_changes`); `mode`, as in SQLite's own URIs: `rwc` (the default: read, write,
        create), `rw` (`create=False`) or `ro` (`read_only=True`). `feed=off` is refused:
        SQLite's feed cannot be off.
        """
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigurationError(f"sqlite URL {redact_url(url)!r} names no database file")
        feed: list[tuple[str, str]] = []
        for name, value in parse_qsl(parts.query):
            if name == "synchronous":
                options.setdefault("synchronous", value.lower())
            elif name == "mode":
                if value not in _MODES:
                    raise ConfigurationError(
                        f"sqlite URL mode must be one of {', '.join(_MODES)}, not {value!r}"
                    )
                for option, setting in _MODES[value].items():
                    options.setdefault(option, setting)
            elif name == "change_retention" and value.isdigit():
                feed.append(("feed_max_changes", value))
            elif name.startswith("feed"):
                feed.append((name, value))
            else:
                raise ConfigurationError(f"unknown sqlite URL parameter {name!r}")
        feed_from_query(feed, options)
        return cls(path, **options)

    # ---------------------------------------------------------------- opening and closing

    async def open(self) -> None:
        """Open the database (creating it if allowed) and start its threads. Idempotent.

        Opening reads the file's layout without the write lock, so it never waits for another
        process's writer; only a new file, or one of an older layout, takes the lock to be
        created or migrated. A call cancelled while the backend opens leaves no thread or
        connection behind.

        Raises:
            NotFoundError: The file is missing or empty and `create` is off.
            ConfigurationError: The path is a directory or cannot be read, or the file is not
                an agenticstate store (nothing in it is changed).
            BackendError: The file is a store of a newer layout, or SQLite failed.
        """
        if self._is_open:
            return
        if self._closed:
            raise BackendError("this SQLiteBackend is closed")
        if self._open_lock is None:
            self._open_lock = anyio.Lock()
        async with self._open_lock:
            if self._is_open:
                return
            if self._closed:
                raise BackendError("this SQLiteBackend is closed")
            schedule = threadsafe_scheduler()
            writer = Worker(
                "agenticstate-sqlite-write", self._open_writer, self._write_batch, schedule
            )
            reader = Worker(
                "agenticstate-sqlite-read", self._open_reader, self._read_batch, schedule
            )
            try:
                await anyio.to_thread.run_sync(writer.start)
                await anyio.to_thread.run_sync(reader.start)
            except BaseException:
                # Cancelled (or failed) part way: a thread that started ends with its connection.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_stop_workers, writer, reader)
                raise
            self._writer, self._reader = writer, reader
            self._feed = Feed(
                self._open_reader,
                schedule,
                self._read,
                self._db_id,
                self.key_prefix,
                self._poll,
            )
            self._new_event = event_factory()
            self._loop = current_loop()  # its threads hand results back to this loop only
            self._is_open = True

    def _open_writer(self) -> sqlite3.Connection:
        """The writer's connection: the file checked, made or migrated (in the writer thread)."""
        self._access = access = prepare(self.path, create=self.create, read_only=self.read_only)
        with open_errors(self.path):
            schema.check_header(self.path)  # another application's file: refused unopened
            if schema.wal_hides_header(self.path):
                self._probe_copy()
            elif (
                access.params == "mode=ro"
                and not self.path.with_name(f"{self.path.name}-wal").exists()
            ):
                self._probe()
            conn = connect(self.path, access, synchronous=self.synchronous, busy_ms=10_000)
        try:
            with open_errors(self.path):
                layout = schema.inspect_layout(conn, self.path)
                if layout.kind == "empty" and (not self.create or access.read_only):
                    raise NotFoundError(
                        f"no SQLite store at {self.path}: the database holds no tables "
                        f"({'opened without create' if not self.create else access.read_only})"
                    )
                if access.read_only is None:
                    self._db_id = self._install(conn, layout)
                elif layout.is_readable:
                    self._db_id = layout.db_id
                    if layout.needs_views:
                        self._views = True
                        schema.revision_views(conn)
                else:
                    raise BackendError(
                        f"{self.path} has schema version {layout.version} and is "
                        f"{access.read_only}: open it writable once to migrate it"
                    )
                conn.execute(f"PRAGMA journal_size_limit={schema.WAL_SIZE_LIMIT}")
                conn.execute("PRAGMA busy_timeout=0")  # BEGIN IMMEDIATE waits in _begin
        except BaseException:
            conn.close()
            raise
        return conn

    def _probe(self) -> None:
        """Refuse a file that is not a store before a read-only connection reads it.

        A read-only connection to a WAL database makes a `-wal` and `-shm` beside it that it
        cannot remove when it closes; a connection to the file as it is (nobody writes it: it
        has no `-wal`) makes none, so another application's file is refused with nothing left.
        """
        probe = connect(
            self.path, Access("mode=ro&immutable=1"), synchronous=self.synchronous, busy_ms=0
        )
        try:
            schema.inspect_layout(probe, self.path)
        finally:
            probe.close()

    def _probe_copy(self) -> None:
        """Refuse a file that is not a store, read from a private copy of it and its `-wal`.

        An unmarked database with a `-wal` (another application's that crashed or was copied
        as it was, or a store of an earlier layout in use) is read through a copy: a connection
        to the file itself would rewrite its `-shm` and, closing, checkpoint the `-wal` into
        it. The copy costs a read of the database once, and only for such files (a store is
        marked from its first writable open on).
        """
        with tempfile.TemporaryDirectory(prefix="agenticstate-probe-") as folder:
            copy = Path(folder) / "probe.db"
            shutil.copyfile(self.path, copy)
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(self.path.with_name(f"{self.path.name}-wal"), f"{copy}-wal")
            probe = connect(copy, Access("mode=rw"), synchronous="normal", busy_ms=0)
            try:
                schema.inspect_layout(probe, self.path)
            finally:
                probe.close()

    def _install(self, conn: sqlite3.Connection, layout: schema.Layout) -> str:
        """Make a new or older file a current store, under the write lock; its database id.

        A current store needs neither the lock nor a write: it is opened as it is.
        """
        if layout.kind == "current":
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                self._use_wal(conn)
            if not conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'changes_key'"
            ).fetchone():
                # A store written before changes held values by reference: index it once.
                conn.execute("PRAGMA busy_timeout=0")
                self._begin(conn)
                try:
                    conn.execute(schema.CHANGES_KEY)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            return layout.db_id
        self._use_wal(conn)
        conn.execute("PRAGMA busy_timeout=0")  # _begin waits, for lock_timeout at most
        self._begin(conn)
        try:
            layout = schema.inspect_layout(conn, self.path)  # again, under the lock
            db_id = layout.db_id
            if layout.kind != "current":
                db_id = schema.install_layout(conn, layout)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return db_id

    @staticmethod
    def _use_wal(conn: sqlite3.Connection) -> None:
        for attempt in range(100):  # another opener switching the mode: BUSY at once
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or attempt == 99:
                    raise
                time.sleep(0.01)  # the writer thread, never the event loop

    def _open_reader(self) -> sqlite3.Connection:
        with open_errors(self.path):
            conn = connect(self.path, self._access, synchronous=self.synchronous, busy_ms=10_000)
            if self._views:
                schema.revision_views(conn)
            return conn

    async def aclose(self) -> None:
        """Finish queued writes, end every subscription and close the connections. Idempotent.

        Runs to the end even when the calling task is being cancelled (the threads and their
        connections must not outlive the backend); a call while the backend opens waits for
        the open to finish, then closes it.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._open_lock is not None:
                async with self._open_lock:
                    pass  # an open in progress has finished
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
        if write and self._access.read_only is not None:
            raise BackendError(
                f"{self.path} is {self._access.read_only}: this store serves reads only"
            )
        worker = self._writer if write else self._reader
        assert worker is not None  # noqa: S101  # set by open()
        job = Job(fn, self._new_event(), key)
        worker.submit(job)
        await job.event.wait()
        if job.error is not None:
            raise job.error
        return job.result

    async def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return await self._call(False, fn)

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
        not three per write. Every job checks (versions, value sizes, the user's `fn`) before it
        writes, so a job that raises has written nothing and the others go on.

        An SQLite error (a statement a job ran, its staged rows, the commit) is rolled back and
        then each job of the batch runs again in a transaction of its own: a job fails with its
        own error only, never with another's. (So an `update` function may run a second time
        then.) A lock wait that runs out fails every job at once: each would wait as long.
        """
        error = self._run_batch(conn, jobs)
        if error is None:
            self._nudge()
            return
        if len(jobs) == 1 or isinstance(error, BackendTimeoutError):
            for job in jobs:
                job.result, job.error = None, job.error or error
            return
        log.debug("sqlite_batch_split", jobs=len(jobs), error=type(error).__name__)
        for position, job in enumerate(jobs):
            job.result, job.error = None, None
            alone = self._run_batch(conn, [job])
            if alone is None:
                self._nudge()
                continue
            job.error = job.error or alone
            if isinstance(alone, BackendTimeoutError):  # the lock is taken: as long for each
                for rest in jobs[position + 1 :]:
                    rest.result, rest.error = None, alone
                return

    def _run_batch(self, conn: sqlite3.Connection, jobs: list[Job]) -> BackendError | None:
        """Run `jobs` in one transaction: `None` once committed, else the error it rolled back.

        Each job's own error (a conflict, its function's) is on the job, not returned.
        """
        try:
            self._begin(conn)
            (self._seq,) = conn.execute(schema.REVISION).fetchone()
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
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            return translated(exc, f"write to {self.path}")
        finally:
            self._rows.clear()
            self._puts.clear()
            self._logs.clear()
            self._history.clear()
            self._history_trims.clear()
        return None

    def _nudge(self) -> None:
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
        if self._history_trims:  # the old versions go first, then the staged new ones
            conn.executemany(schema.HISTORY_TRIM, self._history_trims.items())
            conn.executemany(
                schema.HISTORY_PUT, [row for rows in self._history.values() for row in rows]
            )
            self._history.clear()
            self._history_trims.clear()

    def _stage_history(
        self,
        full: str,
        key: str,
        version: int,
        value: bytes,
        now: int,
        expires: int | None,
        prior: schema.Row | None,
        revision: int,
    ) -> None:
        """Keep version `version` of `key` if a rule says so, dropping versions past its depth.

        The version it replaces (`prior`) is kept too (written again if it was: the same row),
        so a history whose rule came after the key's last write starts with that version.
        """
        depth = self.history_rules.depth(key)
        if depth < 2:
            return
        rows = self._history.setdefault(full, [])
        trims = self._history_trims
        if version == 1:  # a fresh history: whatever an earlier life of the key left goes
            rows.clear()
            trims[full] = _ALL_VERSIONS
        else:
            trims[full] = max(trims.get(full, 0), version - depth + 1)
            if prior is not None and (not rows or rows[-1][1] != prior[1]):
                rows.append((full, prior[1], prior[0], prior[3], prior[4], prior[5]))
        rows.append((full, version, value, now, expires, revision))
        if len(rows) > depth:
            del rows[:-depth]

    def _maintain(self, conn: sqlite3.Connection) -> None:
        """Trim the feed and sweep expired keys (in the writer's transaction).

        By count every `max_changes / 8` changes, by age every `max_age / 8` (at most 1 s);
        expired keys (and their history) each second.
        """
        self._commits += 1
        retention = self.feed
        if self._logged >= self._trim_every and retention.max_changes is not None:
            self._logged = 0
            conn.execute(
                "DELETE FROM changes WHERE seq <= (SELECT max(seq) FROM changes) - ?",
                (retention.max_changes,),
            )
        if self._logged_bytes >= self._bytes_every and retention.max_bytes is not None:
            self._logged_bytes = 0
            self._trim_by_bytes(conn, retention.max_bytes)
        moment = time.monotonic()
        if retention.max_age is not None and moment - self._aged_at >= self._age_every:
            self._aged_at = moment
            cutoff = schema.now_us() - retention.max_age // timedelta(microseconds=1)
            self._trim_by_age(conn, cutoff)
        if moment - self._swept_at > 1.0:
            self._swept_at = moment
            now = schema.now_us()
            conn.execute(
                "DELETE FROM history WHERE key IN "
                "(SELECT key FROM kv WHERE expires_at IS NOT NULL AND expires_at <= ?)",
                (now,),
            )
            conn.execute("DELETE FROM kv WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))

    @staticmethod
    def _trim_by_bytes(conn: sqlite3.Connection, max_bytes: int) -> None:
        """Drop the oldest changes until the rest hold at most `max_bytes` (writer thread).

        Reads every change's size (the newest first, a running total): it runs once per
        `max_bytes / 8` bytes written. The newest change stays, whatever its size. A change
        holding its new value by reference needs the key's next change: that one is newer, so
        it stays as long as the change does.
        """
        (cut,) = conn.execute(
            f"SELECT max(seq) FROM (SELECT seq, sum({schema.FEED_BYTES}) "  # noqa: S608  # constants
            "OVER (ORDER BY seq DESC) AS total FROM changes) WHERE total > ?",
            (max_bytes,),
        ).fetchone()
        if cut is not None:
            conn.execute(
                "DELETE FROM changes WHERE seq <= ? AND seq < (SELECT max(seq) FROM changes)",
                (cut,),
            )

    @staticmethod
    def _trim_by_age(conn: sqlite3.Connection, cutoff: int) -> None:
        """Drop the changes before the oldest one written at `cutoff` or later (writer thread).

        Reads from the oldest change on, so it costs what it drops; the newest change stays
        even when it is older (its sequence number must not be reused).
        """
        (keep,) = conn.execute(
            "SELECT seq FROM changes WHERE ts >= ? ORDER BY seq LIMIT 1", (cutoff,)
        ).fetchone() or (None,)
        if keep is None:
            conn.execute("DELETE FROM changes WHERE seq < (SELECT max(seq) FROM changes)")
        else:
            conn.execute("DELETE FROM changes WHERE seq < ?", (keep,))

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

        def entry(key: str, row: tuple[Any, ...], now: int) -> Entry | None:
            live = schema.live(row, now)
            return None if live is None else schema.entry(key, live)

        return await self._read_keys(keys, schema.SELECT_MANY, entry)

    async def stat_many(self, keys: Sequence[str]) -> list[EntryStat | None]:
        """Return each key's metadata and stored size without reading values (one read).

        See `Backend.stat_many`: `length(value)` of each row, so a listing's cost does not grow
        with the size of the values.
        """

        def stat(key: str, row: tuple[Any, ...], now: int) -> EntryStat | None:
            size, version, created, updated, expires = row
            if expires is not None and expires <= now:
                return None
            return EntryStat(
                key=key,
                size=size,
                version=version,
                created_at=from_us(created),
                updated_at=from_us(updated),
                expires_at=from_us(expires) if expires is not None else None,
            )

        return await self._read_keys(keys, _STAT_MANY, stat)

    async def _read_keys(
        self,
        keys: Sequence[str],
        select: str,
        make: Callable[[str, tuple[Any, ...], int], _T | None],
    ) -> list[_T | None]:
        """`make(key, row, now)` for each of `keys` (in order; `None`: missing), in one read.

        `select` is a `SELECT key, ... WHERE key IN` statement, run a chunk of keys at a time.
        """
        for key in keys:
            validate_key(key)
        prefix, wanted = self.key_prefix, list(dict.fromkeys(keys))

        def run(conn: sqlite3.Connection) -> list[_T | None]:
            now, found = schema.now_us(), {}
            conn.execute("BEGIN")
            try:
                for start in range(0, len(wanted), schema.CHUNK):
                    chunk = [prefix + key for key in wanted[start : start + schema.CHUNK]]
                    marks = ",".join("?" * len(chunk))
                    for full, *row in conn.execute(f"{select} ({marks})", chunk):
                        key = full[len(prefix) :]
                        made = make(key, tuple(row), now)
                        if made is not None:
                            found[key] = made
            finally:
                conn.execute("COMMIT")
            return [found.get(key) for key in keys]

        result: list[_T | None] = await self._call(False, run)
        return result

    async def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Return each value's stored size without reading values (`stat_many`)."""
        return [None if stat is None else stat.size for stat in await self.stat_many(keys)]

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`, reading the key range its prefix allows.

        A pattern that is a literal prefix and `*` (`agent:*`) is answered by the index range
        alone, O(log n + the range); one across entities (`agents:{*}:recovery`) by a skip-scan
        in one read transaction, O(entities x log n + result); any other is filtered by the glob
        matcher after the range its literal prefix allows is read (all keys if it has none).
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
        plan = skip_plan(pattern)
        if plan is not None:
            keys: list[str] = await self._call(False, self._skip_scan(matcher, *plan))
            for start in range(0, len(keys), schema.PAGE):
                yield keys[start : start + schema.PAGE]
            return
        low, high = key_range(self.key_prefix + matcher.literal_prefix)
        every = schema.is_prefix_pattern(pattern, matcher)
        after: str | None = None
        while True:
            run = self._scan_page(None if every else matcher, low, high, after)
            page, after = await self._call(False, run)
            yield page
            if after is None:
                return

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the keys starting `<prefix>{`; see `Backend.scan_tags`.

        One read transaction of index seeks (`tag_scan`): one per tag, O(tags x log n), never a
        read of a tag's other keys.
        """
        validate_key(prefix + "{")
        tags: list[str] = await self._call(False, self._tag_scan(prefix))
        return tags

    def _first_key(
        self, conn: sqlite3.Connection, now: int
    ) -> Callable[[str, str | None, bool], str | None]:
        """The seek `tag_scan` and `skip_scan` take, on `conn` at time `now`.

        `first(low, high, above)`: the first live key at or above `low` (after it, if `above`)
        and below `high` (else below the prefix's end), relative to the prefix, or `None`.
        """
        full, cut = self.key_prefix, len(self.key_prefix)

        def first(low: str, high: str | None, above: bool) -> str | None:
            sql = "SELECT key FROM kv WHERE key " + ("> ?" if above else ">= ?")  # noqa: S608
            params: list[object] = [full + low]
            if high is not None:
                sql += " AND key < ?"
                params.append(full + high)
            elif self._high is not None:
                sql += " AND key < ?"
                params.append(self._high)
            params.append(now)
            sql += " AND (expires_at IS NULL OR expires_at > ?) ORDER BY key LIMIT 1"
            row = conn.execute(sql, params).fetchone()
            return None if row is None else str(row[0])[cut:]

        return first

    def _tag_scan(self, prefix: str) -> Callable[[sqlite3.Connection], list[str]]:
        def run(conn: sqlite3.Connection) -> list[str]:
            first = self._first_key(conn, schema.now_us())
            conn.execute("BEGIN")
            try:
                return tag_scan(prefix, first)
            finally:
                conn.execute("COMMIT")

        return run

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

    def _skip_scan(
        self, matcher: GlobMatcher, prefix: str, rest: str
    ) -> Callable[[sqlite3.Connection], list[str]]:
        """A listing of `<prefix>*}<rest>` as one read transaction of indexed seeks.

        `skip_scan` over the table: each entity's group of keys costs a seek to its first key,
        the range `<group><rest>` selects, and a seek in `kv_braced` over the group (the keys
        whose `*` would cross a second `}`), never a read of the group's other keys.
        """
        full, cut = self.key_prefix, len(self.key_prefix)
        live = " AND (expires_at IS NULL OR expires_at > ?)"
        # Only placeholders and constants are joined into the SQL below.
        braced_sql = "SELECT key FROM kv WHERE key >= ? AND key < ? AND " + schema.BRACED + live  # noqa: S608

        def run(conn: sqlite3.Connection) -> list[str]:
            now = schema.now_us()
            first = self._first_key(conn, now)

            def select(pattern: str) -> list[str]:
                sub = compile_glob(pattern)
                if sub.is_literal:
                    sql = "SELECT key FROM kv WHERE key = ?" + live  # noqa: S608
                    rows = conn.execute(sql, (full + sub.literal_prefix, now)).fetchall()
                    return [str(key)[cut:] for (key,) in rows]
                low, high = key_range(full + sub.literal_prefix)
                sql = "SELECT key FROM kv WHERE key >= ?"
                params: list[object] = [low]
                if high is not None:
                    sql += " AND key < ?"
                    params.append(high)
                params.append(now)
                keys = [
                    str(key)[cut:] for (key,) in conn.execute(sql + live + " ORDER BY key", params)
                ]
                return keys if sub.is_prefix else [key for key in keys if sub.match(key)]

            def braced(low: str, high: str) -> list[str]:
                rows = conn.execute(braced_sql + " ORDER BY key", (full + low, full + high, now))
                return [str(key)[cut:] for (key,) in rows]

            conn.execute("BEGIN")
            try:
                return skip_scan(prefix, rest, matcher, first, select, braced)
            finally:
                conn.execute("COMMIT")

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
        self._check_size(key, value)  # an update's new value, known only here
        self._seq = seq = self._seq + 1  # the change's sequence number is its revision
        if current is None:
            version, created, old, create_revision = 1, now, None, seq
        else:
            version, created, old, create_revision = (
                current[1] + 1,
                current[2],
                current[0],
                current[6],
            )
        full = self.key_prefix + key
        expires = now + ttl_us if ttl_us else None
        self._puts.append((full, value, version, created, now, expires, seq, create_revision))
        self._logs.append((seq, full, schema.SET, old, _logged(value, expires), version, now))
        self._logged_bytes += len(full) + len(value) + (len(old) if old is not None else 0)
        self._rows[full] = (value, version, created, now, expires, seq, create_revision)
        if self.history_rules:
            self._stage_history(full, key, version, value, now, expires, current, seq)
        cursor = format_cursor(self._db_id, seq)
        return new_change(key, ChangeOp.SET, old, value, version, from_us(now), cursor, seq)

    def _check_size(self, key: str, value: bytes) -> None:
        """Refuse a value over `max_value_size` before it is queued or staged."""
        if len(value) > self.max_value_size:
            raise TooLargeError(
                f"the value for {key!r} is {len(value)} bytes; the SQLite backend stores values "
                f"of at most {self.max_value_size} bytes (max_value_size)",
                path="",
            )

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
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key`; see `Backend.set`."""
        validate_key(key)
        ttl_us = schema.ttl_us(check_ttl(ttl))
        check_expected(expected_version, expected_revision)
        value = schema.as_bytes(value)
        self._check_size(key, value)

        def run(conn: sqlite3.Connection) -> Change:
            now = schema.now_us()
            current = self._current(conn, key, now)
            _check(key, current, expected_version, expected_revision)
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
        for key, value in batch:
            self._check_size(key, value)
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
            seq, tag = self._seq, format_cursor(self._db_id, 0)[:-1]
            history = self._stage_history if self.history_rules else None
            for key, value in batch:
                row = current.get(key)
                seq += 1
                if row is None:
                    version, created, old, create_revision = 1, now, None, seq
                else:
                    version, created, old, create_revision = row[1] + 1, row[2], row[0], row[6]
                puts.append(
                    (prefix + key, value, version, created, now, expires, seq, create_revision)
                )
                logs.append(
                    (seq, prefix + key, schema.SET, old, _logged(value, expires), version, now)
                )
                self._logged_bytes += len(key) + len(value) + (len(old) if old is not None else 0)
                current[key] = (value, version, created, now, expires, seq, create_revision)
                changes.append(
                    new_change(key, ChangeOp.SET, old, value, version, stamp, f"{tag}{seq}", seq)
                )
                if history is not None:
                    history(prefix + key, key, version, value, now, expires, row, seq)
            self._seq = seq
            conn.executemany(schema.PUT, puts)
            conn.executemany(schema.LOG, logs)
            self._logged += len(logs)
            self._rows.update((prefix + key, row) for key, row in current.items())
            self._flush_writes(conn)  # the history it staged
            return changes

        result: list[Change] = await self._call(True, run)
        return result

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key`; see `Backend.delete`."""
        validate_key(key)
        check_expected(expected_version, expected_revision)

        def run(conn: sqlite3.Connection) -> Change | None:
            now = schema.now_us()
            current = self._current(conn, key, now)
            _check(key, current, expected_version, expected_revision)
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
        self._seq = seq = self._seq + 1
        conn.execute("DELETE FROM kv WHERE key = ?", (full,))
        conn.execute(schema.LOG, (seq, full, schema.DELETE, current[0], None, current[1], now))
        self._logged_bytes += len(full) + len(current[0])
        conn.execute(schema.HISTORY_TRIM, (full, _ALL_VERSIONS))  # a delete ends its history
        self._logged += 1
        cursor = format_cursor(self._db_id, seq)
        return new_change(
            key, ChangeOp.DELETE, current[0], None, current[1], from_us(now), cursor, seq
        )

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
        for op in (*checked[1], *checked[2]):
            if isinstance(op, Put):  # all checked first: a step writes all or nothing
                self._check_size(op.key, op.value)

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
            max_buffer: Changes buffered before the subscription overflows (a replay reads
                the table a page at a time as it is consumed, so a long one never overflows).
            since: A `Change.cursor` (`s1:<db id>:<seq>`), `feed_cursor()` or `EARLIEST`:
                first deliver the retained changes after it, then the live ones. `None`
                starts from now. A bare sequence number (an int, or the deprecated
                `SQLiteChangeStream.cursor`) is still accepted.

        Raises (on entry):
            CursorExpiredError: Changes after `since` were trimmed, or it is a cursor of
                another database (this file deleted and made again).
            InvalidArgumentError: `since` is not an SQLite feed cursor, or is one beyond the
                feed's head (forged, or a bare sequence number of another file).
        """
        return self._changes(compile_glob(validate_pattern(pattern)), max_buffer, since)

    @contextlib.asynccontextmanager
    async def _changes(
        self, matcher: GlobMatcher, max_buffer: int, since: str | int | None
    ) -> AsyncIterator[SQLiteChangeStream]:
        if isinstance(since, bool) or not isinstance(since, (str, int, type(None))):
            raise InvalidArgumentError(f"since must be a feed cursor, not {since!r}")
        if not self._is_open:
            await self.open()
        feed = self._feed
        assert feed is not None  # noqa: S101  # set by open()
        start = None if since is None else parse_since(since, self._db_id)
        async with feed.subscribe(matcher, max_buffer, start) as stream:
            yield stream

    async def feed_cursor(self) -> str:
        """The cursor of the newest committed change (a fresh database's: `s1:<id>:0`)."""

        def run(conn: sqlite3.Connection) -> int:
            (last,) = conn.execute("SELECT max(seq) FROM changes").fetchone()
            return int(last or 0)

        seq: int = await self._call(False, run)
        return format_cursor(self._db_id, seq)

    async def feed_size(self) -> FeedSize:
        """The changes the database's feed retains and the bytes they hold (one scan of it)."""

        def run(conn: sqlite3.Connection) -> FeedSize:
            count, held = conn.execute(
                f"SELECT count(*), coalesce(sum({schema.FEED_BYTES}), 0) FROM changes"  # noqa: S608  # constants
            ).fetchone()
            return FeedSize(int(count), int(held))

        size: FeedSize = await self._call(False, run)
        return size

    # ---------------------------------------------------------------- history

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep older versions of the keys `rules` names, from the next write on.

        Each write of such a key stores its version in the `history` table in the same
        transaction, and drops the versions past the rule's depth. Every process writing
        those keys must set the same rules (the writer keeps the history).
        """
        self.history_rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest (the current one) first, in one read.

        See `Backend.history`.
        """
        full = self.key_prefix + validate_key(key)
        limit = check_limit(limit)
        depth = self.history_rules.depth(key)
        want = depth if limit is None else min(depth, limit)
        if want == 0:
            return []

        def run(conn: sqlite3.Connection) -> list[Entry]:
            conn.execute("BEGIN")
            try:
                row = schema.live(conn.execute(schema.GET, (full,)).fetchone(), schema.now_us())
                if row is None:
                    return []
                found = [schema.entry(key, row)]
                if want > 1:
                    found += self._older(conn, key, full, row, "", (want - 1,))
            finally:
                conn.execute("COMMIT")
            return found

        result: list[Entry] = await self._call(False, run)
        return result

    async def get_version(self, key: str, version: int) -> Entry | None:
        """Version `version` of `key` if it is retained (and the key present); one read."""
        full = self.key_prefix + validate_key(key)
        if type(version) is not int or version < 1:
            raise InvalidArgumentError(f"version must be an int >= 1, not {version!r}")
        depth = self.history_rules.depth(key)

        def run(conn: sqlite3.Connection) -> Entry | None:
            conn.execute("BEGIN")
            try:
                row = schema.live(conn.execute(schema.GET, (full,)).fetchone(), schema.now_us())
                if row is None or version > row[1] or version <= row[1] - depth:
                    return None
                if version == row[1]:
                    return schema.entry(key, row)
                older = self._older(conn, key, full, row, " AND version = ?", (version, 1))
            finally:
                conn.execute("COMMIT")
            return older[0] if older else None

        result: Entry | None = await self._call(False, run)
        return result

    @staticmethod
    def _older(
        conn: sqlite3.Connection,
        key: str,
        full: str,
        current: schema.Row,
        where: str,
        params: tuple[int, ...],
    ) -> list[Entry]:
        """Retained versions of `key` older than `current`, newest first (in a read).

        Rows an earlier life of the key left (written before it was created again) are
        passed over, should a writer without the rules have deleted it.
        """
        _, version, created, _, _, _, create_revision = current
        sql = (
            "SELECT version, value, updated_at, expires_at, revision FROM history "  # noqa: S608  # constants
            f"WHERE key = ? AND version < ? AND updated_at >= ? "
            f"AND (revision = 0 OR revision >= ?){where} ORDER BY version DESC LIMIT ?"
        )
        made = from_us(created)
        return [
            Entry(
                key,
                old,
                number,
                made,
                from_us(updated),
                from_us(expires) if expires else None,
                revision,
                create_revision,
            )
            for number, old, updated, expires, revision in conn.execute(
                sql, (full, version, created, create_revision, *params)
            )
        ]


def _logged(value: bytes, expires: int | None) -> bytes | None:
    """What a change row holds of a written value: NULL (by reference) when large and lasting.

    A value with a TTL is carried inline: it may expire with no change to carry it on.
    """
    return None if expires is None and len(value) >= schema.INLINE_MAX else value


def _check(
    key: str,
    current: schema.Row | None,
    expected_version: int | None,
    expected_revision: int | None,
) -> None:
    """Raise `ConflictError` unless the live row `current` is the one expected (writer thread)."""
    if expected_version is not None:
        version = current[1] if current is not None else 0
        if expected_version != version:
            raise conflict(key, expected_version, version)
    if expected_revision is not None:
        revision = current[5] if current is not None else 0
        if expected_revision != revision:
            raise conflict(key, expected_revision, revision, what="revision")


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
