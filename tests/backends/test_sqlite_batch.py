"""The SQLite writer's group commit when one write fails, and the largest value it stores.

- A job whose own step fails in SQLite (a statement it runs, a row SQLite refuses) fails alone:
  the batch is rolled back and each of its jobs runs again in a transaction of its own, so the
  other tasks' writes that were batched with it commit. The tests hold the writer on a gate so
  that every write is queued into the one batch, then inject the failing job.
- Values larger than `max_value_size` are refused up front with `TooLargeError` naming the
  limit, for every kind of write, and nothing is written; every value up to the limit can be
  written and overwritten (the slow test writes and overwrites one at the real limit, about
  476 MiB, with the longest key).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import pytest

from agenticstate import SQLiteBackend
from agenticstate.backends._sqlite_schema import LENGTH_LIMIT, MAX_VALUE_SIZE
from agenticstate.backends.base import Put, Version
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    ConfigurationError,
    TooLargeError,
)
from tests.integration.test_sqlite_locks import holding

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

SMALL = 20  # writes batched with the failing one


async def _in_one_batch(
    backend: SQLiteBackend, calls: list[Callable[[], Awaitable[Any]]]
) -> list[Any]:
    """Run `calls` so that the writer takes them in one batch; each call's result or error."""
    entered, gate = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        entered.set()
        gate.wait(30)

    results: list[Any] = [None] * len(calls)

    async def run(position: int) -> None:
        try:
            results[position] = await calls[position]()
        except Exception as exc:  # noqa: BLE001  # the test looks at each outcome
            results[position] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend._call, True, hold)  # the writer thread waits in this batch
        assert await anyio.to_thread.run_sync(entered.wait, 30)
        for position in range(len(calls)):
            tg.start_soon(run, position)
        await anyio.wait_all_tasks_blocked()  # every call is queued behind the gate
        gate.set()
    return results


async def _bad_statement(backend: SQLiteBackend) -> None:
    await backend._call(True, lambda conn: conn.execute("INSERT INTO no_such_table VALUES (1)"))


async def test_a_job_whose_statement_fails_fails_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An injected job whose SQL fails, batched with 20 saves and a compare-and-set: it alone
    fails (a BackendError); every other write commits, once."""
    caplog.set_level(logging.DEBUG, logger="agenticstate.backends.sqlite")
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("cas", b"0")
        calls: list[Callable[[], Awaitable[Any]]] = [
            *(lambda n=n: backend.set(f"k{n}", b"v%d" % n) for n in range(SMALL // 2)),
            lambda: _bad_statement(backend),
            *(lambda n=n: backend.set(f"k{n}", b"v%d" % n) for n in range(SMALL // 2, SMALL)),
            lambda: backend.set("cas", b"1", expected_version=1),
        ]
        results = await _in_one_batch(backend, calls)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1
        assert isinstance(failed[0], BackendError)
        assert "no_such_table" in str(failed[0])
        for n in range(SMALL):
            entry = await backend.get(f"k{n}")
            assert entry is not None
            assert (entry.value, entry.version) == (b"v%d" % n, 1)
        cas = await backend.get("cas")
        assert cas is not None
        assert (cas.value, cas.version) == (b"1", 2)
    assert "sqlite_batch_split jobs=22" in caplog.text  # all of them in one batch, then split


async def test_a_value_sqlite_refuses_fails_only_its_own_write(tmp_path: Path) -> None:
    """A value SQLite itself refuses (its length limit lowered below the value) fails its own
    save; the 20 saves and the update batched with it commit."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        await backend.set("counter", b"0")
        await backend._call(True, lambda conn: conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 10_000))
        calls: list[Callable[[], Awaitable[Any]]] = [
            *(lambda n=n: backend.set(f"k{n}", b"small") for n in range(SMALL)),
            lambda: backend.set("big", b"x" * 50_000),
            lambda: backend.update("counter", lambda entry: b"%d" % (int(entry.value) + 1)),  # type: ignore[union-attr]
        ]
        results = await _in_one_batch(backend, calls)
        big = results[SMALL]
        assert isinstance(big, BackendError)
        assert "too big" in str(big)
        assert not any(isinstance(r, BaseException) for r in results[:SMALL])
        assert [r.version for r in results[:SMALL]] == [1] * SMALL
        assert await backend.get("big") is None
        counter = await backend.get("counter")
        assert counter is not None
        assert (counter.value, counter.version) == (b"1", 2)


async def test_a_lock_timeout_fails_the_batch_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock wait that runs out is not retried job by job (each would wait as long): every
    write queued behind the lock gets the BackendTimeoutError, and no batch is split."""
    path = tmp_path / "s.db"
    caplog.set_level(logging.DEBUG, logger="agenticstate.backends.sqlite")
    async with SQLiteBackend(path, lock_timeout=timedelta(seconds=0.3)) as backend:
        await backend.set("k", b"v")
        with holding(path, "write"):
            results: list[BaseException] = []

            async def write(n: int) -> None:
                with pytest.raises(BackendTimeoutError) as raised:
                    await backend.set(f"k{n}", b"v")
                results.append(raised.value)

            async with anyio.create_task_group() as tg:
                for n in range(SMALL):
                    tg.start_soon(write, n)
        assert len(results) == SMALL
    assert "sqlite_batch_split" not in caplog.text


# ---------------------------------------------------------------- the largest value


def test_the_limit_is_half_of_sqlites_row_limit() -> None:
    """The default limit leaves room for an old and a new value (and a key) in one change row."""
    assert 2 * MAX_VALUE_SIZE + 65_536 == LENGTH_LIMIT
    assert SQLiteBackend("s.db").max_value_size == MAX_VALUE_SIZE
    prefixed = SQLiteBackend("s.db", key_prefix="tenant:")
    assert 2 * prefixed.max_value_size + len("tenant:") + 65_536 <= LENGTH_LIMIT


@pytest.mark.parametrize("size", [0, -1, MAX_VALUE_SIZE + 1, 1.5, True])
def test_max_value_size_is_checked(size: Any) -> None:
    """max_value_size takes an int from 1 to the largest the backend can overwrite."""
    with pytest.raises(ConfigurationError, match="max_value_size"):
        SQLiteBackend("s.db", max_value_size=size)


async def test_every_kind_of_write_refuses_a_larger_value_up_front(tmp_path: Path) -> None:
    """set, set_many, transact's Put and update's new value over max_value_size: TooLargeError
    naming the limit, and nothing of that call is written."""
    async with SQLiteBackend(tmp_path / "s.db", max_value_size=1000) as backend:
        big, fits = b"x" * 1001, b"y" * 1000
        with pytest.raises(TooLargeError, match="at most 1000 bytes"):
            await backend.set("a", big)
        with pytest.raises(TooLargeError, match="1001 bytes"):
            await backend.set_many([("b", fits), ("c", big)])
        with pytest.raises(TooLargeError):
            await backend.transact([Version("d", 0)], [Put("d", fits), Put("e", big)])
        await backend.set("u", b"1")
        with pytest.raises(TooLargeError):
            await backend.update("u", lambda entry: big)
        assert [key async for key in backend.scan("*")] == ["u"]
        assert (await backend.get("u")).version == 1  # type: ignore[union-attr]
        assert (await backend.set("a", fits)).version == 1  # the limit itself is accepted
        assert (await backend.set("a", fits)).version == 2


async def test_a_value_just_over_the_real_limit_is_refused(tmp_path: Path) -> None:
    """One byte over the default limit: TooLargeError before the writer thread sees it."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        with pytest.raises(TooLargeError, match=f"at most {MAX_VALUE_SIZE} bytes"):
            await backend.set("k", bytes(MAX_VALUE_SIZE + 1))
        assert await backend.get("k") is None


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
async def test_a_value_at_the_limit_is_written_overwritten_and_deleted(tmp_path: Path) -> None:
    """A value of exactly max_value_size under the longest key and a prefix: written, then
    overwritten (the change row holds both), read back, and deleted."""
    if _available_memory() < 8 * 2**30:
        pytest.skip("needs about 4 GiB of memory at its peak, and 8 GiB available to start")
    key = "k" * 1024
    async with SQLiteBackend(tmp_path / "s.db", key_prefix="p:", synchronous="normal") as backend:
        size = backend.max_value_size
        first = await backend.set(key, b"a" * size)
        assert first.version == 1
        del first
        second = await backend.set(key, b"b" * size)
        assert (second.version, len(second.old or b""), len(second.new or b"")) == (2, size, size)
        del second
        entry = await backend.get(key)
        assert entry is not None
        assert (len(entry.value), entry.value[:1], entry.value[-1:]) == (size, b"b", b"b")
        del entry
        gone = await backend.delete(key)
        assert gone is not None
        assert gone.version == 2
