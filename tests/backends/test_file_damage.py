"""Damage to a file store's files: refused, never silently cut; and repaired on request.

A crash can only tear the end of the log. Every other damage (a flipped bit, a zeroed run, a
cut in the middle of the log or anywhere in the snapshot) must either leave the store opening
with exactly its acknowledged writes, or be refused with `CorruptStoreError` with the files left
byte for byte as they were. The matrix below damages each region of each frame of a log (its
length, checksum, flags, payload start, middle and end) and of snapshots in both formats, and
checks that rule for every case. `FileBackend.repair` then salvages around the damage.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import anyio
import pytest

from agenticstate import CorruptStoreError, NotFoundError
from agenticstate.backends import FileBackend

State = dict[str, bytes]
Damage = Literal["flip", "flip-low", "zero", "truncate"]
DAMAGES: list[Damage] = ["flip", "flip-low", "zero", "truncate"]


@dataclass(frozen=True)
class Written:
    """A store's directory as written: its files, the frames' ends, the state after each."""

    files: dict[str, bytes]
    frame_ends: list[int]
    states: list[State]


async def _state(backend: FileBackend) -> State:
    keys = [key async for key in backend.scan("*")]
    entries = await backend.get_many(keys)
    state = {entry.key: entry.value for entry in entries if entry is not None}
    for name in ("idx",):
        for member, score in await backend.index_range(name):
            state[f"{name}/{member}"] = repr(score).encode()
    return state


def _frame_ends(log: bytes) -> list[int]:
    ends, offset = [], 0
    while offset < len(log):
        (length,) = struct.unpack_from(">I", log, offset)
        offset += 8 + length
        ends.append(offset)
    return ends


async def _write(
    directory: Path, file_format: Literal["json", "msgpack"], compressed: bool
) -> Written:
    """A snapshot of 20 keys and an index, then 12 frames in the log (writes, deletes, index)."""
    options = {"format": file_format, "compression": compressed, "auto_save": False}
    async with FileBackend(base_path=directory, **options) as backend:  # type: ignore[arg-type]
        await backend.set_many([(f"snap:{n}", f"\x01value {n}".encode() * 3) for n in range(20)])
        await backend.index_add("idx", {"m1": 1.0, "m2": 2.5})
        await backend.flush()
        states = [await _state(backend)]
        for n in range(12):
            if n % 4 == 3:
                await backend.delete(f"snap:{n}")
            elif n % 4 == 2:
                await backend.index_add("idx", {f"m{n}": float(n)})
            else:
                await backend.set(f"log:{n}", bytes([1, n]) + b"x" * (40 * n))
            states.append(await _state(backend))
        backend._write_snapshot = lambda *args: None  # type: ignore[method-assign]  # as a crash would
    files = _on_disk(directory)
    name = f"state.{file_format}"
    return Written(files, _frame_ends(files[f"{name}.log"]), states)


@cache
def _written(file_format: Literal["json", "msgpack"] = "json", compressed: bool = False) -> Written:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        return anyio.run(_write, Path(directory), file_format, compressed)


def _damage(data: bytes, at: int, damage: Damage) -> bytes:
    buffer = bytearray(data)
    if damage == "flip":
        buffer[at] ^= 0x10
    elif damage == "flip-low":
        buffer[at] ^= 0x01  # a digit stays a digit: "21" becomes "31"
    elif damage == "zero":
        buffer[at : at + 16] = bytes(len(buffer[at : at + 16]))
    else:
        del buffer[at:]
    return bytes(buffer)


def _open(
    directory: Path, file_format: Literal["json", "msgpack"], compressed: bool
) -> State | CorruptStoreError:
    async def main() -> State:
        async with FileBackend(
            base_path=directory,
            format=file_format,
            compression=compressed,
            durability="none",
        ) as backend:
            return await _state(backend)

    try:
        return anyio.run(main)
    except CorruptStoreError as exc:
        return exc


def _place(directory: Path, files: dict[str, bytes]) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)


def _on_disk(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.suffix != ".lock"}


def _log_points(ends: list[int]) -> list[tuple[str, int]]:
    """Each region of the first, a middle and the last frame: (name, offset)."""
    points = []
    for index in (0, len(ends) // 2, len(ends) - 1):
        start = ends[index - 1] if index else 0
        end = ends[index]
        where = "first" if index == 0 else "last" if index == len(ends) - 1 else "middle"
        points += [
            (f"{where}-length", start + 2),
            (f"{where}-checksum", start + 5),
            (f"{where}-flags", start + 8),
            (f"{where}-payload-start", start + 9),
            (f"{where}-payload-middle", (start + 9 + end) // 2),
            (f"{where}-last-byte", end - 1),
        ]
    return points


LOG_CASES = [
    pytest.param(point, damage, id=f"{name}-{damage}")
    for name, point in _log_points(_written().frame_ends)
    for damage in DAMAGES
]


@pytest.mark.parametrize(("point", "damage"), LOG_CASES)
def test_log_damage_is_refused_or_loses_at_most_a_torn_last_frame(
    tmp_path: Path, point: int, damage: Damage
) -> None:
    """Damaging any region of a log frame refuses to open (files untouched), unless it is what
    a crash leaves (the end cut off): then exactly the frames before the cut are kept."""
    written = _written()
    log_name = "state.json.log"
    damaged = {**written.files, log_name: _damage(written.files[log_name], point, damage)}
    directory = tmp_path / "store"
    _place(directory, damaged)
    outcome = _open(directory, "json", False)
    whole_before = sum(1 for end in written.frame_ends if end <= point)
    if damage == "truncate":
        assert outcome == written.states[whole_before]
    else:
        assert isinstance(outcome, CorruptStoreError), (point, damage, outcome)
        assert "damaged at byte" in str(outcome)
        assert _on_disk(directory) == damaged  # left exactly as it was


def _snapshot_points(snapshot: bytes) -> list[tuple[str, int]]:
    points = [("first-byte", 0), ("last-byte", len(snapshot) - 1)]
    points += [(f"at-{n}-of-16", len(snapshot) * n // 16) for n in range(1, 16)]
    # The first byte of each field's value: `"lsn": 21` in JSON, `lsn` then the int in msgpack.
    is_json = snapshot[:1] == b"{"
    for field in (b"lsn", b"checksum", b"header_checksum", b"journal", b"indexes", b"entries"):
        at = snapshot.find(b'"' + field + b'"' if is_json else field)
        if at >= 0:
            value = at + len(field) + (4 if is_json else 1)
            points += [(f"{field.decode()}-value", value), (f"{field.decode()}-value+1", value + 1)]
    return points


SNAPSHOT_STORES: list[tuple[Literal["json", "msgpack"], bool]] = [
    ("json", False),
    ("msgpack", False),
    ("json", True),
]
SNAPSHOT_CASES = [
    pytest.param(
        file_format,
        compressed,
        point,
        damage,
        id=f"{file_format}{'-z' if compressed else ''}-{name}-{damage}",
    )
    for file_format, compressed in SNAPSHOT_STORES
    for name, point in _snapshot_points(
        _written(file_format, compressed).files[f"state.{file_format}"]
    )
    for damage in DAMAGES
]


@pytest.mark.parametrize(("file_format", "compressed", "point", "damage"), SNAPSHOT_CASES)
def test_snapshot_damage_is_refused_or_harmless(
    tmp_path: Path,
    file_format: Literal["json", "msgpack"],
    compressed: bool,
    point: int,
    damage: Damage,
) -> None:
    """Damage anywhere in a snapshot (JSON, msgpack, compressed) is refused with the files
    untouched, or changes nothing that is read: never a store with fewer or other entries."""
    written = _written(file_format, compressed)
    name = f"state.{file_format}"
    damaged = {**written.files, name: _damage(written.files[name], point, damage)}
    directory = tmp_path / "store"
    _place(directory, damaged)
    outcome = _open(directory, file_format, compressed)
    if isinstance(outcome, CorruptStoreError):
        assert "snapshot" in str(outcome)
        assert _on_disk(directory) == damaged
    else:
        assert outcome == written.states[-1], (point, damage)


async def test_a_flipped_bit_early_in_the_log_is_refused_and_repair_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """One bit flipped at 10% of a 200-write log: opening refuses (it used to keep 20 keys and
    cut 180), the log is untouched, and repair keeps the 199 intact writes."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        for n in range(200):
            await backend.set(f"k{n:03}", b"\x01" + bytes([n]) * 20)
        backend._write_snapshot = lambda *args: None  # type: ignore[method-assign]
    log_path = tmp_path / "state.json.log"
    original = log_path.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 10] ^= 0x04
    log_path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptStoreError, match="damaged at byte"):
        await FileBackend(base_path=tmp_path).open()
    assert log_path.read_bytes() == bytes(damaged)

    report = await FileBackend(base_path=tmp_path).repair()
    assert report.records_kept == 199
    assert report.frames_kept == 199
    assert len(report.dropped) == 1
    assert report.damaged_copy is not None
    assert report.damaged_copy.read_bytes() == bytes(damaged)
    async with FileBackend(base_path=tmp_path) as backend:
        keys = [key async for key in backend.scan("*")]
        assert len(keys) == 199
        await backend.set("after", b"\x011")  # and it takes writes again
    again = await FileBackend(base_path=tmp_path).repair()
    assert again.damaged_copy is None  # nothing left to repair: nothing changed


async def test_repair_of_a_sound_store_changes_nothing(tmp_path: Path) -> None:
    """A log with no damage is left alone by repair; a missing store is not created."""
    with pytest.raises(NotFoundError):
        await FileBackend(base_path=tmp_path / "missing").repair()
    assert not (tmp_path / "missing").exists()
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        await backend.set("a", b"\x011")
        backend._write_snapshot = lambda *args: None  # type: ignore[method-assign]
    before = _on_disk(tmp_path)
    report = await FileBackend(base_path=tmp_path).repair()
    assert (report.damaged_copy, report.dropped, report.frames_kept) == (None, [], 1)
    assert _on_disk(tmp_path) == before


async def test_repair_refuses_a_damaged_snapshot_and_a_store_in_use(tmp_path: Path) -> None:
    """Repair cannot rebuild a snapshot (it says so), and never runs on an open store."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("a", b"\x011")
        with pytest.raises(Exception, match="in use"):
            await FileBackend(base_path=tmp_path).repair()
    snapshot = tmp_path / "state.json"
    snapshot.write_bytes(
        snapshot.read_bytes().replace(b"agenticstate-snapshot", b"agenticstate-snapshoT")
    )
    with pytest.raises(CorruptStoreError, match="cannot rebuild a snapshot"):
        await FileBackend(base_path=tmp_path).repair()


def test_salvage_finds_every_intact_frame_around_damage() -> None:
    """salvage_frames keeps exactly the frames no damaged byte touches, for damage anywhere."""
    from agenticstate.backends._file_format import salvage_frames

    written = _written()
    log = written.files["state.json.log"]
    ends = written.frame_ends
    starts = [0, *ends[:-1]]
    for at in range(0, len(log), 7):
        damaged = _damage(log, at, "flip")
        frames, dropped = salvage_frames(damaged)
        hit = next(n for n, end in enumerate(ends) if at < end)
        assert [offset for offset, _ in frames] == [s for n, s in enumerate(starts) if n != hit]
        assert dropped == [(starts[hit], ends[hit])]


def test_the_matrix_covers_each_region() -> None:
    """The matrix damages 18 log points, and 17 points of each snapshot plus its fields."""
    assert len(LOG_CASES) == 18 * len(DAMAGES)
    for file_format, compressed in SNAPSHOT_STORES:
        snapshot = _written(file_format, compressed).files[f"state.{file_format}"]
        assert len(_snapshot_points(snapshot)) >= 17 + (12 if not compressed else 0)
    document = json.loads(_written().files["state.json"])
    assert document["lsn"] == 21  # "21" to "31" by one bit: ten log records would be skipped


async def test_repair_after_an_interrupted_repair(tmp_path: Path) -> None:
    """A temporary file left by a repair that was interrupted does not stop the next one."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        for n in range(3):
            await backend.set(f"k{n}", b"\x011")
        backend._write_snapshot = lambda *args: None  # type: ignore[method-assign]
    log_path = tmp_path / "state.json.log"
    damaged = bytearray(log_path.read_bytes())
    damaged[3] ^= 0x01
    log_path.write_bytes(bytes(damaged))
    (tmp_path / "state.json.log.repair.tmp").write_bytes(b"half a repair")
    report = await FileBackend(base_path=tmp_path).repair()
    assert report.frames_kept == 2
    assert not (tmp_path / "state.json.log.repair.tmp").exists()


def test_the_command_refuses_a_damaged_store_and_repairs_it(tmp_path: Path) -> None:
    """`keys` on a store with a damaged log exits 3 in one line naming CorruptStoreError and
    the repair command; `repair` then keeps the intact writes and `keys` lists them."""
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agenticstate", "--url", "file://store", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    async def write() -> None:
        async with FileBackend(base_path=tmp_path / "store", auto_save=False) as backend:
            for n in range(4):
                await backend.set(f"k{n}", b"\x011")
            backend._write_snapshot = lambda *args: None  # type: ignore[method-assign]

    anyio.run(write)
    log_path = tmp_path / "store" / "state.json.log"
    damaged = bytearray(log_path.read_bytes())
    damaged[len(damaged) // 3] ^= 0x01
    log_path.write_bytes(bytes(damaged))
    refused = cli("keys")
    assert refused.returncode == 3
    assert refused.stderr.count("\n") == 1
    assert "(CorruptStoreError)" in refused.stderr
    assert "repair" in refused.stderr
    repaired = cli("repair")
    assert repaired.returncode == 0, repaired.stderr
    assert repaired.stdout.startswith("repaired: kept 3 writes in 3 frames")
    assert repaired.stderr == ""
    assert cli("keys").stdout.count("\n") == 3
    again = cli("--json", "repair")
    assert json.loads(again.stdout)["damaged_copy"] is None
