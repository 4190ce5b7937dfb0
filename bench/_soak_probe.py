"""What the soak measures: the process (tasks, threads, descriptors, children, memory), the
store (keys, entries held, sorted indexes, files on disk) and the Redis server (INFO).

Linux only: it reads /proc/self.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import sys
import threading
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from agenticstate import _glob, _keys
from agenticstate.backends import _local

if TYPE_CHECKING:
    from agenticstate import StateManager

ANYIO_WORKER = "AnyIO worker thread"
MIB = 1024 * 1024


def rss_bytes() -> int:
    """The resident set size, from /proc/self/status."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def children() -> list[int]:
    """The pids of this process's children (the file backend's fsync agent, redis-server)."""
    found: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            text = Path(f"/proc/self/task/{task}/children").read_text(encoding="ascii")
        except OSError:
            continue
        found.extend(int(pid) for pid in text.split())
    return sorted(found)


def describe_task(task: asyncio.Task[Any]) -> str:
    """A task's name (when it was given one) and its coroutine."""
    coro = task.get_coro()
    what = getattr(coro, "__qualname__", type(coro).__name__)
    name = task.get_name()
    return what if name.startswith("Task-") else f"{name} ({what})"


@dataclass
class Process:
    """What the process holds: tasks, threads, descriptors, children, Redis connections."""

    tasks: list[str]
    os_threads: int
    anyio_workers: int
    other_threads: list[str]
    fds: int
    children: int
    timers: tuple[int, int] = (0, 0)  # the event loop's scheduled timers, and the cancelled ones
    redis_clients: int | None = None
    pool: tuple[int, int] | None = None  # Redis: connections the backend holds, and its cap

    @property
    def threads_besides_pool(self) -> int:
        """OS threads that are not anyio's worker pool (which keeps idle threads for 10 s)."""
        return self.os_threads - self.anyio_workers


def measure_process(redis_clients: int | None = None, state: StateManager | None = None) -> Process:
    """Tasks on the running loop (but the caller's), threads, descriptors and children; with a
    Redis `state`, the connections its backend holds."""
    current = asyncio.current_task()
    tasks = sorted(describe_task(t) for t in asyncio.all_tasks() if t is not current)
    names = [thread.name for thread in threading.enumerate()]
    # Cancelled timers (asyncio.timeout, anyio.fail_after) stay in the loop's heap until they
    # are due, or until they are more than half of it: a bounded, time-limited residue.
    scheduled = getattr(asyncio.get_running_loop(), "_scheduled", [])
    return Process(
        tasks=tasks,
        os_threads=len(os.listdir("/proc/self/task")),
        anyio_workers=names.count(ANYIO_WORKER),
        other_threads=sorted(name for name in names if name != ANYIO_WORKER),
        fds=len(os.listdir("/proc/self/fd")),
        children=len(children()),
        timers=(len(scheduled), sum(handle.cancelled() for handle in scheduled)),
        redis_clients=redis_clients,
        pool=held_connections(state) if state is not None else None,
    )


def held_connections(state: StateManager) -> tuple[int, int] | None:
    """The Redis backend's command connections (it makes them when needed and keeps them, up
    to `connection_pool_size`), and that cap; None elsewhere. A private attribute: figures for
    the report only."""
    pool = getattr(state.backend, "_connections", None)
    if pool is None:
        return None
    return len(pool.made), int(pool.size)


@dataclass
class Memory:
    """Live allocations (blocks, and bytes while tracemalloc traces) and the resident set size."""

    blocks: int
    rss: int
    traced: int | None = None
    caches: dict[str, int] = field(default_factory=dict)  # entries dropped from bounded caches


def clear_bounded_caches() -> dict[str, int]:
    """Empty three bounded caches; return how many entries the library's two held.

    All three are capped, so they are not leaks, but they fill during the run and would blur a
    comparison of live memory: key validation keeps up to 4,096 recently validated keys, the
    glob compiler an LRU of 1,024 patterns, and CPython's type attribute cache (4,096 slots)
    keeps the last attribute name looked up in each slot alive. That last one holds a fresh
    "utcoffset" string per slot: `datetime.timestamp()` on an aware datetime (the managers'
    `sort_time`) looks the tzinfo's method up by a name it builds each time.
    """
    held = {
        "validated keys (cap 4,096)": len(_keys._VALID_KEYS),
        "compiled globs (cap 1,024)": _glob.compile_glob.cache_info().currsize,
    }
    _keys._VALID_KEYS.clear()
    _glob.compile_glob.cache_clear()
    sys._clear_type_cache()
    return held


def measure_memory(*, clear_caches: bool = True) -> Memory:
    """Collect garbage (a full collection also empties the free lists), optionally empty the
    bounded caches, and read the live blocks, traced bytes and RSS."""
    caches = clear_bounded_caches() if clear_caches else {}
    gc.collect()
    gc.collect()
    return Memory(
        blocks=sys.getallocatedblocks(),
        rss=rss_bytes(),
        traced=tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None,
        caches=caches,
    )


def object_types() -> Counter[str]:
    """How many gc-tracked objects of each type are alive."""
    gc.collect()
    return Counter(type(thing).__qualname__ for thing in gc.get_objects())


def top_types(before: Counter[str], after: Counter[str], limit: int = 8) -> list[str]:
    """The types whose live objects grew most."""
    grown = sorted(((after[name] - before[name], name) for name in after), reverse=True)
    return [f"{diff:+7,} {name}" for diff, name in grown[:limit] if diff > 0]


def dump_allocations(path: Path) -> None:
    """Write a tracemalloc snapshot (read the figures first: the snapshot itself allocates)."""
    snapshot = tracemalloc.take_snapshot()
    snapshot.dump(str(path))
    del snapshot
    gc.collect()


def store_table_line() -> tuple[str, int] | None:
    """Where the memory and file stores' dict grows its table: `self.data[key] = entry` in
    `LocalStore.store`. Nothing else is allocated on that line, so its traced size is the table
    (a dict reallocates its table when it resizes and keeps its largest size meanwhile)."""
    lines, start = inspect.getsourcelines(_local.LocalStore.store)
    for offset, text in enumerate(lines):
        if "self.data[" in text and "] = " in text:
            return str(Path(_local.__file__).resolve()), start + offset
    return None


def traced_growth(before: Path, limit: int = 8) -> tuple[list[str], int | None]:
    """The source lines whose traced allocations grew most since the snapshot at `before`, and
    how much of the growth is the store's dict table (None: not a memory or file store's, or
    the line was not found)."""
    old = tracemalloc.Snapshot.load(str(before))
    new = tracemalloc.take_snapshot()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = new.filter_traces(ignore).compare_to(old.filter_traces(ignore), "lineno")
    table = store_table_line()
    table_growth: int | None = None
    lines: list[str] = []
    for stat in stats:
        frame = stat.traceback[0]
        if table is not None and (str(Path(frame.filename).resolve()), frame.lineno) == table:
            table_growth = stat.size_diff
        if len(lines) < limit:
            lines.append(
                f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  "
                f"{frame.filename}:{frame.lineno}"
            )
    return lines, table_growth


@dataclass
class Store:
    """What the store holds."""

    keys: int
    held_entries: int | None = None  # memory/file: entries in the dict, expired ones included
    indexes: int | None = None  # memory/file: sorted indexes
    snapshot_bytes: int | None = None
    log_bytes: int | None = None
    files: list[str] | None = None
    redis_keys: int | None = None  # the whole server, sorted-set indexes included
    redis_memory: int | None = None


def local_store(state: StateManager) -> Any:
    """The memory or file backend's in-process store, or None (a private attribute: figures
    for the report only)."""
    return getattr(state.backend, "_local", None)


async def measure_store(state: StateManager, redis: RedisProbe | None) -> Store:
    """Count keys, entries held and indexes; on a file store, the files after a flush()."""
    store = Store(keys=len(await state.list_keys("*")))
    local = local_store(state)
    if local is not None:
        store.held_entries = len(local.data)
        store.indexes = len(local.indexes)
    snapshot_path: Path | None = getattr(state.backend, "snapshot_path", None)
    log_path: Path | None = getattr(state.backend, "log_path", None)
    if snapshot_path is not None and log_path is not None:
        store.snapshot_bytes, store.log_bytes = file_sizes(snapshot_path, log_path)
        store.files = sorted(path.name for path in snapshot_path.parent.iterdir())
    if redis is not None:
        info = await redis.info()
        store.redis_keys = info["keys"]
        store.redis_memory = info["used_memory"]
    return store


def file_sizes(snapshot_path: Path, log_path: Path) -> tuple[int, int]:
    """The snapshot's and the log's sizes in bytes (0 when missing)."""
    sizes = []
    for path in (snapshot_path, log_path):
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            sizes.append(0)
    return sizes[0], sizes[1]


class RedisProbe:
    """One connection of our own to the Redis server, for INFO (it counts as one client)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(url)

    async def info(self) -> dict[str, int]:
        """Connected clients, keys in db 0 and used memory."""
        info = await self.client.info()
        db0 = info.get("db0", {})
        return {
            "connected_clients": int(info["connected_clients"]),
            "keys": int(db0.get("keys", 0)) if isinstance(db0, dict) else 0,
            "used_memory": int(info["used_memory"]),
        }

    async def aclose(self) -> None:
        await self.client.aclose()


async def settle_process(
    target: Process, redis: RedisProbe | None, give_up_after: float, say: Any
) -> tuple[Process, float]:
    """Measure the process until it is back to `target` or `give_up_after` seconds pass.

    anyio keeps idle worker threads for 10 s and stops them only when the next thread call
    comes: one no-op thread call per poll lets it prune them.
    """
    start = anyio.current_time()
    while True:
        await anyio.to_thread.run_sync(lambda: None)
        clients = (await redis.info())["connected_clients"] if redis is not None else None
        now = measure_process(clients)
        waited = anyio.current_time() - start
        settled = (
            Counter(now.tasks) == Counter(target.tasks)
            and now.os_threads <= target.os_threads
            and now.fds <= target.fds
            and now.children <= target.children
            and (clients is None or clients <= (target.redis_clients or 0))
        )
        if settled or waited >= give_up_after:
            return now, waited
        say(
            f"  after close: {len(now.tasks)} tasks, {now.os_threads} threads "
            f"({now.anyio_workers} anyio workers), {now.fds} fds, {now.children} children"
            + (f", {clients} redis clients" if clients is not None else "")
            + f"; waiting ({give_up_after - waited:.0f} s left)"
        )
        await anyio.sleep(1)
