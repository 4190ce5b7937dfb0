"""What a LangGraph thread costs in storage as it grows: `CheckpointSaver` and LangGraph's savers.

Run: `python -m bench.bench_langgraph_storage [TURNS ...]` (25, 50, 100 and 200 turns by default;
starts its own redis-server, and a private PostgreSQL when `initdb` and `pg_ctl` of PostgreSQL 15
and `langgraph-checkpoint-postgres` are there). The thread is `bench._thread_workload`: a two-node
chat graph whose `messages` channel (`add_messages`) grows by three 800-character messages a turn.

What is counted, per contender:

- memory: the bytes the saver holds, keys and values (`CheckpointSaver` on a `MemoryBackend`
  without a feed: every key and its encoded value; `InMemorySaver`: every string and bytes in its
  storage, blobs and writes), without Python's object overhead;
- SQLite: the database file after a WAL checkpoint and VACUUM (`CheckpointSaver` on a
  `SQLiteBackend`, change feed rows included; `AsyncSqliteSaver`);
- Redis: the MEMORY USAGE of every key of a database of its own (`CheckpointSaver` on a
  `RedisBackend` with its feed, `FeedRetention()`);
- PostgreSQL: `pg_total_relation_size` of `AsyncPostgresSaver`'s tables after VACUUM FULL.

Targets: 200 turns hold at most 2.2x what 100 turns hold, and `CheckpointSaver` holds at most a
quarter of `AsyncSqliteSaver`'s bytes on SQLite and of `InMemorySaver`'s on memory.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from langchain_core.messages import HumanMessage

from agenticstate import FeedRetention, MemoryBackend, StateManager
from agenticstate.langgraph import CheckpointSaver
from bench import _thread_workload
from bench._thread_workload import (
    MESSAGE_CHARS,
    _file_bytes,
    chat_graph,
    message_text,
    redis_thread_bytes,
    sqlite_thread_bytes,
)
from bench._util import CHARTS, publish, redis_server, table

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "TURNS",
    "async_sqlite_saver_bytes",
    "in_memory_saver_bytes",
    "memory_bytes",
    "run_graph",
]

TURNS = (25, 50, 100, 200)
_PG_BIN = Path("/usr/lib/postgresql/15/bin")


async def run_graph(saver: Any, turns: int, thread: str = "t1") -> None:
    """Run `turns` turns of the chat thread on any LangGraph checkpointer."""
    graph = chat_graph(saver)
    config: Any = {"configurable": {"thread_id": thread}}
    for turn in range(turns):
        await graph.ainvoke(
            {"messages": [HumanMessage(message_text("user", turn), id=f"u{turn}")]}, config
        )


def _payload(item: object) -> int:
    """The bytes of every string and bytes in a nest of dicts, lists and tuples."""
    if isinstance(item, bytes | str):
        return len(item)
    if isinstance(item, dict):
        return sum(_payload(key) + _payload(value) for key, value in item.items())
    if isinstance(item, list | tuple):
        return sum(_payload(value) for value in item)
    return 0


async def memory_bytes(turns: int, **options: Any) -> int:
    """Keys and encoded values a `turns`-turn thread leaves in a `MemoryBackend` (no feed)."""
    backend = MemoryBackend(feed=None)
    async with StateManager(backend=backend) as state:
        await run_graph(CheckpointSaver(state, **options), turns)
        keys = [key async for key in backend.scan("*")]
        entries = await backend.get_many(keys)
        pairs = zip(keys, entries, strict=True)
        return sum(len(key) + len(entry.value) for key, entry in pairs if entry is not None)


async def in_memory_saver_bytes(turns: int) -> int:
    """The strings and bytes LangGraph's `InMemorySaver` holds for a `turns`-turn thread."""
    from langgraph.checkpoint.memory import InMemorySaver

    saver = InMemorySaver()
    await run_graph(saver, turns)
    return _payload(saver.storage) + _payload(saver.blobs) + _payload(saver.writes)


async def async_sqlite_saver_bytes(path: Path, turns: int) -> int:
    """The file size of LangGraph's `AsyncSqliteSaver` holding a `turns`-turn thread."""
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        await run_graph(saver, turns)
    return _file_bytes(path)


@contextlib.contextmanager
def _postgres() -> Iterator[str | None]:
    """A private PostgreSQL 15 on a unix socket (run as the `postgres` user), or `None`."""
    try:
        import langgraph.checkpoint.postgres  # noqa: F401
    except ImportError:
        yield None
        return
    runuser = shutil.which("runuser")
    if not (_PG_BIN / "initdb").exists() or runuser is None or os.geteuid() != 0:
        yield None
        return
    directory = Path(tempfile.mkdtemp(prefix="bench-pg-"))
    shutil.chown(directory, "postgres")
    data = directory / "data"
    as_postgres: list[str] = [runuser, "-u", "postgres", "--"]
    initdb, pg_ctl = str(_PG_BIN / "initdb"), str(_PG_BIN / "pg_ctl")
    subprocess.run(
        [*as_postgres, initdb, "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    options = f"-p 55437 -k {directory} -c listen_addresses=''"
    start = [*as_postgres, pg_ctl, "-D", str(data), "-o", options, "-l", str(directory / "log")]
    subprocess.run([*start, "-w", "start"], check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@/postgres?host={directory}&port=55437"
    finally:
        subprocess.run(
            [*as_postgres, pg_ctl, "-D", str(data), "-m", "fast", "stop"],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(directory, ignore_errors=True)


async def _postgres_saver_bytes(url: str, turns: int) -> int:
    import psycopg
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        await admin.execute("DROP SCHEMA public CASCADE")
        await admin.execute("CREATE SCHEMA public")
    async with AsyncPostgresSaver.from_conn_string(url) as saver:
        await saver.setup()
        await run_graph(saver, turns)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        await admin.execute("VACUUM FULL")
        cursor = await admin.execute(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r'"
        )
        row = await cursor.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _random_text(kind: str, turn: int) -> str:
    """A message of random letters and spaces: text that compresses about as badly as prose
    does well (zlib: about 0.6 of its size), the same on every run."""
    rng = random.Random(f"{kind} {turn}")
    head = f"{kind} {turn}: "
    letters = "abcdefghijklmnopqrstuvwxyz "
    return head + "".join(rng.choice(letters) for _ in range(MESSAGE_CHARS - len(head)))


@contextlib.contextmanager
def random_text() -> Iterator[None]:
    """Run the thread with messages of random letters (`_random_text`) instead."""
    original = _thread_workload.message_text
    _thread_workload.message_text = _random_text
    try:
        yield
    finally:
        _thread_workload.message_text = original


async def measure(
    turns: list[int], redis_url: str, postgres_url: str | None
) -> dict[str, list[int]]:
    """Bytes per contender, one figure per turn count."""
    figures: dict[str, list[int]] = {}

    def add(name: str, value: int) -> None:
        figures.setdefault(name, []).append(value)

    for count in turns:
        add("ours, memory", await memory_bytes(count))
        add("InMemorySaver", await in_memory_saver_bytes(count))
        with tempfile.TemporaryDirectory() as directory:
            with_feed, _ = await sqlite_thread_bytes(Path(directory) / "ours.db", count)
            add("ours, SQLite", with_feed)
            add(
                "AsyncSqliteSaver",
                await async_sqlite_saver_bytes(Path(directory) / "theirs.db", count),
            )
        add("ours, Redis", await redis_thread_bytes(redis_url, 3, FeedRetention(), count))
        if postgres_url is not None:
            add("AsyncPostgresSaver", await _postgres_saver_bytes(postgres_url, count))
        with random_text():
            add("ours, memory, random text", await memory_bytes(count))
            add("InMemorySaver, random text", await in_memory_saver_bytes(count))
    return figures


def _chart(turns: list[int], figures: dict[str, list[int]]) -> None:
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(8, 4.8), layout="constrained")
    for name, values in figures.items():
        style = ("-o" if name.startswith("ours") else "--s") if "random" not in name else ":^"
        axes.plot(turns, [value / 1e6 for value in values], style, label=name)
    axes.set_xlabel("turns in the thread")
    axes.set_ylabel("MB stored")
    axes.set_xscale("log")  # log-log: a saver growing linearly climbs at slope 1, quadratically 2
    axes.set_yscale("log")
    axes.set_xticks(turns, [str(count) for count in turns])
    axes.minorticks_off()
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.suptitle("Storage of one LangGraph thread as it grows (log-log)")
    CHARTS.mkdir(parents=True, exist_ok=True)
    figure.savefig(CHARTS / "langgraph_storage.png", dpi=110)
    plt.close(figure)


async def run(redis_url: str, turns: list[int], postgres_url: str | None) -> str:
    figures = await measure(turns, redis_url, postgres_url)
    _chart(turns, figures)
    rows = [
        [name, *(f"{value / 1e6:.2f} MB" for value in values)] for name, values in figures.items()
    ]
    notes = []
    if 100 in turns and 200 in turns:
        at = turns.index(100), turns.index(200)
        growth = ", ".join(
            f"{name} {values[at[1]] / values[at[0]]:.2f}x" for name, values in figures.items()
        )
        notes.append(f"200 turns against 100 (target at most 2.2x): {growth}.")
    last = len(turns) - 1
    for ours, theirs in (("ours, memory", "InMemorySaver"), ("ours, SQLite", "AsyncSqliteSaver")):
        share = figures[ours][last] / figures[theirs][last]
        notes.append(f"{ours} at {turns[last]} turns: {share:.3f} of {theirs} (target 0.25).")
    if postgres_url is None:
        notes.append(
            "AsyncPostgresSaver: not measured (no PostgreSQL 15 or langgraph-checkpoint-postgres)."
        )
    notes.append(
        "The thread's messages repeat the alphabet, which zlib compresses about 50x: the whole "
        "copies `CheckpointSaver` keeps every 16 versions weigh little. The `random text` rows "
        "run the same thread with random letters (zlib: about 0.6x), the worst case for them: "
        "their share grows with the thread (see docs/langgraph.md, Storage and retention)."
    )
    return table(
        "LangGraph storage: one thread as it grows, CheckpointSaver against LangGraph's savers",
        ["saver", *(f"{count} turns" for count in turns)],
        rows,
        notes,
    )


async def _main(turns: list[int]) -> str:
    with redis_server() as url, _postgres() as postgres_url:
        return await run(url, turns, postgres_url)


def main() -> None:
    turns = [int(arg) for arg in sys.argv[1:]] or list(TURNS)
    publish("langgraph_storage", anyio.run(_main, turns))


if __name__ == "__main__":
    main()
