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

Revisions. A record's sequence number is also the revision of its write (the log's numbers never
go back: a snapshot records the last one, and index records take numbers too); a write to a key
that was there logs the key's create revision as well, and the snapshot keeps both per entry. A
store written before revisions gets them on open (`_revise_legacy_entries`).

Listings. The entries are in memory with their keys in order (`LocalStore`: sorted chunks kept
in the same step as every change, sorted once on open after the replay): a pattern with a
literal prefix costs O(log n + its range), one across entities (`agents:{*}:recovery`)
O(entities x log n + result), one with no literal prefix a test of every key. The expiry sweep
pops a heap only while its head is due: it costs what expires, not what lives.

The change feed and history. A change enters the in-memory feed (`FeedRing`) when its batch is
durable, in the step that applies it, so a change is in the feed exactly when its write is; its
cursor is `f1:<store id>:<lsn>`. The log is the truth: on open the feed is rebuilt from its
records (each change's old value from the state the replay has reached, expired entries kept
until the replay ends), and a write under a history rule logs its depth, so history is rebuilt
too. A snapshot keeps what compaction would lose in its journal (`_file_format.Journal`): the
store id, the trimmed point, the retained changes and the keys' older versions. A new store (or
one written before the feed) gets a random id, written in a snapshot on open before any cursor
names it; a store made again gets a new one, so old cursors raise `CursorExpiredError`.

One owner. A second process opening the same store gets `BackendError` naming the holder's pid.
A lock left by a killed process is released by the operating system with the process, so the
next opener takes over safely. Keys never become file names.

The backend in modules, by concern (as redis-py separates its client from its connection):
this module is the `Backend` API (opening and recovery, reads, staging writes, snapshots and
closing); `_file_format` encodes and checks the log's frames and the snapshot (no I/O);
`_file_log` appends frames and runs group commit with the fsync agent; `_file_lock` holds the
owner lock and lets go of it in a forked child; `_file_io` holds the writes and syncs that tests
replace to inject faults, and `translate`, the one place where an `OSError` becomes
`BackendError`. Every event they log is logged here, under this module's logger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import sys
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import anyio
import anyio.lowlevel
import anyio.to_thread

from agenticstate._checks import seconds
from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_key_prefix, validate_pattern
from agenticstate._log import get_logger
from agenticstate._tasks import EventLike, event_factory, soon_scheduler, spawn_service
from agenticstate.backends import _file_io, _file_lock, _file_log
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._file_format import (
    FRAME_HEADER,
    MALFORMED_FRAME,
    MALFORMED_SNAPSHOT,
    MISSING,
    OP_DELETE,
    OP_INDEX_ADD,
    OP_INDEX_REMOVE,
    OP_SET,
    Clock,
    FileFormat,
    Journal,
    Times,
    decode_frame,
    decode_journal,
    decode_snapshot,
    encode_journal,
    encode_snapshot,
    entry_from_snapshot,
    from_ms,
    now,
    salvage_frames,
    tail_damage,
    whole_frames,
)
from agenticstate.backends._file_io import translate
from agenticstate.backends._file_lock import OwnerLock, holder_of
from agenticstate.backends._file_log import (
    CommitLog,
    FsyncAgent,
    IndexRecord,
    Job,
    Record,
    TxnGroup,
    UnencodableRecordsError,
)
from agenticstate.backends._local import FeedRing, LocalStore, feed_from_query, run_transaction
from agenticstate.backends._paths import check_path_text, path_errors
from agenticstate.backends._urls import url_query
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    DEFAULT_UPDATE_ATTEMPTS,
    Backend,
    Change,
    ChangeOp,
    Entry,
    FeedRetention,
    FeedSize,
    HistoryRules,
    Put,
    check_expected,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
    new_change,
    new_entry,
)
from agenticstate.config import redact_url
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    CorruptStoreError,
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence

    from agenticstate._glob import GlobMatcher
    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult

__all__ = ["Durability", "FileBackend", "FileFormat", "FileRepairReport"]

log = get_logger(__name__)

Durability = Literal["fsync", "none"]

_MILLISECOND = timedelta(milliseconds=1)
_FRAME_RECORDS = 16  # a frame is sealed when it holds this many records
_STAGE_CHUNK = 512  # records `set_many` stages between two yields to the event loop
_LOCK_CHECK_INTERVAL = 0.01  # seconds between lock file checks with durability="none"
_AGENT_EXIT_TIMEOUT = 2.0  # seconds `aclose()` waits for the agent to exit before killing it
_DEFAULT_FEED = FeedRetention()
_OPS = {OP_SET: ChangeOp.SET, OP_DELETE: ChangeOp.DELETE}
_URL_PARAMETERS = ("feed", "feed_max_changes", "feed_max_age", "feed_max_bytes")


_SNAPSHOT_SUFFIXES = (".json", ".msgpack")
"""A `file://` path ending in one of these names a snapshot file rather than a directory."""


def _snapshot_named(path: Path) -> Path | None:
    """The snapshot file a `file://` path names, or `None` if it names a store's directory.

    An existing directory is a directory; otherwise the path names a snapshot file when its
    name ends in `.json` or `.msgpack`, or when a store's log is beside it (`NAME.log`: a
    store written with `StateConfig(file_path=...)` under a name without that ending).
    """
    with contextlib.suppress(OSError):  # unreadable: opening the store reports the problem
        if path.is_dir() or not path.name or path.name in (".", ".."):
            return None
        if path.suffix.lower() in _SNAPSHOT_SUFFIXES:
            return path
        return path if path.with_name(f"{path.name}.log").is_file() else None
    return None


def _call_now(callback: Callable[[], object]) -> None:
    callback()


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
        feed: The change feed's retention (`None`: no feed, changes carry no cursor).
        history: History rules (`keep_history`): key patterns to the versions each keeps.
        create: Create the store (its directory and files) if it does not exist (the default).
            With `False`, opening a store that does not exist raises `NotFoundError` and
            creates nothing: what a command that only reads wants.
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
        feed: FeedRetention | None = _DEFAULT_FEED,
        history: Mapping[str, int] | HistoryRules | None = None,
        create: bool = True,
    ) -> None:
        if not isinstance(create, bool):
            raise ConfigurationError(f"create must be a bool, not {create!r}")
        if feed is not None and not isinstance(feed, FeedRetention):
            raise ConfigurationError(f"feed must be a FeedRetention or None, not {feed!r}")
        if format not in ("json", "msgpack"):
            raise ConfigurationError(f"format must be 'json' or 'msgpack', not {format!r}")
        if durability not in ("fsync", "none"):
            raise ConfigurationError(f"durability must be 'fsync' or 'none', not {durability!r}")
        save_interval = seconds(save_interval, "save_interval")
        if compact_bytes < 1:
            raise ConfigurationError("compact_bytes must be positive")
        if type(close_snapshot_keys) is not int or close_snapshot_keys < 0:
            raise ConfigurationError("close_snapshot_keys must be an int >= 0")
        self._explicit_name = file_name is not None
        name = file_name or f"state.{'json' if format == 'json' else 'msgpack'}"
        if not name or "/" in name or name in (".", ".."):
            raise ConfigurationError(f"file_name must be a plain file name, not {name!r}")
        check_path_text(name, "file_name")
        check_path_text(base_path, "store directory")
        self.base_path = Path(base_path)
        self.format: FileFormat = format
        self.preferred_format = format
        self.compression = compression
        self.key_prefix = validate_key_prefix(key_prefix)
        self.durability: Durability = durability
        self.auto_save = auto_save
        self.save_interval = save_interval
        self.compact_bytes = compact_bytes
        self.close_snapshot_keys = close_snapshot_keys
        self.create = create
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
        self._lock = OwnerLock(self.lock_path)
        self._commit_log = CommitLog(self.log_path, compression=compression)
        self._lsn = 0  # the last sequence number given to a staged record
        self._applied_lsn = 0  # the last one applied (durable and visible)
        self._snapshot_lsn = 0
        self._snapshot_bytes = 0  # the size of the snapshot file, as last written or read
        self._last_snapshot = time.monotonic()
        self._lock_checked = 0.0  # when the lock file was last checked (`_still_owner`)
        self._ack_reader: object = None  # the task reading the agent's answers
        self._ack_reader_done: anyio.Event | None = None
        self._frame_records = _FRAME_RECORDS  # a frame is sealed when it holds this many
        self._new_event: Callable[[], EventLike] = anyio.Event
        self._clock = Clock()
        self._open_batch = Job()  # gathering writes
        self._staged: dict[str, Record] = {}  # the newest staged write per key, not yet applied
        self._call_soon: Callable[[Callable[[], object]], object] = _call_now
        self._snapshot_job: Job | None = None  # a wanted snapshot: appends pause until it ran
        self._txn_group: TxnGroup | None = None  # the transaction staging records now
        self._snapshot_lock: anyio.Lock | None = None
        self._counters = {"batches": 0, "fsyncs": 0, "snapshots": 0}
        self.feed = feed
        self._ring: FeedRing | None = None  # made on open, when the store's id is known
        self._keeps_history = False
        if history is not None:
            self.keep_history(history)

    _agent_script = Path(__file__).with_name("_fsync_agent.py")
    has_revisions = True

    MAX_VALUE_BYTES = 2**30
    """The largest value a store takes, in bytes (1 GiB): larger ones raise `TooLargeError`.

    A log frame holds up to 4 GiB, but the snapshot's journal keeps a change's old and new
    values together in one field of at most 4 GiB, and the whole store lives in memory.
    """

    def _check_size(self, key: str, value: bytes) -> None:
        """Refuse a value over `MAX_VALUE_BYTES` before it is staged (its writer's own error)."""
        if len(value) > self.MAX_VALUE_BYTES:
            raise TooLargeError(
                f"the value for {key!r} is {len(value)} bytes; a file store takes at most "
                f"{self.MAX_VALUE_BYTES} bytes per value",
                path="",
            )

    def __repr__(self) -> str:
        return f"FileBackend(base_path={str(self.base_path)!r}, format={self.format!r})"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FileBackend:
        """Create a backend from `file://DIR` or `file://DIR/NAME.json`, relative or absolute.

        The path names the store's directory (whose snapshot is `state.json`), or its snapshot
        file, as `StateConfig(file_path=...)` does: a path that is not an existing directory
        names the snapshot file when its name ends in `.json` or `.msgpack` (the format
        follows: a `.msgpack` name opens a msgpack store) or when a store's log
        (`NAME.log`) is beside it. So `file://./state/app_state.json` opens the store
        `StateConfig(backend="file", file_path="./state/app_state.json")` writes.

        Query parameters set the feed: `feed=off`, `feed_max_changes=N`, `feed_max_age=SECONDS`,
        `feed_max_bytes=N`;
        any other, a fragment or a query item without `=` is refused (a `#` or `?` in the path
        is written `%23`, `%3F`).
        """
        params = url_query(url, _URL_PARAMETERS)
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ConfigurationError(f"file URL {redact_url(url)!r} names no directory")
        feed_from_query(params, options)
        snapshot = _snapshot_named(Path(path))
        if snapshot is None:
            return cls(base_path=path, **options)
        if snapshot.suffix == ".msgpack":
            options.setdefault("format", "msgpack")
        options.setdefault("file_name", snapshot.name)
        return cls(base_path=snapshot.parent, **options)

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep the last versions of the keys `rules` names; see `Backend.keep_history`.

        The log records each write's depth, so the history survives a reopen whatever rules
        the next opener sets, and the snapshot keeps it through compaction.
        """
        self.history_rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)
        self._keeps_history = bool(self.history_rules)

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest first; see `Backend.history`."""
        validate_key(key)
        check_limit(limit)
        await self._ready()
        await anyio.lowlevel.checkpoint()
        return self._local.versions(key, now(), limit)

    async def feed_cursor(self) -> str | None:
        """The cursor of the newest durable change, or `None` with the feed off."""
        await self._ready()
        ring = self._ring
        return None if ring is None else ring.cursor(ring.head)

    async def feed_size(self) -> FeedSize | None:
        """The changes the feed retains and the bytes they hold (`None` with the feed off)."""
        await self._ready()
        ring = self._ring
        return None if ring is None else FeedSize(len(ring), ring.bytes)

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
                self._open_batch = Job(self._new_event)
                if self._commit_log.agent is not None:
                    self._ack_reader_done = anyio.Event()
                    self._ack_reader = spawn_service(
                        self._read_acks, name=f"agenticstate-fsync:{self.log_path}"
                    )
                self._is_open = True

    def _open_sync(self) -> None:
        with path_errors(self.base_path):
            if self.base_path.exists() and not self.base_path.is_dir():
                raise ConfigurationError(
                    f"could not open {self.base_path}: it is not a directory (a file store is "
                    "a directory)"
                )
            for name in (self.snapshot_path, self.log_path, self.lock_path):
                if name.exists() and not name.is_file():
                    raise ConfigurationError(
                        f"could not open {name}: it is not a regular file (a directory, a FIFO, "
                        "a device or a socket); it was left as it is"
                    )
            there = self.exists()
        if not self.create and not there:
            raise NotFoundError(
                f"no file store at {self.snapshot_path}: neither it nor {self.log_path.name} "
                "exists, and create=False"
            )
        with path_errors(self.base_path):
            self.base_path.mkdir(parents=True, exist_ok=True)
            # The lock file is the first file opened in the directory: a directory this user
            # cannot write is a path to fix, reported as such.
            self._lock.acquire(self.snapshot_path)
        _file_lock.track(self)
        try:
            self._refuse_other_format()
            self._remove_stray_temps()
            self._local.unordered()  # a bulk load: the keys are sorted once, after it
            journal = self._load_snapshot()
            self._start_feed(journal)
            self._replay_log()
            self._local.sweep(now())  # replay kept expired entries: they give later changes' old
            self._local.reorder()  # the ordered keys, rebuilt from the snapshot and the log
            revised = self._revise_legacy_entries()
            ring = self._ring
            if ring is not None:
                ring.head = self._lsn
            new_id = ring is not None and (journal is None or journal.store_id != ring.store_id)
            if new_id or revised:
                # A new store id (a new store, or one written before the feed): in the snapshot
                # before any cursor naming it is handed out. Revisions given to the entries of a
                # store written before revisions: in the snapshot before any of them is read.
                self._write_snapshot(
                    dict(self._local.data),
                    {name: index.items() for name, index in self._local.indexes.items()},
                    self._lsn,
                    self._journal(),
                )
            if self.durability == "fsync":
                self._commit_log.start_agent(self._agent_script)
        except BaseException:
            self._close_files()
            raise

    def exists(self) -> bool:
        """Whether the store has been created: its snapshot or its log is there (blocking)."""
        with translate(f"look for the store {self.snapshot_path}"):
            return self.snapshot_path.is_file() or self.log_path.is_file()

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
        with translate(f"look for a {other} store in {self.base_path}"):
            holder = holder_of(lock) if lock.exists() else None  # only checking, not locking
            if holder is not None:
                raise BackendError(
                    f"{self.base_path} holds a {other} store ({snapshot.name}) in use by "
                    f"{holder}; " + hint
                )
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
        with translate(f"list the store directory {self.base_path}"):
            names = os.listdir(self.base_path)
        for name in names:
            if pattern.fullmatch(name):
                path = self.base_path / name
                with translate(f"remove the stray temporary file {path}"):
                    path.unlink(missing_ok=True)
                log.info("file_store_removed_temp", path=str(path))

    def _disown(self, owner: int) -> None:
        """In a forked child: close this process's copies of the store's descriptors."""
        self._commit_log.forget()
        self._lock.forget()
        self._closed_reason = (
            f"this store belongs to process {owner}; a process forked from it cannot use it"
        )
        self._closed = True
        self._is_open = False

    def _release_lock(self) -> None:
        _file_lock.untrack(self)
        self._lock.release()

    def _load_snapshot(self) -> Journal | None:
        """Load the snapshot's entries and indexes; return its journal (`None`: none)."""
        with translate(f"read the snapshot {self.snapshot_path}"):
            try:
                raw = self.snapshot_path.read_bytes()
            except FileNotFoundError:
                return None
        self._snapshot_bytes = len(raw)
        try:
            self._snapshot_lsn, entries, indexes, blob = decode_snapshot(raw)
            self._lsn = self._snapshot_lsn
            times, store = Times(), self._local.store
            for key, item in entries.items():
                # Expired entries too, until the replay is done: a write in the log may have
                # found them present, and its change's old value is theirs.
                store(entry_from_snapshot(validate_key(key), item, times))
            for name, members in indexes.items():
                self._apply_index(
                    validate_key(name), {validate_key(m): float(s) for m, s in members.items()}
                )
            journal = None if blob is None else decode_journal(blob)
            if journal is not None:
                self._load_history(journal.history)
        except MALFORMED_SNAPSHOT as exc:
            # Snapshots are replaced atomically, so this is damage, not a crash: refuse to
            # guess rather than silently start from nothing.
            raise CorruptStoreError(
                f"the snapshot {self.snapshot_path} is corrupt ({type(exc).__name__}: {exc}); "
                "nothing was changed. Restore it from a backup, or move it away to start from "
                "the log alone (which holds only the writes since that snapshot)"
            ) from exc
        return journal

    def _revise_legacy_entries(self) -> bool:
        """Give each entry of a store written before revisions a revision of its own.

        Such entries (from an older snapshot, revision 0) get the next sequence numbers, in key
        order, after everything the log holds; the caller writes a snapshot before any is read.
        Their life began before revisions existed, so `create_revision` is the same number.
        Returns whether there were any.
        """
        local = self._local
        legacy = sorted(key for key, entry in local.data.items() if entry.revision == 0)
        for key in legacy:
            entry = local.data[key]
            self._lsn += 1
            revised = new_entry(
                key,
                entry.value,
                entry.version,
                entry.created_at,
                entry.updated_at,
                entry.expires_at,
                self._lsn,
                self._lsn,
            )
            local.data[key] = revised
            versions = local.history.get(key)
            if versions and versions[-1] is entry:
                versions[-1] = revised
        return bool(legacy)

    def _load_history(self, history: dict[str, list[Entry]]) -> None:
        """Put the snapshot's older versions back before their keys' current entries."""
        data, kept = self._local.data, self._local.history
        for key, older in history.items():
            current = data.get(key)
            if current is not None and older and older[-1].version == current.version - 1:
                kept[key] = deque([*older, current], maxlen=len(older) + 1)

    def _start_feed(self, journal: Journal | None) -> None:
        """Make the feed from the snapshot's journal (or start one with a new store id)."""
        if self.feed is None:
            return
        if journal is None or journal.store_id is None:
            # Nothing before the snapshot is known: cursors start after it.
            ring = FeedRing(self.feed, "f1", uuid.uuid4().hex[:16], trimmed=self._snapshot_lsn)
        else:
            ring = FeedRing(self.feed, "f1", journal.store_id, trimmed=journal.trimmed)
            prefix, times = ring.prefix, Times()
            for lsn, op, key, old, new, version, stamp in journal.changes:
                change = new_change(
                    key, _OPS[op], old, new, version, times(stamp), f"{prefix}{lsn}", lsn
                )
                ring.add(lsn, change)
        ring.head = self._snapshot_lsn
        self._ring = ring

    def _journal(self) -> Journal | None:
        """What the next snapshot keeps besides entries: the feed and the older versions."""
        ring, history = self._ring, self._local.history
        if ring is None and not history:
            return None
        changes = (
            []
            if ring is None
            else [
                [
                    lsn,
                    OP_SET if c.op is ChangeOp.SET else OP_DELETE,
                    c.key,
                    c.old,
                    c.new,
                    c.version,
                    round(c.timestamp.timestamp() * 1000),
                ]
                for lsn, c in ring.items()
            ]
        )
        return Journal(
            None if ring is None else ring.store_id,
            0 if ring is None else ring.trimmed,
            changes,
            {key: list(versions)[:-1] for key, versions in history.items() if len(versions) > 1},
        )

    def _replay_log(self) -> None:
        data = self._commit_log.open()
        end = replayed = 0
        moment = now()
        snapshot_lsn, local, times = self._snapshot_lsn, self._local, Times()
        entries, ring = local.data, self._ring
        prefix = "" if ring is None else ring.prefix
        for offset, body in whole_frames(data):
            try:
                records = decode_frame(body)
            except MALFORMED_FRAME as exc:
                # Its checksum holds, so it was written whole: this is damage (or a bug), not a
                # crash mid-append. Refuse to guess rather than drop it and what follows.
                raise self._damaged_log(offset, f"a malformed record ({exc})") from exc
            end = offset + FRAME_HEADER.size + len(body)
            for fields in records:
                lsn = fields[0]
                if lsn <= snapshot_lsn:
                    continue  # already in the snapshot (a crash between snapshot and log reset)
                if lsn > self._lsn:
                    self._lsn = lsn
                if fields[1] == OP_SET:  # most records: the fast path of `_apply_logged`
                    _, _, key, value, version, created, updated, expires = fields[:8]
                    prior = entries.get(key)
                    if len(fields) > 9:
                        create_revision = fields[9]
                    elif version > 1 and prior is not None and prior.create_revision:
                        create_revision = prior.create_revision  # logged before revisions
                    else:
                        create_revision = lsn
                    entry = new_entry(
                        key,
                        value,
                        version,
                        times(created),
                        times(updated),
                        times(expires),
                        lsn,
                        create_revision,
                    )
                    if ring is not None:
                        old = (
                            prior.value
                            if prior is not None and prior.version == version - 1
                            else None
                        )
                        ring.add(
                            lsn,
                            new_change(
                                key,
                                ChangeOp.SET,
                                old,
                                value,
                                version,
                                entry.updated_at,
                                f"{prefix}{lsn}",
                                lsn,
                            ),
                        )
                    # Expired entries too, until the replay is done (see `_load_snapshot`).
                    local.store(entry)
                    depth = fields[8] if len(fields) > 8 else 1
                    if depth > 1 or local.history:
                        local.keep(entry, depth, prior)
                else:
                    self._apply_logged(fields, moment)
                replayed += 1
        if end < len(data):
            damage = tail_damage(data, end)
            if damage is not None:
                # Not what a crash leaves: cutting here would drop acknowledged writes.
                raise self._damaged_log(end, f"damaged bytes ({damage})")
            log.warning(
                "file_store_torn_tail",
                path=str(self.log_path),
                kept=end,
                dropped=len(data) - end,
            )
            self._commit_log.truncate(end)
        if replayed:
            log.info("file_store_replayed", path=str(self.log_path), records=replayed)

    def _damaged_log(self, offset: int, what: str) -> CorruptStoreError:
        """The error that refuses a damaged log; the log is left exactly as it is."""
        log.info("file_store_log_damaged", path=str(self.log_path), offset=offset)
        return CorruptStoreError(
            f"the log {self.log_path} is damaged at byte {offset}: {what}; nothing was "
            "changed. `FileBackend(...).repair()` (or `agenticstate --url file://DIR repair`) "
            "keeps every intact frame around the damage, after keeping a copy of the log; or "
            "restore the store from a backup"
        )

    def _apply_logged(self, fields: list[Any], moment: datetime) -> None:
        lsn, op, key, value, version, created, updated, expires = fields[:8]
        if op in (OP_INDEX_ADD, OP_INDEX_REMOVE):
            self._apply_index(key, value)
            return
        if op == OP_DELETE:
            ring = self._ring
            if ring is not None:
                prior = self._local.data.get(key)
                old = prior.value if prior is not None and prior.version == version else None
                # A delete logged before the feed has no time: the replay's stands in.
                stamp = from_ms(updated) or moment
                ring.add(
                    lsn,
                    new_change(
                        key, ChangeOp.DELETE, old, None, version, stamp, ring.cursor(lsn), lsn
                    ),
                )
            self._local.drop(key)
            return
        created_at, updated_at = from_ms(created), from_ms(updated)
        assert created_at is not None  # noqa: S101
        assert updated_at is not None  # noqa: S101
        entry = Entry(
            key=key,
            value=bytes(value),
            version=int(version),
            created_at=created_at,
            updated_at=updated_at,
            expires_at=from_ms(expires),
            revision=lsn,
            create_revision=lsn,
        )
        if entry.expires_at is not None and entry.expires_at <= moment:
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
        return self._local.live(key, now())

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order."""
        for key in keys:
            validate_key(key)
        await self._ready()
        await anyio.lowlevel.checkpoint()
        moment = now()
        self._local.sweep(moment)
        return [self._local.live(key, moment) for key in keys]

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield the present keys matching `pattern`, sorted.

        Costs O(log n + the range) for a pattern with a literal prefix (`agent:*`), one lookup
        for a literal key, O(entities x log n + result) across entities (`agents:{*}:recovery`,
        a skip-scan), and a test of every key for a pattern with no literal prefix (`*:x`).
        """
        matcher = compile_glob(validate_pattern(pattern))
        await self._ready()
        await anyio.lowlevel.checkpoint()
        for key in self._local.matching(matcher, now()):
            yield key

    async def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        """Yield the present keys matching `pattern` as one sorted list (none if no key matches).

        Costs O(log n + the range) for a pattern with a literal prefix (`agent:*`), one lookup
        for a literal key, O(entities x log n + result) across entities (`agents:{*}:recovery`,
        a skip-scan), and a test of every key for a pattern with no literal prefix (`*:x`).
        """
        matcher = compile_glob(validate_pattern(pattern))
        await self._ready()
        await anyio.lowlevel.checkpoint()
        keys = self._local.matching(matcher, now())
        if keys:
            yield keys

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the keys starting `<prefix>{`; see `Backend.scan_tags`.

        Costs O(tags x log n): one seek in the ordered keys per tag (`tag_scan`).
        """
        validate_key(prefix + "{")
        await self._ready()
        await anyio.lowlevel.checkpoint()
        return self._local.tags(prefix, now())

    # writing

    def _current(self, key: str, moment: datetime) -> Entry | None:
        """The newest state of `key`, counting writes staged but not yet durable."""
        record = self._staged.get(key)
        if record is None:
            return self._local.live(key, moment)
        staged = record.entry
        if staged is not None and staged.expires_at is not None and staged.expires_at <= moment:
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
        current: Any = MISSING,
        expected_revision: int | None = None,
    ) -> Record | None:
        if self._failed is not None:
            raise BackendError(self._failed)
        moment, now_ms = clock
        if current is MISSING:
            current = self._current(key, moment)
        version = current.version if current is not None else 0
        if expected is not None and expected != version:
            raise conflict(key, expected, version)
        if expected_revision is not None:
            found = current.revision if current is not None else 0
            if expected_revision != found:
                raise conflict(key, expected_revision, found, what="revision")
        lsn = self._lsn + 1  # the write's revision too
        ring = self._ring
        cursor = None if ring is None else f"{ring.prefix}{lsn}"
        depth = 1
        if value is None:
            if current is None:
                return None
            change = new_change(
                key, ChangeOp.DELETE, current.value, None, version, moment, cursor, lsn
            )
            entry = None
            stamps: tuple[int | None, int | None, int | None] = (None, now_ms, None)
        else:
            if current is None:
                old, created, created_ms, create_revision = None, moment, now_ms, lsn
            else:
                old, created = current.value, current.created_at
                created_ms = round(created.timestamp() * 1000)
                create_revision = current.create_revision
            if ttl is None:
                expires, expires_ms = None, None
            else:
                expires = moment + ttl
                expires_ms = now_ms + round(ttl / _MILLISECOND)
            entry = new_entry(
                key, value, version + 1, created, moment, expires, lsn, create_revision
            )
            change = new_change(key, ChangeOp.SET, old, value, version + 1, moment, cursor, lsn)
            stamps = (created_ms, now_ms, expires_ms)
            if self._keeps_history:
                depth = self.history_rules.depth(key)
        self._lsn = lsn
        record = Record(lsn, key, entry, change, stamps, depth)
        self._staged[key] = record
        self._add_to_batch(record)
        return record

    def _add_to_batch(self, record: Record | IndexRecord) -> None:
        batch = record.batch = self._open_batch
        group = record.group = self._txn_group
        if group is not None:
            group.records.append(record)
        records = batch.records
        records.append(record)
        if len(records) == 1:
            # Everything staged until the event loop gets round to this goes in one frame.
            self._call_soon(self._seal)
        elif len(records) >= self._frame_records:
            self._seal()

    async def _commit(self, batch: Job, record: Record | IndexRecord | None = None) -> None:
        """Wait until `batch`, holding our staged records, is durable.

        Wait on the batch a record was staged in (`record.batch`), never on `_open_batch`
        after staging: staging may have sealed it (a full frame) and opened the next. `record`
        is one of ours that may have failed alone (its batch went on without it).
        """
        if self._snapshot_job is not None:
            await self._snapshot_if_idle()
        if batch.done.is_set():
            await anyio.lowlevel.checkpoint()  # a write always yields, even when done at once
        else:
            await batch.done.wait()
        if batch.error is not None:
            raise BackendError(f"the write was not saved: {batch.error}") from batch.error
        if record is not None:
            _raise_alone(record.error)

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
        self._open_batch = Job(self._new_event)
        try:
            try:
                self._commit_log.append(batch)
            except UnencodableRecordsError as exc:
                # Those records' own fault: they (and what builds on them) fail alone, and the
                # batch goes on without them.
                if not self._drop_records(batch, exc.bad):
                    return
                self._commit_log.append(batch)
        except (BackendError, UnencodableRecordsError) as exc:
            error = exc if isinstance(exc, BackendError) else BackendError(str(exc))
            self._fail(batch, error)
            return
        self._counters["batches"] += 1
        if self._commit_log.agent is None:  # durability="none": nothing more to wait for
            if self._still_owner():
                self._apply(batch)
            else:
                batch.error = BackendError(str(self._failed))
                batch.done.set()
            return
        self._request_fsync()

    def _request_fsync(self) -> None:
        """Ask the agent to sync every frame appended so far (see `CommitLog.request_fsync`)."""
        try:
            self._commit_log.request_fsync()
        except BackendError as exc:
            self._lose_agent(f"the fsync agent is gone ({exc})")

    async def _read_acks(self) -> None:
        """Complete batches as the agent reports their fsyncs (the store's one service task)."""
        agent, done = self._commit_log.agent, self._ack_reader_done
        assert agent is not None  # noqa: S101
        assert done is not None  # noqa: S101
        try:
            while True:
                answers = await agent.answers()
                if answers is None:
                    if not self._closed or self._commit_log.unacked:
                        self._lose_agent("the fsync agent exited")
                    return
                for seq, code in answers:
                    self._acked(seq, code)
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
        if not self._still_owner():
            return
        durable, error = self._commit_log.acked(seq, code)
        for batch in durable:
            self._apply(batch)
        if error is not None:
            # Every batch still waiting was appended after the failed ones and goes with them:
            # the log is cut back to where the first of them began.
            self._fail(self._commit_log.unacked[0], error)

    def _apply(self, batch: Job) -> None:
        """Make a durable batch visible: entries stored, changes fed and announced, woken."""
        local, ring = self._local, self._ring
        for record in batch.records:
            if isinstance(record, IndexRecord):
                record.result = self._apply_index(record.index, record.members)
                continue
            entry = record.entry
            if entry is None:
                local.drop(record.key)
            elif record.depth > 1 or local.history:
                prior = local.data.get(record.key)
                local.store(entry)
                local.keep(entry, record.depth, prior)
            else:
                local.store(entry)
            if self._staged.get(record.key) is record:
                del self._staged[record.key]
            if ring is not None:
                ring.add(record.lsn, record.change)
            self._fanout.publish(record.change)
        self._applied_lsn = batch.records[-1].lsn
        if ring is not None:
            ring.head = self._applied_lsn
        if self._snapshot_job is None and self._should_snapshot():
            self._snapshot_job = Job(self._new_event)
        batch.done.set()

    def _fail(self, first: Job, error: BackendError) -> None:
        """Fail `first` and every batch after it (they may build on it); keep the log clean.

        Batches appended before `first` are not affected: their fsyncs are still to come.
        """
        failed = self._commit_log.drop_from(first)
        self._truncate_log(first.start)
        pending, self._open_batch = self._open_batch, Job(self._new_event)
        failed.append(pending)
        for job in failed:
            job.error = error
            job.done.set()
        self._restage()
        log.error("file_store_write_failed", path=str(self.log_path), error=str(error))

    def _ownership_problem(self, *, lock: bool = True) -> str | None:
        """Why this process may no longer be the store's only owner, or `None`.

        Its lock file was deleted or replaced (so another process may have locked a new one and
        opened the store), its log was deleted or replaced (later writes would go to a file no
        path names), or the log holds what this process did not append. With `lock=False`
        only the log is checked (an `fstat`, cheaper than looking the lock file up by path).
        """
        if lock:
            self._lock_checked = time.monotonic()
            lost = self._lock.lost() or self._commit_log.unlinked()
            if lost is not None:
                return lost
        if self._commit_log.written_by_another():
            return f"the log {self.log_path} was changed by another process"
        return None

    def _still_owner(self) -> bool:
        """Check ownership before acknowledging writes; if it is lost, stop writing.

        With `durability="fsync"` it runs once per fsync and checks everything. With `"none"` it
        runs once per frame, so the lock file is looked up at most every 10 ms; the log's size,
        which a second owner changes as soon as it writes or compacts, is checked every time.
        """
        lock = (
            self._commit_log.agent is not None
            or time.monotonic() - self._lock_checked >= _LOCK_CHECK_INTERVAL
        )
        problem = self._ownership_problem(lock=lock)
        if problem is None:
            return True
        self._lose_ownership(problem)
        return False

    def _lose_ownership(self, problem: str) -> None:
        """Another process may own the store too: acknowledge nothing more, write nothing more.

        The log is left as it is (cutting it could cut the other process's writes): the writes
        waiting now may or may not be in it, and the next opener replays whatever it holds.
        """
        if self._failed is not None:
            return
        log.error("file_store_ownership_lost", path=str(self.snapshot_path), problem=problem)
        self._lose_agent(
            f"{problem} while this process owned the store, so another process may have opened "
            "it: this one stops writing (writes not yet confirmed may or may not be in the log). "
            f"Close every process using {self.base_path}, then reopen it",
            cut=False,
        )

    def _drop_records(self, batch: Job, bad: dict[Record | IndexRecord, BaseException]) -> bool:
        """Take the failed records out of `batch`; whether any records are left in it."""
        for record, error in bad.items():
            record.error = error
        batch.records = [record for record in batch.records if record not in bad]
        self._staged = {
            record.key: record
            for job in (*self._commit_log.unacked, batch)
            for record in job.records
            if isinstance(record, Record)
        }
        log.warning("file_store_writes_refused", path=str(self.log_path), records=len(bad))
        if not batch.records:
            batch.done.set()
            return False
        return True

    def _lose_agent(self, reason: str, *, cut: bool = True) -> None:
        """The agent cannot answer any more: fail what waits and refuse new writes."""
        self._failed = f"{reason}; reopen the store" if cut else reason
        error = BackendError(self._failed)
        unacked = self._commit_log.unacked
        if unacked and cut:
            self._truncate_log(unacked[0].start)
        for job in [*unacked, self._open_batch]:
            job.error = error
            job.done.set()
        unacked.clear()
        self._open_batch = Job(self._new_event)
        self._restage()

    def _restage(self) -> None:
        """Rebuild the staged view from the batches that still wait, after some failed."""
        self._staged = {
            record.key: record
            for job in self._commit_log.unacked
            for record in job.records
            if isinstance(record, Record)
        }

    def _truncate_log(self, size: int) -> None:
        """Cut the log back to `size` bytes so that no failed record can be replayed later."""
        try:
            self._commit_log.truncate(size)
        except BackendError:
            self._failed = (
                f"the log {self.log_path} could not be repaired after a failed write; "
                "reopen the store"
            )

    def _apply_index(self, index: str, members: dict[str, float] | list[str]) -> int:
        if isinstance(members, dict):
            return self._local.index_add(index, members)
        return self._local.index_remove(index, members)

    def _should_snapshot(self) -> bool:
        """Whether a snapshot is due: the log passed its limit, or `save_interval` passed.

        The interval's snapshot waits until the log holds at least a quarter of the last
        snapshot's size, and the log's limit is at least half of it: rewriting a large store
        every interval, or every `compact_bytes`, would make writes slower the larger the store.
        This way the cost of snapshots stays proportional to what was written.
        """
        if self._commit_log.size >= self._compact_limit():
            return True
        return (
            self.auto_save
            and time.monotonic() - self._last_snapshot >= self.save_interval
            and self._commit_log.size * 4 >= self._snapshot_bytes
        )

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key` durably; see `Backend.set`."""
        validate_key(key)
        if len(value) > self.MAX_VALUE_BYTES:
            self._check_size(key, value)
        if ttl is not None:
            check_ttl(ttl)
        if expected_version is not None or expected_revision is not None:
            check_expected(expected_version, expected_revision)
        if not self._is_open or self._closed:
            await self._ready()
        clock = self._clock()
        if self._local.expiries:
            self._local.sweep(clock[0])
        record = self._stage(
            key, value, ttl, expected_version, clock, expected_revision=expected_revision
        )
        assert record is not None  # noqa: S101  # a set always stages a record
        batch = record.batch
        if self._snapshot_job is None and not batch.done.is_set():
            # The hot path of `_commit`, without its frame.
            await batch.done.wait()
            if batch.error is None and record.error is None:
                return record.change
        await self._commit(batch, record)
        return record.change

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values, sharing fsyncs; a batch of any size leaves the loop running.

        A large batch is staged `_STAGE_CHUNK` records at a time with a yield to the event loop
        between chunks, so other tasks (and the reader of fsync answers) keep running; frames
        are appended as they fill and synced while the rest is staged.
        """
        for key, value in items:
            validate_key(key)
            self._check_size(key, value)
        check_ttl(ttl)
        await self._ready()
        clock = self._clock()
        self._local.sweep(clock[0])
        records: list[Record] = []
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
        for record in records:
            _raise_alone(record.error)
        return [record.change for record in records]

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key` durably; see `Backend.delete`."""
        validate_key(key)
        check_expected(expected_version, expected_revision)
        await self._ready()
        record = self._stage(
            key, None, None, expected_version, self._clock(), expected_revision=expected_revision
        )
        if record is None:
            return None
        await self._commit(record.batch, record)
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
        self._check_size(key, value)
        record = self._stage(
            key, value, ttl, current.version if current else 0, clock, current=current
        )
        assert record is not None  # noqa: S101
        await self._commit(record.batch, record)
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
        for branch in checked[1:]:
            puts = [op for op in branch if type(op) is Put]
            for op in puts:
                self._check_size(op.key, op.value)
            total = sum(len(op.value) + 4 * len(op.key) for op in puts)
            if total > _file_log.MAX_FRAME_BYTES:  # one frame holds the whole step
                raise TooLargeError(
                    f"the transaction writes {total} bytes; a file store logs at most "
                    f"{_file_log.MAX_FRAME_BYTES} bytes in one step",
                    path="",
                )
        await self._ready()
        if self._failed is not None:
            raise BackendError(self._failed)
        clock = self._clock()
        self._local.sweep(clock[0])
        step = _FileStep(self, clock)
        group = self._txn_group = TxnGroup()
        self._frame_records = sys.maxsize  # the step's records never split across frames
        try:
            result = run_transaction(step, *checked)
        finally:
            self._frame_records = _FRAME_RECORDS
            self._txn_group = None
        # Wait for the last batch holding anything the step wrote or read: batches apply in order.
        batch = self._open_batch if self._open_batch.records else None
        if batch is None and self._commit_log.unacked:
            batch = self._commit_log.unacked[-1]
        if batch is None:
            await anyio.lowlevel.checkpoint()
            return result
        if len(batch.records) >= _FRAME_RECORDS and batch is self._open_batch:
            self._seal()
        await self._commit(batch)
        _raise_alone(group.error())
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
        record = IndexRecord(self._lsn, index, members)
        self._add_to_batch(record)
        await self._commit(record.batch, record)
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
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[ChangeStream]:
        """Subscribe to changes of keys matching `pattern` (from `since`); see `Backend.changes`.

        Changes are announced once durable, and enter the feed in that same step: a replay
        and the live changes after it meet with no gap and no duplicate.
        """
        if since is not None and self.feed is None:
            raise UnsupportedOperationError("this FileBackend keeps no change feed (feed=None)")
        return self._changes(validate_pattern(pattern), max_buffer, since)

    @asynccontextmanager
    async def _changes(
        self, pattern: str, max_buffer: int, since: str | None
    ) -> AsyncIterator[ChangeStream]:
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        await self._ready()
        ring = self._ring
        backlog = None
        if since is not None and ring is not None:

            def backlog(matcher: GlobMatcher) -> list[Change]:
                return ring.since(since, matcher)

        async with self._fanout.subscribe(pattern, max_buffer, backlog=backlog) as stream:
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
            if self._commit_log.unacked:
                await self._commit_log.unacked[-1].done.wait()
            else:
                await self._snapshot_if_idle()
                if not job.done.is_set():
                    await job.done.wait()
        if job.error is not None:
            raise BackendError(f"the snapshot was not written: {job.error}") from job.error

    def _request_snapshot(self) -> Job:
        """The snapshot wanted next; appends pause until it is written."""
        job = self._snapshot_job
        if job is None:
            job = self._snapshot_job = Job(self._new_event)
        return job

    async def _snapshot_if_idle(self) -> None:
        """Write the wanted snapshot if no batch waits for its fsync (any task may do this).

        Appends pause while a snapshot is wanted, so the log then holds exactly the applied
        state; the snapshot replaces it and the log is emptied. Writes staged meanwhile are
        appended after it.
        """
        job = self._snapshot_job
        lock = self._snapshot_lock
        if job is None or self._commit_log.unacked or lock is None or lock.locked():
            return
        with anyio.CancelScope(shield=True):
            async with lock:
                if self._snapshot_job is not job or self._commit_log.unacked:
                    return
                # Entries are immutable: a shallow copy is a consistent snapshot, and a worker
                # thread builds the document from it while the loop goes on.
                entries = dict(self._local.data)
                indexes = {name: index.items() for name, index in self._local.indexes.items()}
                journal = self._journal()
                try:
                    await anyio.to_thread.run_sync(
                        self._write_snapshot, entries, indexes, self._applied_lsn, journal
                    )
                except Exception as exc:  # noqa: BLE001  # reported to flush(); the log is intact
                    job.error = exc
                    if isinstance(exc, _OwnershipLostError):
                        self._lose_ownership(str(exc))
                    else:
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

    def _write_snapshot(
        self,
        entries: dict[str, Entry],
        indexes: dict[str, dict[str, float]],
        lsn: int,
        journal: Journal | None,
    ) -> None:
        """Replace the snapshot atomically and empty the log (in a worker thread).

        Raises:
            BackendError: It could not be written; `_OwnershipLostError` if this process may
                not be the store's only owner any more (nothing is written then).
        """
        self._check_ownership()
        data = encode_snapshot(
            entries,
            indexes,
            lsn,
            format=self.format,
            compression=self.compression,
            journal=None if journal is None else encode_journal(journal),
        )
        temp = self.base_path / f"{self.snapshot_path.name}.{os.getpid()}.tmp"
        with translate(f"write the snapshot {self.snapshot_path}"):
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _keep_mode(fd, self.snapshot_path)
                    _file_io.write_all(fd, data)
                    _file_io.fsync(fd)
                finally:
                    os.close(fd)
                self._check_ownership()  # again: writing a large snapshot takes a while
                os.replace(temp, self.snapshot_path)
                self._snapshot_bytes = len(data)
            except BaseException:
                # A partial snapshot on a nearly full disk would eat the space the log needs.
                with contextlib.suppress(OSError):
                    temp.unlink(missing_ok=True)
                raise
            _file_io.fsync_directory(self.base_path)
        self._snapshot_lsn = lsn
        # Every record in the log is in the snapshot: no frame is appended while a snapshot is
        # wanted (`_seal` waits), and it runs only when no batch waits for its fsync.
        self._commit_log.empty(sync=self.durability == "fsync")
        self._last_snapshot = time.monotonic()
        log.debug("file_store_snapshot", path=str(self.snapshot_path), entries=len(entries))

    async def repair(self) -> FileRepairReport:
        """Salvage a damaged log: keep every intact frame, drop only the damaged bytes.

        Opening a store whose log is damaged in the middle (bit rot, a bad copy) raises
        `CorruptStoreError` and changes nothing. This keeps a copy of the log beside it
        (`<name>.log.damaged-<time>`), then replaces the log with its intact frames, in order;
        the writes in the damaged bytes are lost, every other one is kept. A log that is not
        damaged is left alone. Run it on a closed store (it takes the owner lock); it never
        creates a store.

        Frames are found after damage by their checksum: a value that itself holds the bytes of
        a valid log frame could be taken for one, so look at the report (and keep the copy)
        before going on.

        Returns:
            What was kept and dropped, and where the copy is.

        Raises:
            NotFoundError: There is no store at this path.
            CorruptStoreError: The snapshot is damaged (a repair cannot rebuild it).
            BackendError: Another process has the store open, or the files cannot be written.
        """
        if self._is_open or self._closed:
            raise BackendError("repair a store before opening it, from a FileBackend not in use")
        return await anyio.to_thread.run_sync(self._repair_sync)

    def _repair_sync(self) -> FileRepairReport:
        if not (self.snapshot_path.exists() or self.log_path.exists()):
            raise NotFoundError(f"no file store at {self.snapshot_path} (nothing to repair)")
        self._lock.acquire(self.snapshot_path)
        try:
            with translate(f"read the snapshot {self.snapshot_path}"):
                raw = self.snapshot_path.read_bytes() if self.snapshot_path.exists() else None
            if raw is not None:
                try:
                    decode_snapshot(raw)
                except MALFORMED_SNAPSHOT as exc:
                    raise CorruptStoreError(
                        f"the snapshot {self.snapshot_path} is corrupt ({exc}); a repair keeps "
                        "the log's frames but cannot rebuild a snapshot: restore it from a backup"
                    ) from exc
            with translate(f"read the log {self.log_path}"):
                data = self.log_path.read_bytes() if self.log_path.exists() else b""
            frames, dropped = salvage_frames(data)
            kept = b"".join(
                data[offset : offset + FRAME_HEADER.size + len(body)] for offset, body in frames
            )
            report = FileRepairReport(
                log_path=self.log_path,
                frames_kept=len(frames),
                records_kept=sum(len(decode_frame(body)) for _, body in frames),
                dropped=dropped,
                bytes_dropped=len(data) - len(kept),
                damaged_copy=None,
            )
            if kept == data:
                return report
            copy = self._write_repaired_log(data, kept)
            self._seal_revisions_after_repair(report.bytes_dropped)
            log.info(
                "file_store_repaired",
                path=str(self.log_path),
                frames=len(frames),
                dropped=report.bytes_dropped,
            )
            return dataclasses.replace(report, damaged_copy=copy)
        finally:
            self._lock.release()

    def _seal_revisions_after_repair(self, dropped: int) -> None:
        """Make the repaired store's next revision greater than any the dropped bytes held.

        The dropped writes were acknowledged with their revisions and cursors; giving those
        numbers to new writes would let a compare-and-set on a lost write's revision succeed
        against a different write, and a consumer resuming from a lost write's cursor skip the
        new one. Each write takes at least a byte of the log, so the numbers the dropped bytes
        held are at most `dropped` above the last one kept: a snapshot is written with its
        sequence number that far on (under the owner lock this repair holds), and the log
        emptied. Revisions then skip at most `dropped` numbers, once.
        """
        twin = FileBackend(
            self.base_path,
            format=self.format,
            compression=self.compression,
            durability=self.durability,
            file_name=self.snapshot_path.name if self._explicit_name else None,
            feed=self.feed,
            create=False,
        )
        twin._lock = self._lock  # held by this repair: the twin's ownership checks use it
        try:
            journal = twin._load_snapshot()
            twin._start_feed(journal)
            twin._replay_log()
            twin._lsn += dropped
            if twin._ring is not None:
                twin._ring.head = twin._lsn
            twin._write_snapshot(
                dict(twin._local.data),
                {name: index.items() for name, index in twin._local.indexes.items()},
                twin._lsn,
                twin._journal(),
            )
        finally:
            twin._commit_log.close()

    def _write_repaired_log(self, original: bytes, kept: bytes) -> Path:
        """Keep `original` as a copy, then put `kept` in the log's place (atomically)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        copy = self.base_path / f"{self.log_path.name}.damaged-{stamp}"
        n = 1
        while copy.exists():
            n += 1
            copy = self.base_path / f"{self.log_path.name}.damaged-{stamp}-{n}"
        with translate(f"keep a copy of the log as {copy}"):
            _write_new_file(copy, original)
        temp = self.base_path / f"{self.log_path.name}.repair.tmp"
        with translate(f"write the repaired log {self.log_path}"):
            temp.unlink(missing_ok=True)  # left by an interrupted repair: we hold the lock
            try:
                _write_new_file(temp, kept, like=self.log_path)
                os.replace(temp, self.log_path)
            except BaseException:
                with contextlib.suppress(OSError):
                    temp.unlink(missing_ok=True)
                raise
            _file_io.fsync_directory(self.base_path)
        return copy

    def _check_ownership(self) -> None:
        problem = self._ownership_problem()
        if problem is not None:
            raise _OwnershipLostError(problem)

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
        if self._open_lock is not None:
            with anyio.CancelScope(shield=True):
                async with self._open_lock:
                    pass  # an open in progress (another task's) has finished: close what it made
        if not self._is_open:
            return
        with anyio.CancelScope(shield=True):
            try:
                # Every staged write is appended and synced, then the final snapshot replaces
                # the log.
                unacked = self._commit_log.unacked
                while self._failed is None and (unacked or self._open_batch.records):
                    if self._snapshot_job is not None and not unacked:
                        await self._snapshot_if_idle()
                        continue
                    batch = self._open_batch
                    self._seal()
                    await (unacked[-1] if unacked else batch).done.wait()
                # Nothing written since the last snapshot (a read-only session): keep it as it is
                # rather than rewrite a large store for nothing. A large store keeps its log
                # too: the next open replays it, and closing costs nothing.
                unchanged = self._applied_lsn == self._snapshot_lsn and self._commit_log.size == 0
                if self._failed is None and not unchanged:
                    if self._compacts_on_close():
                        self._request_snapshot()
                        await self._snapshot_if_idle()
                    elif self.durability == "none":
                        await anyio.to_thread.run_sync(self._commit_log.sync)
            finally:
                agent = self._commit_log.agent
                if agent is not None:
                    await self._stop_agent(agent)
                    self._commit_log.agent = None
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
            or self._commit_log.size >= self._compact_limit()
        )

    async def _stop_agent(self, agent: FsyncAgent) -> None:
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
        self._commit_log.close()
        self._release_lock()
        self._is_open = False


def _raise_alone(error: BaseException | None) -> None:
    """Raise the error of a write that failed on its own (its batch went on without it)."""
    if error is not None:
        raise BackendError(f"the write was not saved: {error}") from error


class _OwnershipLostError(BackendError):
    """Raised in the snapshot thread: this process may no longer be the store's only owner."""


@dataclasses.dataclass(frozen=True, slots=True)
class FileRepairReport:
    """What `FileBackend.repair` did to a store's log.

    Attributes:
        log_path: The log it read.
        frames_kept: Intact frames kept, in order.
        records_kept: The writes those frames hold.
        dropped: The `(start, end)` byte ranges of the original log that were dropped as damaged
            (zeros at the very end, which a crash leaves, are not counted).
        bytes_dropped: How many bytes the log lost.
        damaged_copy: Where the original log was kept, or `None` if nothing was changed.
    """

    log_path: Path
    frames_kept: int
    records_kept: int
    dropped: list[tuple[int, int]]
    bytes_dropped: int
    damaged_copy: Path | None


def _keep_mode(fd: int, existing: Path) -> None:
    """Give the new file `fd`, about to replace `existing`, its mode and group.

    A file that exists keeps its mode (a store shared with a group stays as its owner set it)
    when it is replaced by a rename. The group is kept where this user may set it.
    """
    try:
        status = os.stat(existing)
    except FileNotFoundError:
        return  # a new file: 0600
    os.fchmod(fd, stat.S_IMODE(status.st_mode))
    with contextlib.suppress(OSError):  # not a member of that group: the mode alone is kept
        os.fchown(fd, -1, status.st_gid)


def _write_new_file(path: Path, data: bytes, *, like: Path | None = None) -> None:
    """Write `data` to a new file at `path` (0600, or the mode of `like`) and make it durable.

    The new file is removed on failure.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            if like is not None:
                _keep_mode(fd, like)
            _file_io.write_all(fd, data)
            _file_io.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


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
        backend = self._backend
        staged = backend._staged.get(key)
        if staged is not None and backend._txn_group is not None:
            backend._txn_group.depends.append(staged)
        return backend._current(key, self._clock[0])

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
        group = backend._txn_group
        pending: dict[str, float | None] = {}
        for job in (*backend._commit_log.unacked, backend._open_batch):
            for record in job.records:
                if isinstance(record, IndexRecord) and record.index == index:
                    if group is not None and record.group is not group:
                        group.depends.append(record)
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
        backend._add_to_batch(IndexRecord(backend._lsn, index, members))

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
