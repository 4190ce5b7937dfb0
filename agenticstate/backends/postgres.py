"""PostgresBackend: state in a PostgreSQL database that any number of processes and hosts share.

Tables (`_postgres_schema`): `kv` (one row per key with the backend's `key_prefix`), `changes`
(the durable change feed), `idx` (sorted indexes), `history` (retained versions), `head` (the
store's last revision) and `meta`, all in one Postgres schema the user names (`agenticstate` by
default). The schema is created, and later migrated, by the first process that opens the store,
under an advisory lock.

Writes. Every write is one transaction that first locks the `head` row (`SELECT ... FOR
UPDATE`), takes its revisions from it, reads the rows it needs, writes the entries, their feed
rows and history, stores the new head and sends one `NOTIFY`, then commits. The head row's lock
is held to commit, so writes to one store are serialised and commit in revision order: a feed
row with a higher sequence number never commits before a lower one. That is what makes "the
rows after my cursor" a complete answer (see "The feed" below). The price is that one store
runs one write transaction at a time: its throughput is one transaction per round trip chain
(a `set` is five statements), across every process. Compare-and-set, `update(fn)` and
`transact` need nothing more: nobody writes between their read and their write.

Reads are single statements in autocommit (a reading call takes one round trip); reads that span
statements (`history`, a feed page with its bounds) run in one `REPEATABLE READ` transaction.
Expired keys read as missing (every read compares `expires_at` with the client's clock) and are
deleted by a writer about once a second through the partial index `kv_expiry`, so the sweep
costs what expired.

The feed. A change's sequence number is its revision. Because revisions are handed out under the
head lock and committed in order, a reader that has seen revision N has seen every revision
below it, and a subscriber resuming "after N" misses nothing. Each backend with subscriptions
keeps one `LISTEN` connection; every write transaction sends one `NOTIFY` (delivered at commit,
one per transaction whatever it wrote), whose payload is empty: the subscriber reads the feed
rows after the last revision it delivered, in one snapshot with the head, and fans them out. A
lost `LISTEN` connection is reopened with backoff and the subscriber catches up from its last
revision: nothing lost, nothing repeated. A catch-up also runs every few seconds without a
notification, a bound on how long a lost notification could delay delivery.

Several processes open one store; the connections come from a `psycopg_pool` pool
(`pool_size`, 10 by default). Passwords and TLS settings are given in the URL or libpq's
environment variables (`PGPASSWORD`, `PGSSLMODE`, a `.pgpass` file); the backend never prints
or logs them (its repr and errors show the URL redacted).

This backend uses psycopg's asyncio API: it runs under asyncio, not trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

import anyio

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_key_prefix, validate_pattern
from agenticstate._log import get_logger
from agenticstate.backends import _postgres_schema as pg_schema
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._keyorder import after_prefix
from agenticstate.backends._local import feed_from_query
from agenticstate.backends._sqlite_feed import from_us, key_range, to_us
from agenticstate.backends._urls import check_url
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    EARLIEST,
    Backend,
    Change,
    ChangeOp,
    Delete,
    Entry,
    EntryStat,
    Exists,
    FeedRetention,
    FeedSize,
    Get,
    HistoryRules,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Revision,
    TxnResult,
    Version,
    backoff,
    check_expected,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
    new_entry,
    utcnow,
)
from agenticstate.config import hide_url_secrets, redact_url
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    CursorExpiredError,
    InvalidArgumentError,
    MissingDependencyError,
    TooLargeError,
    WriteOutcomeUnknownError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

    from agenticstate.backends.base import TxnCompare, TxnOp

__all__ = ["CURSOR_TAG", "SCHEMA_VERSION", "PostgresBackend"]

log = get_logger(__name__)

SCHEMA_VERSION = pg_schema.SCHEMA_VERSION
CURSOR_TAG = "p1"
"""The kind tag every Postgres feed cursor starts with: `p1:<db id>:<revision>`."""

_FEED_DEFAULT = FeedRetention()
_OURS = {
    "schema",
    "key_prefix",
    "pool_size",
    "pool_timeout",
    "feed",
    "feed_max_changes",
    "feed_max_age",
    "feed_max_bytes",
}
# What libpq takes in a URL's query (https://www.postgresql.org/docs/current/libpq-connect.html).
_LIBPQ = {
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "requiressl",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
}
MAX_VALUE_SIZE = 256 * 1024 * 1024
"""The largest value the backend stores by default (a feed row holds the old and new value)."""
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")  # what libpq's URL parser refuses
_SET, _DELETE = 0, 1
_OPS = (ChangeOp.SET, ChangeOp.DELETE)
_PAGE = 1000  # keys per listing page
_FEED_PAGE = 2000  # feed rows per read
_SWEEP_EVERY = 1.0  # seconds between sweeps of expired keys (by a writer)
_IDLE_CATCH_UP = 5.0  # seconds: a subscriber reads the feed at least this often
_ALL = 1 << 62
# Writes whose values total more than this are not pipelined (psycopg's pipeline mode stalls
# with parameters of a few MiB; a plain statement sends them at once).
_PIPELINE_MAX_BYTES = 256 * 1024

# A kv row as selected: value, version, created, updated, expires, revision, create revision.
_ROW = "value, version, created_at, updated_at, expires_at, revision, create_revision"
Row = tuple[bytes, int, int, int, int | None, int, int]


def _import_psycopg() -> Any:
    try:
        import psycopg
        import psycopg_pool
    except ImportError as exc:
        raise MissingDependencyError(exc.name or "psycopg", "postgres") from None
    _quiet_psycopg()
    return psycopg, psycopg_pool


def _quiet_psycopg() -> None:
    """Keep psycopg's and its pool's warnings off stderr unless the application logs.

    A `NullHandler` on the `psycopg` logger stops Python's last-resort handler (which printed
    "discarding broken connection"); records still propagate to the application's handlers.
    """
    logger = logging.getLogger("psycopg")
    if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        logger.addHandler(logging.NullHandler())


def _live(row: Any, now: int) -> Row | None:
    if row is None:
        return None
    expires = row[4]
    if expires is not None and expires <= now:
        return None
    return (bytes(row[0]), row[1], row[2], row[3], expires, row[5], row[6])


def _entry(key: str, row: Row) -> Entry:
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


def _ttl_us(ttl: timedelta | None) -> int | None:
    return None if ttl is None else ttl // timedelta(microseconds=1)


def _now_us() -> int:
    return to_us(utcnow())


class PostgresBackend(Backend):
    """Keep state in a PostgreSQL database (15 or newer) that every process can reach.

    Args:
        url: A libpq URL, `postgresql://[user[:password]@][host][:port][/dbname][?param=...]`
            (`postgres://` too). libpq's parameters (`host=` for a unix socket directory,
            `sslmode`, `sslrootcert`, `connect_timeout`, `options`, ...) and environment
            variables (`PGHOST`, `PGPASSWORD`, `PGSSLMODE`, `.pgpass`) apply as in `psql`.
        schema: The Postgres schema holding the store's tables (created if missing).
        key_prefix: A namespace before every key; several prefixes share one schema.
        feed: How much of the change feed the `changes` table keeps (the last 10,000 changes
            and 64 MiB by default). Subscriptions read that table, so it cannot be off.
        history: Keys that keep their older versions (see `keep_history`).
        pool_size: The most connections the backend holds (plus one per backend with
            subscriptions, for `LISTEN`).
        pool_timeout: How long a call waits for a free connection before it raises
            `BackendTimeoutError`.
        max_value_size: The largest value accepted, in bytes (256 MiB by default and at
            most); a larger one raises `TooLargeError` before anything is written.
    """

    has_revisions = True

    def __init__(
        self,
        url: str = "postgresql://",
        *,
        schema: str = "agenticstate",
        key_prefix: str = "",
        feed: FeedRetention | None = _FEED_DEFAULT,
        history: Mapping[str, int] | HistoryRules | None = None,
        pool_size: int = 10,
        pool_timeout: timedelta = timedelta(seconds=30),
        max_value_size: int | None = None,
    ) -> None:
        if not isinstance(url, str) or url.partition("://")[0].lower() not in (
            "postgresql",
            "postgres",
        ):
            shown = redact_url(url) if isinstance(url, str) else type(url).__name__
            raise ConfigurationError(f"a Postgres URL starts postgresql://, not {shown!r}")
        if _BAD_PERCENT.search(url):
            raise ConfigurationError(
                f"the Postgres URL {redact_url(url)!r} has a '%' not followed by two hex digits "
                "(libpq refuses it): write a '%' in a password or name as %25"
            )
        if feed is None:
            raise ConfigurationError(
                "PostgresBackend cannot turn its change feed off (feed=None): its "
                "subscriptions read the changes table; bound it with FeedRetention(...)"
            )
        if not isinstance(feed, FeedRetention):
            raise ConfigurationError(f"feed must be a FeedRetention, not {feed!r}")
        if type(pool_size) is not int or pool_size < 1:
            raise ConfigurationError(f"pool_size must be an int >= 1, not {pool_size!r}")
        if not isinstance(pool_timeout, timedelta) or pool_timeout <= timedelta(0):
            raise ConfigurationError(
                f"pool_timeout must be a positive timedelta, not {pool_timeout!r}"
            )
        if max_value_size is None:
            max_value_size = MAX_VALUE_SIZE
        elif type(max_value_size) is not int or not 0 < max_value_size <= MAX_VALUE_SIZE:
            raise ConfigurationError(
                f"max_value_size must be an int from 1 to {MAX_VALUE_SIZE}, not {max_value_size!r}"
            )
        self._url = url
        self.schema = pg_schema.check_schema_name(schema)
        self.key_prefix = validate_key_prefix(key_prefix)
        self.feed: FeedRetention = feed
        self.pool_size = pool_size
        self.max_value_size = max_value_size
        self._pool_timeout = pool_timeout.total_seconds()
        if history is not None:
            self.keep_history(history)
        self._low, self._high = key_range(self.key_prefix)
        s = f'"{self.schema}"'
        self._s = s
        self._channel = f"agenticstate_{self.schema}"[:63]
        self._pool: AsyncConnectionPool[Any] | None = None
        self._open_lock: anyio.Lock | None = None
        # This process's writers queue here, not on the head row's lock: one connection waits
        # for the row at a time instead of the pool's every one (a wake-up per hand-over).
        self._write_lock: asyncio.Lock | None = None
        self._db_id = ""
        self._closed = False
        self._feed_state: _Feed | None = None
        self._swept_at = 0.0
        self._aged_at = 0.0
        self._logged = 0
        self._logged_bytes = 0
        self._trim_every = max(1, (feed.max_changes or 0) // 8)
        self._bytes_every = max(1, (feed.max_bytes or 0) // 8)
        age = feed.max_age.total_seconds() if feed.max_age is not None else 0.0
        self._age_every = min(1.0, age / 8)
        self._sql = _Statements(s)

    def __repr__(self) -> str:
        return (
            f"PostgresBackend(url={redact_url(self._url)!r}, schema={self.schema!r}, "
            f"key_prefix={self.key_prefix!r})"
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """Create a backend from `postgresql://...` (or `postgres://...`).

        The query takes libpq's parameters (passed on to it) and these of agenticstate:
        `schema`, `key_prefix`, `pool_size`, `pool_timeout` (seconds), and the feed's retention
        `feed_max_changes=N`, `feed_max_age=SECONDS`, `feed_max_bytes=N`.
        """
        check_url(url)
        params = parse_qsl(url.partition("?")[2].partition("#")[0], keep_blank_values=True)
        for name, _ in params:
            if name not in _OURS and name not in _LIBPQ:
                raise ConfigurationError(
                    f"unknown postgresql:// URL parameter {name!r}: agenticstate's are "
                    f"{', '.join(sorted(_OURS))}, and libpq's connection parameters pass through"
                )
        ours = [(name, value) for name, value in params if name in _OURS]
        libpq = [(name, value) for name, value in params if name not in _OURS]
        feed_from_query(ours, options)
        for name, value in ours:
            try:
                if name in ("schema", "key_prefix"):
                    options.setdefault(name, value)
                elif name == "pool_size":
                    options.setdefault(name, int(value))
                elif name == "pool_timeout":
                    options.setdefault(name, timedelta(seconds=float(value)))
            except (ValueError, OverflowError):
                raise ConfigurationError(f"invalid {name}={value!r} in a postgres URL") from None
        # The URL as written, with agenticstate's parameters taken out of its query (a URL
        # with no host, `postgresql://`, must keep its `//`: urlunsplit would drop it).
        base = url.partition("?")[0]
        return cls(f"{base}?{urlencode(libpq)}" if libpq else base, **options)

    # ---------------------------------------------------------------- connections

    async def open(self) -> None:
        """Open the pool and create or migrate the store's tables; idempotent.

        Raises:
            ConfigurationError: The schema is another application's, or not running under
                asyncio.
            BackendUnavailableError: The server cannot be reached.
        """
        if self._pool is not None:
            return
        if self._closed:
            raise BackendError("this PostgresBackend is closed")
        _require_asyncio()
        if self._open_lock is None:
            self._open_lock = anyio.Lock()
        async with self._open_lock:
            if self._pool is not None:
                return
            psycopg, psycopg_pool = _import_psycopg()
            with self._errors("connect"):
                # One connection first, for the schema: a server that is not there fails
                # here at once (a pool would retry until its timeout).
                conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
            async with conn:
                with self._errors(f"create or check the store in schema {self.schema!r}"):
                    async with conn.transaction():
                        self._db_id = await pg_schema.install(conn, self.schema)
            pool = psycopg_pool.AsyncConnectionPool(
                self._url,
                min_size=1,
                max_size=self.pool_size,
                open=False,
                kwargs={"autocommit": True},
                timeout=self._pool_timeout,
                name=f"agenticstate-{self.schema}",
            )
            try:
                with self._errors("connect"):
                    # Its first connection made now, not by a task later on.
                    await pool.open(wait=True, timeout=self._pool_timeout)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await pool.close()
                raise
            self._pool = pool
            self._feed_state = _Feed(self)

    async def aclose(self) -> None:
        """End every subscription and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._open_lock is not None:
                async with self._open_lock:
                    pass
            feed, self._feed_state = self._feed_state, None
            if feed is not None:
                await feed.close()
            pool, self._pool = self._pool, None
            if pool is not None:
                await pool.close()

    @contextlib.contextmanager
    def _errors(self, doing: str, key: str | None = None) -> Any:
        """Translate psycopg's errors into agenticstate's (their text with secrets hidden)."""
        psycopg, psycopg_pool = _import_psycopg()
        try:
            yield
        except psycopg_pool.PoolTimeout:
            raise BackendTimeoutError(
                f"no free Postgres connection within {self._pool_timeout:g} s to {doing} "
                f"(pool_size={self.pool_size})"
            ) from None
        except psycopg.errors.QueryCanceled as exc:
            raise BackendTimeoutError(
                f"Postgres cancelled the statement to {doing}: {self._hide(exc)}"
            ) from None
        except psycopg.errors.LockNotAvailable as exc:  # lock_timeout: nothing was written
            raise BackendTimeoutError(
                f"Postgres gave up waiting for a lock to {doing}: {self._hide(exc)}"
            ) from None
        except psycopg.errors.ProgramLimitExceeded as exc:
            raise TooLargeError(f"Postgres refused to {doing}: {self._hide(exc)}") from None
        except (psycopg.OperationalError, psycopg_pool.PoolClosed, OSError) as exc:
            if key is not None:
                raise WriteOutcomeUnknownError(
                    key,
                    f"the connection to Postgres failed during a write to {key!r} "
                    f"({self._hide(exc)}): it may or may not have committed; read it to see",
                ) from None
            raise BackendUnavailableError(
                f"Postgres at {redact_url(self._url)} is unavailable ({doing}): {self._hide(exc)}"
            ) from None
        except psycopg.Error as exc:
            raise BackendError(f"Postgres failed to {doing}: {self._hide(exc)}") from None

    def _hide(self, exc: BaseException) -> str:
        return hide_url_secrets(str(exc).strip().splitlines()[0] if str(exc) else "", self._url)

    @contextlib.asynccontextmanager
    async def _connection(self, doing: str, key: str | None = None) -> AsyncIterator[Any]:
        if self._pool is None:
            await self.open()
        _require_asyncio()
        pool = self._pool
        if pool is None:
            raise BackendError("this PostgresBackend is closed")
        with self._errors(doing, key):
            async with pool.connection(timeout=self._pool_timeout) as conn:
                yield conn

    async def _again(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()`, and once more if it met a broken connection before writing anything.

        A pooled connection the server dropped while it was idle (a restart, a failover,
        `pg_terminate_backend`, a proxy's idle timeout) fails its next statement. Then every
        idle connection of the pool is checked (broken ones are replaced) and the call runs
        again. Only reads and writes that failed before their commit was sent come here; a
        write whose commit was sent raises `WriteOutcomeUnknownError` and is never repeated.
        """
        try:
            return await call()
        except BackendUnavailableError:
            pool = self._pool
            if pool is None or self._closed:
                raise
            with contextlib.suppress(Exception):
                await pool.check()
            return await call()

    async def _fetchone(self, sql: bytes, params: Sequence[Any]) -> Any:
        async def call() -> Any:
            async with self._connection("read") as conn:
                cur = await conn.execute(sql, params)
                return await cur.fetchone()

        return await self._again(call)

    async def _fetchall(self, sql: bytes, params: Sequence[Any]) -> list[Any]:
        async def call() -> list[Any]:
            async with self._connection("read") as conn:
                cur = await conn.execute(sql, params)
                rows: list[Any] = await cur.fetchall()
                return rows

        rows: list[Any] = await self._again(call)
        return rows

    async def _write(
        self,
        run: Callable[[_Step], Any],
        key: str | None = None,
        keys: Sequence[str] = (),
        size: int = 0,
    ) -> Any:
        """Run `run(step)` in one write transaction holding the head lock; commit; wake feeds.

        In psycopg's pipeline mode: the transaction's start, the head lock and (in a statement
        after it, so read at the lock) the rows of `keys` (without the prefix) are one round
        trip; the writes, the new head, the notification and the commit are sent together and
        answered in one more. A read the
        step needs besides (another key's row, an index score) is a round trip of its own.

        A write whose values (`size`, in bytes) pass `_PIPELINE_MAX_BYTES` is sent a statement
        at a time instead: psycopg's pipeline stalls on large parameters, so such a write pays
        a round trip per statement (a few, against the transfer of megabytes).

        A connection lost before the commit is sent raises `BackendUnavailableError`: nothing
        was written. Lost at the commit, the outcome is unknown: `WriteOutcomeUnknownError`.
        """
        prefix = self.key_prefix
        fulls = [prefix + name for name in dict.fromkeys(keys)]
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        pipelined = size <= _PIPELINE_MAX_BYTES
        async with self._write_lock:

            async def call() -> Any:
                try:
                    return await self._write_once(run, key, fulls, pipelined)
                except _Unpipelined:
                    return await self._write_once(run, key, fulls, False)

            return await self._again(call)

    async def _write_once(
        self, run: Callable[[_Step], Any], key: str | None, fulls: list[str], pipelined: bool
    ) -> Any:
        async with self._connection("write") as conn:
            done = False
            try:
                async with conn.pipeline() if pipelined else contextlib.nullcontext() as pipe:
                    await conn.execute(b"BEGIN")
                    head = await conn.execute(self._sql.lock_head)
                    # A statement of its own, after the lock: its snapshot sees every write
                    # committed before (a join with the locked row would read older rows).
                    cur = await conn.execute(self._sql.get_many, (fulls,)) if fulls else None
                    row = await head.fetchone()
                    step = _Step(self, conn, int(row[0]), _now_us(), pipelined)
                    if cur is not None:
                        step.preload(fulls, await cur.fetchall())
                    result = await run(step)
                    await step.finish()
                    with self._errors("commit", key or "(transaction)"):
                        await conn.execute(b"COMMIT")
                        if pipe is not None:
                            await pipe.sync()
                done = True
            finally:
                if not done:
                    with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
                        await conn.execute(b"ROLLBACK")
        feed = self._feed_state
        if feed is not None and step.seq != step.start:
            feed.wake()
        return result

    def _check_size(self, key: str, value: bytes) -> None:
        if len(value) > self.max_value_size:
            raise TooLargeError(
                f"value for {key!r} is {len(value)} bytes; this store takes at most "
                f"{self.max_value_size}"
            )

    # ---------------------------------------------------------------- reads

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired (one statement)."""
        full = self.key_prefix + validate_key(key)
        row = _live(await self._fetchone(self._sql.get, (full,)), _now_us())
        return None if row is None else _entry(key, row)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order, in one statement."""
        for key in keys:
            validate_key(key)
        prefix = self.key_prefix
        fulls = [prefix + key for key in dict.fromkeys(keys)]
        if not fulls:
            return []
        rows = await self._fetchall(self._sql.get_many, (fulls,))
        now, cut, found = _now_us(), len(prefix), {}
        for full, *rest in rows:
            row = _live(rest, now)
            if row is not None:
                found[full[cut:]] = _entry(full[cut:], row)
        return [found.get(key) for key in keys]

    async def stat_many(self, keys: Sequence[str]) -> list[EntryStat | None]:
        """Each key's metadata and stored size without reading values (`octet_length`)."""
        for key in keys:
            validate_key(key)
        prefix = self.key_prefix
        fulls = [prefix + key for key in dict.fromkeys(keys)]
        if not fulls:
            return []
        rows = await self._fetchall(self._sql.stat_many, (fulls,))
        now, cut, found = _now_us(), len(prefix), {}
        for full, size, version, created, updated, expires in rows:
            if expires is not None and expires <= now:
                continue
            found[full[cut:]] = EntryStat(
                key=full[cut:],
                size=size,
                version=version,
                created_at=from_us(created),
                updated_at=from_us(updated),
                expires_at=from_us(expires) if expires is not None else None,
            )
        return [found.get(key) for key in keys]

    async def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each value's stored size without reading values (`stat_many`)."""
        return [None if stat is None else stat.size for stat in await self.stat_many(keys)]

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`, in key order, a page at a time.

        Reads the range of the primary key the pattern's literal prefix allows, O(log n + the
        range); a pattern with no literal prefix reads every key of the prefix.
        """
        async for page in self.scan_batches(pattern):
            for key in page:
                yield key

    async def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        """Yield the present keys matching `pattern` a page (up to 1,000) at a time."""
        matcher = compile_glob(validate_pattern(pattern))
        cut = len(self.key_prefix)
        if matcher.is_literal:
            entry = await self.get(matcher.literal_prefix)
            if entry is not None:
                yield [entry.key]
            return
        low, high = key_range(self.key_prefix + matcher.literal_prefix)
        every = matcher.is_prefix
        after: str | None = None
        while True:
            sql, params = self._sql.page(low if after is None else after, after is not None, high)
            rows = await self._fetchall(sql, (*params, _now_us()))
            keys = [str(row[0])[cut:] for row in rows]
            page = keys if every else [key for key in keys if matcher.match(key)]
            if page:
                yield page
            if len(rows) < _PAGE:
                return
            after = str(rows[-1][0])

    async def _first(self, low: str, high: str | None, above: bool) -> str | None:
        """The first live key at or above `low` (after it, if `above`), below `high`."""
        prefix = self.key_prefix
        bound = prefix + high if high is not None else self._high
        sql, params = self._sql.first(prefix + low, above, bound)
        row = await self._fetchone(sql, (*params, _now_us()))
        return None if row is None else str(row[0])[len(prefix) :]

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the keys starting `<prefix>{`; see `Backend.scan_tags`.

        One index seek per tag (to its group's first key, then past the group), O(tags x
        log n), never a read of a tag's other keys.
        """
        validate_key(prefix + "{")
        start = prefix + "{"
        high = after_prefix(start)
        tags: list[str] = []
        low, above = start, False
        while True:
            key = await self._first(low, high, above)
            if key is None:
                break
            cut = key.find("}", len(start))
            if cut < 0:
                low, above = key, True
                continue
            tags.append(key[len(start) : cut])
            end = after_prefix(key[: cut + 1])
            assert end is not None  # noqa: S101  # the group ends with `}`, below U+10FFFF
            low, above = end, False
        tags.sort()
        return tags

    # ---------------------------------------------------------------- writes

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key` in one transaction; see `Backend.set`."""
        validate_key(key)
        value = _as_bytes(key, value)
        self._check_size(key, value)
        ttl_us = _ttl_us(check_ttl(ttl))
        check_expected(expected_version, expected_revision)

        async def run(step: _Step) -> Change:
            current = await step.current(key)
            _check(key, current, expected_version, expected_revision)
            return await step.put(key, value, ttl_us, current)

        result: Change = await self._write(run, key, (key,), len(value))
        return result

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values in one transaction (each write is its own change)."""
        checked = []
        for key, value in items:
            validate_key(key)
            data = _as_bytes(key, value)
            self._check_size(key, data)
            checked.append((key, data))
        ttl_us = _ttl_us(check_ttl(ttl))
        if not checked:
            return []

        async def run(step: _Step) -> list[Change]:
            return [
                await step.put(key, data, ttl_us, await step.current(key)) for key, data in checked
            ]

        result: list[Change] = await self._write(
            run, checked[0][0], [key for key, _ in checked], sum(len(data) for _, data in checked)
        )
        return result

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key` in one transaction; see `Backend.delete`."""
        validate_key(key)
        check_expected(expected_version, expected_revision)

        async def run(step: _Step) -> Change | None:
            current = await step.current(key)
            _check(key, current, expected_version, expected_revision)
            return None if current is None else await step.drop(key, current)

        result: Change | None = await self._write(run, key, (key,))
        return result

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(entry)` inside one write transaction.

        `fn` runs while the transaction holds the store's head lock, so no other writer comes
        between its read and its write: it runs once, never retried.
        """
        validate_key(key)
        ttl_us = _ttl_us(check_ttl(ttl))

        async def run(step: _Step) -> Change:
            current = await step.current(key)
            value = _as_bytes(key, fn(_entry(key, current) if current is not None else None))
            self._check_size(key, value)
            return await step.put(key, value, ttl_us, current)

        result: Change = await self._write(run, key, (key,))
        return result

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Compare, then write, in one Postgres transaction; see `Backend.transact`."""
        checked = check_transaction(compare, then, orelse)
        for op in (*checked[1], *checked[2]):
            if isinstance(op, Put):
                self._check_size(op.key, op.value)

        async def run(step: _Step) -> TxnResult:
            return await _run_transaction(step, *checked)

        named = [item.key for item in checked[0]]
        named += [op.key for op in (*checked[1], *checked[2]) if isinstance(op, (Get, Put, Delete))]
        size = sum(len(op.value) for op in (*checked[1], *checked[2]) if isinstance(op, Put))
        result: TxnResult = await self._write(run, None, named, size)
        return result

    # ---------------------------------------------------------------- indexes

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members to a sorted index (one statement); see `Backend.index_add`."""
        name = self.key_prefix + validate_key(index)
        checked = check_index_members(members)
        if not checked:
            return 0
        async with self._connection("write an index") as conn:
            return await _index_add(conn, self._sql, name, checked)

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """Remove members from a sorted index; see `Backend.index_remove`."""
        name = self.key_prefix + validate_key(index)
        wanted = [validate_key(member) for member in dict.fromkeys(members)]
        if not wanted:
            return 0
        async with self._connection("write an index") as conn:
            return await _index_remove(conn, self._sql, name, wanted)

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Members with scores, lowest first (ties by member); see `Backend.index_range`."""
        name = self.key_prefix + validate_key(index)
        limit = check_limit(limit)
        rows = await self._fetchall(self._sql.index_range, (name, limit))
        return [(str(member), float(score)) for member, score in rows]

    async def index_names(self) -> list[str]:
        """The names of the sorted indexes under this backend's prefix (for transfers).

        A skip over the primary key `(name, member)`, one seek per index: O(indexes x log n).
        """
        prefix, cut = self.key_prefix, len(self.key_prefix)
        names: list[str] = []
        low, above = prefix, False
        while True:
            row = await self._fetchone(
                self._sql.next_index(above, self._high is not None),
                (low, self._high) if self._high is not None else (low,),
            )
            if row is None:
                return names
            name = str(row[0])
            names.append(name[cut:])
            low, above = name, True

    # ---------------------------------------------------------------- history

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep older versions of the keys `rules` names, from the next write on.

        Each write of such a key stores its version in the `history` table in the same
        transaction. Every process writing those keys must set the same rules.
        """
        self.history_rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest (the current one) first; one snapshot."""
        full = self.key_prefix + validate_key(key)
        limit = check_limit(limit)
        depth = self.history_rules.depth(key)
        want = depth if limit is None else min(depth, limit)
        if want == 0:
            return []
        async with self._connection("read history") as conn, conn.transaction():
            await conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur = await conn.execute(self._sql.get, (full,))
            row = _live(await cur.fetchone(), _now_us())
            if row is None:
                return []
            found = [_entry(key, row)]
            if want > 1:
                found += await self._older(conn, key, full, row, None, want - 1)
        return found

    async def get_version(self, key: str, version: int) -> Entry | None:
        """Version `version` of `key` if it is retained (and the key present)."""
        full = self.key_prefix + validate_key(key)
        if type(version) is not int or version < 1:
            raise InvalidArgumentError(f"version must be an int >= 1, not {version!r}")
        depth = self.history_rules.depth(key)
        async with self._connection("read history") as conn, conn.transaction():
            await conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur = await conn.execute(self._sql.get, (full,))
            row = _live(await cur.fetchone(), _now_us())
            if row is None or version > row[1] or version <= row[1] - depth:
                return None
            if version == row[1]:
                return _entry(key, row)
            older = await self._older(conn, key, full, row, version, 1)
        return older[0] if older else None

    async def _older(
        self, conn: Any, key: str, full: str, current: Row, version: int | None, limit: int
    ) -> list[Entry]:
        """Retained versions of `key` older than `current`, newest first.

        Rows an earlier life of the key left (before it was created again) are passed over.
        """
        _, number, created, _, _, _, create_revision = current
        cur = await conn.execute(
            self._sql.older, (full, number, create_revision, version, version, limit)
        )
        made = from_us(created)
        return [
            Entry(
                key,
                bytes(old),
                v,
                made,
                from_us(updated),
                from_us(expires) if expires is not None else None,
                revision,
                create_revision,
            )
            for v, old, updated, expires, revision in await cur.fetchall()
        ]

    # ---------------------------------------------------------------- the feed

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[ChangeStream]:
        """Subscribe to changes of keys matching `pattern`, from every process on the store.

        `since` is a `Change.cursor` (`p1:<db id>:<revision>`), `feed_cursor()` or `EARLIEST`:
        the retained changes after it come first, then the live ones (see `Backend.changes`).
        """
        return self._changes(validate_pattern(pattern), max_buffer, since)

    @contextlib.asynccontextmanager
    async def _changes(
        self, pattern: str, max_buffer: int, since: str | None
    ) -> AsyncIterator[ChangeStream]:
        if since is not None and not isinstance(since, str):
            raise InvalidArgumentError(f"since must be a feed cursor, not {since!r}")
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        if self._pool is None:
            await self.open()
        feed = self._feed_state
        if feed is None:
            raise BackendError("this PostgresBackend is closed")
        after = None if since is None else self._parse_since(since)
        async with feed.subscribe(pattern, max_buffer, after, since) as stream:
            yield stream

    def _parse_since(self, since: str) -> int | None:
        """The revision after which `since` resumes (`None`: the oldest retained)."""
        if since == EARLIEST:
            return None
        parts = since.split(":")
        if (
            len(parts) == 3
            and parts[0] == CURSOR_TAG
            and parts[1].isascii()
            and parts[1].isalnum()
            and parts[2].isascii()
            and parts[2].isdigit()
        ):
            if parts[1] != self._db_id:
                raise CursorExpiredError(
                    since, f"cursor {since!r} belongs to another store than this one"
                )
            return int(parts[2])
        raise InvalidArgumentError(
            f"since must be a Postgres feed cursor ('{CURSOR_TAG}:...') or EARLIEST, not {since!r}"
        )

    def _cursor(self, seq: int) -> str:
        return f"{CURSOR_TAG}:{self._db_id}:{seq}"

    async def feed_cursor(self) -> str:
        """The cursor of the newest committed change (a new store's: `p1:<id>:0`)."""
        row = await self._fetchone(self._sql.head, ())
        return self._cursor(int(row[0]))

    async def feed_size(self) -> FeedSize:
        """The changes the store's feed retains and the bytes they hold (one scan of it)."""
        row = await self._fetchone(self._sql.feed_size, ())
        return FeedSize(int(row[0]), int(row[1]))

    async def _feed_rows(self, conn: Any, after: int, upto: int) -> list[tuple[int, Change]]:
        """The prefix's changes with `after < seq <= upto`, in order (a page at most)."""
        if self._high is None:
            cur = await conn.execute(
                self._sql.feed_rows, (after, upto, self.key_prefix, _FEED_PAGE)
            )
        else:
            cur = await conn.execute(
                self._sql.feed_rows_below, (after, upto, self.key_prefix, self._high, _FEED_PAGE)
            )
        cut = len(self.key_prefix)
        out = []
        for seq, full, op, old, new, version, ts in await cur.fetchall():
            out.append(
                (
                    seq,
                    new_change(
                        str(full)[cut:],
                        _OPS[op],
                        bytes(old) if old is not None else None,
                        bytes(new) if new is not None else None,
                        version,
                        from_us(ts),
                        self._cursor(seq),
                        seq,
                    ),
                )
            )
        return out


def _require_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            "PostgresBackend runs under asyncio (psycopg's async API), not trio"
        ) from None


def _as_bytes(key: str, value: object) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgumentError(f"the value for {key!r} must be bytes, not {type(value).__name__}")


def _check(
    key: str, current: Row | None, expected_version: int | None, expected_revision: int | None
) -> None:
    if expected_version is not None:
        version = current[1] if current is not None else 0
        if expected_version != version:
            raise conflict(key, expected_version, version)
    if expected_revision is not None:
        revision = current[5] if current is not None else 0
        if expected_revision != revision:
            raise conflict(key, expected_revision, revision, what="revision")


class _Statements:
    """The SQL of one schema, built once (only the quoted schema name is joined in)."""

    def __init__(self, s: str) -> None:
        self.s = s
        self.lock_head = f"SELECT seq FROM {s}.head WHERE id = 1 FOR UPDATE".encode()
        self.head = f"SELECT seq FROM {s}.head WHERE id = 1".encode()
        self.set_head = (
            f"WITH moved AS (UPDATE {s}.head SET seq = %s WHERE id = 1) SELECT pg_notify(%s, '')"
        ).encode()
        self.get = f"SELECT {_ROW} FROM {s}.kv WHERE key = %s".encode()
        self.get_many = f"SELECT key, {_ROW} FROM {s}.kv WHERE key = ANY(%s)".encode()
        self.stat_many = (
            f"SELECT key, octet_length(value), version, created_at, updated_at, expires_at "
            f"FROM {s}.kv WHERE key = ANY(%s)"
        ).encode()
        self.put = (
            f"INSERT INTO {s}.kv VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO "
            "UPDATE SET value = excluded.value, version = excluded.version, created_at = "
            "excluded.created_at, updated_at = excluded.updated_at, expires_at = "
            "excluded.expires_at, revision = excluded.revision, create_revision = "
            "excluded.create_revision"
        ).encode()
        # The entry and its change in one statement (one message of the pipeline).
        self.put_log = (
            b"WITH put AS ("
            + self.put
            + b") "
            + f"INSERT INTO {s}.changes VALUES (%s, %s, %s, %s, %s, %s, %s)".encode()
        )
        self.delete = f"DELETE FROM {s}.kv WHERE key = %s".encode()
        self.log = f"INSERT INTO {s}.changes VALUES (%s, %s, %s, %s, %s, %s, %s)".encode()
        self.history_clear = f"DELETE FROM {s}.history WHERE key = %s".encode()
        self.history_put = (
            f"INSERT INTO {s}.history VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key, version) "
            "DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at, "
            "expires_at = excluded.expires_at, revision = excluded.revision"
        ).encode()
        self.history_keep = (
            f"INSERT INTO {s}.history VALUES (%s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (key, version) DO NOTHING"
        ).encode()
        self.history_trim = f"DELETE FROM {s}.history WHERE key = %s AND version < %s".encode()
        self.older = (
            f"SELECT version, value, updated_at, expires_at, revision FROM {s}.history "
            "WHERE key = %s AND version < %s AND revision >= %s "
            "AND (%s::bigint IS NULL OR version = %s) ORDER BY version DESC LIMIT %s"
        ).encode()
        self.sweep_history = (
            f"DELETE FROM {s}.history WHERE key IN (SELECT key FROM {s}.kv "
            "WHERE expires_at IS NOT NULL AND expires_at <= %s)"
        ).encode()
        self.sweep = (
            f"DELETE FROM {s}.kv WHERE expires_at IS NOT NULL AND expires_at <= %s"
        ).encode()
        self.trim_count = f"DELETE FROM {s}.changes WHERE seq <= %s".encode()
        self.trim_age = (
            f"DELETE FROM {s}.changes WHERE seq < coalesce((SELECT seq FROM {s}.changes "
            "WHERE ts >= %s ORDER BY seq LIMIT 1), %s)"
        ).encode()
        self.trim_bytes = (
            f"DELETE FROM {s}.changes WHERE seq < %s AND seq <= (SELECT max(seq) FROM "
            f"(SELECT seq, sum(octet_length(key) + coalesce(octet_length(old), 0) + "
            "coalesce(octet_length(new), 0) + 32) OVER (ORDER BY seq DESC) AS total "
            f"FROM {s}.changes) AS sized WHERE total > %s)"
        ).encode()
        self.feed_size = (
            f"SELECT count(*), coalesce(sum(octet_length(key) + coalesce(octet_length(old), 0) "
            f"+ coalesce(octet_length(new), 0) + 32), 0) FROM {s}.changes"
        ).encode()
        self.feed_bounds = (
            f"SELECT (SELECT seq FROM {s}.head WHERE id = 1), (SELECT min(seq) FROM {s}.changes)"
        ).encode()
        self.feed_rows = (
            f"SELECT seq, key, op, old, new, version, ts FROM {s}.changes "
            "WHERE seq > %s AND seq <= %s AND key >= %s ORDER BY seq LIMIT %s"
        ).encode()
        self.feed_rows_below = (
            f"SELECT seq, key, op, old, new, version, ts FROM {s}.changes "
            "WHERE seq > %s AND seq <= %s AND key >= %s AND key < %s ORDER BY seq LIMIT %s"
        ).encode()
        self.index_range = (
            f"SELECT member, score FROM {s}.idx WHERE name = %s ORDER BY score, member LIMIT %s"
        ).encode()
        self.index_add = (
            f"INSERT INTO {s}.idx SELECT %s, member, score FROM unnest(%s::text[], "
            "%s::float8[]) AS m(member, score) ON CONFLICT (name, member) DO UPDATE SET "
            "score = excluded.score RETURNING (xmax = 0)"
        ).encode()
        self.index_remove = (
            f"DELETE FROM {s}.idx WHERE name = %s AND member = ANY(%s::text[]) RETURNING 1"
        ).encode()
        self.index_score = (
            f"SELECT score FROM {s}.idx WHERE name = %s AND member = %s FOR UPDATE"
        ).encode()

    def next_index(self, above: bool, bounded: bool) -> bytes:
        sql = f"SELECT name FROM {self.s}.idx WHERE name {'>' if above else '>='} %s"
        if bounded:
            sql += " AND name < %s"
        return (sql + " ORDER BY name LIMIT 1").encode()

    def page(self, low: str, above: bool, high: str | None) -> tuple[bytes, tuple[Any, ...]]:
        sql = f"SELECT key FROM {self.s}.kv WHERE key {'>' if above else '>='} %s"
        params: tuple[Any, ...] = (low,)
        if high is not None:
            sql += " AND key < %s"
            params += (high,)
        sql += f" AND (expires_at IS NULL OR expires_at > %s) ORDER BY key LIMIT {_PAGE}"
        return sql.encode(), params

    def first(self, low: str, above: bool, high: str | None) -> tuple[bytes, tuple[Any, ...]]:
        sql = f"SELECT key FROM {self.s}.kv WHERE key {'>' if above else '>='} %s"
        params: tuple[Any, ...] = (low,)
        if high is not None:
            sql += " AND key < %s"
            params += (high,)
        sql += " AND (expires_at IS NULL OR expires_at > %s) ORDER BY key LIMIT 1"
        return sql.encode(), params


async def _index_add(conn: Any, sql: _Statements, name: str, members: Mapping[str, float]) -> int:
    cur = await conn.execute(sql.index_add, (name, list(members), list(members.values())))
    return sum(1 for (inserted,) in await cur.fetchall() if inserted)


async def _index_remove(conn: Any, sql: _Statements, name: str, members: list[str]) -> int:
    cur = await conn.execute(sql.index_remove, (name, members))
    return len(await cur.fetchall())


class _Unpipelined(Exception):  # noqa: N818  # a signal, not an error
    """A write in the pipeline met a large value: `_write` runs it again statement by statement."""


class _Step:
    """One write transaction of a `PostgresBackend`: reads see its own writes.

    `seq` is the last revision handed out (the head row's value as the transaction locked it,
    plus what it wrote); `finish` stores it back, notifies and does the upkeep.
    """

    __slots__ = ("_backend", "_conn", "_rows", "_sql", "now", "pipelined", "seq", "start")

    def __init__(
        self, backend: PostgresBackend, conn: Any, seq: int, now: int, pipelined: bool
    ) -> None:
        self._backend = backend
        self._conn = conn
        self.pipelined = pipelined
        self._sql = backend._sql
        self._rows: dict[str, Row | None] = {}
        self.seq = self.start = seq
        self.now = now

    def preload(self, fulls: list[str], rows: list[Any]) -> None:
        """Take the rows read with the head lock: `fulls` (prefixed keys), `(key, *row)` each."""
        known: dict[str, Row | None] = dict.fromkeys(fulls)
        for full, *rest in rows:
            known[str(full)] = _live(rest, self.now)
        self._rows.update(known)

    async def prefetch(self, keys: list[str]) -> None:
        prefix = self._backend.key_prefix
        fulls = [prefix + key for key in dict.fromkeys(keys)]
        cur = await self._conn.execute(self._sql.get_many, (fulls,))
        rows: dict[str, Row | None] = dict.fromkeys(fulls)
        for full, *rest in await cur.fetchall():
            rows[str(full)] = _live(rest, self.now)
        self._rows.update(rows)

    async def current(self, key: str) -> Row | None:
        full = self._backend.key_prefix + key
        if full in self._rows:
            return self._rows[full]
        cur = await self._conn.execute(self._sql.get, (full,))
        row = _live(await cur.fetchone(), self.now)
        self._rows[full] = row
        return row

    def _check_pipeline(self, size: int) -> None:
        """Leave the pipeline (`_Unpipelined`) before sending `size` bytes of values in it."""
        if self.pipelined and size > _PIPELINE_MAX_BYTES:
            raise _Unpipelined

    async def put(self, key: str, value: bytes, ttl_us: int | None, current: Row | None) -> Change:
        backend, conn, sql, now = self._backend, self._conn, self._sql, self.now
        self._check_pipeline(len(value) + (len(current[0]) * 2 if current is not None else 0))
        full = backend.key_prefix + key
        self.seq = seq = self.seq + 1
        expires = now + ttl_us if ttl_us is not None else None
        if current is None:
            version, created, create_revision, old = 1, now, seq, None
        else:
            version, created, create_revision, old = (
                current[1] + 1,
                current[2],
                current[6],
                current[0],
            )
        await conn.execute(
            sql.put_log,
            # The entry's row, then its change's.
            (
                *(full, value, version, created, now, expires, seq, create_revision),
                *(seq, full, _SET, old, value, version, now),
            ),
        )
        backend._logged += 1
        backend._logged_bytes += len(full) + len(value) + (len(old) if old is not None else 0)
        row: Row = (value, version, created, now, expires, seq, create_revision)
        self._rows[full] = row
        depth = backend.history_rules.depth(key)
        if depth >= 2:
            if version == 1:
                await conn.execute(sql.history_clear, (full,))
            else:
                if current is not None:  # the version it replaces starts a history made now
                    await conn.execute(
                        sql.history_keep,
                        (full, current[1], current[0], current[3], current[4], current[5]),
                    )
                await conn.execute(sql.history_trim, (full, version - depth + 1))
            await conn.execute(sql.history_put, (full, version, value, now, expires, seq))
        return new_change(
            key, ChangeOp.SET, old, value, version, from_us(now), backend._cursor(seq), seq
        )

    async def drop(self, key: str, current: Row) -> Change:
        backend, conn, sql, now = self._backend, self._conn, self._sql, self.now
        self._check_pipeline(len(current[0]))
        full = backend.key_prefix + key
        self.seq = seq = self.seq + 1
        await conn.execute(sql.delete, (full,))
        await conn.execute(sql.log, (seq, full, _DELETE, current[0], None, current[1], now))
        await conn.execute(sql.history_clear, (full,))
        backend._logged += 1
        backend._logged_bytes += len(full) + len(current[0])
        self._rows[full] = None
        return new_change(
            key,
            ChangeOp.DELETE,
            current[0],
            None,
            current[1],
            from_us(now),
            backend._cursor(seq),
            seq,
        )

    async def finish(self) -> None:
        """Store the new head, notify the subscribers (at commit), trim and sweep."""
        backend, conn, sql = self._backend, self._conn, self._sql
        if self.seq != self.start:
            await conn.execute(sql.set_head, (self.seq, backend._channel))
        retention = backend.feed
        if backend._logged >= backend._trim_every and retention.max_changes is not None:
            backend._logged = 0
            await conn.execute(sql.trim_count, (self.seq - retention.max_changes,))
        if backend._logged_bytes >= backend._bytes_every and retention.max_bytes is not None:
            backend._logged_bytes = 0
            await conn.execute(sql.trim_bytes, (self.seq, retention.max_bytes))
        moment = time.monotonic()
        if retention.max_age is not None and moment - backend._aged_at >= backend._age_every:
            backend._aged_at = moment
            cutoff = self.now - retention.max_age // timedelta(microseconds=1)
            await conn.execute(sql.trim_age, (cutoff, self.seq))
        if moment - backend._swept_at > _SWEEP_EVERY:
            backend._swept_at = moment
            await conn.execute(sql.sweep_history, (self.now,))
            await conn.execute(sql.sweep, (self.now,))

    # The transaction step's operations (`_run_transaction`).

    async def txn_get(self, key: str) -> Entry | None:
        row = await self.current(key)
        return None if row is None else _entry(key, row)

    async def txn_put(self, key: str, value: bytes, ttl: timedelta | None) -> Change:
        return await self.put(key, value, _ttl_us(ttl), await self.current(key))

    async def txn_delete(self, key: str) -> Change | None:
        current = await self.current(key)
        return None if current is None else await self.drop(key, current)

    def _name(self, index: str) -> str:
        return self._backend.key_prefix + index

    async def txn_index_incr(self, index: str, member: str, delta: float) -> float:
        """Add `delta` to the member's score (locked), as floats add: an overflow is infinite.

        Computed here, not in SQL: Postgres raises on a float8 sum past its range.
        """
        name = self._name(index)
        cur = await self._conn.execute(self._sql.index_score, (name, member))
        row = await cur.fetchone()
        score = (float(row[0]) if row is not None else 0.0) + delta
        await _index_add(self._conn, self._sql, name, {member: score})
        return score

    async def txn_index_add(self, index: str, members: dict[str, float]) -> int:
        if not members:
            return 0
        return await _index_add(self._conn, self._sql, self._name(index), members)

    async def txn_index_remove(self, index: str, members: list[str]) -> int:
        if not members:
            return 0
        return await _index_remove(self._conn, self._sql, self._name(index), members)

    async def txn_index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        cur = await self._conn.execute(self._sql.index_range, (self._name(index), limit))
        return [(str(member), float(score)) for member, score in await cur.fetchall()]


async def _run_transaction(
    step: _Step, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp]
) -> TxnResult:
    """`run_transaction` (`_local`) over a Postgres write transaction, awaiting each step."""
    succeeded = True
    for item in compare:
        entry = await step.txn_get(item.key)
        if type(item) is Version:
            holds = (entry.version if entry is not None else 0) == item.version
        elif type(item) is Revision:
            holds = (entry.revision if entry is not None else 0) == item.revision
        else:
            assert type(item) is Exists  # noqa: S101  # check_transaction allows no other
            holds = entry is not None
        if not holds:
            succeeded = False
            break
    results: list[Any] = []
    for op in then if succeeded else orelse:
        match op:
            case Get(key=key):
                results.append(await step.txn_get(key))
            case Put(key=key, value=value, ttl=ttl):
                results.append(await step.txn_put(key, value, ttl))
            case Delete(key=key):
                results.append(await step.txn_delete(key))
            case IndexAdd(index=index, members=members):
                results.append(await step.txn_index_add(index, dict(members)))
            case IndexRemove(index=index, members=members):
                results.append(await step.txn_index_remove(index, list(dict.fromkeys(members))))
            case IndexIncr(index=index, member=member, delta=delta):
                results.append(await step.txn_index_incr(index, member, delta))
            case IndexRange(index=index, limit=limit):
                results.append(await step.txn_index_range(index, limit))
    return TxnResult(succeeded, results)


class _Feed:
    """One backend's subscriptions: a `LISTEN` connection, a catch-up task and the fan-out.

    `last` is the revision up to which every change has been handed to the fan-out; changes are
    published only by `_catch_up`, under `lock`, so a subscription that joins under the lock
    (after replaying up to `last`) sees each change exactly once.
    """

    def __init__(self, backend: PostgresBackend) -> None:
        self._backend = backend
        self.fanout = ChangeFanout()
        self.lock = asyncio.Lock()
        self.last = -1  # -1: not started (the first subscription sets it to the head)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._listen_conn: AsyncConnection[Any] | None = None
        # The first LISTEN connection, closed by `close` if its task never ran to take it.
        self._first: AsyncConnection[Any] | None = None

    def wake(self) -> None:
        self._wake.set()

    async def _start(self) -> None:
        """Open the `LISTEN` connection (here: its failure is the caller's), start the tasks.

        Raises:
            BackendUnavailableError: The connection cannot be made (nothing is left running).
            BackendTimeoutError: It is not made within `pool_timeout`.
        """
        if self._tasks:
            return
        conn = await self._connect()
        if self._closed:  # closed while connecting: nothing starts
            with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
                await conn.close()
            return
        self._first = conn
        self._tasks = [
            asyncio.create_task(self._listen(conn), name="agenticstate-postgres-listen"),
            asyncio.create_task(self._pump(), name="agenticstate-postgres-feed"),
        ]

    async def _connect(self) -> AsyncConnection[Any]:
        """A new connection listening on the store's channel (typed errors)."""
        psycopg, _ = _import_psycopg()
        backend = self._backend
        try:
            with anyio.fail_after(backend._pool_timeout):
                with backend._errors("open the LISTEN connection for changes()"):
                    conn = await psycopg.AsyncConnection.connect(backend._url, autocommit=True)
                    try:
                        await conn.execute(f"LISTEN {backend._channel}".encode())
                    except BaseException:
                        with anyio.CancelScope(shield=True):
                            await conn.close()
                        raise
        except TimeoutError:
            raise BackendTimeoutError(
                f"no LISTEN connection to Postgres at {redact_url(backend._url)} within "
                f"{backend._pool_timeout:g} s (pool_timeout) for changes()"
            ) from None
        conn_: AsyncConnection[Any] = conn
        return conn_

    async def _listen(self, first: AsyncConnection[Any]) -> None:
        """Hold the `LISTEN` connection; each notification wakes the catch-up. Reconnects."""
        backend = self._backend
        attempt = 0
        conn: AsyncConnection[Any] | None = first
        while not self._closed:
            try:
                if conn is None:
                    conn = await self._connect()
                    self.wake()  # catch up with what committed while we were not listening
                async with conn:
                    self._listen_conn = conn
                    attempt = 0
                    async for _ in conn.notifies():
                        self.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # a lost connection: reconnect, catch up
                if self._closed:
                    return
                log.warning(
                    "postgres_listen_lost", error=type(exc).__name__, detail=backend._hide(exc)
                )
            finally:
                self._listen_conn = None
                conn = None
            await asyncio.sleep(backoff(attempt, base=0.05, cap=2.0))
            attempt += 1

    async def _pump(self) -> None:
        attempt = 0
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _IDLE_CATCH_UP)
            self._wake.clear()
            try:
                async with self.lock:
                    await self._catch_up()
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # the server is away: try again
                log.warning("postgres_feed_read_failed", error=type(exc).__name__)
                await asyncio.sleep(backoff(attempt, base=0.05, cap=2.0))
                attempt += 1
                self._wake.set()

    async def _catch_up(self) -> None:
        """Publish every change after `last` (under `lock`), in revision order."""
        backend = self._backend
        while True:
            async with backend._connection("read the feed") as conn, conn.transaction():
                await conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur = await conn.execute(backend._sql.feed_bounds)
                head, oldest = await cur.fetchone()
                if self.last < 0:
                    self.last = head
                    return
                if head <= self.last:
                    return
                if oldest is None or oldest > self.last + 1:
                    self._overflow_all()
                    self.last = head
                    return
                rows = await backend._feed_rows(conn, self.last, head)
            fanout = self.fanout
            for _, change in rows:
                fanout.publish(change)
            if len(rows) < _FEED_PAGE:
                self.last = head
                return
            self.last = rows[-1][0]

    def _overflow_all(self) -> None:
        """Retention dropped changes this process had not read: close every subscription."""
        log.warning("postgres_feed_outrun", after=self.last)
        self.fanout.overflow_all()

    @contextlib.asynccontextmanager
    async def subscribe(
        self, pattern: str, max_buffer: int, after: int | None, since: str | None
    ) -> AsyncIterator[ChangeStream]:
        async with contextlib.AsyncExitStack() as stack:
            async with self.lock:
                await self._start()
                await self._catch_up()
                if after is not None and after > self.last:  # a cursor newer than our read
                    await self._catch_up()
                backlog: list[Change] = []
                if since is not None:
                    backlog = await self._replay(after, since)
                matcher = compile_glob(pattern)
                backlog = [change for change in backlog if matcher.match(change.key)]
                stream = await stack.enter_async_context(
                    self.fanout.subscribe(pattern, max_buffer, backlog=lambda _m: backlog)
                )
            yield stream

    async def _replay(self, after: int | None, since: str) -> list[Change]:
        """The retained changes after revision `after` up to `last` (under `lock`).

        Raises:
            InvalidArgumentError: `after` is past the head (a forged cursor).
            CursorExpiredError: Changes after it were trimmed.
        """
        backend = self._backend
        out: list[Change] = []
        async with backend._connection("replay the feed") as conn, conn.transaction():
            await conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur = await conn.execute(backend._sql.feed_bounds)
            head, oldest = await cur.fetchone()
            if after is None:
                after = (oldest - 1) if oldest is not None else head
            elif after > head:
                raise InvalidArgumentError(f"cursor {since!r} is past the feed's head")
            elif after < head and (oldest is None or after < oldest - 1):
                raise CursorExpiredError(
                    since, f"the changes after cursor {since!r} are no longer retained"
                )
            upto = min(head, self.last)
            while after < upto:
                rows = await backend._feed_rows(conn, after, upto)
                out.extend(change for _, change in rows)
                if len(rows) < _FEED_PAGE:
                    break
                after = rows[-1][0]
        return out

    async def close(self) -> None:
        self._closed = True
        self.fanout.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        first, self._first = self._first, None
        if first is not None and not first.closed:
            with contextlib.suppress(Exception):
                await first.close()
