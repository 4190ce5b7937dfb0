"""Durable saves per second on the file backend, against an fsync-per-write loop and the peer.

Run: `python -m bench.bench_file`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import anyio

from agenticstate import FileBackend, StateManager
from bench._util import publish, rate, ratio_of, sync_rate, table

VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
SEQUENTIAL = 500
CONCURRENT_WRITERS = 50
PER_WRITER = 100


def fsync_loop(directory: Path, count: int, size: int) -> float:
    """A plain append + fsync per record: the floor any durable store must beat."""
    fd = os.open(directory / "plain.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    record = b"r" * size
    try:
        return sync_rate(lambda _: (os.write(fd, record), os.fsync(fd)), count)
    finally:
        os.close(fd)


async def ours_sequential(directory: Path) -> float:
    async with StateManager(backend=FileBackend(base_path=directory, format="msgpack")) as state:
        return await rate(lambda i: state.save(f"agent:{i % 50}", VALUE), SEQUENTIAL)


async def ours_concurrent(directory: Path) -> tuple[float, int]:
    backend = FileBackend(base_path=directory, format="msgpack", auto_save=False)
    async with StateManager(backend=backend) as state:

        async def writer(n: int) -> None:
            for i in range(PER_WRITER):
                await state.save(f"agent:{n}:{i % 10}", VALUE)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for n in range(CONCURRENT_WRITERS):
                tg.start_soon(writer, n)
        elapsed = time.perf_counter() - start
        return CONCURRENT_WRITERS * PER_WRITER / elapsed, CONCURRENT_WRITERS * PER_WRITER


def peer_sequential(directory: Path) -> float | None:
    try:
        from agenticaiframework.state.manager import StateManager as PeerStateManager
    except ImportError:
        return None
    peer = PeerStateManager(backend="file", persist_path=str(directory), auto_checkpoint=False)
    return sync_rate(lambda i: peer.save(f"agent:{i % 50}", VALUE), SEQUENTIAL)


async def run() -> tuple[str, list[tuple[str, float]]]:
    with tempfile.TemporaryDirectory(dir=".") as root:
        base = Path(root)
        record_size = 150
        plain_1 = fsync_loop(base, SEQUENTIAL, record_size)
        seq = await ours_sequential(base / "seq")
        conc, total = await ours_concurrent(base / "conc")
        peer = peer_sequential(base / "peer")
    rows = [
        ["fsync per write (plain Python loop)", "1", f"{plain_1:,.0f}", "1.00x"],
        ["agenticstate FileBackend, durable", "1", f"{seq:,.0f}", f"{seq / plain_1:.2f}x"],
        [
            "agenticstate FileBackend, durable",
            str(CONCURRENT_WRITERS),
            f"{conc:,.0f}",
            f"{conc / plain_1:.2f}x",
        ],
    ]
    if peer is not None:
        rows.append(
            [
                "agenticaiframework FileBackend (no fsync)",
                "1",
                f"{peer:,.0f}",
                f"{peer / plain_1:.2f}x",
            ]
        )
    notes = [
        f"Saves go through StateManager.save with a {len(str(VALUE))}-character dict; "
        f"{SEQUENTIAL} sequential saves, {total} concurrent ones.",
        "Durable: acknowledged only after the log record is fsynced (group commit shares one "
        "fsync among the writes that arrive while the previous one runs).",
        "Target: 50 concurrent writers reach at least 10x the fsync-per-write rate: "
        + ("met." if conc >= 10 * plain_1 else "NOT met on this run."),
        "agenticaiframework's FileBackend rewrites one JSON file per key and never fsyncs, so "
        "its figure is not durable; a crash can lose or tear its writes.",
    ]
    bars = [(f"{row[0]} x{row[1]}", ratio_of(row[3]) or 0.0) for row in rows]
    text = table(
        "File backend: durable saves per second",
        ["store", "writers", "saves/s", "vs fsync loop"],
        rows,
        notes,
    )
    return text, bars


def main() -> None:
    text, bars = anyio.run(run)
    publish("file", text, bars)


if __name__ == "__main__":
    main()
