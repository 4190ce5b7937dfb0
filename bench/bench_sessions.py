"""Sessions: message history at 100 and 100,000 messages; the sync API's overhead.

Run: `python -m bench.bench_sessions` (starts its own redis-server on loopback TCP).

- `add_message` and `get_messages(last=50)` on sessions holding 100 and 100,000 messages, on
  Redis, SQLite and memory (target: the 100,000-message figures within 1.5x of the 100-message
  ones). The long history is filled with `save_many` in the manager's documented key layout
  (docs/sessions.md; a fill through `add_message` would take minutes and measure nothing more).
- A blocking `sync.StateManager.get` against an awaited `StateManager.get`, on the memory backend
  (target: under 2x the time) and on Redis.

Rounds alternate the two sizes (and the two APIs) and each ratio is taken within a round, since
the machine's speed drifts; tables show the median ratio and the range.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate import SessionManager, SessionMessage, StateConfig, StateManager, sync
from bench._util import publish, rate, redis_server, sync_rate, table

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

SIZES = (100, 100_000)
ROUNDS = 6
OPS = 200
FILL_BATCH = 2000


def message_key(session_id: str, seq: int) -> str:
    """The key of message `seq` in the documented layout (docs/sessions.md)."""
    return f"sessions:{{{session_id}}}:msg:{seq:012d}"


def meta_key(session_id: str) -> str:
    """The key of the `Session` record in the documented layout (docs/sessions.md)."""
    return f"sessions:{{{session_id}}}:meta"


def set_count(count: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda meta: {**meta, "message_count": count}


async def fill(sessions: SessionManager, session_id: str, count: int) -> None:
    """Give `session_id` `count` messages, in batches, in the manager's key layout."""
    for start in range(1, count + 1, FILL_BATCH):
        stop = min(count, start + FILL_BATCH - 1)
        await sessions.state.save_many(
            {
                message_key(session_id, n): SessionMessage(
                    session_id=session_id, seq=n, role="user", content=f"message {n} " * 8
                )
                for n in range(start, stop + 1)
            },
            ttl=None,
        )
    await sessions.state.update(meta_key(session_id), set_count(count))


def operations(
    sessions: SessionManager, session_id: str
) -> tuple[Callable[[int], Awaitable[object]], Callable[[int], Awaitable[object]]]:
    """The two measured operations on `session_id`: add a message, read the last 50."""
    return (
        lambda n: sessions.add_message(session_id, "user", f"m{n}"),
        lambda _: sessions.get_messages(session_id, last=50),
    )


async def history_rates(config: StateConfig) -> dict[str, list[float]]:
    """Per round: add and last-50 rates for each size."""
    async with StateManager(config) as state:
        sessions = SessionManager(state_manager=state)
        ids = {}
        for size in SIZES:
            session = await sessions.create_session("bench", session_id=f"s{size}")
            await fill(sessions, session.session_id, size)
            ids[size] = session.session_id
        rates: dict[str, list[float]] = {}
        for round_number in range(ROUNDS):
            # Alternate which size goes first, so a drift in the machine's speed within a
            # round does not always favour the same size.
            for size in SIZES if round_number % 2 == 0 else SIZES[::-1]:
                add, last = operations(sessions, ids[size])
                rates.setdefault(f"add{size}", []).append(await rate(add, OPS))
                rates.setdefault(f"last{size}", []).append(await rate(last, OPS))
        return rates


def sync_overhead(config: StateConfig, count: int) -> tuple[list[float], float, float]:
    """Per round: blocking get time / awaited get time."""
    ratios: list[float] = []
    async_rate = blocking_rate = 0.0

    async def awaited() -> float:
        async with StateManager(config) as state:
            await state.save("k", {"status": "idle", "progress": 0.5})
            return await rate(lambda _: state.get("k"), count)

    with sync.StateManager(config) as blocking:
        blocking.save("k", {"status": "idle", "progress": 0.5})
        for _ in range(ROUNDS):
            async_rate = anyio.run(awaited)
            blocking_rate = sync_rate(lambda _: blocking.get("k"), count)
            ratios.append(async_rate / blocking_rate)
    return ratios, async_rate, blocking_rate


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def run() -> str:
    results = {}
    overheads = {}
    with redis_server() as url:
        redis_config = StateConfig(backend="redis", redis_url=url, key_prefix="bs:")
        results["Redis"] = anyio.run(history_rates, redis_config)
        overheads["Redis"] = sync_overhead(redis_config, 1000)
    overheads["memory"] = sync_overhead(StateConfig(backend="memory"), 3000)
    results["memory"] = anyio.run(history_rates, StateConfig(backend="memory"))
    with tempfile.TemporaryDirectory() as directory:
        sqlite_config = StateConfig(backend="sqlite", sqlite_path=f"{directory}/sessions.db")
        results["SQLite"] = anyio.run(history_rates, sqlite_config)
    rows = []
    for backend, rates in results.items():
        for op, label in (("add", "add_message"), ("last", "get_messages(last=50)")):
            small, large = rates[f"{op}{SIZES[0]}"], rates[f"{op}{SIZES[1]}"]
            # time at 100,000 / time at 100: above 1 means the long history is slower.
            slowdown = [s / big for s, big in zip(small, large, strict=True)]
            rows.append(
                [
                    f"{label}, {backend}",
                    f"{statistics.median(small):,.0f}/s",
                    f"{statistics.median(large):,.0f}/s",
                    spread(slowdown),
                    "met" if statistics.median(slowdown) <= 1.5 else "MISSED",
                ]
            )
    for backend in ("memory", "Redis"):
        ratios, async_rate, blocking_rate = overheads[backend]
        met = statistics.median(ratios) <= 2
        rows.append(
            [
                f"blocking get vs awaited get, {backend}",
                f"{async_rate:,.0f}/s awaited",
                f"{blocking_rate:,.0f}/s blocking",
                spread(ratios),
                ("met" if met else "MISSED") if backend == "memory" else "(no target)",
            ]
        )
    notes = [
        f"{ROUNDS} rounds of {OPS} operations per size; the ratio is the time per operation at "
        "100,000 messages over the time at 100 (target <= 1.5x), within each round.",
        "add_message is two round trips (allocate the number with an atomic update of the session "
        "record, write the message); get_messages(last=50) is one read of the session and one "
        "batch read of 50 keys.",
        "Sync rows: time of a blocking get from the main thread (a hop to the loop thread and "
        "back) over an awaited get in a running loop (target <= 2x on memory); the two sync rows "
        "put the columns as awaited and blocking rates instead of history sizes.",
        f"Taken on a shared, loaded machine at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        ": absolute figures are low and noisy; the ratios are what to read.",
    ]
    return table(
        "Sessions",
        ["workload", "100 messages", "100,000 messages", "ratio (median, range)", "target"],
        rows,
        notes,
    )


def main() -> None:
    publish("sessions", run())


if __name__ == "__main__":
    main()
