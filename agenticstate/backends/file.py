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

Group commit. Concurrent writers share fsyncs: while one batch of records is being written and
synced (in a worker thread, one hop per batch), new writes gather in the next batch. A write is
visible to readers (and emitted to subscribers) once its batch is durable; compare-and-set and
`update` see writes still waiting in a batch, so versions stay exact. If a batch fails (disk
full, I/O error), the log is cut back to where it was, every write in that batch and the next
fails with `BackendError`, and the previous values stay in place.

Durability modes: `"fsync"` (the default: every acknowledged write is on disk) or `"none"`
(records go to the operating system without fsync: fast, and a process crash loses nothing, but
a power loss may lose the last writes).

Snapshots are rewritten every `save_interval` seconds when `auto_save` is on (and whenever the
log grows past `compact_bytes`), on `flush()`, and on `aclose()`. With `format="json"` the
snapshot is readable JSON with JSON values embedded as JSON; `"msgpack"` is compact;
`compression=True` compresses the snapshot and large log records.

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
import time
import zlib
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import anyio
import anyio.lowlevel
import msgpack
import structlog

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_pattern
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
)
from agenticstate.events import ChangeFanout, ChangeStream
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    DecodeError,
    InvalidArgumentError,
)
from agenticstate.serialization import payload_format

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

__all__ = ["Durability", "FileBackend", "FileFormat"]

log = structlog.get_logger(__name__)

FileFormat = Literal["json", "msgpack"]
Durability = Literal["fsync", "none"]

_RECORD = struct.Struct(">II")  # length of flags+payload, CRC-32 of flags+payload
_COMPRESSED = 0x01
_SNAPSHOT_MAGIC = "agenticstate-snapshot"
_SNAPSHOT_VERSION = 1
_MISSING = object()


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else round(moment.timestamp() * 1000)


def _from_ms(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)


def _now() -> datetime:
    # Millisecond precision, like every timestamp the store persists.
    return datetime.fromtimestamp(round(time.time() * 1000) / 1000, UTC)


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


@contextlib.contextmanager
def _translate(action: str) -> Iterator[None]:
    """Turn OSError into BackendError, in one place."""
    try:
        yield
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        detail = "the disk is full" if exc.errno == errno.ENOSPC else f"{reason}"
        raise BackendError(f"could not {action}: {detail}") from exc


class _Record:
    """One staged write: what the log gets, and the change it makes."""

    __slots__ = ("change", "entry", "key", "lsn")

    def __init__(self, lsn: int, key: str, entry: Entry | None, change: Change) -> None:
        self.lsn = lsn
        self.key = key
        self.entry = entry  # None for a delete
        self.change = change

    def payload(self) -> list[Any]:
        entry = self.entry
        if entry is None:
            return [self.lsn, "d", self.key, None, self.change.version, None, None, None]
        return [
            self.lsn,
            "s",
            self.key,
            entry.value,
            entry.version,
            _ms(entry.created_at),
            _ms(entry.updated_at),
            _ms(entry.expires_at),
        ]


class _IndexRecord:
    """One staged change to a sorted index: members added (with scores) or removed."""

    __slots__ = ("added", "index", "lsn", "members", "result")

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


class _Batch:
    """Writes that will be made durable together, by one fsync."""

    __slots__ = ("applied", "done", "error", "overlay", "records")

    def __init__(self) -> None:
        self.applied = False
        self.records: list[_Record | _IndexRecord] = []
        self.overlay: dict[str, Entry | None] = {}
        self.done = anyio.Event()
        self.error: BaseException | None = None


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
        self._flush_lock: anyio.Lock | None = None
        self._is_open = False
        self._closed = False
        self._failed: str | None = None
        self._lock_fd: int | None = None
        self._log_fd: int | None = None
        self._log_size = 0
        self._lsn = 0
        self._snapshot_lsn = 0
        self._last_snapshot = time.monotonic()
        self._open_batch = _Batch()
        self._flushing: _Batch | None = None

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
            self._flush_lock = anyio.Lock()
        async with self._open_lock:
            if not self._is_open:
                await anyio.to_thread.run_sync(self._open_sync)
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
        except BaseException:
            self._release_lock()
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
            if document.get("magic") != _SNAPSHOT_MAGIC:
                raise ValueError("not an agenticstate snapshot")
            self._snapshot_lsn = self._lsn = int(document["lsn"])
            now = _now()
            for key, item in document["entries"].items():
                entry = self._entry_from_snapshot(key, item)
                if entry.expires_at is None or entry.expires_at > now:
                    self._local.store(entry)
            for name, members in document.get("indexes", {}).items():
                self._apply_index(name, {str(m): float(s) for m, s in members.items()})
        except (ValueError, KeyError, TypeError, zlib.error, msgpack.UnpackException) as exc:
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
                fields = self._decode_record(body)
            except (ValueError, TypeError, zlib.error, msgpack.UnpackException):
                break
            offset += _RECORD.size + length
            lsn = int(fields[0])
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

    def _decode_record(self, body: bytes) -> list[Any]:
        flags, payload = body[0], body[1:]
        if flags & _COMPRESSED:
            payload = zlib.decompress(payload)
        fields = msgpack.unpackb(payload, raw=False)
        if not isinstance(fields, list) or len(fields) != 8:
            raise ValueError("bad record")
        return fields

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
        """The newest state of `key`, counting writes still waiting in a batch."""
        for batch in (self._open_batch, self._flushing):
            if batch is not None and key in batch.overlay:
                staged = batch.overlay[key]
                if (
                    staged is not None
                    and staged.expires_at is not None
                    and staged.expires_at <= now
                ):
                    return None
                return staged
        return self._local.live(key, now)

    def _stage(
        self,
        key: str,
        value: bytes | None,
        ttl: timedelta | None,
        expected: int | None,
        now: datetime,
        *,
        current: Any = _MISSING,
    ) -> _Record | None:
        if self._failed is not None:
            raise BackendError(self._failed)
        if current is _MISSING:
            current = self._current(key, now)
        version = current.version if current is not None else 0
        if expected is not None and expected != version:
            raise conflict(key, expected, version)
        if value is None:
            if current is None:
                return None
            change = Change(
                key=key,
                op=ChangeOp.DELETE,
                old=current.value,
                new=None,
                version=version,
                timestamp=now,
            )
            entry = None
        else:
            entry = Entry(
                key=key,
                value=value,
                version=version + 1,
                created_at=current.created_at if current is not None else now,
                updated_at=now,
                expires_at=now + ttl if ttl is not None else None,
            )
            change = Change(
                key=key,
                op=ChangeOp.SET,
                old=current.value if current is not None else None,
                new=value,
                version=version + 1,
                timestamp=now,
            )
        self._lsn += 1
        record = _Record(self._lsn, key, entry, change)
        batch = self._open_batch
        batch.records.append(record)
        batch.overlay[key] = entry
        return record

    async def _commit(self) -> None:
        """Wait until the batch holding our staged records is durable (leading it if free)."""
        batch = self._open_batch
        assert self._flush_lock is not None  # noqa: S101  # set by open()
        while not batch.done.is_set():
            flushing = self._flushing
            if flushing is not None:
                # Another writer is syncing the previous batch: ours gathers meanwhile.
                await flushing.done.wait()
                continue
            # Nobody is syncing: lead. Whatever gathered so far goes in this one fsync.
            self._open_batch = _Batch()
            self._flushing = batch
            try:
                async with self._flush_lock:
                    if self._log_fd is None:
                        batch.error = BackendError(
                            "the store was closed before the write was saved"
                        )
                    else:
                        await self._write_batch(batch)
            finally:
                if self._flushing is batch:
                    self._flushing = None
                batch.done.set()
        if batch.error is not None:
            raise BackendError(f"the write was not saved: {batch.error}") from batch.error

    async def _write_batch(self, batch: _Batch) -> None:
        blob = b"".join(self._encode_record(record) for record in batch.records)
        try:
            with anyio.CancelScope(shield=True):
                if self.durability == "fsync":
                    await anyio.to_thread.run_sync(self._append, blob)
                else:
                    self._append(blob)
        except Exception as exc:  # noqa: BLE001  # any failure fails the batch, never silently
            batch.error = exc
            self._fail_pending(exc)
            return
        for record in batch.records:
            if isinstance(record, _IndexRecord):
                record.result = self._apply_index(record.index, record.members)
                continue
            if record.entry is None:
                self._local.drop(record.key)
            else:
                self._local.store(record.entry)
            self._fanout.publish(record.change)
        batch.applied = True
        if self._should_snapshot():
            with contextlib.suppress(BackendError):
                await self._snapshot()

    def _fail_pending(self, exc: BaseException) -> None:
        # Writes staged after the failed batch may build on it: fail them too.
        pending, self._open_batch = self._open_batch, _Batch()
        pending.error = exc
        pending.done.set()
        log.error("file_store_write_failed", path=str(self.log_path), error=type(exc).__name__)

    def _apply_index(self, index: str, members: dict[str, float] | list[str]) -> int:
        if isinstance(members, dict):
            return self._local.index_add(index, members)
        return self._local.index_remove(index, members)

    def _encode_record(self, record: _Record | _IndexRecord) -> bytes:
        payload: bytes = msgpack.packb(record.payload(), use_bin_type=True)
        flags = 0
        if self.compression and len(payload) > 256:
            packed = zlib.compress(payload, 1)
            if len(packed) < len(payload):
                payload, flags = packed, _COMPRESSED
        body = bytes((flags,)) + payload
        return _RECORD.pack(len(body), zlib.crc32(body)) + body

    def _append(self, blob: bytes) -> None:
        fd = self._log_fd
        assert fd is not None  # noqa: S101  # set by open()
        start = self._log_size
        try:
            with _translate(f"append to the log {self.log_path}"):
                _write_all(fd, blob)
                if self.durability == "fsync":
                    _fsync(fd)
        except BackendError:
            # Cut the log back so that no unacknowledged record can be replayed later.
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:
                self._failed = (
                    f"the log {self.log_path} could not be repaired after a failed write; "
                    "reopen the store"
                )
            raise
        self._log_size = start + len(blob)

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
        check_ttl(ttl)
        check_expected_version(expected_version)
        await self._ready()
        now = _now()
        self._local.sweep(now)
        record = self._stage(key, value, ttl, expected_version, now)
        assert record is not None  # noqa: S101  # a set always stages a record
        await self._commit()
        return record.change

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values with one fsync."""
        for key, _ in items:
            validate_key(key)
        check_ttl(ttl)
        await self._ready()
        now = _now()
        records = [self._stage(key, value, ttl, None, now) for key, value in items]
        await self._commit()
        return [record.change for record in records if record is not None]

    async def delete(self, key: str, *, expected_version: int | None = None) -> Change | None:
        """Delete `key` durably; see `Backend.delete`."""
        validate_key(key)
        check_expected_version(expected_version)
        await self._ready()
        record = self._stage(key, None, None, expected_version, _now())
        if record is None:
            return None
        await self._commit()
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
        now = _now()
        current = self._current(key, now)
        value = fn(current)
        record = self._stage(
            key, value, ttl, current.version if current else 0, now, current=current
        )
        assert record is not None  # noqa: S101
        await self._commit()
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
        self._open_batch.records.append(record)
        await self._commit()
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
        """Write a snapshot of every acknowledged write now and empty the log."""
        await self._ready()
        assert self._flush_lock is not None  # noqa: S101
        async with self._flush_lock:
            await self._snapshot()

    async def _snapshot(self) -> None:
        document = self._snapshot_document()
        lsn = self._lsn_committed()
        await anyio.to_thread.run_sync(self._write_snapshot, document, lsn)

    def _lsn_committed(self) -> int:
        # Records applied to the committed state are in the snapshot; staged ones are not.
        pending = [
            record.lsn
            for batch in (self._open_batch, self._flushing)
            if batch is not None and not batch.applied
            for record in batch.records
        ]
        return min(pending) - 1 if pending else self._lsn

    def _snapshot_document(self) -> dict[str, Any]:
        now = _now()
        entries: dict[str, Any] = {}
        for key, entry in self._local.data.items():
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
            entries[key] = item
        indexes = {name: index.items() for name, index in self._local.indexes.items()}
        return {
            "magic": _SNAPSHOT_MAGIC,
            "format_version": _SNAPSHOT_VERSION,
            "entries": entries,
            "indexes": indexes,
        }

    def _write_snapshot(self, document: dict[str, Any], lsn: int) -> None:
        document["lsn"] = lsn
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
            # Records up to `lsn` are in the snapshot now; later ones stay (none while we hold
            # the flush lock, since only the lock holder appends).
            if self._log_fd is not None:
                os.ftruncate(self._log_fd, 0)
                if self.durability == "fsync":
                    _fsync(self._log_fd)
                self._log_size = 0
        self._last_snapshot = time.monotonic()
        log.debug(
            "file_store_snapshot", path=str(self.snapshot_path), entries=len(document["entries"])
        )

    async def aclose(self) -> None:
        """Write a final snapshot, end subscriptions and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fanout.close()
        if not self._is_open:
            return
        assert self._flush_lock is not None  # noqa: S101
        with anyio.CancelScope(shield=True):
            async with self._flush_lock:
                try:
                    if self._failed is None:
                        await self._snapshot()
                finally:
                    await anyio.to_thread.run_sync(self._close_files)

    def _close_files(self) -> None:
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._release_lock()
        self._is_open = False


def _readable_json(value: bytes) -> Any:
    """The parsed JSON of an uncompressed JSON payload, if re-encoding it gives the same bytes."""
    try:
        if payload_format(value) != "json" or value[0] & 0x80:
            return _MISSING
        parsed = json.loads(value[1:])
    except (ValueError, UnicodeDecodeError, DecodeError):
        return _MISSING
    again = json.dumps(parsed, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return parsed if again == value[1:] else _MISSING
