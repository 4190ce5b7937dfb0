"""The SQLite backend's threads: each owns one connection and runs jobs from the event loop.

No blocking SQLite call runs on the event loop. A `Worker` takes every job waiting in its queue
as one batch (the writer runs a batch in one transaction: group commit), then hands the results
back to the loop with one thread-safe callback, where each waiting task is woken.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from agenticstate.backends._paths import path_error
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    NotFoundError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from agenticstate._tasks import EventLike

__all__ = [
    "Access",
    "Job",
    "Worker",
    "connect",
    "open_errors",
    "prepare",
    "translate",
    "translated",
]

_LOCKED = ("database is locked", "database table is locked")


def translated(exc: BaseException, action: str) -> BackendError:
    """The `BackendError` for a `sqlite3` or OS error (the one place this backend maps them)."""
    if isinstance(exc, BackendError):
        return exc
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError):
        if any(marker in text for marker in _LOCKED):
            return BackendTimeoutError(f"could not {action}: {text}")
        if "unable to open" in text:
            return BackendUnavailableError(f"could not {action}: {text}")
    if isinstance(exc, OSError):
        return BackendUnavailableError(f"could not {action}: {exc.strerror or exc}")
    return BackendError(f"could not {action}: {text}")


@contextlib.contextmanager
def translate(action: str) -> Iterator[None]:
    """Raise `sqlite3` and OS errors inside as `BackendError`s (see `translated`)."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        raise translated(exc, action) from exc


@dataclass(frozen=True)
class Access:
    """How the backend's connections open the file.

    Attributes:
        params: SQLite URI parameters (`mode=rw`, `mode=ro`, `mode=ro&immutable=1`).
        read_only: Why the store serves reads only, or `None` if it is writable.
    """

    params: str
    read_only: str | None = None


def prepare(path: Path, *, create: bool, read_only: bool) -> Access:
    """Look at `path` before SQLite opens it; create it (mode 0600) if allowed and missing.

    SQLite itself never creates the file (connections open it with `mode=rw` or `mode=ro`), so
    a file appears only here, with its owner's permissions alone; SQLite gives the `-wal` and
    `-shm` files it makes beside it the same permissions. Runs in the writer thread.

    Raises:
        NotFoundError: The file does not exist (or is empty) and may not be created.
        ConfigurationError: The path is a directory, or cannot be reached or read.
    """
    with open_errors(path):
        if path.is_dir():
            raise ConfigurationError(
                f"{path} is a directory, not an SQLite database file: name a file in it, "
                f"such as {path / 'state.db'}"
            )
        if path.exists() and not path.is_file():
            raise ConfigurationError(
                f"{path} is not a regular file (a FIFO, a device or a socket), not an SQLite "
                "database file; it was left as it is"
            )
        if not path.exists() or _is_empty(path):
            if read_only or not create:
                state = "is empty" if path.exists() else "does not exist"
                raise NotFoundError(
                    f"no SQLite store at {path}: the file {state} (opened without create)"
                )
            if not path.exists():
                _create(path)
        if not os.access(path, os.R_OK):
            raise ConfigurationError(f"{path} cannot be read by this user: permission denied")
        return _access(path, read_only=read_only)


def _is_empty(path: Path) -> bool:
    """Whether `path` is 0 bytes and its `-wal` holds nothing either.

    A new store's first commits may be in its `-wal` alone until a checkpoint copies them in.
    """
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size == 0 and (not wal.exists() or wal.stat().st_size == 0)


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return  # another process created it first: open theirs
    os.close(fd)


def _access(path: Path, *, read_only: bool) -> Access:
    """How to open `path`: writable if it can be, else read-only.

    Read-only as an immutable snapshot when SQLite could not make the `-wal` and `-shm` files
    it needs beside the database to read it as it changes.
    """
    directory = path.parent
    wal = path.with_name(path.name + "-wal")
    shm = path.with_name(path.name + "-shm")
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        reason = "on a read-only file system"
    elif not os.access(path, os.W_OK):
        reason = "read-only for this user"
    elif not os.access(directory, os.W_OK | os.X_OK) and not (
        os.access(wal, os.W_OK) and os.access(shm, os.W_OK)
    ):
        reason = f"in a directory this user cannot write ({directory})"
    elif read_only:
        reason = "opened read-only"
    else:
        return Access("mode=rw")
    if wal.exists() or os.access(directory, os.W_OK | os.X_OK):
        return Access("mode=ro", reason)  # SQLite reads the WAL through the -shm index
    # Nobody writes the file now (a writer keeps a -wal beside it): read it as it is.
    return Access("mode=ro&immutable=1", reason)


@contextlib.contextmanager
def open_errors(path: Path) -> Iterator[None]:
    """Raise the errors of opening `path` as what they mean.

    A path to fix is a `ConfigurationError` (never worth a retry), not the
    `BackendUnavailableError` SQLite's "unable to open database file" used to become.
    """
    try:
        yield
    except OSError as exc:
        raise path_error(path, exc) from exc
    except sqlite3.OperationalError as exc:
        name = getattr(exc, "sqlite_errorname", "")
        if name.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")):
            raise ConfigurationError(f"could not open {path}: {exc} ({_diagnose(path)})") from exc
        raise translated(exc, f"open the database {path}") from exc
    except sqlite3.Error as exc:
        if getattr(exc, "sqlite_errorname", "") == "SQLITE_NOTADB":
            raise BackendError(
                f"{path} is not an SQLite database ({exc}): a damaged store, or not a store at "
                "all; it was left as it is"
            ) from exc
        raise translated(exc, f"open the database {path}") from exc


def _diagnose(path: Path) -> str:
    """Why SQLite could not open `path`, as far as the file system tells."""
    try:
        if path.is_dir():
            return "it is a directory"
        if not path.exists():
            return "it does not exist"
        if not os.access(path, os.R_OK):
            return "permission denied"
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return "read-only file system"
        if not os.access(path.parent, os.W_OK | os.X_OK):
            return f"this user cannot write the directory {path.parent}"
    except OSError as exc:
        return exc.strerror or str(exc)
    return "see the error above"


def connect(path: Path, access: Access, *, synchronous: str, busy_ms: int) -> sqlite3.Connection:
    """Open a connection in autocommit mode (transactions are explicit), as `access` says.

    The URI's `mode` never includes `c`: SQLite never creates the file (see `prepare`).
    """
    conn = sqlite3.connect(
        # An empty authority (`file://` then the absolute path): a path starting with `//`
        # must not be read as a host name.
        f"file://{quote(os.path.abspath(path))}?{access.params}",
        uri=True,
        isolation_level=None,
        check_same_thread=False,
        cached_statements=256,
    )
    conn.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    return conn


class Job:
    """One call from the event loop: a function of the connection, and where its result goes."""

    __slots__ = ("error", "event", "fn", "key", "result")

    def __init__(
        self, fn: Callable[[sqlite3.Connection], Any], event: EventLike, key: str | None = None
    ) -> None:
        self.fn = fn
        self.event = event
        self.key = key  # the stored key a write reads first, so a batch can read them together
        self.result: Any = None
        self.error: BaseException | None = None


def _wake(jobs: list[Job]) -> None:
    for job in jobs:
        job.event.set()


class ForkGuard:
    """Held by a worker while its connection may hold SQLite locks; `os.fork` waits for it.

    SQLite keeps, per process, which of its connections hold which locks on a file. A process
    forked while a connection holds one (inside a write transaction) starts with that record
    and no thread to release it: every connection it opens to the file then waits for a lock
    nobody holds, and its writes time out. So a fork in this process waits until no worker is
    inside a batch (or opening): at most one transaction, which waits for another process's
    lock for at most the backend's `lock_timeout`.
    """

    __slots__ = ("__weakref__", "lock")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        _GUARDS.add(self)

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


_GUARDS: weakref.WeakSet[ForkGuard] = weakref.WeakSet()
_HELD: list[ForkGuard] = []


def _before_fork() -> None:
    for guard in list(_GUARDS):
        guard.lock.acquire()
        _HELD.append(guard)


def _after_fork() -> None:
    while _HELD:
        _HELD.pop().lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


class Worker:
    """A thread with one connection that runs queued jobs in batches.

    Args:
        name: The thread's name.
        open_connection: Called in the thread to make its connection.
        run_batch: Called in the thread with the connection and the jobs taken together; it
            sets each job's `result` or `error`.
        schedule: Runs a callback on the event loop, thread-safely.
        max_batch: The most jobs taken at once.
    """

    def __init__(
        self,
        name: str,
        open_connection: Callable[[], sqlite3.Connection],
        run_batch: Callable[[sqlite3.Connection, list[Job]], None],
        schedule: Callable[[Callable[[], object]], object],
        *,
        max_batch: int = 512,
    ) -> None:
        self._open_connection = open_connection
        self._run_batch = run_batch
        self._schedule = schedule
        self._max_batch = max_batch
        self._jobs: deque[Job] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._stopping = False
        self.conn: sqlite3.Connection | None = None
        self.failure: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.guard = ForkGuard()

    def start(self) -> None:
        """Start the thread and wait until its connection is open (call from a worker thread).

        Raises:
            BackendError: The connection could not be opened.
        """
        self._thread.start()
        self._started.wait()
        if self.failure is not None:
            raise self.failure

    def submit(self, job: Job) -> None:
        """Queue `job`; the thread runs it with the next batch."""
        with self._ready:
            if self._stopping:
                job.error = BackendError("this SQLiteBackend is closed")
                job.event.set()
                return
            self._jobs.append(job)
            if len(self._jobs) == 1:
                self._ready.notify()

    def stop(self) -> None:
        """Finish the queued jobs, close the connection and end the thread (blocking)."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _main(self) -> None:
        try:
            with self.guard:
                self.conn = self._open_connection()
        except BaseException as exc:  # noqa: BLE001  # start() raises it on the loop's side
            self.failure = exc
            self._started.set()
            return
        self._started.set()
        try:
            while True:
                with self._ready:
                    while not self._jobs and not self._stopping:
                        self._ready.wait()
                    if not self._jobs:
                        return
                    count = min(len(self._jobs), self._max_batch)
                    batch = [self._jobs.popleft() for _ in range(count)]
                try:
                    with self.guard:
                        self._run_batch(self.conn, batch)
                except Exception as exc:  # noqa: BLE001  # a bug must not strand the callers
                    failure = BackendError(f"the SQLite worker failed: {type(exc).__name__}: {exc}")
                    for job in batch:
                        if job.error is None:
                            job.result, job.error = None, failure
                self._hand_back(batch)
        finally:
            with self.guard, contextlib.suppress(sqlite3.Error):
                self.conn.close()

    def _hand_back(self, batch: list[Job]) -> None:
        # A closed event loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._schedule(lambda: _wake(batch))
