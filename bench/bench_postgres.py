"""The Postgres backend against what a user would pick instead, on the same server in one run.

Run: `python -m bench.bench_postgres [ROUNDS]` (starts its own private cluster, as the tests do).

- Key-value: agenticstate's `save` and `get` (a `StateManager` on `PostgresBackend`) against raw
  psycopg 3 on a table of the same shape (`key text PRIMARY KEY, value bytea`): a single-row
  upsert and a single-row select, one at a time, through a pool; 50 concurrent writers (50
  tasks sharing a pool of 10 connections, as the backend's default); listing the 2,000 keys of
  a prefix (`list_keys` against `SELECT key ... ORDER BY key`); and replaying the last 2,000
  changes of the feed (`changes(since=...)` against `SELECT ... FROM a feed table ORDER BY seq`).
- LangGraph: `CheckpointSaver` on Postgres against `AsyncPostgresSaver` (langgraph-checkpoint-
  postgres) on a pool of 10 connections: one thread of 200 turns of a two-node chat graph
  (`bench._thread_workload`), 40 concurrent threads of 10 turns, the 200-turn thread's history
  (`aget_state_history`), resuming 20 threads stopped by an interrupt, and direct `aput`,
  `aget_tuple` and `alist(limit=10)` on a 200-checkpoint chain (`bench.bench_langgraph`); and the
  bytes each keeps for the 200-turn thread (its tables' `pg_total_relation_size` after `VACUUM
  FULL`; ours with and without the change feed's rows).

Rounds alternate the contenders; each ratio is agenticstate's rate over the baseline's within a
round (above 1: agenticstate is faster), reported as the median and range over the rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from bench._util import publish, table
from bench.bench_langgraph import CHECKPOINTS, RESUMES, THREAD_TURNS, THREADS, TURNS

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

ROUNDS = 3
OPERATIONS = 1000
WRITERS, WRITES_EACH = 50, 20
LISTED = 2000
VALUE = {"role": "assistant", "content": "x" * 180}


def _with(url: str, **params: str) -> str:
    extra = "&".join(f"{name}={value}" for name, value in params.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


# ------------------------------------------------------------------ key-value


async def _kv_ours(url: str) -> dict[str, float]:
    from agenticstate import StateConfig, StateManager

    schema = f"kv{uuid.uuid4().hex[:8]}"
    config = StateConfig(backend="postgres", postgres_url=_with(url, schema=schema))
    rates: dict[str, float] = {}
    async with StateManager(config) as state:
        for i in range(50):
            await state.save(f"warm{i}", VALUE)
            await state.get(f"warm{i}")
        rates["upsert"] = await _rate(lambda i: state.save(f"k{i % 100}", VALUE), OPERATIONS)
        rates["select"] = await _rate(lambda i: state.get(f"k{i % 100}"), OPERATIONS)

        async def writer(n: int) -> None:
            for i in range(WRITES_EACH):
                await state.save(f"w{n}:{i}", VALUE)

        rates["50 writers"] = await _concurrent(writer)
        for start in range(0, LISTED, 100):
            await state.save_many({f"list:{i:05}": VALUE for i in range(start, start + 100)})
        cursor = await state.backend.feed_cursor()
        for start in range(0, LISTED, 100):
            await state.save_many({f"feed:{i:05}": VALUE for i in range(start, start + 100)})

        async def listing(_: int) -> None:
            assert len(await state.list_keys("list:*")) == LISTED

        rates["list"] = await _rate(listing, 5) * LISTED

        async def replay(_: int) -> None:
            seen = 0
            async with state.backend.changes("feed:*", since=cursor) as stream:
                async for _change in stream:
                    seen += 1
                    if seen == LISTED:
                        break

        rates["feed replay"] = await _rate(replay, 5) * LISTED
    await _drop(url, schema)
    return rates


RAW_SETUP = """
DROP TABLE IF EXISTS bench_raw_kv, bench_raw_feed;
CREATE TABLE bench_raw_kv (key text COLLATE "C" PRIMARY KEY, value bytea NOT NULL);
CREATE TABLE bench_raw_feed (seq bigint PRIMARY KEY, key text, old bytea, new bytea);
"""
RAW_UPSERT = (
    b"INSERT INTO bench_raw_kv VALUES (%s, %s) ON CONFLICT (key) DO UPDATE "
    b"SET value = excluded.value"
)
RAW_SELECT = b"SELECT value FROM bench_raw_kv WHERE key = %s"
RAW_FEED = b"INSERT INTO bench_raw_feed VALUES (%s, %s, NULL, %s)"
RAW_LIST = b"SELECT key FROM bench_raw_kv WHERE key >= %s AND key < %s ORDER BY key"
RAW_REPLAY = b"SELECT seq, key, old, new FROM bench_raw_feed WHERE seq >= %s ORDER BY seq"


async def _kv_raw(url: str) -> dict[str, float]:
    import msgpack
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(RAW_SETUP.encode())
    rates: dict[str, float] = {}
    async with AsyncConnectionPool(
        url, min_size=1, max_size=10, open=False, kwargs={"autocommit": True}
    ) as pool:
        await pool.open(wait=True)

        async def put(key: str) -> None:
            async with pool.connection() as conn:
                await conn.execute(RAW_UPSERT, (key, msgpack.packb(VALUE)))

        async def get(key: str) -> Any:
            async with pool.connection() as conn:
                row = await (await conn.execute(RAW_SELECT, (key,))).fetchone()
                return None if row is None else msgpack.unpackb(row[0])

        for i in range(50):
            await put(f"warm{i}")
            await get(f"warm{i}")
        rates["upsert"] = await _rate(lambda i: put(f"k{i % 100}"), OPERATIONS)
        rates["select"] = await _rate(lambda i: get(f"k{i % 100}"), OPERATIONS)

        async def writer(n: int) -> None:
            for i in range(WRITES_EACH):
                await put(f"w{n}:{i}")

        rates["50 writers"] = await _concurrent(writer)
        packed = msgpack.packb(VALUE)
        async with pool.connection() as conn, conn.cursor() as cur:
            await cur.executemany(RAW_UPSERT, [(f"list:{i:05}", packed) for i in range(LISTED)])
            await cur.executemany(RAW_FEED, [(i, f"feed:{i:05}", packed) for i in range(LISTED)])

        async def listing(_: int) -> None:
            async with pool.connection() as conn:
                cur = await conn.execute(RAW_LIST, ("list:", "list;"))
                assert len(await cur.fetchall()) == LISTED

        rates["list"] = await _rate(listing, 5) * LISTED

        async def replay(_: int) -> None:
            async with pool.connection() as conn:
                cur = await conn.execute(RAW_REPLAY, (0,))
                assert len(await cur.fetchall()) == LISTED

        rates["feed replay"] = await _rate(replay, 5) * LISTED
    return rates


async def _rate(operation: Callable[[int], Awaitable[object]], count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        await operation(i)
    return count / (time.perf_counter() - start)


async def _concurrent(writer: Callable[[int], Coroutine[Any, Any, None]]) -> float:
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for n in range(WRITERS):
            tg.start_soon(writer, n)
    return WRITERS * WRITES_EACH / (time.perf_counter() - start)


async def _drop(url: str, schema: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())


# ------------------------------------------------------------------ LangGraph


async def _langgraph_workloads(saver: Any, tag: str) -> dict[str, float]:
    """Rates of bench_langgraph's workloads on `saver` (the same graphs and direct calls)."""
    from bench.bench_langgraph import _calls, _chain, _graph_runs

    graph = await _graph_runs(saver, tag)
    calls = await _calls(saver, f"{tag}-direct", _chain(CHECKPOINTS))
    return {
        "1 thread x 200 turns": graph["turns"],
        "40 threads x 10 turns": graph["concurrent"],
        "history (per state)": graph["history"],
        "resume after interrupt": graph["resume"],
        "aput": calls["put"],
        "aget_tuple": calls["get_tuple"],
        "alist(limit=10)": calls["list10"],
    }


async def _langgraph_ours(url: str, schema: str) -> dict[str, float]:
    from agenticstate import StateConfig, StateManager
    from agenticstate.langgraph import CheckpointSaver

    config = StateConfig(backend="postgres", postgres_url=_with(url, schema=schema))
    async with StateManager(config) as state:
        return await _langgraph_workloads(CheckpointSaver(state), uuid.uuid4().hex[:8])


async def _langgraph_theirs(url: str) -> dict[str, float]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    async with AsyncConnectionPool(
        url,
        min_size=1,
        max_size=10,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    ) as pool:
        await pool.open(wait=True)
        rows_are_dicts: Any = pool  # its row_factory makes dict rows, as the saver reads them
        saver = AsyncPostgresSaver(rows_are_dicts)
        await saver.setup()
        return await _langgraph_workloads(saver, uuid.uuid4().hex[:8])


async def _storage(url: str) -> tuple[int, int, int]:
    """The bytes of a 200-turn thread: ours with the feed's rows, ours without, theirs."""
    import psycopg
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from agenticstate import StateConfig, StateManager
    from bench._thread_workload import chat_graph, message_text, run_thread

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        for name in ("bytes_ours", "bytes_theirs"):
            await admin.execute(f"DROP DATABASE IF EXISTS {name}".encode())
            await admin.execute(f"CREATE DATABASE {name}".encode())
    ours_url = url.replace("/postgres?", "/bytes_ours?")
    theirs_url = url.replace("/postgres?", "/bytes_theirs?")
    config = StateConfig(backend="postgres", postgres_url=_with(ours_url, schema="lg"))
    async with StateManager(config) as state:
        await run_thread(state, TURNS)
    async with AsyncPostgresSaver.from_conn_string(theirs_url) as saver:
        await saver.setup()
        graph = chat_graph(saver)
        config_: Any = {"configurable": {"thread_id": "t1"}}
        for turn in range(TURNS):
            await graph.ainvoke(
                {"messages": [HumanMessage(message_text("user", turn), id=f"u{turn}")]}, config_
            )
    with_feed = await _schema_bytes(ours_url, "lg")
    async with await psycopg.AsyncConnection.connect(ours_url, autocommit=True) as conn:
        await conn.execute(b'DELETE FROM "lg".changes')
    without_feed = await _schema_bytes(ours_url, "lg")
    theirs = await _schema_bytes(theirs_url, "public")
    return with_feed, without_feed, theirs


async def _schema_bytes(url: str, schema: str) -> int:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(b"VACUUM FULL")
        cur = await conn.execute(
            b"SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            b"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            b"AND c.relkind IN ('r', 'm')",
            (schema,),
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ the report


def _rows(
    rounds: list[tuple[dict[str, float], dict[str, float]]], baseline: str
) -> tuple[list[list[str]], list[tuple[str, float]]]:
    rows, bars = [], []
    for name in rounds[0][0]:
        ratios = sorted(ours[name] / theirs[name] for ours, theirs in rounds)
        middle = statistics.median(ratios)
        rows.append(
            [
                name,
                f"{statistics.median(o[name] for o, _ in rounds):,.0f}/s",
                f"{statistics.median(t[name] for _, t in rounds):,.0f}/s",
                f"{middle:.2f}x {baseline} ({ratios[0]:.2f}-{ratios[-1]:.2f})",
            ]
        )
        bars.append((name, middle))
    return rows, bars


async def run(url: str, rounds: int = ROUNDS) -> tuple[str, list[tuple[str, float]]]:
    kv: list[tuple[dict[str, float], dict[str, float]]] = []
    lg: list[tuple[dict[str, float], dict[str, float]]] = []
    await _kv_ours(url)  # warm-up: the server's caches, psycopg's prepared statements
    await _kv_raw(url)
    for round_ in range(rounds):
        if round_ % 2 == 0:
            ours, raw = await _kv_ours(url), await _kv_raw(url)
        else:
            raw, ours = await _kv_raw(url), await _kv_ours(url)
        kv.append((ours, raw))
    for round_ in range(rounds):
        schema = f"lg{uuid.uuid4().hex[:8]}"
        if round_ % 2 == 0:
            ours, theirs = await _langgraph_ours(url, schema), await _langgraph_theirs(url)
        else:
            theirs, ours = await _langgraph_theirs(url), await _langgraph_ours(url, schema)
        await _drop(url, schema)
        lg.append((ours, theirs))
    with_feed, without_feed, theirs_bytes = await _storage(url)
    kv_rows, kv_bars = _rows(kv, "raw")
    lg_rows, lg_bars = _rows(lg, "AsyncPostgresSaver")
    lg_rows.append(
        [
            "storage, 200-turn thread",
            f"{with_feed / 1024:,.0f} KiB ({without_feed / 1024:,.0f} KiB without the feed)",
            f"{theirs_bytes / 1024:,.0f} KiB",
            f"{with_feed / theirs_bytes:.2f}x its bytes ({without_feed / theirs_bytes:.2f}x "
            "without the feed)",
        ]
    )
    notes = [
        f"{rounds} rounds after a warm-up, the contenders alternating first; ratios are "
        "agenticstate's rate over the baseline's within a round: median (range). One private "
        "PostgreSQL cluster over a unix socket, fsync on.",
        f"Key-value: {OPERATIONS} sequential saves and gets of a ~200-byte dict on 100 keys; "
        f"{WRITERS} tasks x {WRITES_EACH} saves of distinct keys at once, pools of 10 "
        f"connections; list: {LISTED} keys of a prefix (per key); feed replay: the last "
        f"{LISTED} changes (per change). raw: psycopg 3 with msgpack on a two-column table, no "
        "versions, no change feed, no history.",
        f"LangGraph: a two-node chat graph ({TURNS} turns of one thread; {THREADS} threads x "
        f"{THREAD_TURNS} turns at once), the long thread's state history, {RESUMES} threads "
        "interrupted before their second node and resumed, and a 200-checkpoint chain put, read "
        "back by id and paged with alist(limit=10). AsyncPostgresSaver on a psycopg pool of 10.",
        "Taken on a shared, loaded 2-core machine: the ratios are the figures to read.",
    ]
    text = table(
        "PostgreSQL: agenticstate against raw psycopg 3",
        ["operation", "agenticstate", "raw psycopg", "ratio"],
        kv_rows,
        [],
    )
    text += "\n" + table(
        "PostgreSQL: CheckpointSaver against AsyncPostgresSaver",
        ["workload", "agenticstate", "AsyncPostgresSaver", "ratio"],
        lg_rows,
        notes,
    )
    return text, kv_bars + [(f"LangGraph {name}", value) for name, value in lg_bars]


def main(rounds: int | None = None) -> None:
    """Run the benchmark and publish it (`python -m bench` sets `ROUNDS` and calls this)."""
    rounds = ROUNDS if rounds is None else rounds
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests._postgres_server import PostgresServer

    server = PostgresServer(fsync=True)
    server.start()
    try:
        text, bars = anyio.run(run, server.url, rounds)
    finally:
        server.stop()
    publish("postgres", text, bars)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
