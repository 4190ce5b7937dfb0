"""Redis Cluster: a 1-primary cluster against a plain server, and saves with 1, 2 and 3 primaries.

Run: `python -m bench.bench_cluster` (starts its own clusters on loopback: redis-server with
`--cluster-enabled yes` and `redis-cli --cluster create`).

First, in one process, `save` and `get` one after another on a plain redis-server and on a
1-primary cluster, in interleaved rounds (issue #21: the cluster's path costs at most 5% more).
Then the throughput of 4 client processes with 1, 2 and 3 primaries.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from agenticstate import StateConfig, StateManager
from bench._util import ROOT, publish, race_workers, table

CLIENTS = 4
PER_CLIENT = 3000
ROUNDS = 3
SEQUENTIAL = 3000  # operations per round, one after another
SEQUENTIAL_ROUNDS = 5
SLICE = 100  # operations in a row on one side before the other's turn
VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}


async def single_vs_cluster(single_url: str, cluster_url: str) -> dict[str, list[float]]:
    """Per round, the rate of `save` and `get` on the plain server and on the cluster.

    Within a round the two alternate in slices of `SLICE` operations (which goes first
    alternates too), so a machine whose speed drifts (2 cores shared with the servers and
    whatever else runs) slows both sides alike.
    """
    states = {
        place: StateManager(StateConfig(backend="redis", redis_url=url, key_prefix="seq:"))
        for place, url in (("single", single_url), ("cluster", cluster_url))
    }
    figures: dict[str, list[float]] = {}

    async def timed(state: StateManager, operation: str, count: int) -> float:
        start = time.perf_counter()
        if operation == "save":
            for i in range(count):
                await state.save(f"k{i % 100}", VALUE)
        else:
            for i in range(count):
                await state.get(f"k{i % 100}")
        return time.perf_counter() - start

    try:
        for state in states.values():
            await state.open()
            for operation in ("save", "get"):
                await timed(state, operation, 300)  # warm up
        places = list(states)
        for _ in range(SEQUENTIAL_ROUNDS):
            for operation in ("save", "get"):
                spent = dict.fromkeys(places, 0.0)
                for turn in range(SEQUENTIAL // SLICE):
                    for place in places if turn % 2 else reversed(places):
                        spent[place] += await timed(states[place], operation, SLICE)
                for place in places:
                    figures.setdefault(f"{place} {operation}", []).append(SEQUENTIAL / spent[place])
    finally:
        for state in states.values():
            await state.aclose()
    return figures


def single_vs_cluster_table(figures: dict[str, list[float]]) -> tuple[str, list[tuple[str, float]]]:
    rows = []
    bars = []
    met = True
    for operation in ("save", "get"):
        single, cluster = figures[f"single {operation}"], figures[f"cluster {operation}"]
        ratios = [ours / base for ours, base in zip(cluster, single, strict=True)]
        ratio = statistics.median(ratios)
        met = met and ratio >= 0.95
        rows.append(
            [
                operation,
                f"{statistics.median(single):,.0f}",
                f"{statistics.median(cluster):,.0f}",
                f"{ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            ]
        )
        bars.append((f"{operation}: 1-primary cluster vs plain server", ratio))
    notes = [
        f"One process, one operation at a time (StateManager, 100 keys): per round {SEQUENTIAL} "
        f"of each on each side, the sides alternating every {SLICE}; {SEQUENTIAL_ROUNDS} rounds, "
        "each ratio taken within a round: the median and the range.",
        "Both go out on connections agenticstate holds; on the cluster each command is routed "
        "by its key's slot through the slot map (MOVED and ASK followed).",
        f"Target: a 1-primary cluster at least 0.95x a plain server: {'met' if met else 'NOT met'}"
        " on this run.",
    ]
    text = table(
        "Redis Cluster with one primary against a plain redis-server",
        ["operation", "plain server ops/s", "1-primary cluster ops/s", "cluster vs plain"],
        rows,
        notes,
    )
    return text, bars


def throughput(url: str, prefix: str) -> float:
    """Saves per second from CLIENTS processes writing at once."""
    done, elapsed = race_workers(
        [["bench._cluster_worker", url, f"{prefix}{n}:", str(PER_CLIENT)] for n in range(CLIENTS)]
    )
    return done / elapsed


def served(cluster: Any) -> list[float]:
    """Each primary's share of the EVALSHA calls (saves) the cluster served."""
    calls = []
    for node in cluster.primary_nodes():
        with cluster.client(node) as client:
            stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
        calls.append(int(stats["calls"]))
    total = sum(calls) or 1
    return sorted((count / total for count in calls), reverse=True)


def run() -> tuple[str, list[tuple[str, float]]]:
    sys.path.insert(0, str(ROOT))
    from tests._redis_cluster import RedisClusterServers
    from tests._redis_server import RedisServer

    rates: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as directory:
        single = RedisServer(Path(directory) / "single")
        clusters = {
            primaries: RedisClusterServers(Path(directory) / f"c{primaries}", primaries=primaries)
            for primaries in (1, 2, 3)
        }
        try:
            single.start()
            for cluster in clusters.values():
                cluster.start()
            for cluster in clusters.values():
                for node in cluster.nodes:
                    with cluster.client(node) as client:
                        client.config_resetstat()
            sequential = anyio.run(single_vs_cluster, single.tcp_url, clusters[1].url)
            for round_ in range(ROUNDS):  # interleaved, so drift hits every size alike
                rates.setdefault(0, []).append(throughput(single.tcp_url, f"r{round_}s"))
                for primaries, cluster in clusters.items():
                    rate = throughput(cluster.url, f"r{round_}p{primaries}")
                    rates.setdefault(primaries, []).append(rate)
            shares = {primaries: served(cluster) for primaries, cluster in clusters.items()}
        finally:
            single.stop()
            for cluster in clusters.values():
                cluster.stop()
    base = statistics.median(rates[1])
    rows = [
        [
            f"{primaries} (cluster)" if primaries else "1 (plain redis-server, not a cluster)",
            f"{statistics.median(values):,.0f}",
            f"{statistics.median(values) / base:.2f}x",
        ]
        for primaries, values in sorted(rates.items(), key=lambda item: item[0] or 0.5)
    ]
    notes = [
        f"{CLIENTS} client processes x {PER_CLIENT} saves (16 concurrent tasks each, 1,000 "
        f"distinct keys spread over every slot); median of {ROUNDS} interleaved rounds.",
        "Every save is one EVALSHA on the primary that owns its key's slot; adding primaries "
        "spreads the server work, while the clients' own CPU stays what it is.",
        "A plain redis-server and a cluster both get commands on connections agenticstate "
        "holds (one set per primary on a cluster, each command routed by its key's slot).",
        "On this 2-core machine the 4 client processes and the redis-servers share two cores: "
        "the clients' CPU is the ceiling, so the rate cannot grow with the primaries here, and "
        "this run does not show how far it would on separate machines. What it does show is "
        "that the work splits: the share of the saves each primary served is "
        + "; ".join(
            f"{primaries} primaries: " + ", ".join(f"{share:.0%}" for share in shares[primaries])
            for primaries in (2, 3)
        )
        + ".",
    ]
    bars = [(row[0], float(row[2].rstrip("x"))) for row in rows]
    first, first_bars = single_vs_cluster_table(sequential)
    return first + "\n" + table(
        "Redis Cluster: saves per second by number of primaries",
        ["primaries", "saves/s", "vs 1 primary"],
        rows,
        notes,
    ), first_bars + bars


def main() -> None:
    text, bars = run()
    publish("cluster", text, bars)


if __name__ == "__main__":
    main()
