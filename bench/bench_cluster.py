"""Redis Cluster: save throughput with 1, 2 and 3 primaries from 4 client processes.

Run: `python -m bench.bench_cluster` (starts its own clusters on loopback: redis-server with
`--cluster-enabled yes` and `redis-cli --cluster create`).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._util import ROOT, publish, race_workers, table

CLIENTS = 4
PER_CLIENT = 3000
ROUNDS = 3


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
        "A plain redis-server goes through agenticstate's held-connection path; a cluster goes "
        "through redis-py's RedisCluster (routing, MOVED/ASK), which costs more client CPU per "
        "command.",
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
    return table(
        "Redis Cluster: saves per second by number of primaries",
        ["primaries", "saves/s", "vs 1 primary"],
        rows,
        notes,
    ), bars


def main() -> None:
    text, bars = run()
    publish("cluster", text, bars)


if __name__ == "__main__":
    main()
