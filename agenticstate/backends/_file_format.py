"""The file backend's on-disk formats: log frames and snapshots, encoded and checked (no I/O).

A **log frame** is `length (4 bytes) | CRC-32 (4 bytes) | flags (1 byte) | payload`: the length
and checksum cover the flags and the payload, and `FLAG_COMPRESSED` in the flags says the payload
is zlib-compressed. The payload is a msgpack list of records (stores written before 0.2 hold one
record per frame), each a list of eight fields: `[lsn, op, key, value, version, created, updated,
expires]` with times in epoch milliseconds. `op` is `OP_SET` (value: the stored bytes),
`OP_DELETE`, `OP_INDEX_ADD` (value: members and scores) or `OP_INDEX_REMOVE` (value: members).
A write of a key that keeps history has a ninth field, the history's depth (an int >= 2), and a
delete's `updated` is when it happened (`None` in stores written before the change feed). A
record's `lsn` is also the revision of its write. A write to a key that was present has a tenth
field, the key's `create_revision` (then the ninth, the depth, may be 1); a write without it
created the key, so its `create_revision` is its own `lsn` (or, in a store written before
revisions, the one of the entry it replaced).
`check_record` refuses anything else, so a frame whose checksum holds but whose records do not
make sense is reported as damage rather than applied.

A **snapshot** is a JSON or msgpack document (optionally zlib-compressed as a whole) holding
`SNAPSHOT_MAGIC`, its format version, the last sequence number it contains, a CRC-32 of its
entries and indexes (`snapshot_checksum`), the entries and the indexes. Each entry holds its
`revision` and `create_revision` (an entry of a snapshot written before revisions has neither:
it reads as revision 0, and the store gives it one on open). Since the change feed it
may also hold a **journal** (`journal`, with `journal_checksum`, its CRC-32): one msgpack map,
base64 in a JSON snapshot, with the store's id, the retained feed and the keys' older versions
(see `encode_journal`). A release that predates it ignores those two fields. In a JSON snapshot a
value that is itself uncompressed JSON is embedded as JSON (readable, diffable), when it reads
back to the very same bytes; any other value is embedded as base64. A msgpack snapshot holds the
bytes as they are. The bytes of a stored value are `serialization`'s payload: this module asks
`serialization.json_text` and `json_payload` for them and never reads a header bit itself.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import time
import zlib
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import msgpack

from agenticstate._keys import validate_key
from agenticstate.backends.base import new_entry
from agenticstate.exceptions import DecodeError, InvalidKeyError
from agenticstate.serialization import json_payload, json_text, pack

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agenticstate.backends.base import Entry

__all__ = [
    "FLAG_COMPRESSED",
    "FRAME_HEADER",
    "MALFORMED_FRAME",
    "MALFORMED_SNAPSHOT",
    "MISSING",
    "OP_DELETE",
    "OP_INDEX_ADD",
    "OP_INDEX_REMOVE",
    "OP_SET",
    "Clock",
    "FileFormat",
    "Journal",
    "Times",
    "check_record",
    "check_snapshot_header",
    "decode_frame",
    "decode_journal",
    "decode_snapshot",
    "encode_frame",
    "encode_journal",
    "encode_snapshot",
    "entry_from_snapshot",
    "from_ms",
    "intact_frame",
    "ms",
    "next_intact_frame",
    "now",
    "salvage_frames",
    "seal_snapshot_header",
    "tail_damage",
    "whole_frames",
]

FileFormat = Literal["json", "msgpack"]

FRAME_HEADER = struct.Struct(">II")  # length of flags+payload, CRC-32 of flags+payload
FLAG_COMPRESSED = 0x01  # in a frame's flags byte: the payload is zlib-compressed
_COMPRESS_ABOVE = 256  # with compression on, payloads longer than this are compressed
OP_SET, OP_DELETE, OP_INDEX_ADD, OP_INDEX_REMOVE = "s", "d", "ia", "ir"

SNAPSHOT_MAGIC = "agenticstate-snapshot"
SNAPSHOT_VERSION = 2  # 2: with a checksum of its entries and indexes
_ZLIB_STREAM = b"\x78"  # the first byte of a zlib stream: a compressed snapshot
_JSON_DOCUMENT = b"{"  # the first byte of a JSON snapshot (a msgpack one starts with a map)

MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z, the last instant a datetime holds
_READABLE_DEPTH = 64  # deeper JSON values go into a JSON snapshot as base64 (see _readable_json)
_MSGPACK_INT = (-(2**63), 2**64 - 1)  # the integers msgpack (the snapshot checksum) can pack
_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # 2**63 has 19 digits; shorter integers always fit

MISSING: Any = object()  # "no value", where None is a value

# What decoding a damaged frame or snapshot raises (beyond BackendError).
MALFORMED_FRAME = (ValueError, TypeError, zlib.error, msgpack.UnpackException)
MALFORMED_SNAPSHOT = (
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    OverflowError,
    OSError,  # datetime.fromtimestamp, for a time out of the platform's range
    zlib.error,
    msgpack.UnpackException,
    InvalidKeyError,
)


# Times: the log and the snapshot hold epoch milliseconds.


def ms(moment: datetime | None) -> int | None:
    return None if moment is None else round(moment.timestamp() * 1000)


def from_ms(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)


def now() -> datetime:
    """Now, at millisecond precision, like every timestamp the store persists.

    Rounded down, never up: an expiry computed from it is never later than the TTL asked for
    (rounding to nearest made a fresh key's `ttl()` up to half a millisecond too long).
    """
    return datetime.fromtimestamp(time.time_ns() // 1_000_000 / 1000, UTC)


class Times:
    """Epoch milliseconds to datetimes, each built once: a batch's records share their times."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[int | None, datetime | None] = {None: None}

    def __call__(self, ms: int | None) -> Any:
        found = self._cache.get(ms, MISSING)
        if found is MISSING:
            if len(self._cache) > 65536:
                self._cache = {None: None}
            found = self._cache[ms] = from_ms(ms)
        return found


class Clock:
    """Now, as a datetime and in epoch milliseconds (the log's form), the same instant.

    Busy stores write many times a millisecond: the datetime is built once per millisecond.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[datetime, int] = (datetime.fromtimestamp(0, UTC), 0)

    def __call__(self) -> tuple[datetime, int]:
        ms = time.time_ns() // 1_000_000  # down, as `now()`: an expiry never exceeds its TTL
        if ms != self._last[1]:
            self._last = (datetime.fromtimestamp(ms / 1000, UTC), ms)
        return self._last


# Log frames.


def encode_frame(records: list[list[Any]], *, compress: bool) -> bytes:
    """One log frame holding `records` (acknowledged together, so one checksum)."""
    payload = pack(records)
    flags = 0
    if compress and len(payload) > _COMPRESS_ABOVE:
        packed = zlib.compress(payload, 1)
        if len(packed) < len(payload):
            payload, flags = packed, FLAG_COMPRESSED
    body = bytes((flags,)) + payload
    return FRAME_HEADER.pack(len(body), zlib.crc32(body)) + body


def whole_frames(data: bytes) -> Iterator[tuple[int, bytes]]:
    """`(offset, flags and payload)` of each frame in `data` that is whole and checks out.

    Stops at the first frame that is torn (cut short) or fails its checksum: what follows it
    cannot be trusted. The frame ends at `offset + FRAME_HEADER.size + len(body)`.
    """
    offset, header = 0, FRAME_HEADER.size
    while offset + header <= len(data):
        length, crc = FRAME_HEADER.unpack_from(data, offset)
        body = data[offset + header : offset + header + length]
        if len(body) < length or length == 0 or zlib.crc32(body) != crc:
            return
        yield offset, body
        offset += header + length


def decode_frame(body: bytes) -> list[list[Any]]:
    """The records of one frame (its flags and payload): a batch, or before 0.2 one record.

    Raises:
        One of `MALFORMED_FRAME`: the frame does not hold well-formed records.
    """
    flags, payload = body[0], body[1:]
    if flags & FLAG_COMPRESSED:
        payload = zlib.decompress(payload)
    fields = msgpack.unpackb(payload, raw=False)
    if not isinstance(fields, list) or not fields:
        raise ValueError("bad frame")
    records = fields if isinstance(fields[0], list) else [fields]
    for record in records:
        check_record(record)
    return records


def _is_stamp(value: object) -> bool:
    return value is None or (type(value) is int and 0 <= value <= MAX_MS)


def check_record(record: object) -> None:
    """Raise ValueError unless `record` is a well-formed log record (see the module docstring)."""
    if type(record) is list and len(record) == 10:
        lsn, depth, create_revision = record[0], record[8], record[9]
        if (
            record[1] != OP_SET
            or type(depth) is not int
            or depth < 1
            or type(create_revision) is not int
            or not 1 <= create_revision < lsn
        ):
            raise ValueError("bad history depth or create revision")
        record = record[:8]
    elif type(record) is list and len(record) == 9:
        depth = record[8]
        if record[1] != OP_SET or type(depth) is not int or depth < 2:
            raise ValueError("bad history depth")
        record = record[:8]
    if type(record) is list and len(record) == 8:
        # The common case, a write, in one expression; anything unusual takes the long way.
        lsn, op, key, value, version, created, updated, expires = record
        if (
            op == OP_SET
            and type(lsn) is int
            and lsn >= 1
            and type(key) is str
            and type(value) is bytes
            and type(version) is int
            and version >= 1
            and type(created) is int
            and type(updated) is int
            and 0 <= created <= MAX_MS
            and 0 <= updated <= MAX_MS
            and (expires is None or (type(expires) is int and 0 <= expires <= MAX_MS))
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
    if op == OP_SET:
        if not isinstance(value, bytes) or version < 1 or created is None or updated is None:
            raise ValueError("bad write record")
        if not (_is_stamp(created) and _is_stamp(updated) and _is_stamp(expires)):
            raise ValueError("bad timestamps")
    elif op == OP_DELETE:
        if value is not None or not _is_stamp(updated):
            raise ValueError("bad delete record")
    elif op == OP_INDEX_ADD:
        if not isinstance(value, dict) or not all(
            isinstance(m, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for m, v in value.items()
        ):
            raise ValueError("bad index record")
    elif op == OP_INDEX_REMOVE:
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise ValueError("bad index record")
    else:
        raise ValueError(f"unknown operation {op!r}")


# Snapshots.


def encode_snapshot(
    entries: dict[str, Entry],
    indexes: dict[str, dict[str, float]],
    lsn: int,
    *,
    format: FileFormat,  # noqa: A002  # FileBackend's name for it
    compression: bool,
    journal: bytes | None = None,
) -> bytes:
    """The bytes of a snapshot of `entries` (those not expired) and `indexes`, up to `lsn`.

    With `journal` (`encode_journal`'s bytes) it keeps the journal too.
    """
    document = _snapshot_document(entries, indexes, lsn, readable=format == "json")
    if journal is not None:
        document["journal_checksum"] = zlib.crc32(journal)
        document["journal"] = (
            base64.b64encode(journal).decode("ascii") if format == "json" else journal
        )
    seal_snapshot_header(document)
    if format == "json":
        data = _json_snapshot(document)
    else:
        data = msgpack.packb(document, use_bin_type=True)
    if compression:
        data = zlib.compress(data, 6)
    return data


def decode_snapshot(raw: bytes) -> tuple[int, dict[str, Any], dict[str, Any], bytes | None]:
    """The last sequence number, the entries, the indexes and the journal of a snapshot.

    Reads either format, compressed or not. `entry_from_snapshot` reads an entry and
    `decode_journal` the journal (`None` in a snapshot without one).

    Raises:
        One of `MALFORMED_SNAPSHOT`: `raw` is not an intact snapshot.
    """
    if raw[:1] == _ZLIB_STREAM:
        raw = zlib.decompress(raw)
    document = json.loads(raw) if raw[:1] == _JSON_DOCUMENT else msgpack.unpackb(raw, raw=False)
    if not isinstance(document, dict) or document.get("magic") != SNAPSHOT_MAGIC:
        raise ValueError("not an agenticstate snapshot")
    check_snapshot_header(document)
    entries, indexes = document["entries"], document.get("indexes", {})
    if not isinstance(entries, dict) or not isinstance(indexes, dict):
        raise TypeError("entries and indexes must be maps")
    if document.get("format_version", 1) >= 2 and document.get("checksum") != (
        snapshot_checksum(entries, indexes)
    ):
        raise ValueError("its checksum does not match its entries")
    journal = document.get("journal")
    if journal is not None:
        if isinstance(journal, str):
            journal = base64.b64decode(journal, validate=True)
        if not isinstance(journal, bytes) or zlib.crc32(journal) != document["journal_checksum"]:
            raise ValueError("its journal's checksum does not match")
    return int(document["lsn"]), entries, indexes, journal


_HEADER_FIELDS = ("magic", "format_version", "lsn", "checksum", "journal_checksum")


def _header_checksum(document: dict[str, Any]) -> int:
    return zlib.crc32(pack([document.get(name) for name in _HEADER_FIELDS]))


def seal_snapshot_header(document: dict[str, Any]) -> None:
    """Add `header_checksum`: a CRC-32 of the fields the other checksums leave out.

    The entries' checksum does not cover the snapshot's sequence number: a damaged one would
    skip (or replay twice) the log records after it. Releases that predate it ignore the field.
    """
    document["header_checksum"] = _header_checksum(document)


def check_snapshot_header(document: dict[str, Any]) -> None:
    """Raise ValueError if the snapshot has a `header_checksum` and its fields do not match."""
    if "header_checksum" in document and document["header_checksum"] != _header_checksum(document):
        raise ValueError("its header's checksum does not match")


class Journal:
    """What a snapshot keeps besides the entries: the feed and older versions of keys.

    Attributes:
        store_id: The store's id (its cursors name it), or `None` if the feed was off.
        trimmed: The sequence number of the newest change the feed had dropped (0: none).
        changes: The retained feed, oldest first: `[lsn, op, key, old, new, version, time]`,
            `op` being `OP_SET` or `OP_DELETE`, `time` in epoch milliseconds.
        history: Per key, its retained versions before the current one, oldest first, as
            entries.
    """

    __slots__ = ("changes", "history", "store_id", "trimmed")

    def __init__(
        self,
        store_id: str | None,
        trimmed: int,
        changes: list[list[Any]],
        history: dict[str, list[Entry]],
    ) -> None:
        self.store_id = store_id
        self.trimmed = trimmed
        self.changes = changes
        self.history = history


def encode_journal(journal: Journal) -> bytes:
    """The journal as one msgpack map (a snapshot embeds it)."""
    history = {
        key: [
            [
                e.value,
                e.version,
                ms(e.created_at),
                ms(e.updated_at),
                ms(e.expires_at),
                e.revision,
                e.create_revision,
            ]
            for e in versions
        ]
        for key, versions in journal.history.items()
        if versions
    }
    return pack(
        {
            "id": journal.store_id,
            "trimmed": journal.trimmed,
            "changes": journal.changes,
            "history": history,
        }
    )


def decode_journal(blob: bytes) -> Journal:
    """The journal `encode_journal` wrote.

    Raises:
        One of `MALFORMED_SNAPSHOT`: it is not a well-formed journal.
    """
    document = msgpack.unpackb(blob, raw=False)
    store_id, trimmed = document["id"], document["trimmed"]
    if not (store_id is None or (isinstance(store_id, str) and store_id.isalnum())):
        raise ValueError("bad store id")
    if type(trimmed) is not int or trimmed < 0:
        raise ValueError("bad trimmed sequence number")
    changes = document["changes"]
    for change in changes:
        lsn, op, key, old, new, version, stamp = change
        if (
            type(lsn) is not int
            or op not in (OP_SET, OP_DELETE)
            or not (old is None or isinstance(old, bytes))
            or not (new is None or isinstance(new, bytes))
            or (new is None) != (op == OP_DELETE)
            or type(version) is not int
            or not _is_stamp(stamp)
            or stamp is None
        ):
            raise ValueError("bad change in the journal")
        validate_key(key)
    times = Times()
    history: dict[str, list[Entry]] = {}
    for key, versions in document["history"].items():
        entries = history[validate_key(key)] = []
        for value, version, created, updated, expires, *revisions in versions:
            if created is None or updated is None or type(version) is not int or version < 1:
                raise ValueError("bad version in the journal's history")
            revision, create_revision = revisions if revisions else (0, 0)  # before revisions
            if type(revision) is not int or type(create_revision) is not int:
                raise ValueError("bad revision in the journal's history")
            entries.append(
                new_entry(
                    key,
                    bytes(value),
                    version,
                    times(created),
                    times(updated),
                    times(expires),
                    revision,
                    create_revision,
                )
            )
    return Journal(store_id, trimmed, changes, history)


def entry_from_snapshot(key: str, item: dict[str, Any], times: Times) -> Entry:
    """The entry a snapshot holds at `key`."""
    if "json" in item:
        value = json_payload(_encode_json(item["json"]).encode())
    elif "base64" in item:
        value = base64.b64decode(item["base64"], validate=True)
    else:
        value = bytes(item["value"])
    created, updated = times(item["created"]), times(item["updated"])
    if created is None or updated is None:
        raise ValueError("an entry without its creation or update time")
    revision, create_revision = item.get("revision", 0), item.get("create_revision", 0)
    if type(revision) is not int or type(create_revision) is not int or revision < 0:
        raise ValueError("a bad revision")
    return new_entry(
        key,
        value,
        int(item["version"]),
        created,
        updated,
        times(item["expires"]),
        revision,
        create_revision,
    )


def snapshot_checksum(entries: dict[str, Any], indexes: dict[str, Any]) -> int:
    """CRC-32 of a snapshot's entries and indexes, in a form both formats read back the same.

    JSON keeps key order and round-trips floats exactly, so what `json.loads` gives back packs
    to the same bytes as what was written; damage inside a value or a version does not.
    """
    return zlib.crc32(msgpack.packb([entries, indexes], use_bin_type=True))


def _snapshot_document(
    entries: dict[str, Entry], indexes: dict[str, dict[str, float]], lsn: int, *, readable: bool
) -> dict[str, Any]:
    moment = now()
    items: dict[str, Any] = {}
    for key, entry in entries.items():
        if entry.expires_at is not None and entry.expires_at <= moment:
            continue
        item: dict[str, Any] = {
            "version": entry.version,
            "created": ms(entry.created_at),
            "updated": ms(entry.updated_at),
            "expires": ms(entry.expires_at),
            "revision": entry.revision,
            "create_revision": entry.create_revision,
        }
        if readable:
            parsed = _readable_json(entry.value)
            if parsed is not MISSING:
                item["json"] = parsed
            else:
                item["base64"] = base64.b64encode(entry.value).decode("ascii")
        else:
            item["value"] = entry.value
        items[key] = item
    return {
        "magic": SNAPSHOT_MAGIC,
        "format_version": SNAPSHOT_VERSION,
        "lsn": lsn,
        "checksum": snapshot_checksum(items, indexes),
        "entries": items,
        "indexes": indexes,
    }


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


def _readable_json(value: bytes) -> Any:
    """The parsed JSON of an uncompressed JSON payload, if it can be embedded as it is.

    That is, if re-encoding it gives the same bytes and the snapshot's checksum (msgpack) can
    hold it. Anything else (NaN, lone surrogates, integers beyond 64 bits, deep nesting) is
    embedded as base64: no value a store accepted may stop its snapshots.
    """
    try:
        text = json_text(value)
        if text is None:
            return MISSING
        parsed = json.loads(text)
        # Few brackets and no integer of 19 digits or more: it fits without looking closer.
        simple = text.count(b"[") + text.count(b"{") < _READABLE_DEPTH
        if not (simple and _LONG_DIGITS.search(text) is None) and not _fits_checksum(parsed):
            return MISSING
        same = _encode_json(parsed).encode() == text
    except (ValueError, UnicodeError, DecodeError, RecursionError):
        return MISSING
    return parsed if same else MISSING


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


# Damage. A crash can only tear the end of the log: the frame being appended is cut short (a
# process killed in `write`), or, after a power loss on some filesystems, the end reads as
# zeros. Anything else that is wrong with a log is damage, and a frame that checks out after a
# bad region proves that the region held frames: it is refused, never cut.

_FRAME_START = re.compile(rb"(?=[\x00\x01][\x78\x90-\x9f\xdc\xdd])", re.DOTALL)
"""Where a frame's flags byte and first payload byte may be: a candidate frame starts 8 bytes
before (a msgpack list, or a zlib stream when compressed); checking candidates only keeps the
search for intact frames after damage fast."""


def _looks_like_a_frame(data: bytes, start: int, end: int) -> bool:
    """Whether the flags and payload starting at `start` begin as a frame's do (cheap).

    A frame's payload is a msgpack list of records, each a list of 8 or 9 fields (before 0.2,
    one such record), or a zlib stream. Checking that before the checksum keeps a search
    through a long torn tail from checksumming at every offset that happens to look like a
    length.
    """
    if end - start < 4:
        return False
    flags, first, second = data[start], data[start + 1], data[start + 2]
    if flags == FLAG_COMPRESSED:
        return first == 0x78 and (first * 256 + second) % 31 == 0  # a zlib header
    if flags != 0:
        return False
    if first in (0x98, 0x99):  # one record (stores written before 0.2)
        return True
    if 0x91 <= first <= 0x9F:
        record = second
    elif first == 0xDC and end - start >= 5:
        record = data[start + 4]
    elif first == 0xDD and end - start >= 7:
        record = data[start + 6]
    else:
        return False
    return record in (0x98, 0x99)


def intact_frame(data: bytes, offset: int) -> bytes | None:
    """The body of the frame at `offset` if it is whole, checks out and holds good records."""
    header = FRAME_HEADER.size
    if offset < 0 or offset + header > len(data):
        return None
    length, crc = FRAME_HEADER.unpack_from(data, offset)
    end = offset + header + length
    if length < 2 or end > len(data) or not _looks_like_a_frame(data, offset + header, end):
        return None
    body = data[offset + header : end]
    if zlib.crc32(body) != crc:
        return None
    try:
        decode_frame(body)
    except MALFORMED_FRAME:
        return None
    return body


def next_intact_frame(data: bytes, start: int) -> int | None:
    """The offset of the first intact frame (`intact_frame`) that begins after `start`."""
    header = FRAME_HEADER.size
    for match in _FRAME_START.finditer(data, start + header + 1):
        offset = match.start() - header
        if intact_frame(data, offset) is not None:
            return offset
    return None


def tail_damage(data: bytes, end: int) -> str | None:
    """Why the bytes of a log after its last whole frame (which ends at `end`) are damage.

    `None` means they are what a crash leaves, so cutting them loses nothing acknowledged: a
    frame cut short by a crash during its append, or zeros. Anything else is damage, described
    for the error: an intact frame after the bad bytes (what follows them must not be cut), a
    frame that is whole but fails its checksum (a crash does not leave one), or a frame whose
    length field is damaged while its bytes check out.
    """
    tail = data[end:]
    if not tail.strip(b"\0"):
        return None  # nothing, or zeros: a power loss on some filesystems leaves those
    header = FRAME_HEADER.size
    if len(tail) > header:
        length, crc = FRAME_HEADER.unpack_from(data, end)
        if (
            length > 0
            and header + length > len(tail)
            and _looks_like_a_frame(data, end + header, len(data))
            and not _length_damaged(data, end, crc)
        ):
            # A frame that begins as one and runs past the end: an append a crash tore. Bytes
            # inside it that look like a frame are its payload (a value may hold a frame).
            return None
    after = next_intact_frame(data, end)
    if after is not None:
        return f"an intact frame follows at byte {after}"
    if len(tail) < header:
        return None  # a header cut short
    length, crc = FRAME_HEADER.unpack_from(data, end)
    if length == 0:
        return "a frame of length 0 is followed by data"
    if header + length <= len(tail):
        return "a whole frame fails its checksum"
    if zlib.crc32(tail[header:]) == crc:
        return "a frame's length field is damaged"
    return None  # cut short: the append was torn


def _length_damaged(data: bytes, start: int, crc: int) -> bool:
    """Whether the frame at `start`, which says it runs past the end, is damage, not torn.

    It is when the log goes on after it: from some point inside it to the end, intact frames
    run back to back with sequence numbers above every one before `start` (the rest of the
    log, after a damaged length field or bytes lost from the frame), or its checksum matches
    its bytes up to where such frames begin (only its length field is damaged). A torn
    append's bytes hold neither, unless its value holds such frames and the crash tore it
    exactly where they end: then the store is refused, as for damage.
    """
    header = FRAME_HEADER.size
    body = start + header
    if zlib.crc32(data[body:]) == crc:
        return True
    last: int | None = None  # looked up only if a frame is found in the bytes
    for match in _FRAME_START.finditer(data, body + 2 + header):
        offset = match.start() - header
        if intact_frame(data, offset) is None:
            continue
        if last is None:
            last = _last_lsn(data, start)
        if _frames_run_to_the_end(data, offset, last):
            return True
    return False


def _last_lsn(data: bytes, end: int) -> int:
    """The highest sequence number in the whole frames before `end` (0: none)."""
    last = None
    for offset, _ in whole_frames(data[:end]):
        last = offset
    if last is None:
        return 0
    body = intact_frame(data, last)
    return 0 if body is None else frame_lsns(body)[1]


def _frames_run_to_the_end(data: bytes, offset: int, above: int) -> bool:
    """Whether intact frames run back to back from `offset` to the end of `data` (or zeros).

    Their sequence numbers must grow, from above `above`, as a log's do.
    """
    header = FRAME_HEADER.size
    while offset < len(data):
        frame = intact_frame(data, offset)
        if frame is None:
            return not data[offset:].strip(b"\0")
        low, high = frame_lsns(frame)
        if low <= above:
            return False
        above = high
        offset += header + len(frame)
    return True


def frame_lsns(body: bytes) -> tuple[int, int]:
    """The lowest and highest sequence numbers of the records in an intact frame."""
    lsns = [record[0] for record in decode_frame(body)]
    return min(lsns), max(lsns)


def salvage_frames(data: bytes) -> tuple[list[tuple[int, bytes]], list[tuple[int, int]]]:
    """Every intact frame of a damaged log, and the byte ranges between them that are not.

    Returns:
        `(offset, body)` of each intact frame in order, and the `(start, end)` ranges dropped.
    """
    frames: list[tuple[int, bytes]] = []
    dropped: list[tuple[int, int]] = []
    offset, header = 0, FRAME_HEADER.size
    last_lsn = 0
    while offset < len(data):
        body = intact_frame(data, offset)
        if body is not None and frame_lsns(body)[0] <= last_lsn:
            # Sequence numbers only grow along a log: a frame that goes back is not one of its
            # own (the bytes of a frame inside a value's payload), so its writes are not kept.
            dropped.append((offset, offset + header + len(body)))
            offset += header + len(body)
            continue
        if body is not None:
            frames.append((offset, body))
            last_lsn = frame_lsns(body)[1]
            offset += header + len(body)
            continue
        end = _declared_end(data, offset)
        if end is None:
            after = next_intact_frame(data, offset)
            end = len(data) if after is None else after
        if data[offset:end].strip(b"\0"):
            dropped.append((offset, end))
        offset = end
    return frames, dropped


def _declared_end(data: bytes, offset: int) -> int | None:
    """Where the damaged frame at `offset` ends, if its length field can be trusted.

    It can when an intact frame (or the end of the log) begins exactly where it says the
    frame ends: its damage is in its checksum or payload, and whatever looks like a frame
    inside it is payload (a value may hold a frame's bytes), never kept.
    """
    header = FRAME_HEADER.size
    if offset + header > len(data):
        return None
    length, _ = FRAME_HEADER.unpack_from(data, offset)
    end: int = offset + header + length
    if length < 2 or end > len(data):
        return None
    if end == len(data) or intact_frame(data, end) is not None:
        return end
    return None
