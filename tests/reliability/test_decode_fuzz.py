"""The decode path, fuzzed: stored bytes can be anything, and only a DecodeError may come out.

Inputs: random bytes behind every header, mutations of valid encodings (bit flips, truncations,
headers, compression and format switches, damage behind a valid zlib stream), every JSON tag
with garbage payloads, every msgpack extension code, and length, nesting and zlib bombs. They go
through `Serializer.loads` and `load_model`, and, written raw through each backend's API, through
`StateManager.get`, `get_entry`, `update` and `watch`. The file backend's log and snapshot are
fuzzed too: a damaged log is refused, or (damage only at its end, as a crash leaves) opens with
exactly the writes before the damage.

The figures: the hypothesis tests decode 2,000 random (each also compressed) and 3,000 mutated
inputs; the exhaustive lists add 504 JSON-tag and 4,608 extension payloads and 13 bombs; each
backend reads a fixed corpus of 1,804 stored values; the log is reopened after 150 random
corruptions and cut at 40 offsets, the snapshot after 100 random corruptions. Nothing may raise
anything but `DecodeError` (or, opening a store, `BackendError`). The tests at the end are
regressions: bugs this suite found in the file backend, fixed since (malformed records with a
valid checksum, malformed snapshots, a snapshot checksum, any stored bytes in a JSON snapshot).
"""

from __future__ import annotations

import json
import random
import struct
import tempfile
import tracemalloc
import zlib
from dataclasses import dataclass
from datetime import date, datetime
from functools import cache
from pathlib import Path
from types import EllipsisType, NoneType
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agenticstate import (
    BackendError,
    CorruptStoreError,
    DecodeError,
    FileBackend,
    Serializer,
    StateManager,
)
from tests.reliability._bad_payloads import (
    bombs,
    corpus,
    encodings,
    ext_payloads,
    json_tag_payloads,
    mutate,
    zlib_bomb,
)

if TYPE_CHECKING:
    from agenticstate.backends import Backend

SCALARS = (str, int, float, bool, NoneType, datetime, date, UUID, bytes, EllipsisType)


class Record(BaseModel):
    """A model with the kinds of fields the managers store."""

    name: str
    when: datetime
    id: UUID
    tags: list[str] = []
    extra: dict[str, Any] = {}


def _check_decoded(value: object) -> None:
    """A decoded value holds only the types the serializer stores (dict keys: str, or bytes)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            assert all(type(key) in (str, bytes) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            assert type(item) in SCALARS, type(item)


def _decode(serializer: Serializer, raw: bytes) -> object:
    """Decode `raw` and check what came out; a DecodeError is returned, anything else raises."""
    try:
        value = serializer.loads(raw)
    except DecodeError as exc:
        return exc
    _check_decoded(value)
    return value


def _decode_model(serializer: Serializer, raw: bytes) -> None:
    try:
        record = serializer.load_model(raw, Record)
    except DecodeError:
        return
    assert isinstance(record, Record)


@settings(max_examples=2000, deadline=None)
@given(
    header=st.sampled_from([0x01, 0x02, 0x81, 0x82]) | st.integers(0, 255),
    body=st.binary(max_size=300),
)
def test_random_bytes_decode_or_raise_decode_error(header: int, body: bytes) -> None:
    """Random bytes behind any header byte: a value of a stored type, or DecodeError."""
    raw = bytes((header,)) + body
    serializer = Serializer(max_size=10_000)
    _decode(serializer, raw)
    _decode_model(serializer, raw)
    compressed = bytes((header | 0x80,)) + zlib.compress(body)
    _decode(serializer, compressed)


@cache
def _valid() -> list[bytes]:
    return encodings()


@settings(max_examples=3000, deadline=None)
@given(index=st.integers(min_value=0), rng=st.randoms(use_true_random=False))
def test_mutated_encodings_decode_or_raise_decode_error(index: int, rng: random.Random) -> None:
    """Bit flips, truncations, header, format and compression switches, damage behind zlib."""
    valid = _valid()
    raw = mutate(valid[index % len(valid)], rng)
    serializer = Serializer(max_size=100_000)
    _decode(serializer, raw)
    _decode_model(serializer, raw)


def test_every_json_tag_with_garbage_payloads() -> None:
    """`{"$dt": "garbage"}` and the like, for every tag, at the top and nested: never a crash."""
    payloads = json_tag_payloads()
    outcomes = [_decode(Serializer(), raw) for raw in payloads]
    assert len(payloads) == 504
    assert sum(isinstance(outcome, DecodeError) for outcome in outcomes) > 100
    garbage_datetime = b"\x02" + json.dumps({"$dt": "garbage"}).encode()
    assert isinstance(_decode(Serializer(), garbage_datetime), DecodeError)


def test_every_msgpack_extension_code() -> None:
    """Of all 256 extension codes only ours (1-4) decode, and msgpack's timestamp as a datetime."""
    payloads = ext_payloads()
    assert len(payloads) == 256 * 9 * 2
    for code, data, raw in payloads:
        outcome = _decode(Serializer(), raw)
        if code == -1 and len(data) in (4, 8, 12) and not isinstance(outcome, DecodeError):
            inner: object = outcome
            if isinstance(outcome, dict):
                inner = outcome["a"][0]
            assert isinstance(inner, datetime)
            assert inner.tzinfo is not None
        elif code not in (1, 2, 3, 4):
            assert isinstance(outcome, DecodeError), (code, raw)


@pytest.mark.parametrize("raw", bombs(1_000_000), ids=lambda raw: raw[:6].hex())
def test_bombs_are_refused_within_bounded_memory(raw: bytes) -> None:
    """Length, nesting and zlib bombs: DecodeError (or a value), never more than ~max_size held."""
    serializer = Serializer(max_size=1_000_000)
    tracemalloc.start()
    try:
        outcome = _decode(serializer, raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * serializer.max_size + 16 * len(raw)
    if raw[:1] in (b"\x81", b"\x82") or raw[1:2] in (b"\xdd", b"\xdf", b"\xdb", b"\xc6"):
        assert isinstance(outcome, DecodeError)


def test_zlib_bomb_is_refused_without_inflating() -> None:
    """A 64 MB zlib bomb (about 64 KB stored) is refused while holding at most max_size + 1."""
    bomb = zlib_bomb(64 * 1024 * 1024)
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="inflates beyond the maximum size of 1000000"):
            Serializer(max_size=1_000_000).loads(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3_000_000


# Through the public API: raw bytes written with the backend, read with StateManager.


@pytest.fixture(scope="module")
def stored_corpus() -> list[bytes]:
    """1,804 hostile stored values (mutations, random bytes, tags, ext codes, bombs)."""
    return corpus(20261123, mutated=1000, random_count=300, max_size=16 * 1024 * 1024)


@dataclass
class Outcome:
    """What reading one stored value gave: its repr, or that it raised DecodeError."""

    text: str

    @classmethod
    def of(cls, value: object) -> Outcome:
        if isinstance(value, DecodeError):  # or a subclass: the manager may know more
            return cls("raised DecodeError")
        return cls(repr(value))


async def test_state_manager_reads_corrupt_bytes_as_decode_error(
    backend: Backend, stored_corpus: list[bytes]
) -> None:
    """get/get_entry/get_many/update on hostile bytes: loads' value or DecodeError; no change."""
    keys = [f"raw:{index}" for index in range(len(stored_corpus))]
    await backend.set_many(list(zip(keys, stored_corpus, strict=True)))
    async with StateManager(backend=backend, close_backend=False) as state:
        await state.save("good", {"still": "readable"})
        serializer = state.serializer
        for key, raw in zip(keys, stored_corpus, strict=True):
            try:
                got: object = await state.get(key)
            except DecodeError as exc:
                got = exc
            assert Outcome.of(got) == Outcome.of(_decode(serializer, raw)), key
        refused = [
            key
            for key, raw in zip(keys, stored_corpus, strict=True)
            if isinstance(_decode(serializer, raw), DecodeError)
        ]
        assert len(refused) > len(keys) // 2
        for key in refused[:40]:
            with pytest.raises(DecodeError):
                await state.get_entry(key)
            with pytest.raises(DecodeError):
                await state.update(key, lambda value: value)
            entry = await backend.get(key)
            assert entry is not None
            assert entry.version == 1
        with pytest.raises(DecodeError):
            await state.get_many([*refused[:5], "good"])
        assert await state.get("good") == {"still": "readable"}
        assert len(await state.list_keys("raw:*")) == len(keys)


async def test_watch_survives_a_corrupt_change(backend: Backend) -> None:
    """A change carrying corrupt bytes raises DecodeError from the watch; the next one arrives."""
    async with (
        StateManager(backend=backend, close_backend=False) as state,
        state.watch("w:*") as changes,
    ):
        # One hash tag: on a cluster, changes to keys of different shards have no order.
        await backend.set("w:{t}:bad", b"\x01\xc1")
        await state.save("w:{t}:good", 1)
        with anyio.fail_after(5), pytest.raises(DecodeError):
            await changes.__anext__()
        with anyio.fail_after(5):
            change = await changes.__anext__()
        assert (change.key, change.new_value) == ("w:{t}:good", 1)


async def test_file_store_keeps_hostile_values_across_reopen(
    tmp_path: Path, stored_corpus: list[bytes]
) -> None:
    """Hostile values are opaque bytes to the file store: identical after close and reopen."""
    items = [(f"raw:{index}", raw) for index, raw in enumerate(stored_corpus)]
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        await backend.set_many(items)
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        entries = await backend.get_many([key for key, _ in items])
        assert [entry.value if entry else None for entry in entries] == [raw for _, raw in items]
        await backend.set("after", b"\x011")


# The file backend's log: damaged anywhere, it is refused or (damage at its end only) opens with
# exactly the writes before the damage.

LOG_WRITES: list[tuple[str, bytes | None]] = [
    ("a", b"\x011"),
    ("b", b'\x02{"x":1}'),
    ("a", b"\x012"),
    ("c", b"\x01" + b"\xa5hello" * 50),
    ("b", None),
    ("d", bytes(range(256))),
    ("a", b"\x013"),
    ("e", b"\x02[1,2,3]"),
    ("c", None),
    ("f", b"\x01\xc0"),
]

State = dict[str, tuple[bytes, int]]


@dataclass(frozen=True)
class WrittenLog:
    """A log of `LOG_WRITES`, one frame each, and the state after each prefix of them."""

    data: bytes
    frame_ends: list[int]
    states: list[State]


async def _write_log(directory: Path) -> WrittenLog:
    states: list[State] = [{}]
    async with FileBackend(base_path=directory, auto_save=False) as backend:
        for key, value in LOG_WRITES:
            if value is None:
                await backend.delete(key)
            else:
                await backend.set(key, value)
            states.append(await _read_state(backend))
        data = (directory / "state.json.log").read_bytes()
    ends = []
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from(">I", data, offset)
        offset += 8 + length
        ends.append(offset)
    return WrittenLog(data, ends, states)


async def _read_state(backend: FileBackend) -> State:
    keys = sorted([key async for key in backend.scan("*")])
    entries = await backend.get_many(keys)
    return {entry.key: (entry.value, entry.version) for entry in entries if entry is not None}


@cache
def _written_log() -> WrittenLog:
    with tempfile.TemporaryDirectory() as directory:
        return anyio.run(_write_log, Path(directory))


def _reopen(data: bytes) -> tuple[State, State] | BackendError:
    """Open a store whose log is `data`: its state, and its state after one more write."""

    async def main(directory: Path) -> tuple[State, State]:
        (directory / "state.json.log").write_bytes(data)
        async with FileBackend(base_path=directory, durability="none", auto_save=False) as store:
            opened = await _read_state(store)
            await store.set("new", b"\x01\xc3")
        async with FileBackend(base_path=directory, durability="none", auto_save=False) as store:
            return opened, await _read_state(store)

    with tempfile.TemporaryDirectory() as directory:
        try:
            return anyio.run(main, Path(directory))
        except BackendError as exc:
            return exc


def _first_damaged_byte(log: WrittenLog, damaged: bytes) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(log.data, damaged, strict=False)) if a != b),
        min(len(log.data), len(damaged)),
    )


def _expected_after(log: WrittenLog, damaged: bytes) -> State:
    """The state of the frames that lie wholly before the first damaged byte."""
    first = _first_damaged_byte(log, damaged)
    return log.states[sum(1 for end in log.frame_ends if end <= first)]


def _damage(data: bytes, rng: random.Random) -> bytes:
    roll = rng.random()
    buffer = bytearray(data)
    if roll < 0.35:
        for _ in range(rng.randint(1, 3)):
            buffer[rng.randrange(len(buffer))] ^= 1 << rng.randrange(8)
    elif roll < 0.55:
        start = rng.randrange(len(buffer))
        buffer[start : start + rng.randint(1, 32)] = rng.randbytes(rng.randint(1, 32))
    elif roll < 0.7:
        start = rng.randrange(len(buffer))
        end = start + rng.randint(1, 64)
        buffer[start:end] = bytes(len(buffer[start:end]))
    elif roll < 0.85:
        del buffer[rng.randrange(len(buffer)) :]
    else:
        buffer += rng.randbytes(rng.randint(1, 40))
    return bytes(buffer)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_damaged_log_is_refused_or_replays_exactly_the_writes_before_the_damage(
    rng: random.Random,
) -> None:
    """A damaged log is refused untouched (CorruptStoreError) if any original frame survives
    after the damage; otherwise it opens with exactly the frames before it, and writes on."""
    log = _written_log()
    assert len(log.frame_ends) == len(LOG_WRITES)
    damaged = _damage(log.data, rng)
    outcome = _reopen(damaged)
    first = _first_damaged_byte(log, damaged)
    starts = [0, *log.frame_ends[:-1]]
    survivors = [
        log.data[start:end]
        for start, end in zip(starts, log.frame_ends, strict=True)
        if start > first and log.data[start:end] in damaged[first:]
    ]
    if isinstance(outcome, BackendError):
        assert isinstance(outcome, CorruptStoreError), outcome
        return
    assert not survivors, "a frame after the damage was cut away"
    opened, after_write = outcome
    expected = _expected_after(log, damaged)
    assert opened == expected
    assert after_write == {**expected, "new": (b"\x01\xc3", 1)}


def test_every_truncation_point_keeps_the_whole_frames() -> None:
    """A log cut at any of 40 offsets (frame boundaries included) keeps the frames before it."""
    log = _written_log()
    rng = random.Random(5)
    offsets = sorted({0, *log.frame_ends, *rng.sample(range(len(log.data)), 30)})
    for offset in offsets:
        outcome = _reopen(log.data[:offset])
        assert not isinstance(outcome, BackendError), outcome
        assert outcome[0] == _expected_after(log, log.data[:offset])


def _frame(records: list[list[Any]]) -> bytes:
    packed: bytes = msgpack.packb(records, use_bin_type=True)
    body = b"\x00" + packed
    return struct.pack(">II", len(body), zlib.crc32(body)) + body


# Records with a valid checksum but malformed fields: a bug or a foreign writer, not a torn write.
MALFORMED_RECORDS = [
    pytest.param([2, "s", 5, b"x", 1, 0, 0, None], id="key-not-str"),
    pytest.param([2, "s", "k", b"x", 1, "x", 0, None], id="time-not-int"),
    pytest.param([2, "s", "k", "abc", 1, 0, 0, None], id="value-str"),
    pytest.param([2, "s", "k", 7, 1, 0, 0, None], id="value-int"),
    pytest.param(["x", "s", "k", b"x", 1, 0, 0, None], id="lsn-not-int"),
    pytest.param([2, "s", "k", b"x", "v", 0, 0, None], id="version-not-int"),
    pytest.param([2, "s", "k", b"x", 1, 10**18, 10**18, None], id="time-out-of-range"),
    pytest.param([2, "zz", "k", b"x", 1, 0, 0, None], id="unknown-op"),
    pytest.param([2, "s", "a\x00b", b"x", 1, 0, 0, None], id="invalid-key"),
]


@pytest.mark.parametrize("record", MALFORMED_RECORDS)
async def test_malformed_log_record_is_a_backend_error(tmp_path: Path, record: list[Any]) -> None:
    """A checksummed log record with wrong field types refuses to open with BackendError."""
    good = [1, "s", "ok", b"\x011", 1, 0, 0, None]
    (tmp_path / "state.json.log").write_bytes(_frame([good]) + _frame([record]))
    with pytest.raises(BackendError, match="log"):
        await FileBackend(base_path=tmp_path, durability="none").open()


def _snapshot(entries: object, **extra: object) -> bytes:
    document = {"magic": "agenticstate-snapshot", "format_version": 1, "lsn": 1}
    return json.dumps({**document, "entries": entries, **extra}).encode()


MALFORMED_SNAPSHOTS = [
    pytest.param(msgpack.packb([1, 2]), id="msgpack-list"),
    pytest.param(_snapshot([1]), id="entries-list"),
    pytest.param(_snapshot({}, indexes=[1]), id="indexes-list"),
    pytest.param(b'{"magic": "agenticstate-snapshot", "lsn": 1e400, "entries": {}}', id="lsn-inf"),
    pytest.param(
        _snapshot({"k": {"version": 1, "created": 0, "updated": 0, "expires": 10**20, "json": 1}}),
        id="expires-huge",
    ),
    pytest.param(
        _snapshot(
            {"k": {"version": 1, "created": 1e300, "updated": 0, "expires": None, "json": 1}}
        ),
        id="created-huge",
    ),
]


@pytest.mark.parametrize("raw", MALFORMED_SNAPSHOTS)
async def test_malformed_snapshot_is_a_backend_error(tmp_path: Path, raw: bytes) -> None:
    """A snapshot that parses but has the wrong shape refuses to open with BackendError."""
    (tmp_path / "state.json").write_bytes(raw)
    with pytest.raises(BackendError, match="corrupt"):
        await FileBackend(base_path=tmp_path, durability="none").open()


@cache
def _snapshot_bytes() -> bytes:
    async def main(directory: Path) -> bytes:
        async with FileBackend(base_path=directory) as backend:
            for key, value in LOG_WRITES:
                if value is None:
                    await backend.delete(key)
                else:
                    await backend.set(key, value, ttl=None)
        return (directory / "state.json").read_bytes()

    with tempfile.TemporaryDirectory() as directory:
        return anyio.run(main, Path(directory))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_damaged_snapshot_opens_or_raises_backend_error(rng: random.Random) -> None:
    """Random damage to the JSON snapshot: a clean open or BackendError, nothing else."""

    damaged = _damage(_snapshot_bytes(), rng)

    async def main(directory: Path) -> None:
        (directory / "state.json").write_bytes(damaged)
        async with FileBackend(base_path=directory, durability="none", auto_save=False) as store:
            await _read_state(store)

    with tempfile.TemporaryDirectory() as directory:
        try:
            anyio.run(main, Path(directory))
        except BackendError as exc:
            refused: BackendError | None = exc
        else:
            refused = None
    assert refused is None or "corrupt" in str(refused)


async def test_damaged_snapshot_value_is_detected(tmp_path: Path) -> None:
    """One changed digit in the snapshot (a version) is damage: opening raises BackendError."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("a", b"\x011")
        await backend.set("a", b"\x012")
        await backend.set("a", b"\x013")
    snapshot = (tmp_path / "state.json").read_bytes()
    assert snapshot.count(b'"version": 3') == 1
    (tmp_path / "state.json").write_bytes(snapshot.replace(b'"version": 3', b'"version": 7'))
    with pytest.raises(BackendError, match="corrupt"):
        await FileBackend(base_path=tmp_path, durability="none").open()


@pytest.mark.parametrize(
    "raw",
    [b"\x02NaN", b"\x02[Infinity]", b"\x02" + b"[" * 5000 + b"]" * 5000],
    ids=["nan", "infinity", "deep"],
)
async def test_file_snapshot_accepts_any_stored_bytes(tmp_path: Path, raw: bytes) -> None:
    """Values are opaque bytes to the store: any of them can be snapshotted (flush succeeds)."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("odd", raw)
        await backend.flush()
        entry = await backend.get("odd")
        assert entry is not None
        assert entry.value == raw
