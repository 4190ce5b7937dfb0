"""Soak run: many mixed operations across the managers, then everything must be back to baseline.

Run: `python -m bench.soak [--backend memory|file|redis] [--ops 100000]` (`make soak` runs the
file and Redis backends; Redis gets a throwaway redis-server on loopback). Opt-in, never in CI:
it takes a few minutes per backend. Linux only (it reads /proc/self). It uses the library's
public API only. docs/reliability.md says what it checks and why the tolerances are what they are.

`soak()` runs the phases, one function each:

1. `before_open`: tasks, threads, descriptors, children and Redis clients before the store opens.
2. `run_cycle` (the warm-up: every code path, cache and connection used once), then
   `take_reading`: the baseline of keys, files, Redis keys and memory, the process, live memory.
3. `run_cycle` (the run): `run_workload` (`--ops` operations from `--workers` tasks on one
   StateManager shared by the six managers; `bench/_soak_workload.py`), `drain` through the
   managers' API, `wait_for_expiry` until no key has a TTL left, `sweep_expired` with one write;
   any key left then is one no public API would remove: a leak.
4. `take_reading` again, compared with the baseline.
5. `traced_leg`: two more cycles of `--traced-ops` / 2 under tracemalloc, and the traced bytes
   the second leaves alive beyond the first, by source line.
6. `after_close`: the process once the store closed, compared with phase 1.

`bench/_soak_report.py` prints a report with a PASS/FAIL per check; the soak exits 1 on any
FAIL. Not a test: pytest never collects it (testpaths is tests/, and nothing here is named
test_*).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread

from agenticstate import RedisBackend, StateConfig, StateManager
from bench._soak_probe import (
    OTHER_PATTERNS,
    Memory,
    Process,
    RedisProbe,
    dump_allocations,
    file_sizes,
    measure_memory,
    measure_process,
    measure_store,
    object_types,
    prime_bounded_caches,
    rss_bytes,
    settle_process,
    store_files,
    traced_growth,
)
from bench._soak_report import (
    Cycle,
    Peaks,
    Reading,
    Results,
    Traced,
    build_report,
    configure_logging,
    mib,
)
from bench._soak_workload import Timings, Workload
from bench._util import redis_server

EXPIRY_MARGIN = 60.0
"""Seconds past the longest TTL that the expiry wait gives the backend before it gives up."""
SETTLE_TIMEOUT = 20.0
"""Seconds the process gets after closing to give back threads (anyio keeps idle ones 10 s)."""


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass
class Soak:
    """What every phase needs: the options, the Redis probe, the TTLs, the run's peaks."""

    args: argparse.Namespace
    directory: Path
    redis: RedisProbe | None
    timings: Timings = field(default_factory=Timings)
    peaks: Peaks = field(default_factory=Peaks)

    async def clients(self) -> int | None:
        """The Redis server's connected clients (None off Redis)."""
        return await self.redis.clients() if self.redis is not None else None


# ------------------------------------------------------------------ the soak, phase by phase


async def soak(args: argparse.Namespace, directory: Path, url: str | None) -> int:
    """Run every phase; print the report; return the exit status (1 on any FAIL)."""
    logs = configure_logging()
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    say(
        f"soak: {args.backend} backend, {args.ops:,} operations from {args.workers} tasks, "
        f"then a traced leg of {args.traced_ops:,} (warm-up {args.warmup:,}, seed {args.seed})"
    )
    run = Soak(args, directory, RedisProbe(url) if url is not None else None)
    before = await before_open(run)
    async with StateManager(make_config(args.backend, directory, url)) as state:
        warm = await run_cycle(state, run, "warm-up", args.warmup)
        base = await take_reading(state, run)
        say(
            f"baseline: {base.store.keys} keys, {base.memory.blocks:,} blocks, "
            f"rss {mib(base.memory.rss)}, {len(base.process.tasks)} tasks, "
            f"{base.process.os_threads} threads, {base.process.fds} fds"
        )
        main_cycle = await run_cycle(state, run, "run", args.ops, loud=True)
        end = await take_reading(state, run)
        results = Results(
            backend=args.backend,
            workers=args.workers,
            longest_ttl=run.timings.longest,
            pool_size=pool_size(state),
            before_open=before,
            warm=warm,
            base=base,
            run=main_cycle,
            end=end,
            stats=state.stats(),
        )
        results.traced = await traced_leg(state, run) if args.traced_ops else None
    await after_close(run, results)
    results.total_seconds = time.perf_counter() - started
    results.load = (load_before, os.getloadavg()[0])
    results.peaks = run.peaks
    report = build_report(results, logs)
    say(report.render())
    return 1 if report.failed else 0


async def before_open(run: Soak) -> Process:
    """Phase 1: the process before the store opens."""
    if run.redis is not None:
        await run.redis.client.ping()  # our own connection counts from the start
    await anyio.to_thread.run_sync(lambda: None)  # anyio's thread pool exists before phase 1
    return measure_process(await run.clients())


async def take_reading(state: StateManager, run: Soak) -> Reading:
    """Phases 2 and 4: the store, the process, and then live memory."""
    await flush_files(state)
    store = await measure_store(state, run.redis)
    process = measure_process(await run.clients())
    return Reading(store, process, await quiet_memory(state), object_types())


async def traced_leg(state: StateManager, run: Soak) -> Traced:
    """Phase 5: two cycles under tracemalloc; what the second left alive beyond the first."""
    half = max(1, run.args.traced_ops // 2)
    say(f"traced leg: tracemalloc on, 2 cycles of {half:,} operations")
    allocations = run.directory / "traced.tracemalloc"
    tracemalloc.start()
    try:
        # Matchers made before tracing and replaced during it would count on one side only.
        await prime_bounded_caches(state, OTHER_PATTERNS)
        first = await run_cycle(state, run, "traced cycle 1", half)
        start = await quiet_memory(state)
        dump_allocations(allocations)
        second = await run_cycle(state, run, "traced cycle 2", half)
        end = await quiet_memory(state)
        growth = traced_growth(allocations)
    finally:
        tracemalloc.stop()
    return Traced(first, second, start, end, growth)


async def after_close(run: Soak, results: Results) -> None:
    """Phase 6: the process once the store closed, back to what it was before it opened."""
    results.closed, results.settle_seconds = await settle_process(
        results.before_open, run.redis, SETTLE_TIMEOUT, say
    )
    if run.redis is not None:
        results.closed_redis_keys = (await run.redis.info())["keys"]
        await run.redis.aclose()


# ------------------------------------------------------------------ one cycle


async def run_cycle(
    state: StateManager, run: Soak, phase: str, operations: int, *, loud: bool = False
) -> Cycle:
    """Run the workload, drain, wait for the TTLs, sweep; note any key left."""
    cycle = Cycle(phase)
    load = Workload(state, run.timings, phase=phase)
    await run_workload(state, run, load, cycle, operations, loud=loud)
    await drain(load, cycle, run.timings)
    cycle.waited, cycle.keys_left, cycle.still_expiring = await wait_for_expiry(
        state, time.monotonic() + run.timings.longest, run.timings.longest + EXPIRY_MARGIN
    )
    record_counts(load, cycle)
    del load
    await sweep_expired(state, cycle)
    left = await state.list_keys("*")
    cycle.left, cycle.left_count = left[:5], len(left)
    return cycle


async def run_workload(
    state: StateManager,
    run: Soak,
    load: Workload,
    cycle: Cycle,
    operations: int,
    *,
    loud: bool,
) -> None:
    """Spend `operations` operations while the sampler runs.

    The sampler always runs (printing and keeping peaks only when `loud`), so that every cycle
    issues commands at the same concurrency: the Redis backend keeps the connections it needed.
    """
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(sample, state, load, run, loud=loud))
        await load.setup()
        cycle.seconds = await load.run(operations, run.args.workers, run.args.seed)
        tg.cancel_scope.cancel()
    cycle.ops = load.ops.done
    say(
        f"{cycle.phase}: {cycle.ops:,} operations in {cycle.seconds:.1f} s "
        f"({cycle.ops / cycle.seconds:,.0f}/s)"
    )


async def drain(load: Workload, cycle: Cycle, timings: Timings) -> None:
    """End everything the managers' API can end."""
    start = time.perf_counter()
    cycle.drained = await load.drain(say)
    cycle.drain_seconds = time.perf_counter() - start
    say(
        f"{cycle.phase}: drained in {cycle.drain_seconds:.1f} s; "
        f"now the TTLs (up to {timings.longest:.0f} s)"
    )


async def wait_for_expiry(
    state: StateManager, not_before: float, give_up_after: float
) -> tuple[float, int, int]:
    """Poll until no key has a TTL and `not_before` (monotonic) has passed.

    The second condition is for what no key shows: a key written with a TTL and deleted (the
    tool cache's single-flight locks) still has an entry in the memory and file backends' expiry
    heap until its TTL passes.

    Returns:
        Seconds waited, keys left, keys left with a TTL.
    """
    start = time.monotonic()
    while True:
        keys = await state.list_keys("*")
        entries = await state.backend.get_many(keys) if keys else []
        expiring = [e.expires_at for e in entries if e is not None and e.expires_at is not None]
        now = time.monotonic()
        if (not expiring and now >= not_before) or now - start >= give_up_after:
            return now - start, len(keys), len(expiring)
        due = max(e.timestamp() for e in expiring) - time.time() if expiring else 0.0
        due = max(due, not_before - now)
        say(
            f"  waiting for expiry: {len(keys):,} keys, {len(expiring):,} with a TTL; all due in "
            f"{max(due, 0):.1f} s (giving up in {give_up_after - (now - start):.0f} s)"
        )
        await anyio.sleep(min(1.0, max(due, 0.05)))


def record_counts(load: Workload, cycle: Cycle) -> None:
    """Copy the workload's counts into the cycle, so the workload itself can go."""
    cycle.by_area = dict(load.ops.by_area)
    cycle.expected = dict(load.ops.expected)
    cycle.errors = dict(load.ops.errors)
    cycle.error_samples = list(load.ops.error_samples)
    cycle.retention = list(load.retention_violations[:5])
    cycle.plain_events = load.plain_events


async def sweep_expired(state: StateManager, cycle: Cycle) -> None:
    """Make one write: memory and file stores drop expired entries when a write comes (an idle
    store keeps them). Records the live blocks that released."""
    idle_blocks = measure_memory().blocks
    await state.save("soak:sweep", 0)
    await state.delete("soak:sweep")
    cycle.expired_blocks = idle_blocks - measure_memory().blocks


# ------------------------------------------------------------------ sampling and readings


async def sample(state: StateManager, load: Workload, run: Soak, *, loud: bool) -> None:
    """Every `--sample-every` seconds, print a progress line and keep the peaks (when `loud`)."""
    start = last_time = time.perf_counter()
    last_ops = 0
    paths = store_files(state)
    while True:
        await anyio.sleep(run.args.sample_every)
        now, ops = time.perf_counter(), load.ops.done
        reaps, load.ops.reaps = load.ops.reaps, 0
        reap_seconds, load.ops.reap_seconds = load.ops.reap_seconds, 0.0
        info = await run.redis.info() if run.redis is not None else None
        disk = sum(file_sizes(*paths)) if paths is not None else None
        keys = len(await state.list_keys("*"))
        rate, rss = (ops - last_ops) / (now - last_time), rss_bytes()
        last_ops, last_time = ops, now
        if not loud:
            continue
        run.peaks.add("rss", rss)
        run.peaks.add("disk", disk)
        run.peaks.add("redis_memory", info["used_memory"] if info else None)
        say(
            f"  [{now - start:6.1f} s] {ops:>8,} ops ({rate:,.0f}/s)  keys {keys:,}  rss {mib(rss)}"
            + (f"  files {mib(disk)}" if disk is not None else "")
            + (
                f"  redis {mib(info['used_memory'])}, {info['connected_clients']} clients"
                if info
                else ""
            )
            + (f"  reap_expired {reap_seconds / reaps * 1000:.1f} ms" if reaps else "")
        )


async def flush_files(state: StateManager) -> None:
    """On a file store, write the snapshot, so that its size compares (the log is empty)."""
    if store_files(state) is not None:
        await state.flush()


async def quiet_memory(state: StateManager) -> Memory:
    """Fill the bounded caches, wait out Redis's reply timeout, and read live memory.

    Each Redis command runs under `asyncio.timeout(socket_timeout)`, whose cancelled timer stays
    in the event loop's heap until its deadline (a TimerHandle and a Context, a few blocks each):
    the commands just before a reading would otherwise count there, a few hundred blocks.
    """
    await flush_files(state)
    await prime_bounded_caches(state)
    backend = state.backend
    if isinstance(backend, RedisBackend) and backend.socket_timeout:
        await anyio.sleep(backend.socket_timeout + 0.5)
    return measure_memory()


def pool_size(state: StateManager) -> int | None:
    """The Redis backend's `connection_pool_size` (None on other backends)."""
    backend = state.backend
    return backend.connection_pool_size if isinstance(backend, RedisBackend) else None


def make_config(backend: str, directory: Path, url: str | None) -> StateConfig:
    if backend == "memory":
        return StateConfig(backend="memory")
    if backend == "file":
        return StateConfig(backend="file", file_path=directory / "store" / "state.json")
    return StateConfig(backend="redis", redis_url=url, key_prefix="soak:")


# ------------------------------------------------------------------ the command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Soak run: mixed operations across the managers, then back to baseline.",
    )
    parser.add_argument("--backend", choices=["memory", "file", "redis"], default="file")
    parser.add_argument("--ops", type=int, default=100_000, help="operations in the run")
    parser.add_argument(
        "--traced-ops",
        type=int,
        default=None,
        help="operations under tracemalloc, in two cycles (ops / 20; 0 skips the traced leg)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up operations (ops / 50)")
    parser.add_argument("--workers", type=int, default=8, help="concurrent tasks (8)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    args = parser.parse_args(argv)
    if args.traced_ops is None:
        args.traced_ops = args.ops // 20
    if args.warmup is None:
        args.warmup = max(1000, args.ops // 50)
    return args


def main(argv: list[str] | None = None) -> int:
    if not Path("/proc/self/status").exists():
        say("the soak reads /proc/self: Linux only")
        return 2
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="agenticstate-soak-") as scratch:
        directory = Path(scratch)
        if args.backend == "redis":
            with redis_server() as url:
                return asyncio.run(soak(args, directory, url))
        return asyncio.run(soak(args, directory, None))


if __name__ == "__main__":
    raise SystemExit(main())
