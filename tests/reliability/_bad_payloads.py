"""Stored bytes for the decode fuzz: valid encodings, their mutations, and hand-made hostile ones.

Mutations model what damages stored bytes (bit rot, a torn write, a wrong header, a foreign
writer) and what attacks them (headers that switch format or compression, msgpack extension
codes, JSON tags with garbage payloads, length and compression bombs).
"""

from __future__ import annotations

import json
import random
import zlib
from datetime import UTC, date, datetime, timedelta, timezone
from typing import TYPE_CHECKING
from uuid import UUID

from agenticstate import Serializer

if TYPE_CHECKING:
    from collections.abc import Callable

SAMPLE_VALUES: list[object] = [
    None,
    True,
    0,
    -1,
    2**64 - 1,
    -(2**63),
    1.5,
    "",
    "text é 中 😀",
    b"\x00\xff",
    [],
    {},
    {"nested": {"list": [1, 2.5, "x", None, True, {"deep": [[]]}]}},
    datetime(2026, 1, 2, 3, 4, 5),  # noqa: DTZ001  # naive datetimes are stored too
    datetime(2026, 1, 2, tzinfo=UTC),
    datetime(2026, 1, 2, tzinfo=timezone(timedelta(hours=-5))),
    date(2026, 1, 2),
    UUID("12345678-1234-5678-1234-567812345678"),
    ...,
    {"$dt": "a user dict that looks like a tag"},
    {"$map": 1, "$b64": 2},
    {"k" * 100: "v" * 2000, "n": list(range(300))},
]

JSON_TAGS = ("$dt", "$date", "$uuid", "$b64", "$map", "$...", "$unknown")
GARBAGE: list[object] = [
    "garbage",
    "",
    "2026-13-45",
    "0" * 50,
    "AAAA=",
    "!!",
    "\u0000",
    5,
    -1,
    1.5,
    None,
    True,
    [],
    [[1]],
    [[1, 2, 3]],
    [[[1], 2]],
    [["a", 1], ["a", 2]],
    {"a": 1},
]
# Lengths 4, 8 and 12 are the ones msgpack's own timestamp type (code -1) accepts.
EXT_DATA: tuple[bytes, ...] = (
    b"",
    b"x",
    b"\xff\xfe",
    b"\x00" * 4,
    b"\x01" * 8,
    b"\x00" * 12,
    b"\x00" * 16,
)
EXT_DATA += (b"2026-01-02", b"2026-01-02T03:04:05+01:00")
INTERESTING_BYTES: tuple[int, ...] = (
    0x00,
    0x01,
    0x02,
    0x7F,
    0x80,
    0x81,
    0x82,
    0xC1,
    0xC7,
    0xC9,
    0xD4,
    0xD8,
    0xDD,
)
INTERESTING_BYTES += (0xDF, 0xDB, 0xFF, ord("{"), ord("["), ord('"'), ord("\\"), ord("$"))


def encodings() -> list[bytes]:
    """Every sample value in both formats, plain and compressed."""
    out = []
    for fmt in ("msgpack", "json"):
        for compression in (False, True):
            serializer = Serializer(fmt, compression=compression, compression_threshold=0)
            out += [serializer.dumps(value) for value in SAMPLE_VALUES]
    return out


def _flip_bits(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def _truncate(raw: bytes, rng: random.Random) -> bytes:
    return raw[: rng.randrange(len(raw))]


def _set_header(raw: bytes, rng: random.Random) -> bytes:
    return bytes((rng.randrange(256),)) + raw[1:]


def _toggle_compression(raw: bytes, rng: random.Random) -> bytes:
    return bytes((raw[0] ^ 0x80,)) + raw[1:]


def _swap_format(raw: bytes, rng: random.Random) -> bytes:
    return bytes((raw[0] ^ 0x03,)) + raw[1:]


def _insert(raw: bytes, rng: random.Random) -> bytes:
    position = rng.randrange(len(raw) + 1)
    extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return raw[:position] + extra + raw[position:]


def _delete(raw: bytes, rng: random.Random) -> bytes:
    position = rng.randrange(len(raw))
    return raw[:position] + raw[position + rng.randint(1, 8) :]


def _interesting(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    data[rng.randrange(len(data))] = rng.choice(INTERESTING_BYTES)
    return bytes(data)


def _duplicate(raw: bytes, rng: random.Random) -> bytes:
    start = rng.randrange(len(raw))
    piece = raw[start : start + rng.randint(1, 16)]
    position = rng.randrange(len(raw) + 1)
    return raw[:position] + piece + raw[position:]


def _inside_zlib(raw: bytes, rng: random.Random) -> bytes:
    # Damage the payload behind a valid zlib stream, so the parsers see it, not zlib's checks.
    if not raw[0] & 0x80:
        return _flip_bits(raw, rng)
    try:
        body = zlib.decompress(raw[1:])
    except zlib.error:
        return _flip_bits(raw, rng)
    damaged = mutate(bytes((raw[0] & 0x7F,)) + body, rng, inner=False)
    return bytes((raw[0],)) + zlib.compress(damaged[1:])


MUTATIONS: tuple[Callable[[bytes, random.Random], bytes], ...] = (
    _flip_bits,
    _truncate,
    _set_header,
    _toggle_compression,
    _swap_format,
    _insert,
    _delete,
    _interesting,
    _duplicate,
    _inside_zlib,
)


def mutate(raw: bytes, rng: random.Random, *, inner: bool = True) -> bytes:
    """Apply one to three random mutations to `raw` (never to an empty value)."""
    for _ in range(rng.randint(1, 3)):
        if not raw:
            return raw
        kinds = MUTATIONS if inner else MUTATIONS[:-1]
        raw = rng.choice(kinds)(raw, rng)
    return raw


def json_tag_payloads() -> list[bytes]:
    """Every JSON tag with every garbage payload, at the top and nested in a list and a dict."""
    out = []
    for tag in JSON_TAGS:
        for garbage in GARBAGE:
            tagged = {tag: garbage}
            for document in (tagged, [1, tagged], {"a": {"b": tagged}}, {tag: tagged}):
                out.append(b"\x02" + json.dumps(document).encode())
    return out


def _ext(code: int, data: bytes) -> bytes:
    # Built by hand: msgpack.ExtType refuses the negative codes msgpack reserves for itself.
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if len(data) in fixed:
        return bytes((fixed[len(data)], code & 0xFF)) + data
    return bytes((0xC7, len(data), code & 0xFF)) + data


def ext_payloads() -> list[tuple[int, bytes, bytes]]:
    """Every msgpack extension code (-128 to 127) with a few payloads, alone and in a map:
    `(code, data, stored bytes)`."""
    out = []
    for code in range(-128, 128):
        for data in EXT_DATA:
            ext = _ext(code, data)
            out.append((code, data, b"\x01" + ext))
            out.append((code, data, b"\x01\x81\xa1a\x91" + ext))  # {"a": [ext]}
    return out


def bombs(max_size: int) -> list[bytes]:
    """Length bombs (a header claiming gigabytes), nesting bombs and a zlib bomb."""
    claims = [b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9"]  # array, map, str, bin, ext 32
    out = [b"\x01" + claim + b"\xff\xff\xff\xff\x01" for claim in claims]
    out += [
        b"\x01" + b"\x91" * 100_000 + b"\xc0",
        b"\x02" + b"[" * 100_000 + b"]" * 100_000,
        b"\x02" + b"[" * 100_000,
        b"\x02" + b"9" * 5000,
        b"\x02" + b"1e999999",
        b"\x02-",
        zlib_bomb(max_size * 4),
        b"\x82" + zlib.compress(b"[" * 100_000),
    ]
    return out


def zlib_bomb(inflated: int) -> bytes:
    """A compressed msgpack value that inflates to `inflated` bytes (built without holding them)."""
    compressor = zlib.compressobj(9)
    chunk = b"\x00" * (1 << 20)
    parts = [compressor.compress(b"\xc6" + inflated.to_bytes(4, "big"))]
    for _ in range(inflated // len(chunk)):
        parts.append(compressor.compress(chunk))
    parts.append(compressor.flush())
    return b"\x81" + b"".join(parts)


def corpus(seed: int, mutated: int, random_count: int, *, max_size: int) -> list[bytes]:
    """A fixed corpus for the backends: mutations, random bytes and every hand-made case."""
    rng = random.Random(seed)
    valid = encodings()
    out = [mutate(rng.choice(valid), rng) for _ in range(mutated)]
    for _ in range(random_count):
        header = rng.choice((0x01, 0x02, 0x81, 0x82, rng.randrange(256)))
        out.append(bytes((header,)) + rng.randbytes(rng.randint(0, 40)))
    out += json_tag_payloads()[::7] + [raw for _, _, raw in ext_payloads()[::11]] + bombs(max_size)
    return out
