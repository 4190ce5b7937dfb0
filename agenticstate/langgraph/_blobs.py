"""How `CheckpointSaver` stores one channel value: whole, compressed, or as a delta.

A stored value is a list:

| form              | list                                                             |
|-------------------|------------------------------------------------------------------|
| whole             | `[type, bytes]` (every store written before deltas, too)         |
| whole, compressed | `[type, zlib bytes, 1]`                                          |
| delta             | `[type, tail, 2, tail count, base size, base version, base digest]` |
| delta, compressed | `[type, zlib tail, 3, tail count, base size, base version, base digest]` |

A delta extends the value at `base version` (same thread, namespace and channel): the value is
a msgpack array (LangGraph's serializer, type `"msgpack"`), whose encoding is a header (the
element count) followed by the elements' encodings; the new value's elements after the header
start with exactly the base's, so the delta keeps only the bytes after them (`tail`, holding
`tail count` elements). Reading puts the header back in front of the base's body and the tails:
the bytes are the serializer's own, so the value read is the one that was written. `base size`
(the base body's length) and `base digest` (its BLAKE2b) are checked on the way, so a base that
changed is an error, never a wrong value (a delta written before digests has none: its size
alone is checked).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, NamedTuple

from agenticstate.exceptions import DecodeError

__all__ = ["Tip", "assemble", "decode_full", "encode_value", "is_delta", "tip_of"]

FULL_Z = 1
DELTA = 2
DELTA_Z = 3
_LEVEL = 1  # zlib's fastest level: most of the gain on message text, a fraction of the time


class Tip(NamedTuple):
    """What a saver remembers of a channel value it wrote or read, to write the next as a delta.

    Attributes:
        version: The channel version.
        elements: Elements in the array.
        size: Bytes of the array's body (after its header).
        digest: BLAKE2b of the body.
        chain: The versions read before this one: the whole copy, then the deltas up to this.
    """

    version: str
    elements: int
    size: int
    digest: bytes
    chain: tuple[str, ...]


def _array(kind: str, data: bytes) -> tuple[int, int] | None:
    """`(element count, header length)` if `data` is a msgpack array, else `None`."""
    if kind != "msgpack" or not data:
        return None
    first = data[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    if first == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big"), 5
    return None


def _header(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _pack(data: bytes, compress_above: int | None) -> tuple[bytes, bool]:
    if compress_above is not None and len(data) >= compress_above:
        packed = zlib.compress(data, _LEVEL)
        if len(packed) < len(data):
            return packed, True
    return data, False


def _unpack(data: bytes) -> bytes:
    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise DecodeError(f"a compressed checkpoint value is corrupt: {exc}") from exc


def encode_value(
    version: str,
    kind: str,
    data: bytes,
    base: Tip | None,
    *,
    chain_limit: int,
    compress_above: int | None,
) -> tuple[list[Any], Tip | None]:
    """The stored form of one channel value, and its `Tip` if it is a msgpack array.

    A delta against `base` when the value extends it and the chain stays under `chain_limit`
    values read; otherwise whole. Either is compressed when at least `compress_above` bytes
    (`None`: never) and smaller so.
    """
    shape = _array(kind, data)
    if shape is None:
        packed, z = _pack(data, compress_above)
        return ([kind, packed, FULL_Z] if z else [kind, packed]), None
    count, start = shape
    body = memoryview(data)[start:]
    if base is not None and len(base.chain) + 2 <= chain_limit and base.size <= len(body):
        hashed = hashlib.blake2b(body[: base.size], digest_size=16)
        extends = count >= base.elements and hashed.digest() == base.digest
        hashed.update(body[base.size :])
        if extends:
            tail, z = _pack(bytes(body[base.size :]), compress_above)
            tip = Tip(version, count, len(body), hashed.digest(), (*base.chain, base.version))
            stored = [kind, tail, DELTA_Z if z else DELTA, count - base.elements, base.size]
            return [*stored, base.version, base.digest], tip
        digest = hashed.digest()
    else:
        digest = hashlib.blake2b(body, digest_size=16).digest()
    packed, z = _pack(data, compress_above)
    return ([kind, packed, FULL_Z] if z else [kind, packed]), Tip(
        version, count, len(body), digest, ()
    )


def is_delta(stored: Any) -> bool:
    """Whether a stored value is a delta (needs its chain to be read)."""
    return len(stored) > 2 and stored[2] >= DELTA


def decode_full(stored: Any) -> tuple[str, bytes]:
    """`(type, bytes)` of a whole stored value."""
    if len(stored) > 2 and stored[2] == FULL_Z:
        return stored[0], _unpack(stored[1])
    return stored[0], stored[1]


def assemble(versions: list[str], parts: list[Any], where: str) -> tuple[str, bytes]:
    """`(type, bytes)` of the value whose stored chain is `parts` (whole first), at `versions`.

    Raises:
        DecodeError: A part is missing, the first is not a whole array, or a delta does not
            extend the part before it (`where` names the value in the message).
    """
    if any(part is None for part in parts) or is_delta(parts[0]):
        raise DecodeError(f"{where}: a value its delta chain needs is missing")
    kind, data = decode_full(parts[0])
    shape = _array(kind, data)
    if shape is None:
        raise DecodeError(f"{where}: the base of a delta chain is not an array")
    count, start = shape
    pieces: list[bytes | memoryview] = [memoryview(data)[start:]]
    hashed = hashlib.blake2b(pieces[0], digest_size=16)
    size = len(data) - start
    for index in range(1, len(parts)):
        part = parts[index]
        if (
            not is_delta(part)
            or part[4] != size
            or part[5] != versions[index - 1]
            or (len(part) > 6 and part[6] != hashed.digest())
        ):
            raise DecodeError(f"{where}: a delta does not extend the value before it")
        tail = _unpack(part[1]) if part[2] == DELTA_Z else part[1]
        if index + 1 < len(parts):
            hashed.update(tail)
        pieces.append(tail)
        size += len(tail)
        count += part[3]
    return kind, _header(count) + b"".join(pieces)


def tip_of(version: str, chain: tuple[str, ...], kind: str, data: bytes) -> Tip | None:
    """The `Tip` of a value read back (`None` unless it is a msgpack array)."""
    shape = _array(kind, data)
    if shape is None:
        return None
    count, start = shape
    body = memoryview(data)[start:]
    return Tip(version, count, len(body), hashlib.blake2b(body, digest_size=16).digest(), chain)
