"""Durable saves per second on the file backend, against an fsync-per-write loop and the peer.

Run: `python -m bench.bench_file`. Every round measures the baseline and each workload back to
back, and the report gives the median over rounds of each round's ratio: the disk and the CPU
of a shared 2-core machine drift by tens of percent within minutes, so only figures taken side
by side compare. The first round is a warm-up and is not reported: the first stores a process
opens run measurably slower (allocator arenas, specialised bytecode, the page cache of a fresh
log), and a benchmark of a long-running service should report the service warm. Rounds are
long enough (10,000 saves of 50 writers) that one scheduling hiccup does not decide a round.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import anyio

from agenticstate import FileBackend, StateManager
from bench._util import publish, ratio_of, sync_rate, table

VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
ROUNDS = 7
WARMUP_ROUNDS = 1
SEQUENTIAL = 400
WRITERS = 50
PER_WRITER = 1000
PEER_PER_WRITER = 40


def fsync_loop(directory: Path, count: int = 2000, size: int = 150) -> float:
    """A plain append + fsync per record: the floor any durable store must beat."""
    fd = os.open(directory / "plain.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    record = b"r" * size
    try:

        def append(_: int) -> None:
            os.write(fd, record)
            os.fsync(fd)

        return sync_rate(append, count)
    finally:
        os.close(fd)


async def ours(directory: Path, writers: int, per_writer: int, *, through_manager: bool) -> float:
    """Saves per second from `writers` concurrent tasks, every save durable (fsync)."""
    backend = FileBackend(base_path=directory, format="msgpack", auto_save=False)
    async with StateManager(backend=backend) as state:
        raw = state.serializer.dumps(VALUE)

        async def writer(n: int) -> None:
            for i in range(per_writer):
                if through_manager:
                    await state.save(f"agent:{n}:{i % 10}", VALUE)
                else:
                    await backend.set(f"agent:{n}:{i % 10}", raw)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for n in range(writers):
                tg.start_soon(writer, n)
        return writers * per_writer / (time.perf_counter() - start)


def peer(directory: Path, writers: int, per_writer: int) -> float | None:
    """The peer's file-backed StateManager.save from `writers` threads (its API is blocking)."""
    try:
        from agenticaiframework.state.manager import StateManager as PeerStateManager
    except ImportError:
        return None
    state = PeerStateManager(backend="file", persist_path=str(directory), auto_checkpoint=False)

    def writer(n: int) -> None:
        for i in range(per_writer):
            state.save(f"agent:{n}:{i % 10}", VALUE)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(writers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return writers * per_writer / (time.perf_counter() - start)


WORKLOADS: list[tuple[str, str]] = [
    ("agenticstate StateManager.save, durable", "1"),
    ("agenticstate StateManager.save, durable", str(WRITERS)),
    ("agenticstate FileBackend.set, durable", str(WRITERS)),
    ("agenticaiframework FileBackend (no fsync)", "1"),
    ("agenticaiframework FileBackend (no fsync)", str(WRITERS)),
]


async def one_round(base: Path) -> tuple[float, list[float | None]]:
    plain = fsync_loop(base)
    rates: list[float | None] = [
        await ours(base / "seq", 1, SEQUENTIAL, through_manager=True),
        await ours(base / "conc", WRITERS, PER_WRITER, through_manager=True),
        await ours(base / "set", WRITERS, PER_WRITER, through_manager=False),
        peer(base / "peer1", 1, SEQUENTIAL),
        peer(base / "peer50", WRITERS, PEER_PER_WRITER),
    ]
    return plain, rates


async def run() -> tuple[str, list[tuple[str, float]]]:
    plains: list[float] = []
    ratios: list[list[float]] = [[] for _ in WORKLOADS]
    rates: list[list[float]] = [[] for _ in WORKLOADS]
    for round_number in range(WARMUP_ROUNDS + ROUNDS):
        with tempfile.TemporaryDirectory(dir=".", prefix=".bench-file-") as root:
            plain, measured = await one_round(Path(root))
        if round_number < WARMUP_ROUNDS:
            continue
        plains.append(plain)
        for index, value in enumerate(measured):
            if value is not None:
                rates[index].append(value)
                ratios[index].append(value / plain)
    rows = [
        ["fsync per write (plain Python loop)", "1", f"{statistics.median(plains):,.0f}", "1.00x"]
    ]
    for (name, writers), rate, ratio in zip(WORKLOADS, rates, ratios, strict=True):
        if not rate:
            continue
        rows.append(
            [
                name,
                writers,
                f"{statistics.median(rate):,.0f}",
                f"{statistics.median(ratio):.2f}x ({min(ratio):.1f}-{max(ratio):.1f})",
            ]
        )
    manager_50 = statistics.median(ratios[1])
    backend_50 = statistics.median(ratios[2])
    target = 10.0
    verdicts = []
    for label, value in (("StateManager.save", manager_50), ("FileBackend.set", backend_50)):
        verdicts.append(f"{label} {value:.1f}x ({'met' if value >= target else 'NOT met'})")
    notes = [
        f"{ROUNDS} rounds after {WARMUP_ROUNDS} warm-up round; each round runs the fsync loop "
        "and every workload back to back, and the ratio is taken within the round. Shown: the "
        "median rate, the median ratio and the range of ratios over the rounds.",
        f"A save writes a {len(str(VALUE))}-character dict; {WRITERS} writers are {WRITERS} "
        f"asyncio tasks doing {PER_WRITER} saves each (the peer: {WRITERS} threads doing "
        f"{PEER_PER_WRITER} each, since its API blocks).",
        "Durable: a save returns only after its log frame is fsynced. Writes staged while the "
        "fsync agent syncs one frame go out in the next frames, and the agent covers all of "
        "them with its next fsync, so the loop never waits for the disk.",
        "Target: 50 concurrent writers reach at least 10x the fsync-per-write rate: "
        + "; ".join(verdicts)
        + ". With the disk hidden, the ceiling is the CPU cost of a save on the event loop "
        "(about 80,000 instructions through StateManager, 65,000 through FileBackend.set).",
        "agenticaiframework's FileBackend rewrites one JSON file per key under a global lock and "
        "never fsyncs, so its figure is not durable; a crash can lose or tear its writes.",
    ]
    bars = [(f"{row[0]} x{row[1]}", ratio_of(row[3]) or 0.0) for row in rows]
    text = table(
        "File backend: durable saves per second",
        ["store", "writers", "saves/s", "vs fsync loop (range)"],
        rows,
        notes,
    )
    return text, bars


def main() -> None:
    text, bars = anyio.run(run)
    publish("file", text, bars)


if __name__ == "__main__":
    main()
