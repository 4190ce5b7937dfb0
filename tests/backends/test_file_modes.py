"""A file store's files: created 0600, and a file that exists keeps its mode through rewrites.

Every file of the store (snapshot, log, lock) x every mode a group might set x every way the
store rewrites a file (flush, close, compaction past `compact_bytes`, `repair` of a damaged
log): the mode afterwards is the mode before.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

import pytest

from agenticstate import FileBackend

if TYPE_CHECKING:
    from pathlib import Path

NAMES = ("state.json", "state.json.log", "state.json.lock")


def _modes(path: Path) -> dict[str, int]:
    return {name: stat.S_IMODE(os.stat(path / name).st_mode) for name in NAMES}


async def test_new_store_files_are_0600(tmp_path: Path) -> None:
    """A new store's snapshot, log and lock file are readable and writable by the owner alone."""
    async with FileBackend(tmp_path, close_snapshot_keys=0) as store:
        await store.set("k", b"1")
        await store.flush()
        await store.set("k", b"2")
    assert _modes(tmp_path) == dict.fromkeys(NAMES, 0o600)


async def _flush(path: Path) -> None:
    async with FileBackend(path) as store:
        await store.set("k", b"2")
        await store.flush()


async def _close(path: Path) -> None:
    async with FileBackend(path) as store:
        await store.set("k", b"2")


async def _compact(path: Path) -> None:
    async with FileBackend(path, compact_bytes=1000, close_snapshot_keys=0) as store:
        for i in range(20):
            await store.set("k", b"x" * 200 + str(i).encode())
        assert store.stats()["snapshots"] >= 1


async def _repair(path: Path) -> None:
    log = path / "state.json.log"
    data = bytearray(log.read_bytes())
    data[-3] ^= 0x01  # bit rot in the last frame
    log.write_bytes(bytes(data))
    await FileBackend(path).repair()


REWRITES = {"flush": _flush, "close": _close, "compaction": _compact, "repair": _repair}


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o660, 0o644, 0o400 | 0o200 | 0o040])
@pytest.mark.parametrize("rewrite", REWRITES)
async def test_a_file_that_exists_keeps_its_mode(rewrite: str, mode: int, tmp_path: Path) -> None:
    """Every rewrite of the store leaves each of its files with the mode it was given."""
    async with FileBackend(tmp_path, close_snapshot_keys=0) as store:
        await store.set("k", b"1")
        await store.flush()
        await store.set("k", b"1b")  # the log holds a frame too
    for name in NAMES:
        os.chmod(tmp_path / name, mode)
    await REWRITES[rewrite](tmp_path)
    assert _modes(tmp_path) == dict.fromkeys(NAMES, mode)
