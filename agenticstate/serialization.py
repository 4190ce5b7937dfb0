"""Values to bytes and back: the one place a stored value is encoded or decoded.

Every value `StateManager` stores goes through `Serializer` here, and only here is the payload
format (the header byte below, msgpack, JSON and their type tags) written or read; other modules
ask `payload_format`, `payload_is_compressed` and `json_text` (and build a JSON value from its
text with `json_payload`) rather than look at the bytes. Other modules do
use json and msgpack for formats of their own, never for a stored value's payload: the file
backend's snapshot and log framing, `transfer`'s dump lines, the CLI's and the inspector's
output, and the managers' canonical texts (the tools cache key, a session message's text).

What can be stored: `dict` (str keys), `list`, `tuple` (read back as a list), `str` (without lone
surrogates, which have no UTF-8 form), `int` (64-bit), `float` (finite), `bool`, `None`,
`datetime` (naive stays naive; aware stays aware with the same UTC offset), `date`, `UUID`,
`bytes` (and `bytearray`/`memoryview`, read back as bytes), and pydantic models (stored as their
JSON form; read them back with `model=`), and `...` (the `Ellipsis` placeholder the
documentation's examples use). `str` and `int` subclasses such as `StrEnum` and `IntEnum` are
stored as their plain value.

Everything else raises a `SerializationError` (the subclass that fits, where one does) naming
where the problem is (`$.a[2]`) before anything is written. Nothing is ever pickled.

Every encoded value starts with one header byte: the format (`msgpack` or `json`) and whether the
payload is zlib-compressed. Values written in either format read back whatever the current setting.
Decompression is bounded by `max_size`, so a compression bomb is refused, not inflated.
"""

from __future__ import annotations

import base64
import json
import math
import threading
import zlib
from datetime import date, datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from uuid import UUID

import msgpack
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from agenticstate.exceptions import (
    CycleError,
    DecodeError,
    InvalidArgumentError,
    InvalidNumberError,
    NonStringKeyError,
    SerializationError,
    TooDeepError,
    TooLargeError,
    UnsupportedTypeError,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_SIZE",
    "Format",
    "Serializer",
    "json_payload",
    "json_text",
    "pack",
    "payload_format",
    "payload_is_compressed",
]

Format = Literal["msgpack", "json"]
M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_SIZE = 16 * 1024 * 1024
"""The largest encoded value accepted by default, in bytes (uncompressed)."""
DEFAULT_MAX_DEPTH = 64
"""The deepest nesting of containers accepted by default."""

_MSGPACK, _JSON, _COMPRESSED = 0x01, 0x02, 0x80
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_EXT_DATETIME, _EXT_DATE, _EXT_UUID, _EXT_ELLIPSIS = 1, 2, 3, 4
_TAG_DATETIME, _TAG_DATE, _TAG_UUID, _TAG_BYTES, _TAG_MAP = "$dt", "$date", "$uuid", "$b64", "$map"
_TAG_ELLIPSIS = "$..."
_TAGS = frozenset({_TAG_DATETIME, _TAG_DATE, _TAG_UUID, _TAG_BYTES, _TAG_MAP, _TAG_ELLIPSIS})


def _format_path(parts: list[str | int]) -> str:
    out = ["$"]
    for part in parts:
        out.append(f"[{part}]" if isinstance(part, int) else f".{part}")  # noqa: PERF401
    return "".join(out)


class _Encoder:
    """Walks a value once: validates it and converts what the wire format needs.

    Containers are copied only where something inside them changed, so a plain tree of dicts,
    lists and scalars is validated without being rebuilt.
    """

    __slots__ = ("active", "for_json", "max_depth", "path")

    def __init__(self, *, for_json: bool, max_depth: int) -> None:
        self.for_json = for_json
        self.max_depth = max_depth
        self.path: list[str | int] = []
        self.active: set[int] = set()

    def special(self, value: datetime | date | UUID | bytes) -> object:
        if isinstance(value, datetime):
            text = value.isoformat()
            return (
                {_TAG_DATETIME: text}
                if self.for_json
                else msgpack.ExtType(_EXT_DATETIME, text.encode())
            )
        if isinstance(value, date):
            text = value.isoformat()
            return {_TAG_DATE: text} if self.for_json else msgpack.ExtType(_EXT_DATE, text.encode())
        if isinstance(value, UUID):
            return (
                {_TAG_UUID: str(value)}
                if self.for_json
                else msgpack.ExtType(_EXT_UUID, value.bytes)
            )
        return {_TAG_BYTES: base64.b64encode(value).decode("ascii")} if self.for_json else value

    def walk(self, value: object, depth: int) -> object:
        kind = type(value)
        if kind is str or value is None or kind is bool:
            return value
        if kind is int:
            if not _INT_MIN <= value <= _INT_MAX:  # type: ignore[operator]
                raise InvalidNumberError(
                    "int does not fit in 64 bits", path=_format_path(self.path)
                )
            return value
        if kind is float:
            if not math.isfinite(value):  # type: ignore[arg-type]
                raise InvalidNumberError(
                    f"float {value!r} is not finite", path=_format_path(self.path)
                )
            return value
        if kind is dict or kind is list or kind is tuple:
            return self.container(value, depth)
        if isinstance(value, BaseModel):
            dumped: object
            try:
                dumped = value.model_dump(mode="json")
            except PydanticSerializationError:
                # A field holds something JSON mode cannot render: walk the Python form, which
                # this encoder either stores or refuses with a path. Its dict keys are made
                # what JSON mode makes them (`{1: step}` keys "1"), so the error names the
                # value at fault (`$.steps.1.result`), not a typed int key on the way to it.
                dumped = _json_keys(value.model_dump(mode="python"))
            return self.walk(dumped, depth)
        if value is Ellipsis:
            return {_TAG_ELLIPSIS: 0} if self.for_json else msgpack.ExtType(_EXT_ELLIPSIS, b"")
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, int):
            return self.walk(int(value), depth)
        if isinstance(value, float):
            return self.walk(float(value), depth)
        if isinstance(value, (datetime, date, UUID)):
            return self.special(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return self.special(bytes(value))
        if isinstance(value, (dict, list, tuple)):
            return self.container(value, depth)
        error = UnsupportedTypeError(
            f"cannot store a value of type {kind.__qualname__}", path=_format_path(self.path)
        )
        error.args = (f"{error.args[0]}{_unsupported_hint(value)}",)  # what to store instead
        raise error

    def container(self, value: object, depth: int) -> object:
        if depth >= self.max_depth:
            raise TooDeepError(
                f"value is nested deeper than {self.max_depth} levels", path=_format_path(self.path)
            )
        marker = id(value)
        if marker in self.active:
            raise CycleError("value contains itself", path=_format_path(self.path))
        self.active.add(marker)
        try:
            if isinstance(value, dict):
                return self.mapping(value, depth + 1)
            return self.sequence(value, depth + 1)  # type: ignore[arg-type]
        finally:
            self.active.discard(marker)

    def mapping(self, value: dict[object, object], depth: int) -> object:
        changed = type(value) is not dict
        out: dict[str, object] = {}
        path = self.path
        for key, item in value.items():
            if type(key) is not str:
                if not isinstance(key, str):
                    raise NonStringKeyError(
                        f"dict key {key!r} is a {type(key).__qualname__}, not a str",
                        path=_format_path(path),
                    )
                key = str.__str__(key)
                changed = True
            path.append(key)
            converted = self.walk(item, depth)
            path.pop()
            changed = changed or converted is not item
            out[key] = converted
        if self.for_json and len(out) == 1 and next(iter(out)) in _TAGS:
            # A user dict that looks like one of our tags is wrapped so it reads back as itself.
            return {_TAG_MAP: [[key, item] for key, item in out.items()]}
        return out if changed else value

    def sequence(self, value: list[object] | tuple[object, ...], depth: int) -> object:
        changed = type(value) is not list
        out: list[object] = []
        path = self.path
        for index, item in enumerate(value):
            path.append(index)
            converted = self.walk(item, depth)
            path.pop()
            changed = changed or converted is not item
            out.append(converted)
        return out if changed else value


def _json_keys(value: object) -> object:
    """`value` with the int, float and enum dict keys written as JSON mode writes them."""
    if isinstance(value, dict):
        return {_json_key(key): _json_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_keys(item) for item in value]
    return value


def _json_key(key: object) -> object:
    if isinstance(key, Enum):
        key = key.value
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return str(key)
    return key


_THREAD = threading.local()


def pack(value: object) -> bytes:
    """`msgpack.packb(value, use_bin_type=True)` with a reused packer (one per thread).

    Building a `Packer` costs as much as packing a small value; a packer is not thread-safe,
    so each thread keeps its own. Nothing here calls back into Python, so it cannot re-enter.
    """
    try:
        packer = _THREAD.packer
    except AttributeError:
        packer = _THREAD.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack(value)
    return packed


def _pack_framed(value: object) -> bytes:
    """The msgpack header byte, then `value` packed, built in one buffer (no copy to join them).

    The header `_MSGPACK` (0x01) is also msgpack's own encoding of the int 1, so the packer
    writes it. A value that fails to pack leaves the packer empty for the next call.
    """
    try:
        packer = _THREAD.framer
    except AttributeError:
        packer = _THREAD.framer = msgpack.Packer(use_bin_type=True, autoreset=False)
    try:
        packer.pack(_MSGPACK)
        packer.pack(value)
        framed: bytes = packer.bytes()
    finally:
        packer.reset()
    return framed


def _is_plain(value: object, depth: int, max_depth: int, for_json: bool) -> bool:
    """Whether `value` can be packed as it is: the common case, checked without building a path.

    True only for exact dicts (str keys), lists, str, bool, None, 64-bit ints, finite floats and
    (in msgpack, which stores them as they are) bytes, nested at most `max_depth` deep. Anything
    else (a cycle included, which exceeds the depth) returns False, and the full walk then
    converts it or raises an error naming the path.
    """
    if depth >= max_depth:
        return False
    if type(value) is dict:
        if for_json and len(value) == 1 and next(iter(value)) in _TAGS:
            return False  # a user dict that looks like a tag must be wrapped
        items: Iterable[object] = value.values()
        for key in value:
            if type(key) is not str:
                return False
    elif type(value) is list:
        items = value
    else:
        return False
    for item in items:
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is bytes:
            if for_json:
                return False
        elif kind is float:
            if item - item != 0.0:  # type: ignore[operator]  # inf - inf and nan - nan are nan
                return False
        elif kind is int:
            if not _INT_MIN <= item <= _INT_MAX:  # type: ignore[operator]
                return False
        elif not (kind is dict or kind is list) or not _is_plain(
            item, depth + 1, max_depth, for_json
        ):
            return False
    return True


def _unencodable_text(value: object) -> SerializationError:
    """The error for the first str (or dict key) in `value` that has no UTF-8 form."""
    found = _find_unencodable(value, [])
    if found is None:
        return SerializationError("value holds text that is not valid UTF-8", path="$")
    message, path = found
    return SerializationError(message, path=_format_path(path))


def _find_unencodable(value: object, path: list[str | int]) -> tuple[str, list[str | int]] | None:
    if isinstance(value, str):
        if _encodes(value):
            return None
        return "str contains a lone surrogate and is not valid UTF-8", path
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _encodes(key):
                return f"dict key {key!r} contains a lone surrogate and is not valid UTF-8", path
            found = _find_unencodable(item, [*path, key])
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _find_unencodable(item, [*path, index])
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ext_hook(code: int, data: bytes) -> object:
    if code == _EXT_DATETIME:
        return datetime.fromisoformat(data.decode())
    if code == _EXT_DATE:
        return date.fromisoformat(data.decode())
    if code == _EXT_UUID:
        return UUID(bytes=data)
    if code == _EXT_ELLIPSIS:
        return Ellipsis
    raise DecodeError(f"unknown msgpack extension type {code}")


def _json_hook(obj: dict[str, Any]) -> object:
    if len(obj) != 1:
        return obj
    tag, payload = next(iter(obj.items()))
    if tag == _TAG_DATETIME:
        return datetime.fromisoformat(payload)
    if tag == _TAG_DATE:
        return date.fromisoformat(payload)
    if tag == _TAG_UUID:
        return UUID(payload)
    if tag == _TAG_BYTES:
        return base64.b64decode(payload, validate=True)
    if tag == _TAG_MAP:
        return dict(payload)
    if tag == _TAG_ELLIPSIS:
        return Ellipsis
    return obj


def payload_format(raw: bytes) -> Format:
    """Return the format an encoded value was written in.

    Raises:
        DecodeError: `raw` does not start with a valid header byte.
    """
    if not raw:
        raise DecodeError("empty payload", path="")
    kind = raw[0] & ~_COMPRESSED
    if kind == _MSGPACK:
        return "msgpack"
    if kind == _JSON:
        return "json"
    raise DecodeError(f"unknown payload header 0x{raw[0]:02x}", path="")


def payload_is_compressed(raw: bytes) -> bool:
    """Return whether an encoded value's payload is zlib-compressed (after its header byte).

    Raises:
        DecodeError: `raw` does not start with a valid header byte.
    """
    payload_format(raw)
    return bool(raw[0] & _COMPRESSED)


def json_text(raw: bytes) -> bytes | None:
    """Return the JSON text of an uncompressed JSON-encoded value; `None` for any other value.

    Raises:
        DecodeError: `raw` does not start with a valid header byte.
    """
    payload_format(raw)
    return raw[1:] if raw[0] == _JSON else None


def json_payload(text: bytes) -> bytes:
    """Return the encoded value (uncompressed JSON) whose JSON text is `text` (see `json_text`)."""
    return bytes((_JSON,)) + text


def _plain_model(value: object, max_depth: int, for_json: bool) -> object | None:
    """A pydantic model's JSON dump when it packs as it is (the common case), else None.

    What `_Encoder.walk` returns for such a model, without walking it: a plain dump is never
    rebuilt. Anything else (not a model, a dump that fails or is not plain) gets `None`, and
    the full walk then converts it or raises an error naming the path.
    """
    if not isinstance(value, BaseModel):
        return None
    try:
        dumped = value.model_dump(mode="json")
    except PydanticSerializationError:
        return None
    return dumped if _is_plain(dumped, 0, max_depth, for_json) else None


class Serializer:
    """Encode values to bytes and decode them back.

    Args:
        format: `"msgpack"` (compact, fast; the default) or `"json"` (readable).
        compression: Compress payloads larger than `compression_threshold` with zlib.
        compression_threshold: Smallest payload, in bytes, worth compressing.
        max_size: Largest value accepted, in bytes before compression; also bounds decompression.
        max_depth: Deepest nesting of containers accepted.
    """

    __slots__ = ("compression", "compression_threshold", "format", "max_depth", "max_size")

    def __init__(
        self,
        format: Format = "msgpack",  # noqa: A002  # the AgenticAI Framework state-management API's name for it
        *,
        compression: bool = False,
        compression_threshold: int = 1024,
        max_size: int = DEFAULT_MAX_SIZE,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if format not in ("msgpack", "json"):
            raise InvalidArgumentError(f"format must be 'msgpack' or 'json', not {format!r}")
        if max_size <= 0 or max_depth <= 0 or compression_threshold < 0:
            raise InvalidArgumentError("max_size, max_depth and compression_threshold must be > 0")
        self.format: Format = format
        self.compression = compression
        self.compression_threshold = compression_threshold
        self.max_size = max_size
        self.max_depth = max_depth

    def __repr__(self) -> str:
        return f"Serializer(format={self.format!r}, compression={self.compression})"

    def dumps(self, value: object) -> bytes:
        """Encode `value`, validating all of it first.

        Raises:
            SerializationError: A subclass naming the path of the first unsupported part.
        """
        for_json = self.format == "json"
        plain: object = value
        try:
            if not _is_plain(value, 0, self.max_depth, for_json):
                plain = _plain_model(value, self.max_depth, for_json)
                if plain is None:
                    plain = _Encoder(for_json=for_json, max_depth=self.max_depth).walk(value, 0)
            if for_json:
                framed = bytes((_JSON,)) + json.dumps(
                    plain, ensure_ascii=False, allow_nan=False, separators=(",", ":")
                ).encode("utf-8")
            else:
                framed = _pack_framed(plain)
        except UnicodeEncodeError:
            # A str with a lone surrogate has no UTF-8 form; looked for only when encoding failed.
            raise _unencodable_text(plain) from None
        except RecursionError:
            # Only a max_depth beyond what Python's recursion allows gets here.
            raise TooDeepError(
                "value is nested too deeply for this interpreter to encode", path="$"
            ) from None
        size = len(framed) - 1  # the payload, after its header byte
        if size > self.max_size:
            raise TooLargeError(
                f"encoded value is {size} bytes; the maximum is {self.max_size}", path="$"
            )
        if self.compression and size > self.compression_threshold:
            packed = zlib.compress(memoryview(framed)[1:], 6)
            if len(packed) < size:
                return bytes((framed[0] | _COMPRESSED,)) + packed
        return framed

    def loads(self, raw: bytes) -> Any:
        """Decode bytes written by `dumps` (in either format).

        Raises:
            DecodeError: The bytes are corrupt, truncated, or inflate beyond `max_size`.
        """
        kind = payload_format(raw)
        body = self._inflate(raw) if raw[0] & _COMPRESSED else memoryview(raw)[1:]
        if len(body) > self.max_size:
            raise DecodeError(f"stored value exceeds the maximum size of {self.max_size}", path="")
        try:
            if kind == "json":
                return json.loads(bytes(body), object_hook=_json_hook)
            # timestamp=3: msgpack's own timestamp extension (code -1, which only a foreign
            # writer stores) never reaches ext_hook; read it as an aware datetime, a type we
            # store, instead of leaking a msgpack.Timestamp to the caller.
            return msgpack.unpackb(
                body,
                raw=False,
                ext_hook=_ext_hook,
                strict_map_key=True,
                use_list=True,
                timestamp=3,
            )
        except DecodeError:
            raise
        except Exception as exc:
            # msgpack, json, base64, uuid and datetime raise many types for corrupt input.
            raise DecodeError(f"stored value is corrupt: {type(exc).__name__}", path="") from exc

    def load_model(self, raw: bytes, model: type[M], *, key: str | None = None) -> M:
        """Decode bytes and validate them as `model` (stored at `key`, named in the error).

        Raises:
            DecodeError: The bytes are corrupt or do not validate as `model`; the message
                names the key, the first field at fault (never a value) and what to do.
        """
        try:
            value = self.loads(raw)
        except DecodeError as exc:
            if key is None:
                raise
            raise DecodeError(f"{exc} (at key {key!r})", path="") from exc
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
            field = ".".join(str(part) for part in first["loc"]) or "the record"
            where = f" at {key!r}" if key is not None else ""
            fix = f"agenticstate delete {key!r}" if key is not None else "delete it"
            raise DecodeError(
                f"stored value does not validate as {model.__qualname__}{where}: "
                f"{exc.error_count()} error(s), first {field}: {first['msg']}; it was written "
                f"by another program or a newer release: correct it, or "
                f"delete it ({fix})",
                path="",
            ) from exc

    def _inflate(self, raw: bytes) -> bytes:
        inflater = zlib.decompressobj()
        try:
            body = inflater.decompress(memoryview(raw)[1:], self.max_size + 1)
        except zlib.error as exc:
            raise DecodeError("stored value is not valid zlib data", path="") from exc
        if len(body) > self.max_size or inflater.unconsumed_tail:
            raise DecodeError(
                f"stored value inflates beyond the maximum size of {self.max_size}", path=""
            )
        if not inflater.eof:
            raise DecodeError("stored value is truncated", path="")
        return body


def _unsupported_hint(value: object) -> str:
    """What to store instead of a value of an unsupported type (docs/concepts/values.md)."""
    import dataclasses  # only this message needs them
    import decimal
    import enum
    import os
    from datetime import timedelta

    if dataclasses.is_dataclass(value):
        return "; store dataclasses.asdict(value), or make it a pydantic model"
    if isinstance(value, (set, frozenset)):
        return "; store a list instead, such as sorted(value)"
    if isinstance(value, decimal.Decimal):
        return "; store str(value) to keep it exact, or float(value)"
    if isinstance(value, enum.Enum):
        return "; store value.value, or use a StrEnum or IntEnum"
    if isinstance(value, timedelta):
        return "; store value.total_seconds()"
    if isinstance(value, os.PathLike):
        return "; store str(value)"
    if isinstance(value, complex):
        return "; store [value.real, value.imag]"
    return ""
