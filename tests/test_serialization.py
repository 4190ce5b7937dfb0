"""Serialization: supported values round-trip, unsupported ones are refused with a path."""

from __future__ import annotations

import contextlib
import zlib
from datetime import UTC, date, datetime
from enum import IntEnum, StrEnum
from typing import Any
from unittest import mock
from uuid import uuid4

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agenticstate import (
    CycleError,
    DecodeError,
    InvalidArgumentError,
    InvalidNumberError,
    NonStringKeyError,
    SerializationError,
    Serializer,
    TooDeepError,
    TooLargeError,
    UnsupportedTypeError,
)
from agenticstate.serialization import payload_format

FORMATS = ["msgpack", "json"]


class Color(StrEnum):
    RED = "red"


class Level(IntEnum):
    HIGH = 3


class Item(BaseModel):
    name: str
    when: datetime
    color: Color = Color.RED


def _cyclic_dict() -> dict[str, Any]:
    value: dict[str, Any] = {"a": {}}
    value["a"]["self"] = value
    return value


def _cyclic_list() -> list[Any]:
    value: list[Any] = [1]
    value.append([value])
    return value


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("value", "error", "path"),
    [
        ({"a": [1, 2, {3}]}, UnsupportedTypeError, "$.a[2]"),
        ({"fn": print}, UnsupportedTypeError, "$.fn"),
        ([object()], UnsupportedTypeError, "$[0]"),
        ({"x": frozenset()}, UnsupportedTypeError, "$.x"),
        ({"n": float("nan")}, InvalidNumberError, "$.n"),
        ([float("inf")], InvalidNumberError, "$[0]"),
        ({"big": 2**64}, InvalidNumberError, "$.big"),
        ({"small": -(2**63) - 1}, InvalidNumberError, "$.small"),
        ({"a": {1: "x"}}, NonStringKeyError, "$.a"),
        ({("t",): 1}, NonStringKeyError, "$"),
        (_cyclic_dict(), CycleError, "$.a.self"),
        (_cyclic_list(), CycleError, "$[1][0]"),
        (_nested(100), TooDeepError, "$" + "[0]" * 64),
    ],
)
def test_unsupported_values_name_the_path(
    fmt: Any, value: Any, error: type[SerializationError], path: str
) -> None:
    """Each unsupported value raises its own SerializationError subclass naming the path."""
    with pytest.raises(error) as caught:
        Serializer(fmt).dumps(value)
    assert caught.value.path == path
    assert path in str(caught.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_too_large_is_refused(fmt: Any) -> None:
    """A value encoding beyond max_size raises TooLargeError."""
    with pytest.raises(TooLargeError):
        Serializer(fmt, max_size=100).dumps("x" * 200)


@pytest.mark.parametrize("fmt", FORMATS)
def test_subclasses_store_as_plain_values(fmt: Any) -> None:
    """StrEnum, IntEnum and models are stored as their plain values."""
    serializer = Serializer(fmt)
    when = datetime(2026, 1, 1, tzinfo=UTC)
    out = serializer.loads(
        serializer.dumps({"c": Color.RED, "l": Level.HIGH, "m": Item(name="n", when=when)})
    )
    assert out == {
        "c": "red",
        "l": 3,
        "m": {"name": "n", "when": "2026-01-01T00:00:00Z", "color": "red"},
    }
    assert type(out["c"]) is str
    assert type(out["l"]) is int
    assert serializer.load_model(serializer.dumps(Item(name="n", when=when)), Item).when == when


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_model_refuses_invalid_stored_data(fmt: Any) -> None:
    """Stored data that does not validate as the model raises DecodeError."""
    serializer = Serializer(fmt)
    with pytest.raises(DecodeError):
        serializer.load_model(serializer.dumps({"name": 1}), Item)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compression_round_trips_and_shrinks(fmt: Any) -> None:
    """Compressed values are smaller and read back equal, in either format."""
    value = {"text": "abc" * 5000, "n": list(range(100))}
    plain = Serializer(fmt).dumps(value)
    packed = Serializer(fmt, compression=True).dumps(value)
    assert len(packed) < len(plain) / 5
    assert Serializer(fmt).loads(packed) == value


def test_either_format_reads_the_other() -> None:
    """A serializer decodes values written in the other format (the header says which)."""
    value = {"when": datetime(2026, 3, 4, 5, 6), "id": uuid4(), "b": b"\x00"}  # noqa: DTZ001
    as_json = Serializer("json").dumps(value)
    as_msgpack = Serializer("msgpack").dumps(value)
    assert payload_format(as_json) == "json"
    assert payload_format(as_msgpack) == "msgpack"
    assert Serializer("msgpack").loads(as_json) == value
    assert Serializer("json").loads(as_msgpack) == value


def test_json_payload_is_readable() -> None:
    """JSON payloads are plain UTF-8 JSON after the header byte."""
    raw = Serializer("json").dumps({"status": "running", "day": date(2026, 1, 2)})
    assert raw[1:].decode() == '{"status":"running","day":{"$date":"2026-01-02"}}'


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x07whatever",
        b"\x01\xc1",  # msgpack: reserved byte
        b"\x01\x92\x01",  # msgpack: truncated array
        b"\x02{not json",
        b'\x02{"$uuid": "nope"}',
        b'\x02{"$b64": "!!!"}',
        b'\x02{"$dt": 5}',
        b"\x81garbage",  # compressed flag with bad zlib data
        b"\x81" + zlib.compress(b"\x92\x01")[:-3],  # truncated zlib stream
        b"\x01" + msgpack.packb(msgpack.ExtType(99, b"x")),
        b"\x01" + msgpack.packb(msgpack.ExtType(3, b"short")),
    ],
)
def test_corrupt_bytes_raise_decode_error(raw: bytes) -> None:
    """Corrupt, truncated or unknown stored bytes raise DecodeError, never something else."""
    with pytest.raises(DecodeError):
        Serializer().loads(raw)


def test_compression_bomb_is_refused() -> None:
    """A payload that inflates past max_size is refused without inflating all of it."""
    bomb = b"\x81" + zlib.compress(b"\x00" * 50_000_000, 9)
    assert len(bomb) < 100_000
    with pytest.raises(DecodeError, match="inflates beyond"):
        Serializer(max_size=1_000_000).loads(bomb)


def test_msgpack_length_bomb_is_refused() -> None:
    """A msgpack header claiming a huge array in a tiny payload is refused."""
    with pytest.raises(DecodeError):
        Serializer().loads(b"\x01\xdd\xff\xff\xff\xff")


@pytest.mark.parametrize(
    "kwargs", [{"format": "xml"}, {"max_size": 0}, {"max_depth": -1}, {"compression_threshold": -1}]
)
def test_bad_serializer_options(kwargs: dict[str, Any]) -> None:
    """Invalid options raise InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError):
        Serializer(**kwargs)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.binary(max_size=20)
    | st.datetimes()
    | st.datetimes(timezones=st.just(UTC))
    | st.dates()
    | st.uuids(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=json_values, fmt=st.sampled_from(FORMATS), compression=st.booleans())
def test_round_trip_property(value: Any, fmt: Any, compression: bool) -> None:
    """Any supported value reads back equal, in both formats, compressed or not."""
    serializer = Serializer(fmt, compression=compression, compression_threshold=0)
    assert serializer.loads(serializer.dumps(value)) == value


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_decode_fuzz_only_raises_decode_error(raw: bytes) -> None:
    """Random bytes either decode or raise DecodeError: no other exception escapes."""
    with contextlib.suppress(DecodeError):
        Serializer(max_size=10_000).loads(raw)


class _Step(BaseModel):
    result: Any = None


class _Run(BaseModel):
    steps: dict[int, _Step] = {}


class _Opaque:
    """Not a value the store knows."""


def test_a_model_error_names_the_value_at_fault_not_a_typed_int_key() -> None:
    """A model whose `dict[int, Model]` field holds an unstorable value deep inside is refused
    with the path of that value (`$.steps.1.result`), as JSON mode would name the keys."""
    with pytest.raises(UnsupportedTypeError) as caught:
        Serializer().dumps(_Run(steps={1: _Step(result=_Opaque())}))
    assert caught.value.path == "$.steps.1.result"
    assert " at $.steps.1.result" in str(caught.value)


def test_bytes_take_the_plain_path_in_msgpack_only() -> None:
    """A tree holding bytes (a LangGraph `[type, bytes]` pair) skips the full walk in msgpack,
    where bytes are stored as they are, and takes it in JSON, where they are spelled in base64."""
    from agenticstate.serialization import _is_plain

    pair = {"type": "msgpack", "data": b"\x81\xa1a\x01", "nested": [[b"", "x"]]}
    assert _is_plain(pair, 0, 64, for_json=False)
    assert not _is_plain(pair, 0, 64, for_json=True)
    for view in (bytearray(b"x"), memoryview(b"x")):  # not exactly bytes: the walk converts them
        assert not _is_plain([view], 0, 64, for_json=False)


@settings(max_examples=200, deadline=None)
@given(value=json_values, fmt=st.sampled_from(FORMATS))
def test_the_plain_path_encodes_as_the_full_walk_does(value: Any, fmt: Any) -> None:
    """Any value encodes to the same bytes with the plain check as with the full walk alone."""
    from agenticstate import serialization

    fast = Serializer(fmt).dumps(value)
    with mock.patch.object(serialization, "_is_plain", return_value=False):
        walked = Serializer(fmt).dumps(value)
    assert fast == walked


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_encode_leaves_nothing_for_the_next(fmt: Any) -> None:
    """A value refused halfway through packing (a lone surrogate deep inside) leaves the
    reused packer empty: the next value encodes to exactly its own bytes."""
    serializer = Serializer(fmt)
    expected = serializer.dumps({"ok": [1, "two"]})
    with pytest.raises(SerializationError):
        serializer.dumps({"a": "x" * 100, "b": ["\ud800"]})
    assert serializer.dumps({"ok": [1, "two"]}) == expected
    assert serializer.loads(expected) == {"ok": [1, "two"]}
