"""What the soak measures: the process (tasks, threads, descriptors, children, memory), the
store (keys, files on disk) and the Redis server (INFO), through public APIs only.

Linux only: it reads /proc/self.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from agenticstate import FileBackend

if TYPE_CHECKING:
    from collections.abc import Callable

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
    redis_clients: int | None = None  # the server's connected clients, our INFO one included

    @property
    def threads_besides_pool(self) -> int:
        """OS threads that are not anyio's worker pool (which keeps idle threads for 10 s)."""
        return self.os_threads - self.anyio_workers


def measure_process(redis_clients: int | None = None) -> Process:
    """Tasks on the running loop (but the caller's), threads, descriptors and children."""
    current = asyncio.current_task()
    tasks = sorted(describe_task(t) for t in asyncio.all_tasks() if t is not current)
    names = [thread.name for thread in threading.enumerate()]
    return Process(
        tasks=tasks,
        os_threads=len(os.listdir("/proc/self/task")),
        anyio_workers=names.count(ANYIO_WORKER),
        other_threads=sorted(name for name in names if name != ANYIO_WORKER),
        fds=len(os.listdir("/proc/self/fd")),
        children=len(children()),
        redis_clients=redis_clients,
    )


@dataclass
class Memory:
    """Live allocations (blocks, and bytes while tracemalloc traces) and the resident set size."""

    blocks: int
    rss: int
    traced: int | None = None


# Larger than the library's two bounded caches: key validation remembers up to 4,096 keys, the
# glob compiler an LRU of 1,024 patterns (docs/reliability.md).
PRIMER_KEYS = tuple(f"soak:primer:{n}" for n in range(4096))
PRIMER_PATTERNS = tuple(f"soak:primer:{n}:*" for n in range(1024))
OTHER_PATTERNS = tuple(f"soak:other:{n}:*" for n in range(1024))


async def prime_bounded_caches(
    state: StateManager, patterns: tuple[str, ...] = PRIMER_PATTERNS
) -> None:
    """Fill the library's bounded caches with the soak's own keys and patterns.

    Both caches are capped, so they are not leaks, but they fill during the run with the run's
    keys and patterns and would blur a comparison of live memory. Through the public API the
    soak cannot empty them, so before each reading it fills them with strings it keeps alive
    anyway: after `get_many` of `PRIMER_KEYS` the key cache holds only those keys (it empties
    itself when full), and after a `watch` on each of `PRIMER_PATTERNS` the LRU holds exactly
    those patterns' matchers. (`OTHER_PATTERNS` evict them all, so that the next priming makes
    them anew: under tracemalloc, that is the start of the traced leg.)
    """
    await state.get_many(list(PRIMER_KEYS))
    for pattern in patterns:
        async with state.watch(pattern):
            pass


def clear_type_cache() -> None:
    """Empty CPython's type attribute cache (4,096 slots), which keeps the last attribute name
    looked up in each slot alive: `datetime.timestamp()` on an aware datetime (the managers'
    `sort_time`) looks the tzinfo's method up by a name it builds each time, a fresh
    "utcoffset" string per slot."""
    sys._clear_type_cache()


def measure_memory() -> Memory:
    """Collect garbage (a full collection also empties the free lists) and read the live
    blocks, traced bytes and RSS. Call `prime_bounded_caches` first."""
    clear_type_cache()
    gc.collect()
    gc.collect()
    return Memory(
        blocks=sys.getallocatedblocks(),
        rss=rss_bytes(),
        traced=tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None,
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


@dataclass
class Growth:
    """Traced allocations that grew between two snapshots, by source line."""

    lines: list[str]  # the largest, formatted
    total: int  # bytes, every line
    resized: int  # bytes on lines that grew by at most one block: containers reallocated


def traced_growth(before: Path, limit: int = 8) -> Growth:
    """The source lines whose traced allocations grew most since the snapshot at `before`.

    A line that grew by at most one block is a container that reallocated its table when it
    resized (the store's dict, the key cache's set): a dict or set keeps the table of its
    largest size, so that growth is bounded by the most items ever held. It is counted apart
    (`resized`); a leak of an object per operation adds a block per operation.
    """
    old = tracemalloc.Snapshot.load(str(before))
    new = tracemalloc.take_snapshot()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = new.filter_traces(ignore).compare_to(old.filter_traces(ignore), "lineno")
    growth = Growth([], sum(stat.size_diff for stat in stats), 0)
    for stat in stats:
        frame = stat.traceback[0]
        one_block = stat.count_diff <= 1 and stat.size_diff > 0
        if one_block:
            growth.resized += stat.size_diff
        if len(growth.lines) < limit:
            growth.lines.append(
                f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  "
                f"{frame.filename}:{frame.lineno}" + ("  (one block: resized)" if one_block else "")
            )
    return growth


@dataclass
class Store:
    """What the store holds."""

    keys: int
    snapshot_bytes: int | None = None  # file
    log_bytes: int | None = None
    files: list[str] | None = None
    redis_keys: int | None = None  # the whole server, sorted-set indexes included
    redis_memory: int | None = None


def store_files(state: StateManager) -> tuple[Path, Path] | None:
    """A file store's snapshot and log paths; None on other backends."""
    backend = state.backend
    if isinstance(backend, FileBackend):
        return backend.snapshot_path, backend.log_path
    return None


async def measure_store(state: StateManager, redis: RedisProbe | None) -> Store:
    """Count keys; on a file store, the files (after a flush(), for comparable sizes)."""
    store = Store(keys=len(await state.list_keys("*")))
    paths = store_files(state)
    if paths is not None:
        store.snapshot_bytes, store.log_bytes = file_sizes(*paths)
        store.files = sorted(path.name for path in paths[0].parent.iterdir())
    if redis is not None:
        info = await redis.info()
        store.redis_keys = info["keys"]
        store.redis_memory = info["used_memory"]
    return store


def file_sizes(snapshot_path: Path, log_path: Path) -> tuple[int, int]:
    """The snapshot's and the log's sizes in bytes (0 when missing)."""
    sizes: list[int] = []
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

        self.client: aioredis.Redis = aioredis.Redis.from_url(url)

    async def clients(self) -> int:
        """The server's connected clients (this one included)."""
        return (await self.info())["connected_clients"]

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
    target: Process, redis: RedisProbe | None, give_up_after: float, say: Callable[[str], None]
) -> tuple[Process, float]:
    """Measure the process until it is back to `target` or `give_up_after` seconds pass.

    anyio keeps idle worker threads for 10 s and stops them only when the next thread call
    comes: one no-op thread call per poll lets it prune them.
    """
    start = anyio.current_time()
    while True:
        await anyio.to_thread.run_sync(lambda: None)
        clients = await redis.clients() if redis is not None else None
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
