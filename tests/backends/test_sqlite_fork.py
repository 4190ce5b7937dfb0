"""A process forked while an SQLite backend works can still use the database.

SQLite records per process which of its connections hold which locks; a child forked while the
parent's writer holds one would inherit that record with no thread to release it, and every
write it makes would time out. A fork waits for the transaction in progress instead. For each
way a fork happens (`os.fork`, a `multiprocessing` fork process) x each place the parent's
threads are (inside a write transaction, inside a read, idle), the child opens its own backend
on the same file and writes, and the parent goes on writing after.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import SQLiteBackend

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends.base import Entry


def _child_write(path: str) -> int:
    async def run() -> int:
        async with SQLiteBackend(path, lock_timeout=timedelta(seconds=5)) as mine:
            await mine.set("child", b"hello")
        return 0

    try:
        return anyio.run(run)
    except Exception:  # noqa: BLE001  # the exit code says it
        return 1


def _fork(path: str, how: str) -> int:
    if how == "os.fork":
        pid = os.fork()
        if pid == 0:
            os._exit(_child_write(path))
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    process = multiprocessing.get_context("fork").Process(target=_child_exit, args=(path,))
    process.start()
    process.join(60)
    return -1 if process.exitcode is None else process.exitcode


def _child_exit(path: str) -> None:
    os._exit(_child_write(path))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "read", "idle"])
@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
async def test_a_child_forked_mid_transaction_can_write(
    where: str, how: str, tmp_path: Path
) -> None:
    """A child forked while the parent's writer or reader is inside a transaction writes."""
    path = str(tmp_path / "state.db")
    async with SQLiteBackend(path) as backend:
        await backend.set("k", b"0")
        inside = threading.Event()

        def slow(entry: Entry | None) -> bytes:  # in the writer thread, inside BEGIN IMMEDIATE
            inside.set()
            time.sleep(0.3)  # a long transaction: the fork comes while it runs
            return b"1"

        def fork_and_wait() -> int:  # a plain thread: the child has no event loop running
            assert inside.wait(30)
            return _fork(path, how)

        async with anyio.create_task_group() as group:
            if where == "write":
                group.start_soon(backend.update, "k", slow)
            elif where == "read":

                async def reads() -> None:
                    inside.set()
                    for _ in range(200):
                        await backend.get_many([f"k{n}" for n in range(50)])

                group.start_soon(reads)
            else:
                inside.set()
            code = await anyio.to_thread.run_sync(fork_and_wait)
        assert code == 0
        await backend.set("parent", b"after")
        assert (await backend.get("child")) is not None
