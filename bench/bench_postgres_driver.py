"""Which PostgreSQL driver the Postgres backend runs on: psycopg 3 against asyncpg.

Run: `python -m bench.bench_postgres_driver [OPERATIONS]` (starts its own private cluster, as the
tests do). Each driver, through its own pool of one connection on the same unix socket, runs the
three shapes of statement the backend's calls are made of: a single-row upsert (autocommit), a
single-row select by primary key, and a small transaction (BEGIN; lock a row; upsert; insert a
feed row; COMMIT). Rounds interleave the drivers; each ratio is psycopg's rate over asyncpg's
within a round (above 1: psycopg is faster). Both use prepared statements (psycopg prepares a
statement after its 5th run by default; asyncpg always does).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from bench._util import median, publish, table

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

ROUNDS = 5
OPERATIONS = 2000
SHAPES = ("upsert", "select", "transaction")
SETUP = """
DROP TABLE IF EXISTS bench_kv, bench_feed, bench_head;
CREATE TABLE bench_kv (key text COLLATE "C" PRIMARY KEY, value bytea NOT NULL, version bigint);
CREATE TABLE bench_feed (seq bigint PRIMARY KEY, key text, value bytea);
CREATE TABLE bench_head (id int PRIMARY KEY, seq bigint NOT NULL);
INSERT INTO bench_head VALUES (1, 0);
"""
UPSERT = (
    "INSERT INTO bench_kv VALUES ({0}, {1}, 1) ON CONFLICT (key) DO UPDATE "
    "SET value = excluded.value, version = bench_kv.version + 1"
)
SELECT = "SELECT value, version FROM bench_kv WHERE key = {0}"
HEAD = "UPDATE bench_head SET seq = seq + 1 WHERE id = 1 RETURNING seq"
FEED = "INSERT INTO bench_feed VALUES ({0}, {1}, {2})"
VALUE = b"x" * 200


def _sql(template: str, style: str) -> str:
    marks = ["%s"] * 3 if style == "psycopg" else ["$1", "$2", "$3"]
    return template.format(*marks)


async def _psycopg(url: str, count: int) -> dict[str, float]:
    from psycopg_pool import AsyncConnectionPool

    async with AsyncConnectionPool(url, min_size=1, max_size=1, open=False) as pool:
        await pool.open(wait=True)
        upsert, select = _sql(UPSERT, "psycopg"), _sql(SELECT, "psycopg")
        feed = _sql(FEED, "psycopg")

        async def do_upsert(i: int) -> None:
            async with pool.connection() as conn:
                await conn.execute(upsert, (f"k{i % 100}", VALUE))

        async def do_select(i: int) -> None:
            async with pool.connection() as conn:
                cur = await conn.execute(select, (f"k{i % 100}",))
                await cur.fetchone()

        async def do_txn(i: int) -> None:
            async with pool.connection() as conn, conn.transaction():
                cur = await conn.execute(HEAD)
                row = await cur.fetchone()
                assert row is not None
                await conn.execute(upsert, (f"k{i % 100}", VALUE))
                await conn.execute(feed, (row[0], f"k{i % 100}", VALUE))

        return await _measure(count, do_upsert, do_select, do_txn)


async def _asyncpg(url: str, count: int) -> dict[str, float]:
    import asyncpg

    pool = await asyncpg.create_pool(_asyncpg_dsn(url), min_size=1, max_size=1)
    try:
        upsert, select = _sql(UPSERT, "asyncpg"), _sql(SELECT, "asyncpg")
        feed = _sql(FEED, "asyncpg")

        async def do_upsert(i: int) -> None:
            async with pool.acquire() as conn:
                await conn.execute(upsert, f"k{i % 100}", VALUE)

        async def do_select(i: int) -> None:
            async with pool.acquire() as conn:
                await conn.fetchrow(select, f"k{i % 100}")

        async def do_txn(i: int) -> None:
            async with pool.acquire() as conn, conn.transaction():
                seq = await conn.fetchval(HEAD)
                await conn.execute(upsert, f"k{i % 100}", VALUE)
                await conn.execute(feed, seq, f"k{i % 100}", VALUE)

        return await _measure(count, do_upsert, do_select, do_txn)
    finally:
        await pool.close()


def _asyncpg_dsn(url: str) -> str:
    """asyncpg reads `host=` from the query as psycopg does; it wants no empty netloc host."""
    return url


async def _measure(count: int, *operations: Callable[[int], Awaitable[None]]) -> dict[str, float]:
    rates: dict[str, float] = {}
    for shape, operation in zip(SHAPES, operations, strict=True):
        for i in range(50):  # warm up: prepared statements, the pool
            await operation(i)
        start = time.perf_counter()
        for i in range(count):
            await operation(i)
        rates[shape] = count / (time.perf_counter() - start)
    return rates


async def run(url: str, count: int = OPERATIONS) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SETUP)
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(ROUNDS):
        ours = await _psycopg(url, count)
        theirs = await _asyncpg(url, count)
        rounds.append({shape: (ours[shape], theirs[shape]) for shape in SHAPES})
    rows = []
    for shape in SHAPES:
        ratios = [figures[shape][0] / figures[shape][1] for figures in rounds]
        rows.append(
            [
                shape,
                f"{median([figures[shape][0] for figures in rounds]):,.0f}/s",
                f"{median([figures[shape][1] for figures in rounds]):,.0f}/s",
                f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            ]
        )
    notes = [
        f"{count} operations per shape per driver per round, {ROUNDS} interleaved rounds, one "
        "pooled connection over a unix socket to a private PostgreSQL cluster.",
        "The ratio is psycopg 3's rate over asyncpg's in the same round (median, range).",
    ]
    return table(
        "PostgreSQL drivers: psycopg 3 (psycopg_pool) against asyncpg",
        ["operation", "psycopg 3", "asyncpg", "psycopg / asyncpg"],
        rows,
        notes,
    )


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else OPERATIONS
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests._postgres_server import PostgresServer

    server = PostgresServer(fsync=True)
    server.start()
    try:
        text = anyio.run(run, server.url, count)
    finally:
        server.stop()
    publish("postgres_driver", text)


if __name__ == "__main__":
    main()
