"""Cost against unrelated data on the SQLite, memory and file stores: listings and the sweep.

Run: `python -m bench.bench_local_costs` (`--quick`: 100,000 keys instead of 1,000,000).

Each store is built twice: a small one (20 sessions of 200 messages, `sess:{sNN}:meta` and
`sess:{sNN}:msg:NNNNN`, plus 1,000 other keys) and a large one (the same sessions plus
1,000,000 other keys, half of them with a TTL of a day). Then, in interleaved rounds:

1. Listings, each after a write of another key (a store that sorted its keys lazily would pay
   for it here): `sess:{*}:meta` (every session: the skip-scan across entities), `sess:{s07}:*`
   (one session's keys: a prefix range) and `sess:{s07}:meta` (one key). The ratio is the large
   store's listing rate to the small one's: 1.0 means the unrelated keys cost nothing; the
   target is at least 0.67 (within 1.5x).
2. The expiry sweep (SQLite and file): 10 keys written with a TTL of 50 ms, waited out, then
   the write that sweeps them is timed, `SWEEPS` times a round (SQLite sweeps on a write once a
   second: each waits for that). The ratio is the small store's time to the large one's (1.0:
   the sweep costs what expires, not what lives).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from agenticstate import FileBackend, MemoryBackend, SQLiteBackend
from bench._util import publish, table

if TYPE_CHECKING:
    from agenticstate.backends import Backend

ROUNDS = 3
LARGE = 1_000_000
SMALL = 1_000
SESSIONS = 20
MESSAGES = 200
LISTINGS = 30  # per pattern and round: the median is kept
SWEEPS = 5  # per store and round: the median is kept
BATCH = 10_000
PATTERNS = ["sess:{*}:meta", "sess:{s07}:*", "sess:{s07}:meta"]
KINDS = ["sqlite", "memory", "file"]


def _make(kind: str, directory: Path) -> Backend:
    if kind == "sqlite":
        return SQLiteBackend(directory / "state.db", synchronous="normal")
    if kind == "memory":
        return MemoryBackend()
    return FileBackend(base_path=directory, format="msgpack", durability="none", auto_save=False)


async def _fill(backend: Backend, unrelated: int) -> None:
    for s in range(SESSIONS):
        parts = ["meta", *(f"msg:{m:05d}" for m in range(MESSAGES))]
        await backend.set_many([(f"sess:{{s{s:02d}}}:{part}", b"m") for part in parts])
    for start in range(0, unrelated, BATCH):
        items = [(f"other:{i:08d}", b"v") for i in range(start, min(unrelated, start + BATCH))]
        ttl = timedelta(days=1) if (start // BATCH) % 2 else None
        await backend.set_many(items, ttl=ttl)


async def _listing(backend: Backend, pattern: str, write: int) -> float:
    """Seconds one listing of `pattern` takes, after an (untimed) write of another key."""
    await backend.set(f"other:new:{write}", b"v")
    start = time.perf_counter()
    keys = [key async for batch in backend.scan_batches(pattern) for key in batch]
    took = time.perf_counter() - start
    assert keys, pattern
    return took


async def _sweep(backend: Backend, kind: str, round_: int) -> float:
    """Seconds the write that sweeps 10 just-expired keys takes."""
    await backend.set_many(
        [(f"due:{round_}:{i}", b"e") for i in range(10)], ttl=timedelta(milliseconds=50)
    )
    await anyio.sleep(1.1 if kind == "sqlite" else 0.06)  # expired, and SQLite's sweep is due
    start = time.perf_counter()
    await backend.set(f"sweeper:{round_}", b"v")
    took = time.perf_counter() - start
    assert await backend.get(f"due:{round_}:0") is None
    return took


async def _measure(kind: str, large: int) -> dict[str, list[float]]:
    """Per figure, each round's ratio (large store against small)."""
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as small_dir, tempfile.TemporaryDirectory() as large_dir:
        stores = {
            "small": _make(kind, Path(small_dir)),
            "large": _make(kind, Path(large_dir)),
        }
        for name, backend in stores.items():
            await backend.open()
            await _fill(backend, SMALL if name == "small" else large)
        try:
            writes = 0
            for round_ in range(ROUNDS):
                times: dict[str, dict[str, float]] = {"small": {}, "large": {}}
                for name, backend in stores.items():
                    for pattern in PATTERNS:
                        taken = []
                        for _ in range(LISTINGS):
                            writes += 1
                            taken.append(await _listing(backend, pattern, writes))
                        times[name][pattern] = statistics.median(taken)
                    if kind != "memory":
                        times[name]["sweep"] = statistics.median(
                            [
                                await _sweep(backend, kind, round_ * SWEEPS + n)
                                for n in range(SWEEPS)
                            ]
                        )
                for figure in times["small"]:
                    ratios.setdefault(figure, []).append(
                        times["small"][figure] / times["large"][figure]
                    )
                    ratios.setdefault(f"{figure}:ms", []).append(times["large"][figure] * 1000)
                    ratios.setdefault(f"{figure}:base", []).append(times["small"][figure] * 1000)
        finally:
            for backend in stores.values():
                await backend.aclose()
    return ratios


def main() -> None:
    large = 100_000 if "--quick" in sys.argv else LARGE
    rows: list[list[str]] = []
    bars: list[tuple[str, float]] = []
    for kind in KINDS:
        ratios = anyio.run(_measure, kind, large)
        for figure in [*PATTERNS, "sweep"]:
            if figure not in ratios:
                continue
            ratio = statistics.median(ratios[figure])
            what = f"`{figure}`" if figure != "sweep" else "expiry sweep of 10 keys (a write)"
            rows.append(
                [
                    kind,
                    what,
                    f"{statistics.median(ratios[f'{figure}:base']):.3f} ms",
                    f"{statistics.median(ratios[f'{figure}:ms']):.3f} ms",
                    f"{ratio:.2f}x ({min(ratios[figure]):.2f}-{max(ratios[figure]):.2f})",
                ]
            )
            bars.append((f"{kind} {figure}", ratio))
    text = table(
        "Cost against unrelated data: SQLite, memory and file",
        [
            "store",
            "operation",
            f"with {SMALL:,} other keys",
            f"with {large:,} other keys",
            "ratio (range over rounds)",
        ],
        rows,
        [
            f"{SESSIONS} sessions of {MESSAGES} messages in both stores; the large one holds "
            f"{large:,} other keys, half with a TTL of a day. Median of {LISTINGS} listings "
            f"per round, {ROUNDS} rounds; each listing follows a write of another key.",
            "Ratio: the small store's time over the large one's (1.0: the other keys cost "
            "nothing). Target: at least 0.67 (within 1.5x).",
            "`sess:{*}:meta` lists every session with one seek per session (skip-scan), "
            "`sess:{s07}:*` reads one prefix range, `sess:{s07}:meta` one key.",
            f"Sweep: 10 keys with a 50 ms TTL, expired, then the write that sweeps them is timed, "
            f"median of {SWEEPS} per round (SQLite: synchronous=normal; file: durability=none, "
            "so the sweep is not hidden behind an fsync; SQLite's time includes the write's "
            "commit, and now and then a WAL checkpoint).",
        ],
    )
    publish("local_costs", text, bars)


if __name__ == "__main__":
    main()
