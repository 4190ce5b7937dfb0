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

Group commit. Each open store has one I/O thread that owns its files. The event loop only
stages writes and encodes them; the thread appends and fsyncs, one batch at a time, and reports
back. While it syncs one batch, new writes gather in the next, so concurrent writers share
fsyncs, and a batch is one log frame (one checksum) because all of its writes are acknowledged
together. A write is visible to readers (and emitted to subscribers) once its batch is durable;
compare-and-set and `update` see writes still waiting in a batch, so versions stay exact. If a
batch fails (disk full, I/O error), the log is cut back to where it was, every write in that
batch and the next fails with `BackendError`, and the previous values stay in place.

Durability modes: `"fsync"` (the default: every acknowledged write is on disk) or `"none"`
(records are written to the operating system on the event loop, without fsync: fast, and a
process crash loses nothing, but a power loss may lose the last writes).

Snapshots are rewritten every `save_interval` seconds when `auto_save` is on (and whenever the
log grows past `compact_bytes`), on `flush()`, and on `aclose()`. The I/O thread builds and
writes them from a copy of the entries, so the event loop only pauses to copy a dict. With
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
import struct
import subprocess
import sys
import time
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
from agenticstate.backends._local import LocalStore
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
    check_ttl,
    conflict,
    new_change,
    new_entry,
)
from agenticstate.events import ChangeFanout, ChangeStream
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    DecodeError,
    InvalidArgumentError,
    InvalidKeyError,
)
from agenticstate.serialization import pack, payload_format

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

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
_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z, the last instant a datetime holds
_FRAME_RECORDS = 16


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else round(moment.timestamp() * 1000)


def _from_ms(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)


def _now() -> datetime:
    # Millisecond precision, like every timestamp the store persists.
    return datetime.fromtimestamp(round(time.time() * 1000) / 1000, UTC)


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

    def request(self, seq: int) -> None:
        """Ask for an fsync covering every frame appended so far (answered on `acks`)."""
        os.write(self.requests, seq.to_bytes(8, "little"))

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
        compact_bytes: Rewrite the snapshot whenever the log grows past this many bytes.
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
    ) -> None:
        if format not in ("json", "msgpack"):
            raise ConfigurationError(f"format must be 'json' or 'msgpack', not {format!r}")
        if durability not in ("fsync", "none"):
            raise ConfigurationError(f"durability must be 'fsync' or 'none', not {durability!r}")
        if not save_interval > 0 or compact_bytes < 1:
            raise ConfigurationError("save_interval and compact_bytes must be positive")
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
        self.snapshot_path = self.base_path / name
        self.log_path = self.base_path / f"{name}.log"
        self.lock_path = self.base_path / f"{name}.lock"
        self._local = LocalStore()
        self._fanout = ChangeFanout()
        self._open_lock: anyio.Lock | None = None
        self._is_open = False
        self._closed = False
        self._failed: str | None = None
        self._lock_fd: int | None = None
        self._log_fd: int | None = None
        self._log_size = 0
        self._lsn = 0  # the last sequence number given to a staged record
        self._applied_lsn = 0  # the last one applied (durable and visible)
        self._snapshot_lsn = 0
        self._last_snapshot = time.monotonic()
        self._agent: _FsyncAgent | None = None
        self._ack_reader: object = None  # the task reading the agent's answers
        self._ack_reader_done: anyio.Event | None = None
        self._seq = 0  # the last fsync request number
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
            raise BackendError("this FileBackend is closed")
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
        try:
            for stray in self.base_path.glob(f"{self.snapshot_path.name}.*.tmp"):
                stray.unlink(missing_ok=True)
                log.info("file_store_removed_temp", path=str(stray))
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
        with _translate(f"open the lock file {self.lock_path}"):
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = "another process"
            with contextlib.suppress(OSError, ValueError):
                text = os.pread(fd, 32, 0).decode().strip()
                if text:
                    holder = f"process {int(text)}"
            os.close(fd)
            raise BackendError(
                f"the store {self.snapshot_path} is in use by {holder}; one process owns a "
                "store at a time"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise BackendError(f"could not lock {self.lock_path}: {exc.strerror}") from exc
        with _translate(f"write the lock file {self.lock_path}"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _load_snapshot(self) -> None:
        try:
            raw = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BackendError(f"could not read the snapshot {self.snapshot_path}") from exc
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
            now = _now()
            for key, item in entries.items():
                entry = self._entry_from_snapshot(validate_key(key), item)
                if entry.expires_at is None or entry.expires_at > now:
                    self._local.store(entry)
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

    def _entry_from_snapshot(self, key: str, item: dict[str, Any]) -> Entry:
        if "json" in item:
            text = json.dumps(
                item["json"], ensure_ascii=False, allow_nan=False, separators=(",", ":")
            )
            value = b"\x02" + text.encode()
        elif "base64" in item:
            value = base64.b64decode(item["base64"], validate=True)
        else:
            value = bytes(item["value"])
        created = _from_ms(item["created"])
        updated = _from_ms(item["updated"])
        assert created is not None  # noqa: S101
        assert updated is not None  # noqa: S101
        return Entry(
            key=key,
            value=value,
            version=int(item["version"]),
            created_at=created,
            updated_at=updated,
            expires_at=_from_ms(item["expires"]),
        )

    def _replay_log(self) -> None:
        with _translate(f"open the log {self.log_path}"):
            fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._log_fd = fd
        with _translate(f"read the log {self.log_path}"):
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
        offset = 0
        replayed = 0
        now = _now()
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
                if lsn <= self._snapshot_lsn:
                    continue  # already in the snapshot (a crash between snapshot and log reset)
                self._lsn = max(self._lsn, lsn)
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
            raise BackendError("this FileBackend is closed")

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
        elif len(records) >= _FRAME_RECORDS:
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
        try:
            self._agent.request(self._seq)
        except OSError as exc:
            self._lose_agent(f"the fsync agent is gone ({exc.strerror})")

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
        if self._log_size >= self.compact_bytes:
            return True
        return self.auto_save and time.monotonic() - self._last_snapshot >= self.save_interval

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
        """Store several values with one fsync."""
        for key, _ in items:
            validate_key(key)
        check_ttl(ttl)
        await self._ready()
        clock = self._clock()
        self._local.sweep(clock[0])
        records = [self._stage(key, value, ttl, None, clock) for key, value in items]
        # Large batches span frames: every frame must be durable (dict keeps them in order).
        for batch in {record.batch: None for record in records if record is not None}:
            await self._commit(batch)
        return [record.change for record in records if record is not None]

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
        """Replace the snapshot atomically and empty the log (in the I/O thread)."""
        document = self._snapshot_document(entries, indexes, lsn)
        if self.format == "json":
            data = json.dumps(document, ensure_ascii=False, indent=1).encode()
        else:
            data = msgpack.packb(document, use_bin_type=True)
        if self.compression:
            data = zlib.compress(data, 6)
        temp = self.base_path / f"{self.snapshot_path.name}.{os.getpid()}.tmp"
        with _translate(f"write the snapshot {self.snapshot_path}"):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, data)
                _fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, self.snapshot_path)
            _fsync_directory(self.base_path)
            self._snapshot_lsn = lsn
            # Every record in the log is in the snapshot: this thread writes the log, and no
            # batch runs while a snapshot does.
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
                # rather than rewrite a large store for nothing.
                unchanged = self._applied_lsn == self._snapshot_lsn and self._log_size == 0
                if self._failed is None and not unchanged:
                    self._request_snapshot()
                    await self._snapshot_if_idle()
            finally:
                agent = self._agent
                if agent is not None:
                    agent.stop()
                    if self._ack_reader_done is not None:
                        await self._ack_reader_done.wait()
                    await anyio.to_thread.run_sync(agent.wait)
                    self._agent = None
                self._close_files()

    def _close_files(self) -> None:
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._release_lock()
        self._is_open = False


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
    """The parsed JSON of an uncompressed JSON payload, if re-encoding it gives the same bytes."""
    try:
        if payload_format(value) != "json" or value[0] & 0x80:
            return _MISSING
        parsed = json.loads(value[1:])
        again = json.dumps(parsed, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (ValueError, UnicodeDecodeError, DecodeError, RecursionError):
        # NaN, Infinity, nesting beyond the interpreter's depth: kept as base64 instead.
        return _MISSING
    return parsed if again.encode() == value[1:] else _MISSING
