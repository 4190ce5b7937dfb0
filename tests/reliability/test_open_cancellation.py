"""A call cancelled while a backend opens leaves nothing behind once the backend is closed.

For every backend, `open()` (and, separately, a first call that opens it lazily) runs under a
wrapper that counts the times it suspends (each await that yields to the event loop), and a
cancel scope is cancelled at its 1st, 2nd, ... suspension in turn, up to the number an open
that is not cancelled makes: every await of every `open()`. The same sweep closes the backend
from another task instead of cancelling.
After each cancelled open, `aclose()`; then the process must hold no more threads (other than
anyio's idle worker pool), file descriptors or child processes than before it started. The
backend must also be usable again: a second instance on the same store opens and writes.
"""

from __future__ import annotations

import gc
import os
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from agenticstate import FileBackend, MemoryBackend, RedisBackend, SQLiteBackend
from agenticstate.exceptions import BackendError
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Generator

    from agenticstate.backends import Backend

POOL_THREAD = "AnyIO worker thread"  # anyio's to_thread pool: idle threads linger, by design
KEPT: list[Backend] = []  # every backend a test made, referenced until the test ends


class CountedAwait:
    """Await `coro` as `yield from` would, counting the times it suspends."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.suspensions = 0
        self.done = False

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.coro.__await__()
        try:
            value = inner.send(None)
            while True:
                self.suspensions += 1
                try:
                    sent = yield value
                except BaseException as exc:  # noqa: BLE001  # passed in, as yield from does
                    value = inner.throw(exc)
                else:
                    value = inner.send(sent)
        except StopIteration as stop:
            self.done = True
            return stop.value


def _children() -> set[int]:
    found = set()
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat.rpartition(")")[2].split()[1] == me:
                found.add(int(entry))
    return found


def _resources() -> tuple[set[threading.Thread], int, set[int]]:
    gc.collect()
    threads = {t for t in threading.enumerate() if not t.name.startswith(POOL_THREAD)}
    return threads, len(os.listdir("/proc/self/fd")), _children()


async def _settled(before: tuple[set[threading.Thread], int, set[int]]) -> None:
    """Wait (bounded) for threads and processes that are ending, then compare with `before`."""

    def left() -> tuple[set[threading.Thread], int, set[int]]:
        threads, fds, children = _resources()
        return threads - before[0], max(0, fds - before[1]), children - before[2]

    with anyio.move_on_after(10):
        # A child (the file store's fsync agent) ends on its own once its pipe closes: nothing
        # to wait on but the process table.
        while left() != (set(), 0, set()):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert left() == (set(), 0, set())


async def _open_cancelled_at(
    make: Callable[[], Backend], suspension: int, call: str, action: str = "cancel"
) -> CountedAwait:
    """Open a new backend (by `open()` or by its first call, which opens it lazily) and, at its
    `suspension`-th suspension (0: never), cancel it or close the backend from another task;
    then close it. The backend stays referenced (`KEPT`), as an application's would: a
    leak must not hide behind a finalizer that garbage collection runs."""
    backend = make()
    KEPT.append(backend)
    opening = CountedAwait(backend.open() if call == "open" else backend.get("seed"))
    with anyio.CancelScope() as scope:

        async def interrupt() -> None:
            while not opening.done and opening.suspensions < suspension:
                await anyio.lowlevel.checkpoint()
            if action == "cancel":
                scope.cancel()
            else:
                await backend.aclose()

        async with anyio.create_task_group() as tg:
            if suspension:
                tg.start_soon(interrupt)
            try:
                await opening
            except BackendError:
                assert action == "close"  # the backend was closed under the call: it says so
    await backend.aclose()
    return opening


def _makers(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Callable[[], Backend]]:
    return {
        "memory": MemoryBackend,
        "file": lambda: FileBackend(base_path=tmp_path / "store"),
        "sqlite": lambda: SQLiteBackend(tmp_path / "s.db"),
        "redis": lambda: RedisBackend(
            url=request.getfixturevalue("redis_url"), key_prefix=unique_prefix()
        ),
        "redis-cluster": lambda: RedisBackend(
            url=request.getfixturevalue("redis_cluster_url"), key_prefix=unique_prefix()
        ),
    }


@pytest.mark.parametrize(
    ("name", "fresh"),
    [
        *((name, fresh) for name in ("memory", "file", "sqlite") for fresh in (True, False)),
        # A Redis store is never new to a connection: one case each (a fresh key prefix).
        pytest.param("redis", True, marks=pytest.mark.redis),
        pytest.param("redis-cluster", True, marks=[pytest.mark.redis, pytest.mark.slow]),
    ],
    ids=lambda value: value if isinstance(value, str) else ("new" if value else "existing"),
)
@pytest.mark.parametrize("call", ["open", "first-get"])
@pytest.mark.parametrize("action", ["cancel", "close"])
async def test_open_cancelled_at_every_await_leaves_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, name: str, fresh: bool, call: str, action: str
) -> None:
    """Cancelled (or closed by another task) at each suspension of open() (or of the first
    call, which opens lazily: a Redis backend connects there), then closed: no thread,
    descriptor or child process is left, and the store opens and writes afterwards."""
    make = _makers(request, tmp_path)[name]
    request.addfinalizer(KEPT.clear)
    if name.startswith("redis"):
        request.getfixturevalue("redis_url" if name == "redis" else "redis_cluster_url")
    if not fresh:
        async with make() as backend:
            await backend.set("seed", b"1")
    await _open_cancelled_at(make, 0, call)  # warm up: imports, pools, the loop's descriptors
    before = _resources()
    full = (await _open_cancelled_at(make, 0, call)).suspensions
    await _settled(before)
    for suspension in range(1, full + 1):
        await _open_cancelled_at(make, suspension, call, action)
        await _settled(before)
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(make())
        await backend.set("after", b"1")
        assert await backend.get("after") is not None
    await _settled(before)
    lazy = name == "memory" or (name.startswith("redis") and call == "open")
    assert full >= 1 or lazy  # the sweep reached at least one await
