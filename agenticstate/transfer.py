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
is refused; `import_state` checks the whole file before it writes anything.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agenticstate._glob import compile_glob
from agenticstate._keys import escape_glob, validate_key, validate_pattern
from agenticstate.backends.base import Backend, Entry, utcnow
from agenticstate.exceptions import ConfigurationError, SerializationError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "DUMP_FORMAT",
    "DUMP_VERSION",
    "TransferProgress",
    "copy_state",
    "export_state",
    "import_state",
]

DUMP_FORMAT = "agenticstate-dump"
"""The `format` field of a dump's header line."""
DUMP_VERSION = 1
"""The dump layout this module writes; `import_state` reads this version and refuses newer."""
_BATCH = 500


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
    (`SQLiteBackend.index_names`, the in-process store of memory and file, SCAN on Redis).
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


async def export_state(
    source: Backend,
    path: str | Path,
    pattern: str = "*",
    *,
    progress: Callable[[TransferProgress], object] | None = None,
) -> TransferProgress:
    """Write every key matching `pattern`, and its indexes, to a dump file (see above).

    The file is written beside its final name and renamed into place when complete.

    Returns:
        The totals.
    """
    validate_pattern(pattern)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    done = TransferProgress()
    with partial.open("w", encoding="utf-8") as out:
        header = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "pattern": pattern}
        out.write(json.dumps({**header, "created_at": utcnow().isoformat()}) + "\n")
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
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
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
                line = {"type": "index", "name": name, "members": [list(m) for m in members]}
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
                done.indexes += 1
        out.write(json.dumps({"type": "end", "entries": done.entries, "indexes": done.indexes}))
        out.write("\n")
    partial.replace(target)
    return done


def _bad(number: int, problem: str) -> SerializationError:
    return SerializationError(f"dump line {number}: {problem}")


def _read_dump(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _bad(number, f"not JSON ({exc.msg})") from None
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


def _parse_entry(number: int, record: dict[str, Any]) -> tuple[str, bytes, datetime | None]:
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
    return str(key), raw, _parse_time(number, record.get("expires_at"))


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
        and isinstance(m[1], (int, float))
        and not isinstance(m[1], bool)
        for m in members
    ):
        raise _bad(number, "members must be a list of [member, score] pairs")
    return str(name), {str(m[0]): float(m[1]) for m in members}


def _check_dump(path: Path) -> None:
    """Read the whole dump once and raise on the first problem, before anything is written."""
    seen_end = False
    entries = indexes = 0
    for number, record in _read_dump(path):
        if number == 1:
            _check_header(number, record)
            continue
        if seen_end:
            raise _bad(number, "data after the end line")
        kind = record.get("type")
        if kind == "entry":
            _parse_entry(number, record)
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
    if not seen_end:
        raise SerializationError(f"dump {path} is truncated: it has no end line")


async def import_state(
    path: str | Path,
    destination: Backend,
    *,
    progress: Callable[[TransferProgress], object] | None = None,
) -> TransferProgress:
    """Write the keys and indexes of a dump file (from `export_state`) into `destination`.

    The whole file is checked first: a malformed, truncated or newer dump raises and writes
    nothing. Keys whose TTL ran out since the export are skipped. Running it again is safe.

    Raises:
        SerializationError: The file is not a complete, well-formed dump.
        ConfigurationError: The dump's version is newer than this agenticstate reads.
    """
    source = Path(path)
    _check_dump(source)
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
