"""The SQLite backend's threads: each owns one connection and runs jobs from the event loop.

No blocking SQLite call runs on the event loop. A `Worker` takes every job waiting in its queue
as one batch (the writer runs a batch in one transaction: group commit), then hands the results
back to the loop with one thread-safe callback, where each waiting task is woken.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from agenticstate._tasks import EventLike

__all__ = ["Job", "Worker", "connect", "translate", "translated"]

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


def connect(path: Path, *, synchronous: str, busy_ms: int) -> sqlite3.Connection:
    """Open a connection in autocommit mode (transactions are explicit), WAL journal."""
    conn = sqlite3.connect(
        str(path), isolation_level=None, check_same_thread=False, cached_statements=256
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
                    self._run_batch(self.conn, batch)
                except Exception as exc:  # noqa: BLE001  # a bug must not strand the callers
                    failure = BackendError(f"the SQLite worker failed: {type(exc).__name__}: {exc}")
                    for job in batch:
                        if job.error is None:
                            job.result, job.error = None, failure
                self._hand_back(batch)
        finally:
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()

    def _hand_back(self, batch: list[Job]) -> None:
        # A closed event loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._schedule(lambda: _wake(batch))
