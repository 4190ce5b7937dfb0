"""`update` on Redis: through a LocalView (version known), through StateManager, and a raw SET.

Run: `python -m bench.bench_update` (starts its own redis-server on loopback TCP).

`LocalView.update` computes the new value from the view's copy and sends one conditional write;
`StateManager.update` reads the key first (GET, then the conditional write). Issue 21 asks for
an update with a known version at 0.8x a raw SET or better.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import redis.asyncio as aioredis

from agenticstate import StateConfig, StateManager
from bench._util import median, publish, rate, ratio_of, redis_server, table

N = 3000
KEYS = 100
ROUNDS = 5
VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
RAW = json.dumps(VALUE).encode()

# (row label, our operation); every ratio is against a raw SET of the same value, per round.
ROWS = [
    ("update, merge (LocalView.update, version known)", "v_merge"),
    ("update, function (LocalView.update, version known)", "v_function"),
    ("update, merge (StateManager.update)", "s_merge"),
    ("update, function (StateManager.update)", "s_function"),
    ("save (StateManager), for reference", "s_save"),
    ("save, nobody subscribed (another StateManager)", "p_save"),
]


async def _server_cpu(raw: aioredis.Redis) -> float:
    """Seconds of CPU the redis-server has used (user + system, main thread included)."""
    info = await raw.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _costed(raw: aioredis.Redis, operation: Any, count: int) -> tuple[float, float, float]:
    """Operations per second, and client and server CPU microseconds per operation.

    CPU time is what each side spent, whatever else the machine was doing: a steadier figure
    than the rate on a loaded machine.
    """
    server = await _server_cpu(raw)
    client = time.process_time()
    per_second = await rate(operation, count)
    client_us = (time.process_time() - client) / count * 1e6
    server_us = (await _server_cpu(raw) - server) / count * 1e6
    return per_second, client_us, server_us


def _progress(i: int) -> Any:
    def step(value: Any) -> Any:
        value["progress"] = i
        return value

    return step


async def measure(url: str) -> tuple[list[list[str]], dict[str, float]]:
    raw = aioredis.Redis.from_url(url)
    config = StateConfig(backend="redis", redis_url=url, key_prefix="u:")
    # A namespace no subscription covers: its saves show what the subscription costs the others.
    alone = StateConfig(backend="redis", redis_url=url, key_prefix="p:")
    async with StateManager(config) as state, StateManager(alone) as plain:
        await raw.ping()
        await state.save_many({f"v:k{i}": VALUE for i in range(KEYS)})
        await state.save_many({f"s:k{i}": VALUE for i in range(KEYS)})
        async with state.view("v:*") as view:
            operations = {
                "raw_set": lambda i: raw.set(f"r:k{i % KEYS}", RAW),
                "v_merge": lambda i: view.update(f"v:k{i % KEYS}", {"progress": i}),
                "v_function": lambda i: view.update(f"v:k{i % KEYS}", _progress(i)),
                "s_merge": lambda i: state.update(f"s:k{i % KEYS}", {"progress": i}),
                "s_function": lambda i: state.update(f"s:k{i % KEYS}", _progress(i)),
                "s_save": lambda i: state.save(f"s:k{i % KEYS}", VALUE),
                "p_save": lambda i: plain.save(f"s:k{i % KEYS}", VALUE),
            }
            for operation in operations.values():  # warm every path up first
                await rate(operation, 300)
            conflicts = state.stats().conflicts
            rounds = []
            costs: dict[str, list[tuple[float, float]]] = {name: [] for name in operations}
            # Interleaved rounds, ratios taken within each (the machine's speed drifts).
            for _ in range(ROUNDS):
                figures = {}
                for name, op in operations.items():
                    figures[name], client_us, server_us = await _costed(raw, op, N)
                    costs[name].append((client_us, server_us))
                rounds.append(figures)
            conflicts = state.stats().conflicts - conflicts
        await raw.aclose()
    rows = []
    summary = {}
    for label, name in [*ROWS, ("raw SET (redis-py)", "raw_set")]:
        ratios = [figures[name] / figures["raw_set"] for figures in rounds]
        summary[name] = median(ratios)
        client_us = median([client for client, _ in costs[name]])
        server_us = median([server for _, server in costs[name]])
        rows.append(
            [
                label,
                f"{median([figures[name] for figures in rounds]):,.0f}",
                f"{median([figures['raw_set'] for figures in rounds]):,.0f} (raw SET)",
                f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{client_us:.0f} + {server_us:.0f}",
            ]
        )
    summary["conflicts"] = conflicts
    return rows, summary


def run() -> tuple[str, list[tuple[str, float]]]:
    with redis_server() as url:
        rows, summary = anyio.run(measure, url)
    view_ratio = min(summary["v_merge"], summary["v_function"])
    notes = [
        f"{ROUNDS} interleaved rounds of {N} sequential operations each over {KEYS} keys "
        "(asyncio, hiredis, loopback TCP). Each ratio is taken within a round; shown: the median "
        "rate, the median ratio and the range of ratios over the rounds.",
        "LocalView.update sends one EVALSHA (the conditional write) per update; "
        "StateManager.update sends a GET and then the EVALSHA. The view's subscription receives "
        "each write's change on the same event loop (and skips it: the view already holds it); "
        "the manager's other writes are received too (its pub/sub connection covers the whole "
        "namespace) and filtered out: compare the two save rows.",
        "CPU µs/op: the process's CPU time and the redis-server's (INFO cpu), per operation, "
        "medians over the rounds: steadier than the rates when the machine is shared.",
        f"Conflicts during the measured rounds: {summary['conflicts']:.0f} (the view was never "
        "stale: each update found its version current).",
        "Target update with a known version >= 0.8x raw SET: "
        f"{'met' if view_ratio >= 0.8 else 'NOT met'} on this run ({view_ratio:.2f}x).",
    ]
    text = table(
        "update on Redis: operations per second",
        [
            "operation",
            "agenticstate ops/s",
            "baseline ops/s",
            "ratio (range)",
            "CPU µs/op: client + server",
        ],
        rows,
        notes,
    )
    bars = [(row[0], ratio_of(row[3]) or 0.0) for row in rows[:-1]]
    return text, bars


def main() -> None:
    text, bars = run()
    publish("update", text, bars)


if __name__ == "__main__":
    main()
