"""Move state between stores: copy from one backend to another, export to a dump, import it.

Everything works on the backend layer, with the stored bytes as they are, so values (encrypted
ones too) arrive exactly as they left, whatever their type. Each key keeps its remaining time to
live; a key that expires during the copy is skipped. The sorted indexes managers keep beside
their records (a task queue's pending tasks) travel with them. Versions are not copied: the
destination numbers its own writes, as any write would.

Copies are idempotent: running one again writes the same values (a destination key that the
source lacks is left alone), so an interrupted copy is finished by running it again.

The dump format (`DUMP_FORMAT`, version `DUMP_VERSION`) is JSON lines, one object per line:

```text
{"format": "agenticstate-dump", "version": 1, "created_at": "2026-11-24T04:00:00+00:00",
 "pattern": "*"}
{"type": "entry", "key": "agent:1", "value": "<base64 of the stored bytes>", "version": 3,
 "created_at": "...", "updated_at": "...", "expires_at": null}
{"type": "index", "name": "teams:{crew}:pending", "members": [["t1", 1.0], ["t2", 2.0]]}
{"type": "end", "entries": 1, "indexes": 1}
```

(each object on one line). The header comes first and the `end` line last, so a truncated dump
is refused; `import_state` checks the whole file before it writes anything (`check_dump`): every
line, key, value, index member and score, and each value against the destination's largest
(`value_limit`, where a backend has one), so an import never stops part-way on bad input.

A score is a JSON number, or the string `"inf"` or `"-inf"`: scores may be infinite (a counter
that overflowed; see the backend contract), and JSON has no infinity. (A dump written before
holds `Infinity`, which is read too.) The dump is strict JSON: no `NaN`, no `Infinity`.

An export is written to a temporary file beside its final name (`.<name>.<random>.partial`,
created `0600`: a dump holds every value, so only its owner may read it), synced, and renamed
into place when complete; on any failure (a full disk, an error of the source, cancellation) the
temporary file is removed and the previous dump, if any, is left as it was.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from agenticstate._glob import compile_glob
from agenticstate._keys import escape_glob, validate_key, validate_pattern
from agenticstate.backends.base import Backend, Entry, check_index_members, utcnow
from agenticstate.exceptions import (
    ConfigurationError,
    InvalidArgumentError,
    SerializationError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "DUMP_FORMAT",
    "DUMP_VERSION",
    "TransferProgress",
    "check_dump",
    "copy_state",
    "export_state",
    "import_state",
    "value_limit",
]

DUMP_FORMAT = "agenticstate-dump"
"""The `format` field of a dump's header line."""
DUMP_VERSION = 1
"""The dump layout this module writes; `import_state` reads this version and refuses newer."""
_BATCH = 500
_CHUNK = 1 << 20  # an export writes this many bytes at a time (in a worker thread)
_MAX_LINE = 4 * (1 << 30) // 3 + (1 << 20)
"""The longest dump line read: the base64 of the largest value a built-in backend holds (1 GiB)
and its fields. A longer one (a file that is not a dump, with no line breaks) is refused
before it is read into memory."""


@dataclass
class TransferProgress:
    """How far a copy, export or import has come (passed to the `progress` callback).

    Attributes:
        entries: Keys written so far.
        indexes: Sorted indexes written so far.
        skipped: Keys that expired (or vanished) before they could be copied.
        bytes: Value bytes written so far.
    """

    entries: int = 0
    indexes: int = 0
    skipped: int = 0
    bytes: int = 0


async def _index_names(backend: Backend, pattern: str) -> list[str]:
    """The names of the backend's sorted indexes that match `pattern`.

    The backend contract has no listing of indexes yet; this reads each built-in backend's own
    (`SQLiteBackend.index_names` and `PostgresBackend.index_names`, the in-process store of
    memory and file, SCAN on Redis).
    """
    await backend.open()
    matcher = compile_glob(pattern)
    lister = getattr(backend, "index_names", None)
    if lister is not None:
        names: list[str] = await lister()
    elif hasattr(backend, "_local"):  # MemoryBackend, FileBackend
        names = list(backend._local.indexes)
    else:
        names = await _redis_index_names(backend)
    return sorted(name for name in names if matcher.match(name))


async def _redis_index_names(backend: Any) -> list[str]:
    from agenticstate.backends.redis import INDEX_NAMESPACE  # optional extra

    head = INDEX_NAMESPACE + backend.key_prefix
    client = await backend._redis()
    nodes = await backend._primaries(client) if backend.is_cluster else [None]
    found: set[str] = set()
    for node in nodes:
        cursor: Any = 0
        while True:
            cursor, batch = await backend._scan_page(node, cursor, escape_glob(head) + "*")
            found.update(raw.decode()[len(head) :] for raw in batch)
            if int(cursor) == 0:
                break
    return list(found)


async def _write_entries(
    destination: Backend, entries: list[Entry], progress: TransferProgress
) -> None:
    now = utcnow()
    plain = [(entry.key, entry.value) for entry in entries if entry.expires_at is None]
    if plain:
        await destination.set_many(plain)
    written = [entry for entry in entries if entry.expires_at is None]
    for entry in entries:
        if entry.expires_at is None:
            continue
        left = entry.expires_at - now
        if left <= timedelta(0):
            progress.skipped += 1  # it expired on the way
            continue
        await destination.set(entry.key, entry.value, ttl=left)
        written.append(entry)
    progress.entries += len(written)
    progress.bytes += sum(len(entry.value) for entry in written)


async def copy_state(
    source: Backend,
    destination: Backend,
    pattern: str = "*",
    *,
    progress: Callable[[TransferProgress], object] | None = None,
) -> TransferProgress:
    """Copy every key matching `pattern` (value and remaining TTL) and its indexes.

    Streams in batches of 500 keys; `progress` is called after each. Running it again is safe.

    Returns:
        The totals.
    """
    validate_pattern(pattern)
    done = TransferProgress()
    keys: list[str] = []
    async for key in source.scan(pattern):
        keys.append(key)
        if len(keys) >= _BATCH:
            await _copy_batch(source, destination, keys, done, progress)
            keys = []
    await _copy_batch(source, destination, keys, done, progress)
    for name in await _index_names(source, pattern):
        members = dict(await source.index_range(name))
        if members:
            await destination.index_add(name, members)
            done.indexes += 1
    if progress is not None:
        progress(done)
    return done


async def _copy_batch(
    source: Backend,
    destination: Backend,
    keys: list[str],
    done: TransferProgress,
    progress: Callable[[TransferProgress], object] | None,
) -> None:
    if not keys:
        return
    found = await source.get_many(keys)
    done.skipped += sum(1 for entry in found if entry is None)
    await _write_entries(destination, [entry for entry in found if entry is not None], done)
    if progress is not None:
        progress(done)


def _stamp(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _score(score: float) -> float | str:
    """A score as the dump holds it: a number, or "inf" / "-inf" (JSON has no infinity)."""
    if math.isinf(score):
        return "inf" if score > 0 else "-inf"
    return score


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"


# The steps that touch the file, one function each, so tests can fail any one of them.


def _create_temp(target: Path) -> tuple[int, Path]:
    """A new, empty temporary file (0600) beside `target`: its descriptor and its path."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    return fd, Path(name)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _sync(fd: int) -> None:
    os.fsync(fd)


def _rename(source: Path, target: Path) -> None:
    os.replace(source, target)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DumpFile:
    """Where an export writes: a temporary file renamed into place by `commit`, or a stream.

    A regular file (or a name that does not exist yet) is written beside its final name and
    renamed over it when complete. A symbolic link is followed: the file it names is replaced
    that way, and the link stays. Anything else that is not a directory (a FIFO, a character
    device such as `/dev/stdout` or `/dev/null`) is written through, as `cat > FILE` would:
    it is never replaced, and a stopped export leaves what it wrote so far in it. A FIFO that
    no process reads is refused (`ENXIO`) instead of waited on.
    """

    def __init__(self, target: Path) -> None:
        if target.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(target))
        try:
            mode = os.stat(target).st_mode  # follows symbolic links
        except FileNotFoundError:
            mode = None
        self.pending: list[str] = []
        self.size = 0
        self.stream = mode is not None and not stat.S_ISREG(mode)
        if self.stream:
            self.target = target
            self.path: Path | None = None
            # Non-blocking: a FIFO nobody reads is refused (ENXIO) rather than waited on.
            try:
                self.fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO and stat.S_ISFIFO(mode or 0):
                    raise OSError(exc.errno, "no process reads this FIFO", str(target)) from exc
                raise
            os.set_blocking(self.fd, True)
        else:
            # The file a symbolic link names (a dangling one: the file it would name).
            self.target = Path(os.path.realpath(target)) if target.is_symlink() else target
            self.fd, self.path = _create_temp(self.target)

    async def add(self, line: str) -> None:
        self.pending.append(line)
        self.size += len(line)
        if self.size >= _CHUNK:
            await self.flush()

    async def flush(self) -> None:
        data = "".join(self.pending).encode("utf-8")
        self.pending, self.size = [], 0
        if data:
            await anyio.to_thread.run_sync(_write, self.fd, data)

    async def commit(self) -> None:
        await self.flush()
        if self.path is None:  # a stream: written through, nothing to sync or rename
            fd, self.fd = self.fd, -1
            os.close(fd)
            return
        await anyio.to_thread.run_sync(_sync, self.fd)
        fd, self.fd = self.fd, -1
        os.close(fd)
        await anyio.to_thread.run_sync(_rename, self.path, self.target)
        await anyio.to_thread.run_sync(_sync_directory, self.target.parent)

    def discard(self) -> None:
        """Close and remove the temporary file (after a failure); never raises."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)


async def export_state(
    source: Backend,
    path: str | Path,
    pattern: str = "*",
    *,
    progress: Callable[[TransferProgress], object] | None = None,
) -> TransferProgress:
    """Write every key matching `pattern`, and its indexes, to a dump file (see above).

    The file is written beside its final name, created readable by its owner only (0600), and
    renamed into place when complete; whatever fails, nothing is left behind. A symbolic link
    is followed (the file it names is replaced, the link stays); a FIFO or a device
    (`/dev/stdout`) is written through, never replaced.

    Returns:
        The totals.

    Raises:
        OSError: The file cannot be written (`path` is a directory, its directory is missing,
            the disk is full, ...); nothing was left behind.
    """
    validate_pattern(pattern)
    if str(path).endswith(("/", os.sep)) or not str(path):
        raise IsADirectoryError(21, "names a directory, not a dump file", str(path))
    out = _DumpFile(Path(path))
    try:
        done = await _export(source, out, pattern, progress)
        await out.commit()
    except BaseException:
        out.discard()
        raise
    return done


async def _export(
    source: Backend,
    out: _DumpFile,
    pattern: str,
    progress: Callable[[TransferProgress], object] | None,
) -> TransferProgress:
    done = TransferProgress()
    header = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "pattern": pattern}
    await out.add(_line({**header, "created_at": utcnow().isoformat()}))
    keys: list[str] = []

    async def flush() -> None:
        for entry in await source.get_many(keys):
            if entry is None:
                done.skipped += 1
                continue
            line = {
                "type": "entry",
                "key": entry.key,
                "value": base64.b64encode(entry.value).decode("ascii"),
                "version": entry.version,
                "created_at": _stamp(entry.created_at),
                "updated_at": _stamp(entry.updated_at),
                "expires_at": _stamp(entry.expires_at),
            }
            await out.add(_line(line))
            done.entries += 1
            done.bytes += len(entry.value)
        keys.clear()
        if progress is not None:
            progress(done)

    async for key in source.scan(pattern):
        keys.append(key)
        if len(keys) >= _BATCH:
            await flush()
    await flush()
    for name in await _index_names(source, pattern):
        members = await source.index_range(name)
        if members:
            scored = [[member, _score(score)] for member, score in members]
            await out.add(_line({"type": "index", "name": name, "members": scored}))
            done.indexes += 1
    await out.add(_line({"type": "end", "entries": done.entries, "indexes": done.indexes}))
    return done


def _bad(number: int, problem: str) -> SerializationError:
    return SerializationError(f"dump line {number}: {problem}", path="")


def _read_dump(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each line of a dump as a JSON object, numbered from 1.

    Raises:
        SerializationError: A line is not UTF-8, not JSON, not an object, or too long.
        OSError: The file cannot be read (missing, a directory, ...).
    """
    with path.open("rb") as lines:
        number = 0
        while line := lines.readline(_MAX_LINE + 1):
            number += 1
            if len(line) > _MAX_LINE:
                raise _bad(number, f"longer than {_MAX_LINE} bytes: not a dump line")
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise _bad(number, "not UTF-8 text (a binary file?)") from None
            except json.JSONDecodeError as exc:
                raise _bad(number, f"not JSON ({exc.msg})") from None
            except RecursionError:
                raise _bad(number, "nested too deeply") from None
            if not isinstance(record, dict):
                raise _bad(number, "not a JSON object")
            yield number, record


def _check_header(number: int, record: dict[str, Any]) -> None:
    if record.get("format") != DUMP_FORMAT:
        raise _bad(number, f"not an agenticstate dump (format {record.get('format')!r})")
    version = record.get("version")
    if type(version) is not int or not 1 <= version <= DUMP_VERSION:
        raise ConfigurationError(
            f"dump version {version!r} is not supported; this agenticstate reads up to "
            f"{DUMP_VERSION}: upgrade agenticstate"
        )


def _parse_time(number: int, value: object) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        raise _bad(number, f"bad timestamp {value!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _parse_entry(
    number: int, record: dict[str, Any], max_value: int | None = None
) -> tuple[str, bytes, datetime | None]:
    key, value = record.get("key"), record.get("value")
    try:
        validate_key(key)
    except ValueError as exc:
        raise _bad(number, str(exc)) from None
    if not isinstance(value, str):
        raise _bad(number, "value must be base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(number, "value is not valid base64") from None
    if max_value is not None and len(raw) > max_value:
        raise _bad(
            number, f"the value is {len(raw)} bytes; the destination takes at most {max_value}"
        )
    return str(key), raw, _parse_time(number, record.get("expires_at"))


_SCORES = {"inf": math.inf, "-inf": -math.inf}


def _parse_index(number: int, record: dict[str, Any]) -> tuple[str, dict[str, float]]:
    name, members = record.get("name"), record.get("members")
    try:
        validate_key(name)
    except ValueError as exc:
        raise _bad(number, str(exc)) from None
    if not isinstance(members, list) or not all(
        isinstance(m, list)
        and len(m) == 2  # [member, score]
        and isinstance(m[0], str)
        and (isinstance(m[1], (int, float)) or m[1] in _SCORES)
        and not isinstance(m[1], bool)
        for m in members
    ):
        raise _bad(
            number,
            'members must be a list of [member, score] pairs (score: a number, "inf" or "-inf")',
        )
    scores: dict[str, float] = {
        m[0]: _SCORES[m[1]] if isinstance(m[1], str) else m[1] for m in members
    }
    try:
        # What `index_add` checks (member names, no NaN), so an import never stops part-way.
        return str(name), check_index_members(scores)
    except InvalidArgumentError as exc:
        raise _bad(number, str(exc)) from None


def value_limit(backend: object) -> int | None:
    """The largest value `backend` accepts, in bytes, or `None` if it states no limit.

    Backends state it by two names: the file backend's class constant `MAX_VALUE_BYTES` and the
    SQLite backend's `max_value_size` option (lower by choice); the smaller one counts.
    """
    limits = [
        limit
        for limit in (
            getattr(backend, "MAX_VALUE_BYTES", None),
            getattr(backend, "max_value_size", None),
        )
        if type(limit) is int and limit > 0
    ]
    return min(limits) if limits else None


def check_dump(path: str | Path, *, max_value: int | None = None) -> None:
    """Read a whole dump and raise on its first problem: what `import_state` checks first.

    Args:
        path: The dump file.
        max_value: The largest value the destination takes, in bytes (`None`: no limit).

    Raises:
        SerializationError: The file is not a complete, well-formed dump (a binary or empty
            file, a truncated dump, a bad key, value, member or score).
        ConfigurationError: The dump's version is newer than this agenticstate reads.
        OSError: The file cannot be read.
    """
    seen_end = False
    entries = indexes = 0
    number = 0
    for number, record in _read_dump(Path(path)):
        if number == 1:
            _check_header(number, record)
            continue
        if seen_end:
            raise _bad(number, "data after the end line")
        kind = record.get("type")
        if kind == "entry":
            _parse_entry(number, record, max_value)
            entries += 1
        elif kind == "index":
            _parse_index(number, record)
            indexes += 1
        elif kind == "end":
            if (record.get("entries"), record.get("indexes")) != (entries, indexes):
                raise _bad(number, "the end line's counts do not match the dump")
            seen_end = True
        else:
            raise _bad(number, f"unknown record type {kind!r}")
    if number == 0:
        raise SerializationError(f"{path} is empty: not an agenticstate dump", path="")
    if not seen_end:
        raise SerializationError(f"dump {path} is truncated: it has no end line", path="")


async def import_state(
    path: str | Path,
    destination: Backend,
    *,
    progress: Callable[[TransferProgress], object] | None = None,
) -> TransferProgress:
    """Write the keys and indexes of a dump file (from `export_state`) into `destination`.

    The whole file is checked first (`check_dump`, with the destination's largest value,
    `value_limit`, if it has one): a malformed, truncated or newer dump, or one with a value
    the destination would refuse, raises and writes nothing. Keys whose TTL ran out since the
    export are skipped. Running it again is safe.

    Raises:
        SerializationError: The file is not a complete, well-formed dump.
        ConfigurationError: The dump's version is newer than this agenticstate reads.
        OSError: The file cannot be read.
    """
    source = Path(path)
    check_dump(source, max_value=value_limit(destination))
    done = TransferProgress()
    batch: list[Entry] = []
    now = utcnow()

    async def flush() -> None:
        await _write_entries(destination, batch, done)
        batch.clear()
        if progress is not None:
            progress(done)

    for number, record in _read_dump(source):
        kind = record.get("type")
        if kind == "entry":
            key, raw, expires_at = _parse_entry(number, record)
            batch.append(Entry(key, raw, 1, now, now, expires_at))
            if len(batch) >= _BATCH:
                await flush()
        elif kind == "index":
            name, members = _parse_index(number, record)
            if members:
                await destination.index_add(name, members)
                done.indexes += 1
    await flush()
    return done
