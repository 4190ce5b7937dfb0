"""SQLite and another process's locks: what a write waits, what a read and an open never wait for,
and how far the WAL grows behind a long reader. The other process is a plain `sqlite3` program
(`_sqlite_lock`) holding a real lock on the file."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

from agenticstate import SQLiteBackend, StateManager
from agenticstate.backends._sqlite_schema import WAL_SIZE_LIMIT
from agenticstate.exceptions import BackendTimeoutError
from tests.helpers import LineProcess
from tests.test_cli import cli

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@contextmanager
def holding(path: Path, mode: str) -> Iterator[LineProcess]:
    """Another process holding the write lock (`write`) or a read snapshot (`read`) on `path`."""
    proc = LineProcess("tests.integration._sqlite_lock", str(path), mode)
    try:
        word = "locked" if mode == "write" else "reading"
        assert proc.wait_until(lambda lines: word in lines, 60), proc.errors
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "lock_timeout",
    [0.5, pytest.param(6.0, marks=pytest.mark.slow, id="6.0-past-1030-tries")],
)
async def test_a_write_waits_lock_timeout_then_raises_backend_timeout(
    tmp_path: Path, lock_timeout: float
) -> None:
    """While another process holds the write lock, a write fails with BackendTimeoutError after
    lock_timeout, not earlier (and not with OverflowError from its retry backoff)."""
    path = tmp_path / "s.db"
    async with SQLiteBackend(path, lock_timeout=timedelta(seconds=lock_timeout)) as backend:
        await backend.set("before", b"1")
        with holding(path, "write"):
            started = time.monotonic()
            with pytest.raises(BackendTimeoutError, match="write lock"):
                await backend.set("k", b"v")
            waited = time.monotonic() - started
        assert waited >= lock_timeout
        assert waited < 2 * lock_timeout + 30  # about lock_timeout: a loose bound for busy hosts
        await backend.set("k", b"v")  # the lock released: the next write goes through
        assert (await backend.get("k")) is not None


async def test_opening_and_reading_never_wait_for_another_process_writer(tmp_path: Path) -> None:
    """While another process holds the write lock, a new backend opens and reads, and the CLI's
    `get` answers: checking a current store's layout takes no lock."""
    path = tmp_path / "s.db"
    async with StateManager(backend=SQLiteBackend(path)) as state:
        await state.save("k", {"a": 1})
    with holding(path, "write"):
        backend = SQLiteBackend(path, lock_timeout=timedelta(seconds=3))
        async with StateManager(backend=backend) as state:
            assert await state.get("k") == {"a": 1}
            assert await state.list_keys() == ["k"]
        shown = cli("--url", f"sqlite://{path}", "--json", "get", "k", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["value"] == {"a": 1}


async def test_the_wal_returns_under_its_limit_after_a_long_reader(tmp_path: Path) -> None:
    """A reader in another process holds a snapshot while 40 MB are written (the -wal grows past
    its limit: nothing can be checkpointed behind the reader); once it lets go, the next
    writes' checkpoints bring the -wal back under WAL_SIZE_LIMIT while the store stays open."""
    path = tmp_path / "s.db"
    wal = tmp_path / "s.db-wal"
    value = b"x" * 100_000
    async with SQLiteBackend(path, synchronous="normal") as backend:
        await backend.set("k0", value)
        with holding(path, "read"):
            for round_ in range(400):
                await backend.set(f"k{round_ % 50}", value)
            grown = wal.stat().st_size
        assert grown > WAL_SIZE_LIMIT
        sizes = []
        for writes in range(100):  # a checkpoint runs about every 4 MB (1,000 pages) written
            sizes.append(wal.stat().st_size)
            if sizes[-1] <= WAL_SIZE_LIMIT:
                break
            await backend.set(f"k{writes % 50}", value)
        assert sizes[-1] <= WAL_SIZE_LIMIT, sizes
        assert (await backend.get("k0")) is not None
