"""A real Redis Cluster on loopback for the tests: primaries, optional replicas, `redis-cli`.

Each node is a `RedisServer` started with `--cluster-enabled yes`; `redis-cli --cluster create`
assigns the slots (and replicas), and the cluster is ready when every node reports
`cluster_state:ok` and agrees on the slot map.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis as sync_redis

from tests._redis_server import RedisServer

if TYPE_CHECKING:
    from pathlib import Path


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (so at most 55535)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class RedisClusterServers:
    """`primaries` primaries with `replicas` replicas each, on loopback TCP."""

    directory: Path
    primaries: int = 3
    replicas: int = 0
    node_timeout_ms: int = 1000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node as a startup node."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}"

    def start(self, timeout: float = 60.0) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (make test installs redis-tools)")
        count = self.primaries * (1 + self.replicas)
        for index in range(count):
            node = RedisServer(
                self.directory / f"node{index}",
                port=free_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(self.directory / f"node{index}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    "--appendonly",
                    "no",
                ),
            )
            node.start()
            self.nodes.append(node)
        try:
            if self.primaries < 3:
                # redis-cli wants three primaries; smaller clusters are assembled by hand.
                self._assemble()
                self.wait_ready(timeout)
                return
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{node.port}" for node in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _assemble(self) -> None:
        """Split the 16384 slots among the primaries and introduce the nodes to each other."""
        if self.replicas:
            raise ValueError("clusters of fewer than 3 primaries are built without replicas")
        share = 16384 // self.primaries
        for index, node in enumerate(self.nodes):
            last = 16383 if index == self.primaries - 1 else (index + 1) * share - 1
            with self.client(node) as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", index * share, last)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            with self.client(node) as client:
                client.execute_command("CLUSTER MEET", "127.0.0.1", first.port)

    def client(self, node: RedisServer) -> sync_redis.Redis:
        return sync_redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every live node says `cluster_state:ok` and they agree on the slot map."""
        deadline = time.monotonic() + timeout
        while True:
            if self._consistent():
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become ready")
            time.sleep(0.05)  # polling another process's state, with a deadline

    def _consistent(self) -> bool:
        seen: set[str] = set()
        for node in self.live_nodes():
            try:
                with self.client(node) as client:
                    info = client.cluster("INFO")
                    if info.get("cluster_state") != "ok":
                        return False
                    slots = client.cluster("SLOTS")
            except sync_redis.RedisError:
                return False
            owners = sorted((start, end, primary[1]) for start, end, primary, *_ in slots)
            seen.add(repr(owners))
        return len(seen) == 1

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    def primary_nodes(self) -> list[RedisServer]:
        """The live nodes that are primaries now (after any failover)."""
        result = []
        for node in self.live_nodes():
            with self.client(node) as client:
                if client.info("replication")["role"] == "master":
                    result.append(node)
        return result

    def replica_of(self, primary: RedisServer) -> RedisServer:
        with self.client(primary) as client:
            node_id = client.cluster("MYID")
        for node in self.live_nodes():
            if node is primary:
                continue
            with self.client(node) as client:
                info = client.info("replication")
                if info["role"] == "slave" and int(info["master_port"]) == primary.port:
                    return node
        raise LookupError(f"no replica of {node_id}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []
