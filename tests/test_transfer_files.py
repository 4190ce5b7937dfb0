"""copy, export and import against what can go wrong with files and scores.

- Infinite index scores (a counter that overflowed) copy, export and import like any other; a
  dump is strict JSON; a dump with anything the destination would refuse (a NaN score, a bad
  member, a value over its size limit) is refused before one key is written.
- An export that fails at any step (creating, writing, syncing or renaming its temporary file,
  a failing source, cancellation, a real full disk) leaves no temporary file and the previous
  dump as it was; a dump is created 0600 whatever the umask.
- Hostile file arguments to import, export and copy give one line and an exit code, never a
  traceback, and create nothing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import SerializationError, transfer
from agenticstate.backends import FileBackend, IndexIncr, MemoryBackend, SQLiteBackend
from agenticstate.transfer import check_dump, copy_state, export_state, import_state

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from agenticstate.backends import Backend

INF = float("inf")
KEYS = 1200


async def _with_overflowed_counter(backend: Backend) -> None:
    await backend.set_many([(f"k{n:04}", b"\x01%d" % n) for n in range(KEYS)])
    await backend.index_add("counters", {"big": 1e308, "low": -1e308, "one": 1.0})
    await backend.transact([], [IndexIncr("counters", "big", 1e308)])  # overflows to inf
    await backend.transact([], [IndexIncr("counters", "low", -1e308)])  # and to -inf


EXPECTED_INDEX = [("low", -INF), ("one", 1.0), ("big", INF)]


async def _contents(backend: Backend) -> tuple[int, list[tuple[str, float]]]:
    keys = [key async for key in backend.scan("*")]
    return len(keys), await backend.index_range("counters")


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


async def test_an_overflowed_score_copies_exports_and_imports(
    backend: Backend, tmp_path: Path
) -> None:
    """A counter that overflowed to inf/-inf (IndexIncr allows it) copies to a file store,
    exports as "inf"/"-inf" in strict JSON, and imports whole: all 1,200 keys and the index
    (the copy raised after the keys, the export wrote Infinity, the import stopped at 1,000)."""
    await _with_overflowed_counter(backend)
    assert await backend.index_range("counters") == EXPECTED_INDEX
    async with FileBackend(base_path=tmp_path / "copy") as copied:
        done = await copy_state(backend, copied)
        assert (done.entries, done.indexes) == (KEYS, 1)
    async with FileBackend(base_path=tmp_path / "copy") as reopened:
        assert await _contents(reopened) == (KEYS, EXPECTED_INDEX)
    dump = tmp_path / "dump.jsonl"
    await export_state(backend, dump)
    records = [_strict_json(line) for line in dump.read_text().splitlines()]
    index = next(record for record in records if record.get("type") == "index")
    assert index["members"] == [["low", "-inf"], ["one", 1.0], ["big", "inf"]]
    async with SQLiteBackend(tmp_path / "imported.db") as imported:
        done = await import_state(dump, imported)
        assert (done.entries, done.indexes) == (KEYS, 1)
        assert await _contents(imported) == (KEYS, EXPECTED_INDEX)


async def test_a_dump_written_with_infinity_still_imports(tmp_path: Path) -> None:
    """A dump from the release that wrote bare `Infinity` imports with the infinite score."""
    dump = tmp_path / "old.jsonl"
    lines = [
        '{"format": "agenticstate-dump", "version": 1, "pattern": "*"}',
        '{"type": "index", "name": "counters", "members": [["big", Infinity]]}',
        '{"type": "end", "entries": 0, "indexes": 1}',
    ]
    dump.write_text("\n".join(lines) + "\n")
    async with MemoryBackend() as destination:
        await import_state(dump, destination)
        assert await destination.index_range("counters") == [("big", INF)]


BAD_LAST_LINES = {
    "nan-score": '{"type": "index", "name": "i", "members": [["m", NaN]]}',
    "bad-member": '{"type": "index", "name": "i", "members": [["", 1.0]]}',
    "control-member": '{"type": "index", "name": "i", "members": [["a\\u0000b", 1.0]]}',
    "string-score": '{"type": "index", "name": "i", "members": [["m", "lots"]]}',
    "huge-int-score": '{"type": "index", "name": "i", "members": [["m", 1' + "0" * 400 + "]]}",
    "too-large-value": '{"type": "entry", "key": "big", "value": "' + "A" * 2000 + '"}',
}


@pytest.mark.parametrize("name", list(BAD_LAST_LINES))
async def test_import_refuses_what_the_destination_would_before_writing(
    tmp_path: Path, name: str
) -> None:
    """1,200 good keys, then one line the destination would refuse (a NaN score, a bad member,
    a value over its limit): the import raises and the destination stays empty."""
    dump = tmp_path / "dump.jsonl"
    async with MemoryBackend() as source:
        await source.set_many([(f"k{n:04}", b"\x01x") for n in range(KEYS)])
        await export_state(source, dump)
    lines = dump.read_text().splitlines()
    end = json.loads(lines[-1])
    kind = "entries" if name == "too-large-value" else "indexes"
    end[kind] += 1
    dump.write_text("\n".join([*lines[:-1], BAD_LAST_LINES[name], json.dumps(end)]) + "\n")
    async with FileBackend(base_path=tmp_path / "destination") as destination:
        destination.MAX_VALUE_BYTES = 1000
        with pytest.raises(SerializationError, match=f"dump line {KEYS + 2}"):
            await import_state(dump, destination)
        assert [key async for key in destination.scan("*")] == []


# -- An export that fails at any step leaves nothing behind.

STEPS = ["_create_temp", "_write", "_sync", "_rename", "_sync_directory"]


def _failing(monkeypatch: pytest.MonkeyPatch, step: str, on_call: int, code: int) -> None:
    """Make transfer's `step` raise OSError(code) on its `on_call`-th call."""
    real = getattr(transfer, step)
    calls = 0

    def fail(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == on_call:
            raise OSError(code, os.strerror(code))
        return real(*args)

    monkeypatch.setattr(transfer, step, fail)


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name != "dump.jsonl")


async def _source() -> MemoryBackend:
    source = MemoryBackend()
    await source.set_many([(f"k{n:04}", b"\x01" + b"v" * 100) for n in range(300)])
    return source


FAILURES = [
    pytest.param(step, call, code, id=f"{step}-{call}-{errno.errorcode[code]}")
    for step, calls in {
        "_create_temp": [1],
        "_write": [1, 2, 5],
        "_sync": [1],
        "_rename": [1],
        "_sync_directory": [1],
    }.items()
    for call in calls
    for code in (errno.ENOSPC, errno.EIO)
]


@pytest.mark.parametrize(("step", "call", "code"), FAILURES)
async def test_an_export_failing_at_any_step_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, call: int, code: int
) -> None:
    """Whichever write, sync or rename fails, the error is the OSError, no temporary file is
    left, and the previous dump is intact (or, if only the directory sync failed, the new one
    is complete)."""
    monkeypatch.setattr(transfer, "_CHUNK", 4096)  # many writes
    previous = b"the previous dump\n"
    (tmp_path / "dump.jsonl").write_bytes(previous)
    _failing(monkeypatch, step, call, code)
    source = await _source()
    with pytest.raises(OSError, match=os.strerror(code)) as raised:
        await export_state(source, tmp_path / "dump.jsonl")
    assert raised.value.errno == code
    assert _leftovers(tmp_path) == []
    after = (tmp_path / "dump.jsonl").read_bytes()
    if step == "_sync_directory":
        check_dump(tmp_path / "dump.jsonl")  # renamed into place, complete
    else:
        assert after == previous


@pytest.mark.parametrize("how", ["source-error", "cancelled"])
async def test_an_export_stopped_midway_leaves_no_temporary_file(tmp_path: Path, how: str) -> None:
    """A source that fails in the middle, or a cancelled export, leaves no temporary file."""
    source = await _source()
    calls = 0

    def progress(_: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1 and how == "source-error":
            raise RuntimeError("the source failed")
        if calls == 1:
            scope.cancel()

    with anyio.CancelScope() as scope:
        try:
            await export_state(source, tmp_path / "dump.jsonl", progress=progress)
        except RuntimeError:
            assert how == "source-error"
    assert calls == 1
    assert os.listdir(tmp_path) == []


async def test_a_dump_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    """An export is 0600 whatever the umask, also over an existing 0644 file (a dump holds
    every value of the store)."""
    source = await _source()
    target = tmp_path / "dump.jsonl"
    target.write_text("old")
    target.chmod(0o644)
    old = os.umask(0)
    try:
        await export_state(source, target)
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real filesystem that really fills up."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run([umount, "-l", str(mount_point)], check=True)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_export_to_a_full_disk_fails_cleanly_and_frees_its_space(
    small_disk: Path, tmp_path: Path
) -> None:
    """Exporting 3 MB to a 1 MiB filesystem: exit 2 with "No space left", no temporary file
    left on it, and its space free again (a `.partial` file used to keep the disk full)."""
    store = f"sqlite://{tmp_path / 'big.db'}"

    async def populate() -> None:
        async with SQLiteBackend(tmp_path / "big.db") as backend:
            await backend.set_many([(f"k{n}", b"\x01" + b"x" * 30_000) for n in range(100)])

    anyio.run(populate)
    free_before = os.statvfs(small_disk).f_bfree
    result = _cli("export", store, str(small_disk / "dump.jsonl"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("agenticstate: cannot write")
    assert "No space left on device" in result.stderr
    assert result.stderr.count("\n") == 1
    assert os.listdir(small_disk) == []
    assert os.statvfs(small_disk).f_bfree == free_before


# -- Hostile file arguments: one line, an exit code, nothing created.


def _binary(directory: Path) -> str:
    (directory / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64)
    return "binary.bin"


def _empty(directory: Path) -> str:
    (directory / "empty.jsonl").write_bytes(b"")
    return "empty.jsonl"


def _a_directory(directory: Path) -> str:
    (directory / "folder").mkdir()
    return "folder"


def _through_a_file(directory: Path) -> str:
    (directory / "plain.txt").write_text("x")
    return "plain.txt/dump.jsonl"


def _long_line(directory: Path) -> str:
    (directory / "long.jsonl").write_bytes(b"{" + b'"a": 1, ' * 300_000)
    return "long.jsonl"


def _nul_bytes(directory: Path) -> str:
    (directory / "nul.jsonl").write_bytes(b"\x00" * 10_000)
    return "nul.jsonl"


IMPORT_FILES: dict[str, tuple[Callable[[Path], str], str]] = {
    "binary": (_binary, "not UTF-8 text"),
    "empty": (_empty, "is empty: not an agenticstate dump"),
    "directory": (_a_directory, "cannot read folder: Is a directory"),
    "missing": (lambda directory: "nope.jsonl", "cannot read nope.jsonl: No such file"),
    "through-a-file": (_through_a_file, "Not a directory"),
    "long-line": (_long_line, "not JSON"),
    "nul-bytes": (_nul_bytes, "not JSON"),
}


@pytest.mark.parametrize("name", list(IMPORT_FILES))
def test_import_of_a_hostile_file_is_one_line_and_creates_nothing(
    tmp_path: Path, name: str
) -> None:
    """import of a binary, empty, missing file, a directory, a path through a file, a huge
    line or NUL bytes: exit 2, one line saying what is wrong, and no destination store made."""
    make, message = IMPORT_FILES[name]
    argument = make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    result = _cli("import", argument, "sqlite://restored.db", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("agenticstate: ")
    assert message in result.stderr
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == before


EXPORT_TARGETS: dict[str, tuple[Callable[[Path], str], str]] = {
    "dot": (lambda directory: ".", "Is a directory"),
    "directory-slash": (lambda directory: _a_directory(directory) + "/", "directory"),
    "new-directory-slash": (lambda directory: "new/", "names a directory"),
    "missing-parent": (lambda directory: "missing/dump.jsonl", "No such file or directory"),
    "through-a-file": (_through_a_file, "Not a directory"),
    "empty-name": (lambda directory: "", "names a directory"),
}


@pytest.mark.parametrize("name", list(EXPORT_TARGETS))
def test_export_to_a_hostile_path_is_one_line_and_creates_nothing(
    tmp_path: Path, name: str
) -> None:
    """export to ".", a directory, "new/", a missing directory, a path through a file or "":
    exit 2 "cannot write", one line, and nothing new in the directory (no `.partial`)."""
    store = tmp_path / "store"
    store.mkdir()
    assert _cli("--url", "file://store", "set", "k", "1", cwd=tmp_path).returncode == 0
    make, message = EXPORT_TARGETS[name]
    argument = make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    result = _cli("export", "file://store", argument, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("agenticstate: cannot write")
    assert message in result.stderr
    assert result.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == before
    if (tmp_path / "folder").exists():
        assert os.listdir(tmp_path / "folder") == []


COPY_ARGUMENTS = {
    "not-a-url": (("copy", "store", "memory://"), 2, "must look like scheme://"),
    "empty-file-url": (("copy", "file://", "memory://"), 2, "names no directory"),
    "fragment": (("copy", "file://store#1", "memory://"), 2, "%23"),
    "onto-itself": (("copy", "file://store", "file://store"), 0, ""),
}


@pytest.mark.parametrize("name", list(COPY_ARGUMENTS))
def test_copy_with_hostile_arguments_is_one_line(tmp_path: Path, name: str) -> None:
    """copy with a path for a URL, an empty path, a fragment, or a store onto itself: one
    line and an exit code (copying a store onto itself changes nothing)."""
    assert _cli("--url", "file://store", "set", "k", "1", cwd=tmp_path).returncode == 0
    args, code, message = COPY_ARGUMENTS[name]
    result = _cli(*args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert _cli("--url", "file://store", "keys", cwd=tmp_path).stdout == "k\n"


def test_an_over_long_line_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line longer than the longest a dump can hold is refused, not read into memory."""
    monkeypatch.setattr(transfer, "_MAX_LINE", 1000)
    dump = tmp_path / "long.jsonl"
    dump.write_bytes(b'{"format": "agenticstate-dump", "version": 1}\n' + b"x" * 5000)
    with pytest.raises(SerializationError, match="dump line 2: longer than 1000 bytes"):
        check_dump(dump)
