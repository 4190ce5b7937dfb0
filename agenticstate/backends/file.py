"""FileBackend: state in local files that survives crashes, for one process on one machine.

On disk, in one directory:

- `<name>` (for example `state.json`): the **snapshot**, every entry at one point in time. It is
  only ever replaced atomically: written to a temporary file, fsynced, renamed over the old one,
  and the directory fsynced. A reader therefore sees the old snapshot or the new one, never a mix.
- `<name>.log`: the **log** of writes since that snapshot. Each record is
  `length (4 bytes) | CRC-32 (4 bytes) | flags (1 byte) | payload` and carries a sequence number.
- `<name>.lock`: holds the owner's pid under an exclusive `flock`.

Crash safety. A write is acknowledged only after its log record is on disk (fsync), so nothing
acknowledged is ever lost. On open, the backend loads the snapshot, replays the log records newer
than it, and stops at the first torn or corrupt record (a crash mid-append), truncating the log
there; stray temporary files from an interrupted snapshot are removed. Because the snapshot
records the last sequence number it contains, a crash between writing a snapshot and emptying
the log replays nothing twice.

Group commit. The event loop stages writes, encodes them and appends each batch to the log as one
frame (one checksum, because all of its writes are acknowledged together); a small **fsync
agent** process (`_fsync_agent.py`) makes the log durable on request and reports back. While it
syncs, new writes gather in the next frames and one later fsync covers them all, so concurrent
writers share fsyncs and the loop never waits for an fsync (a process, not a thread, so the
fsync never competes for the GIL). A write is visible to readers (and emitted to subscribers)
once its batch is durable; compare-and-set and `update` see writes still waiting in a batch, so
versions stay exact. If a sync fails (disk full, I/O error), the log is cut back to where the
first failed batch began, every write in it and in the batches after it fails with
`BackendError`, and the previous values stay in place; if the agent dies, the writes waiting
fail the same way and the store refuses new writes until it is reopened.

Durability modes: `"fsync"` (the default: every acknowledged write is on disk) or `"none"`
(records are written to the operating system on the event loop, without fsync: fast, and a
process crash loses nothing, but a power loss may lose the last writes).

Snapshots are rewritten every `save_interval` seconds when `auto_save` is on (and whenever the
log grows past `compact_bytes`), on `flush()`, and on `aclose()`. A worker thread builds and
writes them from a copy of the entries, so the event loop only pauses to copy a dict; no frame is
appended meanwhile, so the log can be emptied when the snapshot is in place. With
`format="json"` the snapshot is readable JSON with JSON values embedded as JSON; `"msgpack"` is
compact; `compression=True` compresses the snapshot and large log records.

One owner. A second process opening the same store gets `BackendError` naming the holder's pid.
A lock left by a killed process is released by the operating system with the process, so the
next opener takes over safely. Keys never become file names.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import time
import weakref
import zlib
from collections import deque
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgpack

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._log import get_logger
from agenticstate._tasks import EventLike, event_factory, soon_scheduler, spawn_service
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._local import LocalStore, run_transaction
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    check_expected_version,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
    new_entry,
)
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    DecodeError,
    InvalidArgumentError,
    InvalidKeyError,
)
from agenticstate.serialization import pack, payload_format, payload_is_compressed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult

__all__ = ["Durability", "FileBackend", "FileFormat"]

log = get_logger(__name__)

FileFormat = Literal["json", "msgpack"]
Durability = Literal["fsync", "none"]

_RECORD = struct.Struct(">II")  # length of flags+payload, CRC-32 of flags+payload
_COMPRESSED = 0x01
_SNAPSHOT_MAGIC = "agenticstate-snapshot"
_SNAPSHOT_VERSION = 2  # 2: with a checksum of its entries and indexes
_MISSING = object()
_MILLISECOND = timedelta(milliseconds=1)


def _json_encoder(*, allow_nan: bool, separators: tuple[str, str]) -> Callable[[Any], str]:
    """`json.dumps` with these options (and `ensure_ascii=False`), minus its cost per call.

    `JSONEncoder.encode` builds the C encoder anew on every call, which costs more than encoding
    a small value; snapshots encode one value per entry, so the C encoder is built once here.
    If the running Python has none, or it encodes a probe differently, `encode` is used.
    """
    fallback = json.JSONEncoder(ensure_ascii=False, allow_nan=allow_nan, separators=separators)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return fallback.encode

    def refuse(value: object) -> object:
        raise TypeError(f"{type(value).__name__} is not JSON")

    item_key = separators  # json's order; the C encoder takes the key separator first
    try:
        chunks = make(
            None,
            refuse,
            json.encoder.encode_basestring,
            None,
            item_key[1],
            item_key[0],
            False,
            False,
            allow_nan,
        )
    except TypeError:
        return fallback.encode

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    probe = {"a": [1, 2.5, -0.0, 10**30, "é\ud800\n", None, True], "": {}}
    return encode if encode(probe) == fallback.encode(probe) else fallback.encode


# How a JSON value embedded in a snapshot becomes the stored bytes again.
_encode_json = _json_encoder(allow_nan=False, separators=(",", ":"))
_encode_readable = _json_encoder(allow_nan=True, separators=(", ", ": "))  # snapshot lines
_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z, the last instant a datetime holds
_FRAME_RECORDS = 16
_MAX_REQUESTS = 8  # fsync requests unanswered at a time (each 8 bytes; a pipe holds 64 KiB)
_STAGE_CHUNK = 512  # records `set_many` stages between two yields to the event loop
_AGENT_EXIT_TIMEOUT = 2.0  # seconds `aclose()` waits for the agent to exit before killing it
_READABLE_DEPTH = 64  # deeper JSON values go into a JSON snapshot as base64 (see _readable_json)
_MSGPACK_INT = (-(2**63), 2**64 - 1)  # the integers msgpack (the snapshot checksum) can pack


# Stores open in this process. A forked child inherits their descriptors (the lock, the log,
# the agent's request pipe): it closes its copies at once, so that it neither keeps the
# agent alive (which would block the owner's `aclose()`) nor keeps the lock after the owner
# dies. Closing a copy never releases the owner's lock: only the last descriptor of an open
# file description does.
_OPEN_STORES: weakref.WeakSet[FileBackend] = weakref.WeakSet()


def _disown_after_fork() -> None:
    for store in list(_OPEN_STORES):
        store._disown(os.getppid())
    _OPEN_STORES.clear()


os.register_at_fork(after_in_child=_disown_after_fork)


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else round(moment.timestamp() * 1000)


def _from_ms(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)


def _now() -> datetime:
    # Millisecond precision, like every timestamp the store persists.
    return datetime.fromtimestamp(round(time.time() * 1000) / 1000, UTC)


class _Times:
    """Epoch milliseconds to datetimes, each built once: a batch's records share their times."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[int | None, datetime | None] = {None: None}

    def __call__(self, ms: int | None) -> Any:
        found = self._cache.get(ms, _MISSING)
        if found is _MISSING:
            if len(self._cache) > 65536:
                self._cache = {None: None}
            found = self._cache[ms] = _from_ms(ms)
        return found


class _Clock:
    """Now, as a datetime and in epoch milliseconds (the log's form), the same instant.

    Busy stores write many times a millisecond: the datetime is built once per millisecond.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[datetime, int] = (datetime.fromtimestamp(0, UTC), 0)

    def __call__(self) -> tuple[datetime, int]:
        ms = round(time.time() * 1000)
        if ms != self._last[1]:
            self._last = (datetime.fromtimestamp(ms / 1000, UTC), ms)
        return self._last


# The low-level I/O, in small functions so that tests can inject faults (ENOSPC, EIO).


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync(fd: int) -> None:
    os.fsync(fd)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _call_now(callback: Callable[[], object]) -> None:
    callback()


def _describe_errno(code: int, action: str) -> str:
    name = errno.errorcode.get(code, str(code))
    detail = "the disk is full" if code == errno.ENOSPC else f"{os.strerror(code).lower()} ({name})"
    return f"could not {action}: {detail}"


@contextlib.contextmanager
def _translate(action: str) -> Iterator[None]:
    """Turn OSError into BackendError, in one place."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise BackendError(f"could not {action}: {type(exc).__name__}") from exc
        raise BackendError(_describe_errno(exc.errno, action)) from exc


class _Record:
    """One staged write: what the log gets, and the change it makes."""

    __slots__ = ("batch", "change", "entry", "key", "lsn", "stamps")

    batch: _Job  # the batch it was staged in (set by `_add_to_batch`)

    def __init__(
        self,
        lsn: int,
        key: str,
        entry: Entry | None,
        change: Change,
        stamps: tuple[int | None, int | None, int | None],
    ) -> None:
        self.lsn = lsn
        self.key = key
        self.entry = entry  # None for a delete
        self.change = change
        self.stamps = stamps  # created, updated, expires: the entry's times in epoch ms

    def payload(self) -> list[Any]:
        entry = self.entry
        if entry is None:
            return [self.lsn, "d", self.key, None, self.change.version, None, None, None]
        return [self.lsn, "s", self.key, entry.value, entry.version, *self.stamps]


class _IndexRecord:
    """One staged change to a sorted index: members added (with scores) or removed."""

    __slots__ = ("added", "batch", "index", "lsn", "members", "result")

    batch: _Job

    def __init__(self, lsn: int, index: str, members: dict[str, float] | list[str]) -> None:
        self.lsn = lsn
        self.index = index
        self.members = members
        self.added = isinstance(members, dict)
        self.result = 0

    def payload(self) -> list[Any]:
        return [
            self.lsn,
            "ia" if self.added else "ir",
            self.index,
            self.members,
            0,
            None,
            None,
            None,
        ]


class _Job:
    """A batch of writes appended as one log frame, or a snapshot; its writers wait on `done`.

    `seq` and `start` are set when a batch's frame is appended: its fsync request number and
    where the frame begins in the log.
    """

    __slots__ = ("done", "error", "records", "seq", "start")

    def __init__(self, event: Callable[[], EventLike] = anyio.Event) -> None:
        self.records: list[_Record | _IndexRecord] = []
        self.done = event()
        self.error: BaseException | None = None
        self.seq = 0
        self.start = 0


_ACK = struct.Struct("<QI")  # the last request number an fsync covered, errno (0: success)


class _FsyncAgent:
    """The process that fsyncs a store's log on request (see `_fsync_agent`)."""

    __slots__ = ("acks", "process", "requests")

    def __init__(self, script: Path, log_fd: int) -> None:
        request_read, self.requests = os.pipe()
        self.acks, ack_write = os.pipe()
        try:
            self.process = subprocess.Popen(  # noqa: S603  # our own script, no shell
                [sys.executable, "-I", "-S", str(script)]
                + [str(fd) for fd in (log_fd, request_read, ack_write)],
                pass_fds=(log_fd, request_read, ack_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (self.requests, self.acks):
                os.close(fd)
            raise
        finally:
            os.close(request_read)
            os.close(ack_write)
        os.set_blocking(self.acks, False)
        # Never block the event loop on the agent: the store keeps at most `_MAX_REQUESTS`
        # requests unanswered (far below a pipe's capacity), and a full pipe anyway means "ask
        # again when the next answer comes", not a stalled loop.
        os.set_blocking(self.requests, False)

    def request(self, seq: int) -> bool:
        """Ask for an fsync covering every frame appended so far (answered on `acks`).

        Returns:
            False if the request pipe is full (nothing was sent).
        """
        try:
            os.write(self.requests, seq.to_bytes(8, "little"))  # 8 bytes: all or nothing
        except BlockingIOError:
            return False
        return True

    def stop(self) -> None:
        """Close the request pipe: the agent answers what it has read and exits."""
        with contextlib.suppress(OSError):
            os.close(self.requests)

    def wait(self) -> None:
        """Reap the process and close the acknowledgement pipe (blocking)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            os.close(self.acks)


class FileBackend(Backend):
    """Keep state in crash-safe local files; one process owns a store at a time.

    Args:
        base_path: The store's directory (created if missing).
        format: The snapshot's format: readable `"json"` or compact `"msgpack"`. Also the value
            encoding a `StateManager` picks for this store unless its config says otherwise.
        compression: Compress the snapshot and log records larger than 256 bytes.
        key_prefix: A namespace shown in `repr` (each store is separate already).
        durability: `"fsync"` (every acknowledged write is on disk) or `"none"`.
        auto_save: Rewrite the snapshot every `save_interval` seconds (checked after writes).
        save_interval: Seconds between automatic snapshots.
        file_name: The snapshot's file name (default `state.json` or `state.msgpack`).
        compact_bytes: Rewrite the snapshot whenever the log grows past this many bytes (or
            past half the snapshot's size, if that is more).
        close_snapshot_keys: Closing rewrites the snapshot only for stores of at most this many
            keys (or when a snapshot is due anyway); a larger store leaves its log for the next
            open to replay, so closing it is fast. `flush()` always rewrites the snapshot.
    """

    def __init__(
        self,
        base_path: str | os.PathLike[str] = "./state",
        format: FileFormat = "json",  # noqa: A002  # the seed page's name for it
        compression: bool = False,
        *,
        key_prefix: str = "",
        durability: Durability = "fsync",
        auto_save: bool = True,
        save_interval: float = 30.0,
        file_name: str | None = None,
        compact_bytes: int = 64 * 1024 * 1024,
        close_snapshot_keys: int = 10_000,
    ) -> None:
        if format not in ("json", "msgpack"):
            raise ConfigurationError(f"format must be 'json' or 'msgpack', not {format!r}")
        if durability not in ("fsync", "none"):
            raise ConfigurationError(f"durability must be 'fsync' or 'none', not {durability!r}")
        if not save_interval > 0 or compact_bytes < 1:
            raise ConfigurationError("save_interval and compact_bytes must be positive")
        if type(close_snapshot_keys) is not int or close_snapshot_keys < 0:
            raise ConfigurationError("close_snapshot_keys must be an int >= 0")
        self._explicit_name = file_name is not None
        name = file_name or f"state.{'json' if format == 'json' else 'msgpack'}"
        if not name or "/" in name or name in (".", ".."):
            raise ConfigurationError(f"file_name must be a plain file name, not {name!r}")
        self.base_path = Path(base_path)
        self.format: FileFormat = format
        self.preferred_format = format
        self.compression = compression
        self.key_prefix = key_prefix
        self.durability: Durability = durability
        self.auto_save = auto_save
        self.save_interval = save_interval
        self.compact_bytes = compact_bytes
        self.close_snapshot_keys = close_snapshot_keys
        self.snapshot_path = self.base_path / name
        self.log_path = self.base_path / f"{name}.log"
        self.lock_path = self.base_path / f"{name}.lock"
        self._local = LocalStore()
        self._fanout = ChangeFanout()
        self._open_lock: anyio.Lock | None = None
        self._is_open = False
        self._closed = False
        self._failed: str | None = None
        self._closed_reason = "this FileBackend is closed"
        self._lock_fd: int | None = None
        self._log_fd: int | None = None
        self._log_size = 0
        self._lsn = 0  # the last sequence number given to a staged record
        self._applied_lsn = 0  # the last one applied (durable and visible)
        self._snapshot_lsn = 0
        self._snapshot_bytes = 0  # the size of the snapshot file, as last written or read
        self._last_snapshot = time.monotonic()
        self._agent: _FsyncAgent | None = None
        self._ack_reader: object = None  # the task reading the agent's answers
        self._ack_reader_done: anyio.Event | None = None
        self._seq = 0  # the number of the last frame appended (what an fsync request names)
        self._frame_records = _FRAME_RECORDS  # a frame is sealed when it holds this many
        self._requested: deque[int] = deque()  # requests sent and not yet answered
        self._acked_seq = 0  # the last request number answered
        self._new_event: Callable[[], EventLike] = anyio.Event
        self._clock = _Clock()
        self._open_batch = _Job()  # gathering writes
        self._staged: dict[str, _Record] = {}  # the newest staged write per key, not yet applied
        self._call_soon: Callable[[Callable[[], object]], object] = _call_now
        self._unacked: deque[_Job] = deque()  # appended, waiting for their fsync, in order
        self._snapshot_job: _Job | None = None  # a wanted snapshot: appends pause until it ran
        self._snapshot_lock: anyio.Lock | None = None
        self._counters = {"batches": 0, "fsyncs": 0, "snapshots": 0}

    _agent_script = Path(__file__).with_name("_fsync_agent.py")

    def __repr__(self) -> str:
        return f"FileBackend(base_path={str(self.base_path)!r}, format={self.format!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FileBackend:
        """Create a backend from `file:///absolute/dir` or `file://relative/dir`."""
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigurationError(f"file URL {url!r} names no directory")
        return cls(base_path=path, **options)

    # opening and recovery

    async def open(self) -> None:
        """Take the lock, load the snapshot and replay the log. Idempotent."""
        if self._is_open:
            return
        if self._closed:
            raise BackendError(self._closed_reason)
        if self._open_lock is None:
            self._open_lock = anyio.Lock()
            self._snapshot_lock = anyio.Lock()
        async with self._open_lock:
            if not self._is_open:
                await anyio.to_thread.run_sync(self._open_sync)
                self._applied_lsn = self._lsn
                self._new_event = event_factory()
                self._call_soon = soon_scheduler()
                self._open_batch = _Job(self._new_event)
                if self._agent is not None:
                    self._ack_reader_done = anyio.Event()
                    self._ack_reader = spawn_service(
                        self._read_acks, name=f"agenticstate-fsync:{self.log_path}"
                    )
                self._is_open = True

    def _open_sync(self) -> None:
        with _translate(f"create the store directory {self.base_path}"):
            self.base_path.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        _OPEN_STORES.add(self)
        try:
            self._refuse_other_format()
            self._remove_stray_temps()
            self._load_snapshot()
            self._replay_log()
            if self.durability == "fsync":
                assert self._log_fd is not None  # noqa: S101  # opened by _replay_log
                try:
                    self._agent = _FsyncAgent(self._agent_script, self._log_fd)
                except OSError as exc:
                    raise BackendError(
                        f"could not start the fsync agent process ({exc.strerror}), which "
                        'durability="fsync" needs; durability="none" runs without it'
                    ) from exc
        except BaseException:
            self._close_files()
            raise

    def _take_lock(self) -> None:
        fd = _lock_or_holder(self.lock_path)
        if isinstance(fd, str):
            raise BackendError(
                f"the store {self.snapshot_path} is in use by {fd}; one process owns a "
                "store at a time"
            )
        with _translate(f"write the lock file {self.lock_path}"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _refuse_other_format(self) -> None:
        """Refuse a directory that holds the other format's store under its default name.

        The default snapshot name follows the format (`state.json`, `state.msgpack`), so opening
        a JSON store as msgpack would otherwise show an empty store under a second lock, and two
        processes could each own the directory. With an explicit `file_name` there is one name
        and one lock whatever the format, and both formats are read.
        """
        if self._explicit_name:
            return
        other = "msgpack" if self.format == "json" else "json"
        snapshot = self.base_path / f"state.{other}"
        lock = self.base_path / f"state.{other}.lock"
        hint = (
            f"open it with format={other!r}, or pass file_name={snapshot.name!r} to read it and "
            f"go on writing it as {self.format}"
        )
        if lock.exists():
            fd = _lock_or_holder(lock)
            if isinstance(fd, str):
                raise BackendError(
                    f"{self.base_path} holds a {other} store ({snapshot.name}) in use by {fd}; "
                    + hint
                )
            os.close(fd)  # free again: only checking that nobody is writing it now
        for path in (snapshot, self.base_path / f"state.{other}.log"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size > 0:
                    raise ConfigurationError(
                        f"{self.base_path} holds a {other} store ({path.name}), not a "
                        f"{self.format} one; " + hint
                    )

    def _remove_stray_temps(self) -> None:
        """Remove the temporary files of this store's interrupted snapshots, and no others.

        They are named `<name>.<pid>.tmp`; a store named `<name>.x` in the same directory has
        temporary files `<name>.x.<pid>.tmp`, which a glob `<name>.*.tmp` would also match.
        """
        pattern = re.compile(re.escape(self.snapshot_path.name) + r"\.[0-9]+\.tmp")
        with _translate(f"list the store directory {self.base_path}"):
            names = os.listdir(self.base_path)
        for name in names:
            if pattern.fullmatch(name):
                (self.base_path / name).unlink(missing_ok=True)
                log.info("file_store_removed_temp", path=str(self.base_path / name))

    def _disown(self, owner: int) -> None:
        """In a forked child: close this process's copies of the store's descriptors."""
        agent, self._agent = self._agent, None
        fds = [self._lock_fd, self._log_fd]
        if agent is not None:
            fds += [agent.requests, agent.acks]
            agent.process.returncode = 0  # not this process's child: never wait for it here
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._log_fd = None
        self._closed_reason = (
            f"this store belongs to process {owner}; a process forked from it cannot use it"
        )
        self._closed = True
        self._is_open = False

    def _release_lock(self) -> None:
        _OPEN_STORES.discard(self)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

    def _load_snapshot(self) -> None:
        try:
            raw = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BackendError(f"could not read the snapshot {self.snapshot_path}") from exc
        self._snapshot_bytes = len(raw)
        try:
            if raw[:1] == b"\x78":  # a zlib stream: the snapshot was compressed
                raw = zlib.decompress(raw)
            document = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw, raw=False)
            if not isinstance(document, dict) or document.get("magic") != _SNAPSHOT_MAGIC:
                raise ValueError("not an agenticstate snapshot")
            entries, indexes = document["entries"], document.get("indexes", {})
            if not isinstance(entries, dict) or not isinstance(indexes, dict):
                raise TypeError("entries and indexes must be maps")
            if document.get("format_version", 1) >= 2 and document.get("checksum") != (
                _snapshot_checksum(entries, indexes)
            ):
                raise ValueError("its checksum does not match its entries")
            self._snapshot_lsn = self._lsn = int(document["lsn"])
            now, times, store = _now(), _Times(), self._local.store
            for key, item in entries.items():
                entry = self._entry_from_snapshot(validate_key(key), item, times)
                if entry.expires_at is None or entry.expires_at > now:
                    store(entry)
            for name, members in indexes.items():
                self._apply_index(
                    validate_key(name), {validate_key(m): float(s) for m, s in members.items()}
                )
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            OverflowError,
            OSError,
            zlib.error,
            msgpack.UnpackException,
            InvalidKeyError,
        ) as exc:
            # Snapshots are replaced atomically, so this is damage, not a crash: refuse to
            # guess rather than silently start from nothing.
            raise BackendError(
                f"the snapshot {self.snapshot_path} is corrupt ({type(exc).__name__}); "
                "restore it from a backup or move it away"
            ) from exc

    def _entry_from_snapshot(self, key: str, item: dict[str, Any], times: _Times) -> Entry:
        if "json" in item:
            value = b"\x02" + _encode_json(item["json"]).encode()
        elif "base64" in item:
            value = base64.b64decode(item["base64"], validate=True)
        else:
            value = bytes(item["value"])
        created, updated = times(item["created"]), times(item["updated"])
        if created is None or updated is None:
            raise ValueError("an entry without its creation or update time")
        return new_entry(key, value, int(item["version"]), created, updated, times(item["expires"]))

    def _replay_log(self) -> None:
        with _translate(f"open the log {self.log_path}"):
            fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._log_fd = fd
        with _translate(f"read the log {self.log_path}"):
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
        offset = 0
        replayed = 0
        now = _now()
        now_ms = _ms(now)
        snapshot_lsn, local, times = self._snapshot_lsn, self._local, _Times()
        while offset + _RECORD.size <= len(data):
            length, crc = _RECORD.unpack_from(data, offset)
            body = data[offset + _RECORD.size : offset + _RECORD.size + length]
            if len(body) < length or length == 0 or zlib.crc32(body) != crc:
                break
            try:
                records = self._decode_frame(body)
            except (ValueError, TypeError, zlib.error, msgpack.UnpackException) as exc:
                # Its checksum holds, so it was written whole: this is damage (or a bug), not a
                # crash mid-append. Refuse to guess rather than drop it and what follows.
                raise BackendError(
                    f"the log {self.log_path} has a malformed record at byte {offset} "
                    f"({exc}); restore the store from a backup or move the log away"
                ) from exc
            offset += _RECORD.size + length
            for fields in records:
                lsn = fields[0]
                if lsn <= snapshot_lsn:
                    continue  # already in the snapshot (a crash between snapshot and log reset)
                if lsn > self._lsn:
                    self._lsn = lsn
                if fields[1] == "s":  # most records: the fast path of `_apply_logged`
                    _, _, key, value, version, created, updated, expires = fields
                    if expires is not None and expires <= now_ms:
                        local.drop(key)
                    else:
                        local.store(
                            new_entry(
                                key, value, version, times(created), times(updated), times(expires)
                            )
                        )
                else:
                    self._apply_logged(fields, now)
                replayed += 1
        if offset < len(data):
            log.warning(
                "file_store_torn_tail",
                path=str(self.log_path),
                kept=offset,
                dropped=len(data) - offset,
            )
            with _translate(f"truncate the log {self.log_path}"):
                os.ftruncate(fd, offset)
                _fsync(fd)
        self._log_size = offset
        if replayed:
            log.info("file_store_replayed", path=str(self.log_path), records=replayed)

    def _decode_frame(self, body: bytes) -> list[list[Any]]:
        """The records of one log frame: a batch, or (in stores written before 0.2) one record."""
        flags, payload = body[0], body[1:]
        if flags & _COMPRESSED:
            payload = zlib.decompress(payload)
        fields = msgpack.unpackb(payload, raw=False)
        if not isinstance(fields, list) or not fields:
            raise ValueError("bad frame")
        records = fields if isinstance(fields[0], list) else [fields]
        for record in records:
            _check_logged(record)
        return records

    def _apply_logged(self, fields: list[Any], now: datetime) -> None:
        _, op, key, value, version, created, updated, expires = fields
        if op in ("ia", "ir"):
            self._apply_index(key, value)
            return
        if op == "d":
            self._local.drop(key)
            return
        created_at, updated_at = _from_ms(created), _from_ms(updated)
        assert created_at is not None  # noqa: S101
        assert updated_at is not None  # noqa: S101
        entry = Entry(
            key=key,
            value=bytes(value),
            version=int(version),
            created_at=created_at,
            updated_at=updated_at,
            expires_at=_from_ms(expires),
        )
        if entry.expires_at is not None and entry.expires_at <= now:
            self._local.drop(key)
        else:
            self._local.store(entry)

    # reading

    async def _ready(self) -> None:
        if not self._is_open:
            await self.open()
        if self._closed:
            raise BackendError(self._closed_reason)

    async def get(self, key: str) -> Entry | None:
        """Return the entry at `key`, or `None` if missing or expired."""
        validate_key(key)
        await self._ready()
        await anyio.lowlevel.checkpoint()
        return self._local.live(key, _now())

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order."""
        for key in keys:
            validate_key(key)
        await self._ready()
        await anyio.lowlevel.checkpoint()
        now = _now()
        self._local.sweep(now)
        return [self._local.live(key, now) for key in keys]

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`."""
        matcher = compile_glob(validate_pattern(pattern))
        await self._ready()
        await anyio.lowlevel.checkpoint()
        now = _now()
        for key in self._local.matching(matcher, now):
            yield key

    # writing

    def _current(self, key: str, now: datetime) -> Entry | None:
        """The newest state of `key`, counting writes staged but not yet durable."""
        record = self._staged.get(key)
        if record is None:
            return self._local.live(key, now)
        staged = record.entry
        if staged is not None and staged.expires_at is not None and staged.expires_at <= now:
            return None
        return staged

    def _stage(
        self,
        key: str,
        value: bytes | None,
        ttl: timedelta | None,
        expected: int | None,
        clock: tuple[datetime, int],
        *,
        current: Any = _MISSING,
    ) -> _Record | None:
        if self._failed is not None:
            raise BackendError(self._failed)
        now, now_ms = clock
        if current is _MISSING:
            current = self._current(key, now)
        version = current.version if current is not None else 0
        if expected is not None and expected != version:
            raise conflict(key, expected, version)
        stamps: tuple[int | None, int | None, int | None] = (None, None, None)
        if value is None:
            if current is None:
                return None
            change = new_change(key, ChangeOp.DELETE, current.value, None, version, now)
            entry = None
        else:
            if current is None:
                old, created, created_ms = None, now, now_ms
            else:
                old, created = current.value, current.created_at
                created_ms = round(created.timestamp() * 1000)
            if ttl is None:
                expires, expires_ms = None, None
            else:
                expires = now + ttl
                expires_ms = now_ms + round(ttl / _MILLISECOND)
            entry = new_entry(key, value, version + 1, created, now, expires)
            change = new_change(key, ChangeOp.SET, old, value, version + 1, now)
            stamps = (created_ms, now_ms, expires_ms)
        self._lsn += 1
        record = _Record(self._lsn, key, entry, change, stamps)
        self._staged[key] = record
        self._add_to_batch(record)
        return record

    def _add_to_batch(self, record: _Record | _IndexRecord) -> None:
        batch = record.batch = self._open_batch
        records = batch.records
        records.append(record)
        if len(records) == 1:
            # Everything staged until the event loop gets round to this goes in one frame.
            self._call_soon(self._seal)
        elif len(records) >= self._frame_records:
            self._seal()

    async def _commit(self, batch: _Job) -> None:
        """Wait until `batch`, holding our staged records, is durable.

        Wait on the batch a record was staged in (`record.batch`), never on `_open_batch`
        after staging: staging may have sealed it (a full frame) and opened the next.
        """
        if self._snapshot_job is not None:
            await self._snapshot_if_idle()
        if batch.done.is_set():
            await anyio.lowlevel.checkpoint()  # a write always yields, even when done at once
        else:
            await batch.done.wait()
        if batch.error is not None:
            raise BackendError(f"the write was not saved: {batch.error}") from batch.error

    def _seal(self) -> None:
        """Append the open batch to the log as one frame and ask the agent to sync it.

        Scheduled on the event loop by the first write staged in a batch, so every write staged
        in the meantime shares the frame. The agent syncs whatever was appended while its last
        fsync ran in one fsync, so the loop never waits for the disk to go on appending, and
        concurrent writers share fsyncs. Nothing is appended while a snapshot is wanted; the
        snapshot seals what gathered when it is done.
        """
        batch = self._open_batch
        if not batch.records or self._snapshot_job is not None:
            return
        self._open_batch = _Job(self._new_event)
        batch.start = self._log_size
        try:
            self._append(self._encode_frame(batch.records))
        except BackendError as exc:
            self._fail(batch, exc)
            return
        self._counters["batches"] += 1
        if self._agent is None:  # durability="none": nothing more to wait for
            self._apply(batch)
            return
        self._seq += 1
        batch.seq = self._seq
        self._unacked.append(batch)
        self._request_fsync()

    def _request_fsync(self) -> None:
        """Ask the agent to sync every frame appended so far, unless enough requests wait.

        The agent answers once for all the requests it read together, so a few requests in
        flight keep it busy; more would only fill the pipes. Frames appended meanwhile are
        covered by the request sent when the next answer arrives (`_read_acks`).
        """
        agent, requested = self._agent, self._requested
        if agent is None or self._seq <= (requested[-1] if requested else self._acked_seq):
            return
        if len(requested) >= _MAX_REQUESTS:
            return
        try:
            sent = agent.request(self._seq)
        except OSError as exc:
            self._lose_agent(f"the fsync agent is gone ({exc.strerror})")
            return
        if sent:
            requested.append(self._seq)

    async def _read_acks(self) -> None:
        """Complete batches as the agent reports their fsyncs (the store's one service task)."""
        agent, done = self._agent, self._ack_reader_done
        assert agent is not None  # noqa: S101
        assert done is not None  # noqa: S101
        pending = b""
        try:
            while True:
                await anyio.wait_readable(agent.acks)
                try:
                    data = os.read(agent.acks, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    if not self._closed or self._unacked:
                        self._lose_agent("the fsync agent exited")
                    return
                pending += data
                usable = len(pending) - len(pending) % _ACK.size
                for offset in range(0, usable, _ACK.size):
                    self._acked(*_ACK.unpack_from(pending, offset))
                pending = pending[usable:]
                self._request_fsync()  # the frames appended while those requests waited
                if self._snapshot_job is not None:
                    await self._snapshot_if_idle()
        except Exception as exc:  # a service task must not raise: fail the writes, loudly
            log.exception("file_store_ack_reader_failed", path=str(self.log_path))
            self._lose_agent(f"reading fsync results failed ({type(exc).__name__})")
        finally:
            done.set()

    def _acked(self, seq: int, code: int) -> None:
        """Apply the batches an fsync covered, or fail them and cut them from the log."""
        self._counters["fsyncs"] += 1
        requested = self._requested
        while requested and requested[0] <= seq:
            requested.popleft()
        self._acked_seq = max(self._acked_seq, seq)
        unacked = self._unacked
        if code == 0:
            while unacked and unacked[0].seq <= seq:
                self._apply(unacked.popleft())
            return
        if not unacked or unacked[0].seq > seq:
            return  # about batches that already failed
        error = BackendError(_describe_errno(code, f"sync the log {self.log_path}"))
        # Every batch still waiting was appended after the failed ones and goes with them: the
        # log is cut back to where the first of them began.
        self._fail(unacked[0], error)

    def _apply(self, batch: _Job) -> None:
        """Make a durable batch visible: store its entries, announce its changes, wake it."""
        for record in batch.records:
            if isinstance(record, _IndexRecord):
                record.result = self._apply_index(record.index, record.members)
                continue
            if record.entry is None:
                self._local.drop(record.key)
            else:
                self._local.store(record.entry)
            if self._staged.get(record.key) is record:
                del self._staged[record.key]
            self._fanout.publish(record.change)
        self._applied_lsn = batch.records[-1].lsn
        if self._snapshot_job is None and self._should_snapshot():
            self._snapshot_job = _Job(self._new_event)
        batch.done.set()

    def _fail(self, first: _Job, error: BackendError) -> None:
        """Fail `first` and every batch after it (they may build on it); keep the log clean.

        Batches appended before `first` are not affected: their fsyncs are still to come.
        """
        unacked = self._unacked
        failed = [first]
        if first in unacked:
            while unacked[-1] is not first:
                failed.append(unacked.pop())
            unacked.pop()
        self._truncate_log(first.start)
        pending, self._open_batch = self._open_batch, _Job(self._new_event)
        failed.append(pending)
        for job in failed:
            job.error = error
            job.done.set()
        self._restage()
        log.error("file_store_write_failed", path=str(self.log_path), error=str(error))

    def _lose_agent(self, reason: str) -> None:
        """The agent cannot answer any more: fail what waits and refuse new writes."""
        self._failed = f"{reason}; reopen the store"
        error = BackendError(self._failed)
        if self._unacked:
            self._truncate_log(self._unacked[0].start)
        for job in [*self._unacked, self._open_batch]:
            job.error = error
            job.done.set()
        self._unacked.clear()
        self._open_batch = _Job(self._new_event)
        self._restage()

    def _restage(self) -> None:
        """Rebuild the staged view from the batches that still wait, after some failed."""
        self._staged = {
            record.key: record
            for job in self._unacked
            for record in job.records
            if isinstance(record, _Record)
        }

    def _truncate_log(self, size: int) -> None:
        """Cut the log back to `size` bytes so that no failed record can be replayed later."""
        fd = self._log_fd
        if fd is None or self._log_size <= size:
            return
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError:
            self._failed = (
                f"the log {self.log_path} could not be repaired after a failed write; "
                "reopen the store"
            )
        else:
            self._log_size = size

    def _apply_index(self, index: str, members: dict[str, float] | list[str]) -> int:
        if isinstance(members, dict):
            return self._local.index_add(index, members)
        return self._local.index_remove(index, members)

    def _encode_frame(self, records: list[_Record | _IndexRecord]) -> bytes:
        """One log frame for a batch: its records are acknowledged together, so one checksum."""
        payload = pack([record.payload() for record in records])
        flags = 0
        if self.compression and len(payload) > 256:
            packed = zlib.compress(payload, 1)
            if len(packed) < len(payload):
                payload, flags = packed, _COMPRESSED
        body = bytes((flags,)) + payload
        return _RECORD.pack(len(body), zlib.crc32(body)) + body

    def _append(self, frame: bytes) -> None:
        """Append a frame to the log (the page cache; the agent makes it durable)."""
        fd = self._log_fd
        assert fd is not None  # noqa: S101  # set by open()
        start = self._log_size
        try:
            with _translate(f"append to the log {self.log_path}"):
                _write_all(fd, frame)
        except BackendError:
            self._log_size = start + len(frame)  # at most: the cut below finds what is there
            self._truncate_log(start)
            raise
        self._log_size = start + len(frame)

    def _should_snapshot(self) -> bool:
        """Whether a snapshot is due: the log passed its limit, or `save_interval` passed.

        The interval's snapshot waits until the log holds at least a quarter of the last
        snapshot's size, and the log's limit is at least half of it: rewriting a large store
        every interval, or every `compact_bytes`, would make writes slower the larger the store.
        This way the cost of snapshots stays proportional to what was written.
        """
        if self._log_size >= self._compact_limit():
            return True
        return (
            self.auto_save
            and time.monotonic() - self._last_snapshot >= self.save_interval
            and self._log_size * 4 >= self._snapshot_bytes
        )

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
    ) -> Change:
        """Store `value` at `key` durably; see `Backend.set`."""
        validate_key(key)
        if ttl is not None:
            check_ttl(ttl)
        if expected_version is not None:
            check_expected_version(expected_version)
        if not self._is_open or self._closed:
            await self._ready()
        clock = self._clock()
        if self._local.expiries:
            self._local.sweep(clock[0])
        record = self._stage(key, value, ttl, expected_version, clock)
        assert record is not None  # noqa: S101  # a set always stages a record
        batch = record.batch
        if self._snapshot_job is None and not batch.done.is_set():
            # The hot path of `_commit`, without its frame.
            await batch.done.wait()
            if batch.error is None:
                return record.change
        await self._commit(batch)
        return record.change

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values, sharing fsyncs; a batch of any size leaves the loop running.

        A large batch is staged `_STAGE_CHUNK` records at a time with a yield to the event loop
        between chunks, so other tasks (and the reader of fsync answers) keep running; frames
        are appended as they fill and synced while the rest is staged.
        """
        for key, _ in items:
            validate_key(key)
        check_ttl(ttl)
        await self._ready()
        clock = self._clock()
        self._local.sweep(clock[0])
        records: list[_Record] = []
        stage = self._stage
        for start in range(0, len(items), _STAGE_CHUNK):
            if start:
                await anyio.lowlevel.checkpoint()
                clock = self._clock()
            # One frame per chunk: its writes are acknowledged together anyway. Nothing in the
            # chunk yields, so no other writer sees the larger frame limit.
            self._frame_records = _STAGE_CHUNK
            try:
                for key, value in items[start : start + _STAGE_CHUNK]:
                    record = stage(key, value, ttl, None, clock)
                    assert record is not None  # noqa: S101  # a set always stages a record
                    records.append(record)
            finally:
                self._frame_records = _FRAME_RECORDS
            self._seal()
        # Large batches span frames: every frame must be durable (dict keeps them in order).
        for batch in {record.batch: None for record in records}:
            await self._commit(batch)
        return [record.change for record in records]

    async def delete(self, key: str, *, expected_version: int | None = None) -> Change | None:
        """Delete `key` durably; see `Backend.delete`."""
        validate_key(key)
        check_expected_version(expected_version)
        await self._ready()
        record = self._stage(key, None, None, expected_version, self._clock())
        if record is None:
            return None
        await self._commit(record.batch)
        return record.change

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(entry)` in one step (no retries needed)."""
        validate_key(key)
        check_ttl(ttl)
        await self._ready()
        clock = self._clock()
        self._local.sweep(clock[0])
        current = self._current(key, clock[0])
        value = fn(current)
        record = self._stage(
            key, value, ttl, current.version if current else 0, clock, current=current
        )
        assert record is not None  # noqa: S101
        await self._commit(record.batch)
        return record.change

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Compare, then write, in one step on the event loop, logged as one frame.

        Nothing awaits between the compares and the writes, and every record the step stages
        goes into one log frame (one checksum: after a crash the whole step is replayed or none
        of it). Like `update`, the step sees writes still waiting for their fsync, and returns
        once its frame is durable; see `Backend.transact`.
        """
        checked = check_transaction(compare, then, orelse)
        await self._ready()
        if self._failed is not None:
            raise BackendError(self._failed)
        clock = self._clock()
        self._local.sweep(clock[0])
        step = _FileStep(self, clock)
        self._frame_records = sys.maxsize  # the step's records never split across frames
        try:
            result = run_transaction(step, *checked)
        finally:
            self._frame_records = _FRAME_RECORDS
        # Wait for the last batch holding anything the step wrote or read: batches apply in order.
        batch = self._open_batch if self._open_batch.records else None
        if batch is None and self._unacked:
            batch = self._unacked[-1]
        if batch is None:
            await anyio.lowlevel.checkpoint()
            return result
        if len(batch.records) >= _FRAME_RECORDS and batch is self._open_batch:
            self._seal()
        await self._commit(batch)
        return result

    # sorted indexes

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members to a sorted index, durably; see `Backend.index_add`."""
        validate_key(index)
        checked = check_index_members(members)
        await self._ready()
        return await self._stage_index(index, checked)

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """Remove members from a sorted index, durably; see `Backend.index_remove`."""
        validate_key(index)
        await self._ready()
        return await self._stage_index(index, [validate_key(member) for member in members])

    async def _stage_index(self, index: str, members: dict[str, float] | list[str]) -> int:
        if self._failed is not None:
            raise BackendError(self._failed)
        self._lsn += 1
        record = _IndexRecord(self._lsn, index, members)
        self._add_to_batch(record)
        await self._commit(record.batch)
        return record.result

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Read a sorted index, lowest score first; see `Backend.index_range`."""
        validate_key(index)
        check_limit(limit)
        await self._ready()
        await anyio.lowlevel.checkpoint()
        return self._local.index_range(index, limit)

    # subscriptions

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER
    ) -> contextlib.AbstractAsyncContextManager[ChangeStream]:
        """Subscribe to changes of keys matching `pattern`; see `Backend.changes`."""
        return self._changes(validate_pattern(pattern), max_buffer)

    @asynccontextmanager
    async def _changes(self, pattern: str, max_buffer: int) -> AsyncIterator[ChangeStream]:
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        await self._ready()
        async with self._fanout.subscribe(pattern, max_buffer) as stream:
            yield stream

    # snapshots and closing

    async def flush(self) -> None:
        """Write a snapshot of every acknowledged write now and empty the log.

        Raises:
            BackendError: The snapshot could not be written; the log still holds every write.
        """
        await self._ready()
        job = self._request_snapshot()
        while not job.done.is_set():
            if self._unacked:
                await self._unacked[-1].done.wait()
            else:
                await self._snapshot_if_idle()
                if not job.done.is_set():
                    await job.done.wait()
        if job.error is not None:
            raise BackendError(f"the snapshot was not written: {job.error}") from job.error

    def _request_snapshot(self) -> _Job:
        """The snapshot wanted next; appends pause until it is written."""
        job = self._snapshot_job
        if job is None:
            job = self._snapshot_job = _Job(self._new_event)
        return job

    async def _snapshot_if_idle(self) -> None:
        """Write the wanted snapshot if no batch waits for its fsync (any task may do this).

        Appends pause while a snapshot is wanted, so the log then holds exactly the applied
        state; the snapshot replaces it and the log is emptied. Writes staged meanwhile are
        appended after it.
        """
        job = self._snapshot_job
        lock = self._snapshot_lock
        if job is None or self._unacked or lock is None or lock.locked():
            return
        with anyio.CancelScope(shield=True):
            async with lock:
                if self._snapshot_job is not job or self._unacked:
                    return
                # Entries are immutable: a shallow copy is a consistent snapshot, and a worker
                # thread builds the document from it while the loop goes on.
                entries = dict(self._local.data)
                indexes = {name: index.items() for name, index in self._local.indexes.items()}
                try:
                    await anyio.to_thread.run_sync(
                        self._write_snapshot, entries, indexes, self._applied_lsn
                    )
                except Exception as exc:  # noqa: BLE001  # reported to flush(); the log is intact
                    job.error = exc
                    log.warning(
                        "file_store_snapshot_failed",
                        path=str(self.snapshot_path),
                        error=type(exc).__name__,
                    )
                else:
                    self._counters["snapshots"] += 1
                finally:
                    self._snapshot_job = None
                    job.done.set()
                    self._seal()

    def _snapshot_document(
        self, entries: dict[str, Entry], indexes: dict[str, dict[str, float]], lsn: int
    ) -> dict[str, Any]:
        now = _now()
        items: dict[str, Any] = {}
        for key, entry in entries.items():
            if entry.expires_at is not None and entry.expires_at <= now:
                continue
            item: dict[str, Any] = {
                "version": entry.version,
                "created": _ms(entry.created_at),
                "updated": _ms(entry.updated_at),
                "expires": _ms(entry.expires_at),
            }
            if self.format == "json":
                readable = _readable_json(entry.value)
                if readable is not _MISSING:
                    item["json"] = readable
                else:
                    item["base64"] = base64.b64encode(entry.value).decode("ascii")
            else:
                item["value"] = entry.value
            items[key] = item
        return {
            "magic": _SNAPSHOT_MAGIC,
            "format_version": _SNAPSHOT_VERSION,
            "lsn": lsn,
            "checksum": _snapshot_checksum(items, indexes),
            "entries": items,
            "indexes": indexes,
        }

    def _write_snapshot(
        self, entries: dict[str, Entry], indexes: dict[str, dict[str, float]], lsn: int
    ) -> None:
        """Replace the snapshot atomically and empty the log (in a worker thread)."""
        document = self._snapshot_document(entries, indexes, lsn)
        if self.format == "json":
            data = _json_snapshot(document)
        else:
            data = msgpack.packb(document, use_bin_type=True)
        if self.compression:
            data = zlib.compress(data, 6)
        temp = self.base_path / f"{self.snapshot_path.name}.{os.getpid()}.tmp"
        with _translate(f"write the snapshot {self.snapshot_path}"):
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _write_all(fd, data)
                    _fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temp, self.snapshot_path)
                self._snapshot_bytes = len(data)
            except BaseException:
                # A partial snapshot on a nearly full disk would eat the space the log needs.
                with contextlib.suppress(OSError):
                    temp.unlink(missing_ok=True)
                raise
            _fsync_directory(self.base_path)
            self._snapshot_lsn = lsn
            # Every record in the log is in the snapshot: no frame is appended while a snapshot
            # is wanted (`_seal` waits), and it runs only when no batch waits for its fsync.
            if self._log_fd is not None:
                os.ftruncate(self._log_fd, 0)
                if self.durability == "fsync":
                    _fsync(self._log_fd)
                self._log_size = 0
        self._last_snapshot = time.monotonic()
        log.debug("file_store_snapshot", path=str(self.snapshot_path), entries=len(entries))

    def stats(self) -> dict[str, int]:
        """Counters since the store was opened: `batches` appended, `fsyncs`, `snapshots`."""
        return dict(self._counters)

    async def aclose(self) -> None:
        """Finish staged writes, write a final snapshot and release the store. Idempotent.

        Subscriptions end at once; writes already staged are still made durable, and new ones
        are refused with `BackendError`.
        """
        if self._closed:
            return
        self._closed = True
        self._fanout.close()
        if not self._is_open:
            return
        with anyio.CancelScope(shield=True):
            try:
                # Every staged write is appended and synced, then the final snapshot replaces
                # the log.
                while self._failed is None and (self._unacked or self._open_batch.records):
                    if self._snapshot_job is not None and not self._unacked:
                        await self._snapshot_if_idle()
                        continue
                    batch = self._open_batch
                    self._seal()
                    await (self._unacked[-1] if self._unacked else batch).done.wait()
                # Nothing written since the last snapshot (a read-only session): keep it as it is
                # rather than rewrite a large store for nothing. A large store keeps its log
                # too: the next open replays it, and closing costs nothing.
                unchanged = self._applied_lsn == self._snapshot_lsn and self._log_size == 0
                if self._failed is None and not unchanged:
                    if self._compacts_on_close():
                        self._request_snapshot()
                        await self._snapshot_if_idle()
                    elif self.durability == "none" and self._log_fd is not None:
                        with _translate(f"sync the log {self.log_path}"):
                            await anyio.to_thread.run_sync(_fsync, self._log_fd)
            finally:
                agent = self._agent
                if agent is not None:
                    await self._stop_agent(agent)
                    self._agent = None
                self._close_files()

    def _compact_limit(self) -> int:
        return max(self.compact_bytes, self._snapshot_bytes // 2)

    def _compacts_on_close(self) -> bool:
        """Whether closing rewrites the snapshot: for small stores, or a log past its limit.

        A small store's snapshot is cheap and keeps the (readable) snapshot current. A large
        one's log is durable already and replays on open at least as fast as a snapshot loads:
        rewriting every entry on close would make closing cost as much as the whole store.
        """
        return (
            len(self._local.data) <= self.close_snapshot_keys
            or self._log_size >= self._compact_limit()
        )

    async def _stop_agent(self, agent: _FsyncAgent) -> None:
        """End the agent, within a bound: nothing waits for its answers any more.

        It exits once its request pipe is closed everywhere. A child forked without Python's
        fork hooks could still hold a copy; then the agent is killed after a grace period
        rather than `aclose()` waiting for that child.
        """
        agent.stop()
        done = self._ack_reader_done
        if done is not None:
            with anyio.move_on_after(_AGENT_EXIT_TIMEOUT):
                await done.wait()
            if not done.is_set():
                log.warning("file_store_agent_killed", path=str(self.log_path))
                with contextlib.suppress(OSError):
                    agent.process.kill()
                with anyio.move_on_after(_AGENT_EXIT_TIMEOUT):
                    await done.wait()
        await anyio.to_thread.run_sync(agent.wait)

    def _close_files(self) -> None:
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._release_lock()
        self._is_open = False


def _lock_or_holder(path: Path) -> int | str:
    """Lock `path` (exclusive `flock`, close-on-exec): its descriptor, or who holds it.

    Raises:
        BackendError: The lock file cannot be opened or locked for another reason.
    """
    with _translate(f"open the lock file {path}"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = "another process"
        with contextlib.suppress(OSError, ValueError):
            text = os.pread(fd, 32, 0).decode().strip()
            if text:
                holder = f"process {int(text)}"
        os.close(fd)
        return holder
    except OSError as exc:
        os.close(fd)
        raise BackendError(f"could not lock {path}: {exc.strerror}") from exc
    return fd


def _snapshot_checksum(entries: dict[str, Any], indexes: dict[str, Any]) -> int:
    """CRC-32 of a snapshot's entries and indexes, in a form both formats read back the same.

    JSON keeps key order and round-trips floats exactly, so what `json.loads` gives back packs
    to the same bytes as what was written; damage inside a value or a version does not.
    """
    return zlib.crc32(msgpack.packb([entries, indexes], use_bin_type=True))


def _is_stamp(value: object) -> bool:
    return value is None or (type(value) is int and 0 <= value <= _MAX_MS)


def _check_logged(record: object) -> None:
    """Raise ValueError unless `record` is a well-formed log record (see `_Record.payload`)."""
    if type(record) is list and len(record) == 8:
        # The common case, a write, in one expression; anything unusual takes the long way.
        lsn, op, key, value, version, created, updated, expires = record
        if (
            op == "s"
            and type(lsn) is int
            and lsn >= 1
            and type(key) is str
            and type(value) is bytes
            and type(version) is int
            and version >= 1
            and type(created) is int
            and type(updated) is int
            and 0 <= created <= _MAX_MS
            and 0 <= updated <= _MAX_MS
            and (expires is None or (type(expires) is int and 0 <= expires <= _MAX_MS))
        ):
            try:
                validate_key(key)
            except InvalidKeyError as exc:
                raise ValueError(f"bad key: {exc}") from None
            return
    if not isinstance(record, list) or len(record) != 8:
        raise ValueError("a record is not a list of 8 fields")
    lsn, op, key, value, version, created, updated, expires = record
    if type(lsn) is not int or lsn < 1 or not isinstance(key, str) or type(version) is not int:
        raise ValueError("bad sequence number, key or version")
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        raise ValueError(f"bad key: {exc}") from None
    if op == "s":
        if not isinstance(value, bytes) or version < 1 or created is None or updated is None:
            raise ValueError("bad write record")
        if not (_is_stamp(created) and _is_stamp(updated) and _is_stamp(expires)):
            raise ValueError("bad timestamps")
    elif op == "d":
        if value is not None:
            raise ValueError("bad delete record")
    elif op == "ia":
        if not isinstance(value, dict) or not all(
            isinstance(m, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for m, v in value.items()
        ):
            raise ValueError("bad index record")
    elif op == "ir":
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise ValueError("bad index record")
    else:
        raise ValueError(f"unknown operation {op!r}")


def _readable_json(value: bytes) -> Any:
    """The parsed JSON of an uncompressed JSON payload, if it can be embedded as it is.

    That is, if re-encoding it gives the same bytes and the snapshot's checksum (msgpack) can
    hold it. Anything else (NaN, lone surrogates, integers beyond 64 bits, deep nesting) is
    embedded as base64: no value a store accepted may stop its snapshots.
    """
    try:
        if payload_format(value) != "json" or payload_is_compressed(value):
            return _MISSING
        text = value[1:]
        parsed = json.loads(text)
        # Few brackets and no integer of 19 digits or more: it fits without looking closer.
        simple = text.count(b"[") + text.count(b"{") < _READABLE_DEPTH
        if not (simple and _LONG_DIGITS.search(text) is None) and not _fits_checksum(parsed):
            return _MISSING
        same = _encode_json(parsed).encode() == text
    except (ValueError, UnicodeError, DecodeError, RecursionError):
        return _MISSING
    return parsed if same else _MISSING


_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # 2**63 has 19 digits; shorter integers always fit


def _json_snapshot(document: dict[str, Any]) -> bytes:
    """A JSON snapshot with one entry per line, written by the C encoder.

    `json.dumps(..., indent=...)` falls back to the pure-Python encoder, many times slower on
    a large store; one line per entry is as readable and as easy to diff.
    """
    encode = _encode_readable
    lines = ["{"]
    lines.extend(
        f" {encode(name)}: {encode(value)},"
        for name, value in document.items()
        if name not in ("entries", "indexes")
    )
    entries = document["entries"]
    lines.append(' "entries": {' + ("" if entries else "},"))
    last = len(entries) - 1
    lines.extend(
        f"  {encode(key)}: {encode(item)}{',' if n < last else ''}"
        for n, (key, item) in enumerate(entries.items())
    )
    if entries:
        lines.append(" },")
    lines.append(f' "indexes": {encode(document["indexes"])}')
    lines.append("}\n")
    return "\n".join(lines).encode()


def _fits_checksum(parsed: object) -> bool:
    """Whether msgpack can pack `parsed` at the depth a snapshot nests it, without recursing."""
    low, high = _MSGPACK_INT
    stack: list[tuple[object, int]] = [(parsed, 0)]
    while stack:
        item, depth = stack.pop()
        if type(item) is int:
            if not low <= item <= high:
                return False
        elif isinstance(item, list | dict):
            if depth >= _READABLE_DEPTH:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


class _FileStep:
    """A `TxnTarget` over a `FileBackend` at one moment: staged writes count, as in `update`.

    Sorted indexes apply their records only once durable, so the step reads an index as the
    applied one with the records still waiting (in every unapplied batch, its own included)
    laid over it.
    """

    __slots__ = ("_backend", "_clock")

    def __init__(self, backend: FileBackend, clock: tuple[datetime, int]) -> None:
        self._backend = backend
        self._clock = clock

    def txn_get(self, key: str) -> Entry | None:
        return self._backend._current(key, self._clock[0])

    def txn_put(self, key: str, value: bytes, ttl: timedelta | None) -> Change:
        record = self._backend._stage(key, value, ttl, None, self._clock)
        assert record is not None  # noqa: S101  # a set always stages a record
        return record.change

    def txn_delete(self, key: str) -> Change | None:
        record = self._backend._stage(key, None, None, None, self._clock)
        return None if record is None else record.change

    def _pending(self, index: str) -> dict[str, float | None]:
        """The members of `index` that waiting records set (a score) or removed (`None`)."""
        backend = self._backend
        pending: dict[str, float | None] = {}
        for job in (*backend._unacked, backend._open_batch):
            for record in job.records:
                if isinstance(record, _IndexRecord) and record.index == index:
                    if isinstance(record.members, dict):
                        pending.update(record.members)
                    else:
                        pending.update(dict.fromkeys(record.members))
        return pending

    def txn_score(self, index: str, member: str) -> float | None:
        return self._scores(index, [member])[0]

    def _scores(self, index: str, members: Iterable[str]) -> list[float | None]:
        pending, local = self._pending(index), self._backend._local
        return [
            pending[member] if member in pending else local.index_score(index, member)
            for member in members
        ]

    def _stage(self, index: str, members: dict[str, float] | list[str]) -> None:
        backend = self._backend
        backend._lsn += 1
        backend._add_to_batch(_IndexRecord(backend._lsn, index, members))

    def txn_index_add(self, index: str, members: dict[str, float]) -> int:
        added = sum(score is None for score in self._scores(index, members))
        self._stage(index, members)
        return added

    def txn_index_remove(self, index: str, members: list[str]) -> int:
        removed = sum(score is not None for score in self._scores(index, members))
        self._stage(index, members)
        return removed

    def txn_index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        local = self._backend._local
        pending = self._pending(index)
        if not pending:
            return local.index_range(index, limit)
        # At most len(pending) of the applied members are moved or removed by waiting records.
        applied = local.index_range(index, None if limit is None else limit + len(pending))
        merged = [(member, score) for member, score in applied if member not in pending]
        merged += [(member, score) for member, score in pending.items() if score is not None]
        merged.sort(key=lambda item: (item[1], item[0]))
        return merged if limit is None else merged[:limit]
