"""The file backend's log: staged writes, the frames they are appended in, and group commit.

`FileBackend` stages each write as a `Record` (or an `IndexRecord`) in the open `Job`, a batch
that the event loop seals into one log frame (`_file_format.encode_frame`) and appends with
`CommitLog.append`: one `write` to the page cache, never an fsync. With `durability="fsync"` the
log then asks the `FsyncAgent`, a small process running `_fsync_agent.py`, to make every frame
appended so far durable; the agent answers with the last request its fsync covered, and
`CommitLog.acked` hands back the batches that answer made durable, in order, or the error that
failed them. While an fsync runs, frames keep being appended, and one later fsync covers them
all: concurrent writers share fsyncs, and the event loop never waits for the disk.

This module keeps the log's bookkeeping (its size, the requests in flight, the batches waiting
for their fsync) and opens, appends to, cuts back and empties the log file; what a durable or
failed batch means for the store (entries applied, subscribers told, writes failed) is
`FileBackend`'s.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate.backends import _file_io
from agenticstate.backends._file_format import (
    FRAME_HEADER,
    OP_DELETE,
    OP_INDEX_ADD,
    OP_INDEX_REMOVE,
    OP_SET,
    encode_frame,
)
from agenticstate.backends._file_io import describe_errno, translate
from agenticstate.exceptions import BackendError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agenticstate._tasks import EventLike
    from agenticstate.backends.base import Change, Entry

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_REQUESTS",
    "CommitLog",
    "FsyncAgent",
    "IndexRecord",
    "Job",
    "Record",
    "TxnGroup",
    "UnencodableRecordsError",
]

MAX_REQUESTS = 8  # fsync requests unanswered at a time (each 8 bytes; a pipe holds 64 KiB)
MAX_FRAME_BYTES = 2**32 - 1  # a frame's length field has 4 bytes
_RECORD_OVERHEAD = 128  # bytes a record's fields take besides its key and value, at most
_ACK = struct.Struct("<QI")  # the last request number an fsync covered, errno (0: success)


class TxnGroup:
    """The records one `transact` step staged: logged in one frame, failed together.

    `depends` holds the staged records (not yet durable) whose state the step read: if one of
    them fails, the step's decision rested on a write that never happened, so it fails too.
    """

    __slots__ = ("depends", "records")

    def __init__(self) -> None:
        self.depends: list[Record | IndexRecord] = []
        self.records: list[Record | IndexRecord] = []

    def error(self) -> BaseException | None:
        """The first error among its records and the records it read, or `None`."""
        for record in (*self.records, *self.depends):
            if record.error is not None:
                return record.error
        return None


class Record:
    """One staged write: what the log gets, and the change it makes."""

    __slots__ = ("batch", "change", "depth", "entry", "error", "group", "key", "lsn", "stamps")

    batch: Job  # the batch it was staged in (set when it is added to one)
    group: TxnGroup | None  # the transaction it belongs to (set when it is added to a batch)
    error: BaseException | None  # why this record alone failed (its batch went on without it)

    def __init__(
        self,
        lsn: int,
        key: str,
        entry: Entry | None,
        change: Change,
        stamps: tuple[int | None, int | None, int | None],
        depth: int = 1,
    ) -> None:
        self.lsn = lsn
        self.key = key
        self.entry = entry  # None for a delete
        self.change = change
        self.stamps = stamps  # created, updated, expires: the entry's times in epoch ms
        self.depth = depth  # the versions of the key's history to keep (1: none)
        self.group = None
        self.error = None

    def size(self) -> int:
        """About how many bytes the record takes in a frame (uncompressed), at most."""
        entry = self.entry
        return len(self.key) * 4 + _RECORD_OVERHEAD + (0 if entry is None else len(entry.value))

    def payload(self) -> list[Any]:
        """The record's fields in the log (see `_file_format`)."""
        entry = self.entry
        if entry is None:
            stamp = self.stamps[1]  # when it was deleted
            return [self.lsn, OP_DELETE, self.key, None, self.change.version, None, stamp, None]
        if entry.create_revision != self.lsn:  # the key was there: its life's first revision
            return [
                self.lsn,
                OP_SET,
                self.key,
                entry.value,
                entry.version,
                *self.stamps,
                self.depth,
                entry.create_revision,
            ]
        if self.depth > 1:
            return [
                self.lsn,
                OP_SET,
                self.key,
                entry.value,
                entry.version,
                *self.stamps,
                self.depth,
            ]
        return [self.lsn, OP_SET, self.key, entry.value, entry.version, *self.stamps]


class IndexRecord:
    """One staged change to a sorted index: members added (with scores) or removed."""

    __slots__ = ("added", "batch", "error", "group", "index", "lsn", "members", "result")

    batch: Job
    group: TxnGroup | None
    error: BaseException | None

    def __init__(self, lsn: int, index: str, members: dict[str, float] | list[str]) -> None:
        self.lsn = lsn
        self.index = index
        self.members = members
        self.added = isinstance(members, dict)
        self.result = 0
        self.group = None
        self.error = None

    @property
    def key(self) -> str:
        """The index's name: what later records that build on this one share."""
        return self.index

    def size(self) -> int:
        """About how many bytes the record takes in a frame (uncompressed), at most."""
        return (len(self.index) + sum(len(m) + 8 for m in self.members)) * 4 + _RECORD_OVERHEAD

    def payload(self) -> list[Any]:
        """The record's fields in the log (see `_file_format`)."""
        op = OP_INDEX_ADD if self.added else OP_INDEX_REMOVE
        return [self.lsn, op, self.index, self.members, 0, None, None, None]


class Job:
    """A batch of writes appended as one log frame, or a snapshot; its writers wait on `done`.

    `seq` and `start` are set when a batch's frame is appended: its fsync request number and
    where the frame begins in the log.
    """

    __slots__ = ("done", "error", "records", "seq", "start")

    def __init__(self, event: Callable[[], EventLike] = anyio.Event) -> None:
        self.records: list[Record | IndexRecord] = []
        self.done = event()
        self.error: BaseException | None = None
        self.seq = 0
        self.start = 0


class UnencodableRecordsError(Exception):
    """Some records of a batch cannot go into a log frame; nothing was written.

    Attributes:
        bad: Each record that fails, with its own error, and each record that builds on one of
            them (a later write of its key, the rest of its transaction, a transaction that read
            it), with an error naming the failed write.
    """

    def __init__(self, bad: dict[Record | IndexRecord, BaseException]) -> None:
        super().__init__(f"{len(bad)} record(s) cannot be logged")
        self.bad = bad


def frames_of(records: list[Record | IndexRecord], *, compress: bool) -> bytes:
    """The log bytes of `records`: one frame, or several no larger than `MAX_FRAME_BYTES`.

    A batch is only a way to share an fsync, so it may span frames; a transaction's records
    stay in one frame (one checksum: after a crash all of it is replayed or none).

    Raises:
        UnencodableRecordsError: A record cannot be encoded, or is alone too large for a frame.
    """
    try:
        frame: bytes | None = encode_frame(
            [record.payload() for record in records], compress=compress
        )
    except Exception:  # noqa: BLE001  # too large for one frame (struct.error), or a bad record
        frame = None
    if frame is not None and len(frame) - FRAME_HEADER.size <= MAX_FRAME_BYTES:
        return frame
    try:
        return b"".join(_split_frames(records, compress=compress))
    except Exception as exc:  # find the records at fault; the others go on
        bad = _unencodable(records, compress=compress)
        if not bad:
            # Every record encodes alone, so this is not about them: fail the whole batch.
            raise BackendError(f"could not encode a log frame ({exc})") from exc
        raise UnencodableRecordsError(_with_dependents(records, bad)) from exc


def _units(records: list[Record | IndexRecord]) -> list[list[Record | IndexRecord]]:
    """The records in runs that must share a frame: each transaction's, or one record."""
    units: list[list[Record | IndexRecord]] = []
    for record in records:
        if record.group is not None and units and units[-1][0].group is record.group:
            units[-1].append(record)
        else:
            units.append([record])
    return units


def _split_frames(records: list[Record | IndexRecord], *, compress: bool) -> list[bytes]:
    frames: list[bytes] = []
    pending: list[Record | IndexRecord] = []
    size = 0
    for unit in _units(records):
        unit_size = sum(record.size() for record in unit)
        if pending and size + unit_size > MAX_FRAME_BYTES:
            frames.append(encode_frame([r.payload() for r in pending], compress=compress))
            pending, size = [], 0
        pending += unit
        size += unit_size
    if pending:
        frames.append(encode_frame([r.payload() for r in pending], compress=compress))
    for frame in frames:
        if len(frame) - FRAME_HEADER.size > MAX_FRAME_BYTES:
            raise ValueError("a log frame is too large")  # a unit alone is: found one by one
    return frames


def _unencodable(
    records: list[Record | IndexRecord], *, compress: bool
) -> dict[Record | IndexRecord, BaseException]:
    """The records that cannot be logged, each alone (a transaction: all of it), with errors."""
    bad: dict[Record | IndexRecord, BaseException] = {}
    for unit in _units(records):
        for record in unit:
            try:
                encode_frame([record.payload()], compress=compress)
            except Exception as exc:  # noqa: BLE001  # the record's own fault, told its writer
                error = bad[record] = BackendError(
                    f"the write of {record.key!r} cannot be logged: {exc}"
                )
                error.__cause__ = exc
        if any(record in bad for record in unit):
            continue
        size = len(encode_frame([r.payload() for r in unit], compress=compress))
        if size - FRAME_HEADER.size > MAX_FRAME_BYTES:
            for record in unit:
                bad[record] = BackendError(
                    f"the write of {record.key!r} does not fit in a log frame ({size} bytes"
                    f"{' with its transaction' if len(unit) > 1 else ''}; at most "
                    f"{MAX_FRAME_BYTES})"
                )
    return bad


def _with_dependents(
    records: list[Record | IndexRecord], bad: dict[Record | IndexRecord, BaseException]
) -> dict[Record | IndexRecord, BaseException]:
    """`bad`, plus every record that builds on one of them (see `UnencodableRecordsError`)."""
    failed = dict(bad)
    while True:
        first_bad: dict[str, int] = {}  # key -> position of its first failed record
        for position, record in enumerate(records):
            if record in failed:
                first_bad.setdefault(record.key, position)
        bad_groups = {record.group for record in failed if record.group is not None}
        added = False
        for position, record in enumerate(records):
            group = record.group
            if record in failed:
                continue
            reason = None
            if group is not None and group in bad_groups:
                reason = "another write of its transaction cannot be logged"
            elif first_bad.get(record.key, position) < position:
                reason = f"it builds on a write of {record.key!r} that cannot be logged"
            elif group is not None and any(read in failed for read in group.depends):
                reason = "its transaction read a write that cannot be logged"
            if reason is not None:
                failed[record] = BackendError(f"the write of {record.key!r} failed: {reason}")
                added = True
        if not added:
            return failed


class FsyncAgent:
    """The process that fsyncs a store's log on request (see `_fsync_agent`)."""

    __slots__ = ("acks", "pending", "process", "requests")

    def __init__(self, script: Path, log_fd: int) -> None:
        request_read, self.requests = os.pipe()
        self.acks, ack_write = os.pipe()
        self.pending = b""  # the start of an answer not read whole yet
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
        # Never block the event loop on the agent: the store keeps at most `MAX_REQUESTS`
        # requests unanswered (far below a pipe's capacity), and a full pipe anyway means "ask
        # again when the next answer comes", not a stalled loop.
        os.set_blocking(self.requests, False)

    def request(self, seq: int) -> bool:
        """Ask for an fsync covering every frame appended so far (answered on `acks`).

        Returns:
            False if the request pipe is full (nothing was sent).

        Raises:
            BackendError: The agent is gone (the pipe is closed at its end).
        """
        with translate("send the fsync agent a request"):
            try:
                os.write(self.requests, seq.to_bytes(8, "little"))  # 8 bytes: all or nothing
            except BlockingIOError:
                return False
        return True

    async def answers(self) -> list[tuple[int, int]] | None:
        """Wait for the agent's next answers: `(last request covered, errno or 0)` each.

        Returns:
            None once the agent has exited.

        Raises:
            BackendError: Reading the answers failed.
        """
        while True:
            await anyio.wait_readable(self.acks)
            with translate("read the fsync agent's answers"):
                try:
                    data = os.read(self.acks, 65536)
                except BlockingIOError:
                    continue
            if not data:
                return None
            pending = self.pending + data
            usable = len(pending) - len(pending) % _ACK.size
            self.pending = pending[usable:]
            if usable:
                return [_ACK.unpack_from(pending, offset) for offset in range(0, usable, _ACK.size)]

    def stop(self) -> None:
        """Close the request pipe: the agent answers what it has read and exits."""
        with contextlib.suppress(OSError):
            os.close(self.requests)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the pipes; never wait for it."""
        for fd in (self.requests, self.acks):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.process.returncode = 0  # not this process's child

    def wait(self) -> None:
        """Reap the process and close the acknowledgement pipe (blocking)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            os.close(self.acks)


class CommitLog:
    """The log file of a store: frames appended in order, made durable by the fsync agent.

    Args:
        path: The log file (`<name>.log`).
        compression: Compress frames larger than 256 bytes.
    """

    def __init__(self, path: Path, *, compression: bool) -> None:
        self.path = path
        self.compression = compression
        self.fd: int | None = None
        self.size = 0  # bytes appended (the end of the last frame)
        self.agent: FsyncAgent | None = None  # None with durability="none"
        self.seq = 0  # the number of the last frame appended (what an fsync request names)
        self.requested: deque[int] = deque()  # requests sent and not yet answered
        self.acked_seq = 0  # the last request number answered
        self.unacked: deque[Job] = deque()  # appended, waiting for their fsync, in order

    def open(self) -> bytes:
        """Open the log (creating it) and return what it holds (blocking)."""
        with translate(f"open the log {self.path}"):
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with translate(f"read the log {self.path}"):
            size = os.fstat(self.fd).st_size
            data = os.pread(self.fd, size, 0) if size else b""
        self.size = len(data)
        return data

    def start_agent(self, script: Path) -> None:
        """Start the fsync agent process (`durability="fsync"`)."""
        assert self.fd is not None  # noqa: S101  # opened by open()
        hint = '; durability="fsync" needs it, durability="none" runs without it'
        with translate("start the fsync agent process", hint=hint):
            self.agent = FsyncAgent(script, self.fd)

    def append(self, batch: Job) -> None:
        """Append `batch` as one frame (or a few, see `frames_of`) and count it in for an fsync.

        Raises:
            UnencodableRecordsError: Records of the batch cannot be logged; nothing was written.
            BackendError: The write failed; `size` then counts the whole frame, so
                `truncate(batch.start)` cuts off whatever part of it was written.
        """
        fd = self.fd
        assert fd is not None  # noqa: S101  # set by open()
        batch.start = start = self.size  # first: a failure to encode cuts nothing
        frame = frames_of(batch.records, compress=self.compression)
        self.size = start + len(frame)  # at most, if the write fails
        with translate(f"append to the log {self.path}"):
            _file_io.write_all(fd, frame)
        if self.agent is not None:
            self.seq += 1
            batch.seq = self.seq
            self.unacked.append(batch)

    def request_fsync(self) -> None:
        """Ask the agent to sync every frame appended so far, unless enough requests wait.

        The agent answers once for all the requests it read together, so a few requests in
        flight keep it busy; more would only fill the pipes. Frames appended meanwhile are
        covered by the request sent when the next answer arrives.

        Raises:
            BackendError: The agent is gone.
        """
        agent, requested = self.agent, self.requested
        if agent is None or self.seq <= (requested[-1] if requested else self.acked_seq):
            return
        if len(requested) >= MAX_REQUESTS:
            return
        if agent.request(self.seq):
            requested.append(self.seq)

    def acked(self, seq: int, code: int) -> tuple[list[Job], BackendError | None]:
        """Take the agent's answer that an fsync covering request `seq` ended with `code`.

        Returns:
            The batches it made durable, oldest first; or, if it failed, the error for the
            batches still waiting from `unacked[0]` on (None if they already failed).
        """
        requested = self.requested
        while requested and requested[0] <= seq:
            requested.popleft()
        self.acked_seq = max(self.acked_seq, seq)
        unacked = self.unacked
        if code == 0:
            durable = []
            while unacked and unacked[0].seq <= seq:
                durable.append(unacked.popleft())
            return durable, None
        if not unacked or unacked[0].seq > seq:
            return [], None  # about batches that already failed
        return [], BackendError(describe_errno(code, f"sync the log {self.path}"))

    def drop_from(self, first: Job) -> list[Job]:
        """Stop waiting for `first` and every batch appended after it; return them."""
        unacked = self.unacked
        dropped = [first]
        if first in unacked:
            while unacked[-1] is not first:
                dropped.append(unacked.pop())
            unacked.pop()
        return dropped

    def truncate(self, size: int) -> None:
        """Cut the log back to `size` bytes, durably, so that no failed record is replayed.

        Raises:
            BackendError: The log could not be cut back.
        """
        fd = self.fd
        if fd is None or self.size <= size:
            return
        with translate(f"cut the log {self.path} back"):
            os.ftruncate(fd, size)
            _file_io.fsync(fd)
        self.size = size

    def written_by_another(self) -> bool:
        """Whether the log's size is not what this process appended (another writer changed it).

        Only a second owner can do that: one that opened the store after its lock file was
        deleted, and appended to or emptied the same log.
        """
        fd = self.fd
        if fd is not None:
            with contextlib.suppress(OSError):  # cannot tell: the next check looks again
                return os.fstat(fd).st_size != self.size
        return False

    def unlinked(self) -> str | None:
        """Why the log at the path is no longer the file this process appends to, or `None`.

        A log deleted (a `*.log` cleanup job, logrotate) or replaced while the store is open
        takes every later write with it: they would go to a file no path names, lost at the
        next crash or reopen. The owner finds out here and must stop acknowledging.
        """
        fd = self.fd
        if fd is None:
            return None
        held = there = None
        with contextlib.suppress(OSError):  # cannot tell (a transient error): look next time
            held = os.fstat(fd)
            try:
                there = os.stat(self.path)
            except FileNotFoundError:
                return f"the log {self.path} was deleted"
        if held is None or there is None:
            return None
        if (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
            return f"the log {self.path} was replaced"
        return None

    def empty(self, *, sync: bool) -> None:
        """Empty the log: a snapshot now holds every record in it (blocking)."""
        fd = self.fd
        if fd is None:
            return
        with translate(f"empty the log {self.path}"):
            os.ftruncate(fd, 0)
            if sync:
                _file_io.fsync(fd)
        self.size = 0

    def sync(self) -> None:
        """Make the log durable now, in this thread (blocking; for `durability="none"`)."""
        if self.fd is not None:
            with translate(f"sync the log {self.path}"):
                _file_io.fsync(self.fd)

    def close(self) -> None:
        """Close the log file (the agent is stopped before)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the log and the agent's pipes."""
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.forget()
        self.close()
