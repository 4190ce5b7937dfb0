"""Soak run: many mixed operations across the managers, then everything must be back to baseline.

Run: `python -m bench.soak [--backend memory|file|redis] [--ops 100000]` (`make soak` runs the
file and Redis backends; Redis gets a throwaway redis-server on loopback). Opt-in, never in CI:
it takes a few minutes per backend. Linux only (it reads /proc/self).

1. Before the store opens, count asyncio tasks, threads, file descriptors, child processes and
   (Redis) the server's connected clients.
2. Warm up with one cycle of the workload (below), so every code path, cache and connection has
   been used, then take the baseline: keys, entries held and sorted indexes, the file store's
   snapshot and log after `flush()`, live allocated blocks (`sys.getallocatedblocks()` after a
   full collection) and RSS, tasks, threads, descriptors, children, and the Redis server's
   clients, keys and memory.
3. The run: one cycle of `--ops` operations. A cycle runs the operations from `--workers` tasks
   on one StateManager shared by all six managers (`bench/_soak_workload.py` says what each
   scenario does and how it ends what it creates), with short TTLs and tight retention; drains
   through the managers' own API; polls (printing progress, with a deadline) until no key has a
   TTL left and the longest TTL has passed since the last write; then explains every remaining
   key: each must be a kind of record that no public API removes (`RESIDUE`, empty now that
   every kind the soak found has an API or a TTL), and kinds bounded by configuration pass while
   kinds that grow with the operations fail; an unexplained key fails. The explained residue is
   then deleted with `StateManager.delete`, so the other checks look at the library itself.
4. Measure again and compare with the baseline.
5. The traced leg: tracemalloc on, two more cycles of `--traced-ops` / 2 operations each, and
   the traced bytes the second one leaves alive beyond the first, by source line. Comparing two
   traced cycles (not "before tracing" with "after") keeps the comparison fair: a long-lived
   container reallocated during the leg (the store's dict) frees a block tracemalloc never saw.
   tracemalloc makes the workload 3-5x slower, so it traces a twentieth of the run, not all.
6. Close the store and compare the process with step 1.

Prints a report with a PASS/FAIL per check; exits 1 on any FAIL. Not a test: pytest never
collects it (testpaths is tests/, and nothing here is named test_*).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio

from agenticstate import StateConfig, StateManager
from bench._soak_probe import (
    MIB,
    Memory,
    Process,
    RedisProbe,
    dump_allocations,
    file_sizes,
    local_store,
    measure_memory,
    measure_process,
    measure_store,
    object_types,
    rss_bytes,
    settle_process,
    top_types,
    traced_growth,
)
from bench._soak_workload import RESIDUE, Timings, Workload
from bench._util import machine, redis_server

BLOCKS_TOLERANCE = 2_000
"""Live allocated blocks may end at most this many above the baseline after the run (see
docs/reliability.md): one block per 50 operations at 100,000 operations, so any leak of an
object per operation (or per scenario) fails, while the run-to-run noise stays far below it."""
TRACED_TOLERANCE = 64 * 1024
"""Traced bytes the second traced cycle may leave alive beyond the first (see
docs/reliability.md): 26 bytes per operation at the default 2,500, so a leaked object per
operation fails."""
RSS_TOLERANCE = 32 * MIB
"""RSS may end at most this much above the baseline. RSS rarely shrinks (freed memory stays in
the allocator's arenas), so this only catches leaks outside the Python heap (C extensions)."""
SNAPSHOT_TOLERANCE = 1024
"""The file store's snapshot after flush() may differ from the baseline's by this many bytes."""
EXPIRY_MARGIN = 60.0
"""Seconds past the longest TTL that the expiry wait gives the backend before it gives up."""
SETTLE_TIMEOUT = 20.0
"""Seconds the process gets after closing to give back threads (anyio keeps idle ones 10 s)."""


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def mib(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value / MIB:.2f} MiB"


# ------------------------------------------------------------------ logging


class LogCounter(logging.Handler):
    """A handler on the `agenticstate` loggers that counts events by level and name."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.counts: Counter[tuple[str, str]] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        # The library's records carry their event dict as the message.
        event = record.msg.get("event") if isinstance(record.msg, dict) else record.getMessage()
        self.counts[(record.levelname.lower(), str(event))] += 1

    def at(self, *levels: str) -> dict[str, int]:
        return {
            f"{name} ({level})": count
            for (level, name), count in sorted(self.counts.items())
            if level in levels
        }


def configure_logging() -> LogCounter:
    """Count the library's log events at info level and above instead of printing them."""
    counter = LogCounter()
    library = logging.getLogger("agenticstate")
    library.addHandler(counter)
    library.setLevel(logging.INFO)
    library.propagate = False
    return counter


# ------------------------------------------------------------------ the timeline


class Timeline:
    """Samples taken during the run, kept in one array so they barely touch the heap."""

    fields = ("seconds", "ops", "rate", "keys", "held", "rss", "disk", "redis_memory", "reap_ms")

    def __init__(self) -> None:
        self.values = array("d")

    def add(self, **values: float | None) -> None:
        for name in self.fields:
            value = values[name]
            self.values.append(math.nan if value is None else value)

    def rows(self) -> list[dict[str, float]]:
        width = len(self.fields)
        return [
            dict(zip(self.fields, self.values[i : i + width], strict=True))
            for i in range(0, len(self.values), width)
        ]

    def peak(self, name: str) -> float | None:
        found = [row[name] for row in self.rows() if not math.isnan(row[name])]
        return max(found) if found else None

    def render(self, backend: str) -> str:
        rows = self.rows()
        if not rows:
            return "Timeline: (the run ended before the first sample)"
        step = max(1, math.ceil(len(rows) / 12))
        picked = rows[::step]
        if picked[-1] is not rows[-1]:
            picked.append(rows[-1])
        third = {"file": ("files", "disk"), "redis": ("redis mem", "redis_memory")}.get(
            backend, ("", "")
        )
        lines = [
            "Timeline of the run:",
            f"  {'time':>6} {'ops':>8} {'ops/s':>6} {'keys':>6} {'held':>6} {'rss':>10} "
            f"{third[0]:>10} {'reap_expired':>12}",
        ]
        for row in picked:
            held = "-" if math.isnan(row["held"]) else f"{row['held']:,.0f}"
            extra = mib(row[third[1]]) if third[1] else ""
            reap = "-" if math.isnan(row["reap_ms"]) else f"{row['reap_ms']:.1f} ms"
            lines.append(
                f"  {row['seconds']:5.0f}s {row['ops']:>8,.0f} {row['rate']:>6,.0f} "
                f"{row['keys']:>6,.0f} {held:>6} {mib(row['rss']):>10} {extra:>10} {reap:>12}"
            )
        return "\n".join(lines)


async def sample(
    state: StateManager,
    load: Workload,
    redis: RedisProbe | None,
    timeline: Timeline,
    every: float,
    *,
    quiet: bool = False,
) -> None:
    """Take a sample every `every` seconds and print it (unless `quiet`)."""
    start = last_time = time.perf_counter()
    last_ops = 0
    local = local_store(state)
    paths = (
        getattr(state.backend, "snapshot_path", None),
        getattr(state.backend, "log_path", None),
    )
    while True:
        await anyio.sleep(every)
        now, ops = time.perf_counter(), load.ops.done
        reaps, load.ops.reaps = load.ops.reaps, 0
        reap_seconds, load.ops.reap_seconds = load.ops.reap_seconds, 0.0
        info = await redis.info() if redis is not None else None
        disk = sum(file_sizes(paths[0], paths[1])) if paths[0] and paths[1] else None
        keys = len(await state.list_keys("*"))
        held = len(local.data) if local is not None else None
        rate = (ops - last_ops) / (now - last_time)
        timeline.add(
            seconds=now - start,
            ops=ops,
            rate=rate,
            keys=keys,
            held=held,
            rss=rss_bytes(),
            disk=disk,
            redis_memory=info["used_memory"] if info else None,
            reap_ms=reap_seconds / reaps * 1000 if reaps else None,
        )
        last_ops, last_time = ops, now
        if quiet:
            continue
        say(
            f"  [{now - start:6.1f} s] {ops:>8,} ops ({rate:,.0f}/s)  keys {keys:,}"
            + (f" (held {held:,})" if held is not None else "")
            + f"  rss {mib(rss_bytes())}"
            + (f"  files {mib(disk)}" if disk is not None else "")
            + (
                f"  redis {mib(info['used_memory'])}, {info['connected_clients']} clients"
                if info
                else ""
            )
            + (f"  reap_expired {reap_seconds / reaps * 1000:.1f} ms" if reaps else "")
        )


# ------------------------------------------------------------------ one cycle


@dataclass
class Cycle:
    """What one cycle did: counts only, so that it weighs little in the memory figures."""

    phase: str
    ops: int = 0
    seconds: float = 0.0
    by_area: dict[str, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    retention: list[str] = field(default_factory=list)
    plain_events: int = 0
    drained: dict[str, int] = field(default_factory=dict)
    drain_seconds: float = 0.0
    waited: float = 0.0
    keys_left: int = 0
    still_expiring: int = 0
    residue: dict[str, int] = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)  # the first few
    unexplained_count: int = 0
    expired_held: int | None = None  # memory/file: expired entries still held while idle
    expired_blocks: int = 0  # the live blocks the first write after that released
    removed: int = 0

    @property
    def growing(self) -> list[str]:
        """Residue kinds that grow with the operations and are present."""
        return [k.name for k in RESIDUE if k.bound is None and self.residue.get(k.name)]

    @property
    def over_bound(self) -> list[str]:
        return [
            f"{self.residue[k.name]} {k.name} > bound {k.bound}"
            for k in RESIDUE
            if k.bound is not None and self.residue.get(k.name, 0) > k.bound
        ]

    @property
    def residue_ok(self) -> bool:
        return not self.growing and not self.over_bound and not self.unexplained_count

    def describe_residue(self) -> str:
        lines = [f"Keys left after the {self.phase}'s drain and TTLs (then removed by the soak):"]
        for kind in RESIDUE:
            count = self.residue.get(kind.name, 0)
            if count:
                bound = "GROWS with the operations" if kind.bound is None else f"bound {kind.bound}"
                lines.append(f"  {count:>6,}  {kind.name} ({bound}): {kind.why}")
        if self.unexplained_count:
            lines.append(f"  {self.unexplained_count:>6,}  UNEXPLAINED, e.g. {self.unexplained}")
        if len(lines) == 1:
            lines.append("  none")
        return "\n".join(lines)


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


async def run_cycle(
    state: StateManager,
    phase: str,
    operations: int,
    args: argparse.Namespace,
    timings: Timings,
    redis: RedisProbe | None = None,
    timeline: Timeline | None = None,
) -> Cycle:
    """Run, drain, wait for the TTLs, explain and remove the residue.

    The sampler always runs (quietly without a `timeline`), so that every cycle issues commands
    at the same concurrency: the Redis backend keeps the connections it needed.
    """
    cycle = Cycle(phase)
    load = Workload(state, timings, phase=phase)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            partial(
                sample,
                state,
                load,
                redis,
                timeline or Timeline(),
                args.sample_every,
                quiet=timeline is None,
            )
        )
        await load.setup()
        cycle.seconds = await load.run(operations, args.workers, args.seed)
        tg.cancel_scope.cancel()
    cycle.ops = load.ops.done
    say(
        f"{phase}: {cycle.ops:,} operations in {cycle.seconds:.1f} s "
        f"({cycle.ops / cycle.seconds:,.0f}/s)"
    )
    start = time.perf_counter()
    cycle.drained = await load.drain(say)
    cycle.drain_seconds = time.perf_counter() - start
    say(
        f"{phase}: drained in {cycle.drain_seconds:.1f} s; "
        f"now the TTLs (up to {timings.longest:.0f} s)"
    )
    cycle.waited, cycle.keys_left, cycle.still_expiring = await wait_for_expiry(
        state, time.monotonic() + timings.longest, timings.longest + EXPIRY_MARGIN
    )
    cycle.by_area = dict(load.ops.by_area)
    cycle.expected = dict(load.ops.expected)
    cycle.errors = dict(load.ops.errors)
    cycle.error_samples = list(load.ops.error_samples)
    cycle.retention = list(load.retention_violations[:5])
    cycle.plain_events = load.plain_events
    del load
    # Memory and file stores drop expired entries when a write comes: until then an idle store
    # keeps them. Measure that, then make one write.
    local = local_store(state)
    idle_held = len(local.data) if local is not None else 0
    idle_blocks = measure_memory().blocks
    await state.save("soak:sweep", 0)
    await state.delete("soak:sweep")
    if local is not None:
        cycle.expired_held = idle_held - len(local.data)
        cycle.expired_blocks = idle_blocks - measure_memory().blocks
    residue: dict[str, list[str]] = {kind.name: [] for kind in RESIDUE}
    unexplained: list[str] = []
    for key in await state.list_keys("*"):
        kind = next((k for k in RESIDUE if k.pattern.search(key)), None)
        (residue[kind.name] if kind is not None else unexplained).append(key)
    for keys in residue.values():
        for key in keys:
            cycle.removed += await state.delete(key)  # no manager can
    cycle.residue = {name: len(keys) for name, keys in residue.items() if keys}
    cycle.unexplained = unexplained[:5]
    cycle.unexplained_count = len(unexplained)
    return cycle


# ------------------------------------------------------------------ the report


@dataclass
class Report:
    backend: str
    checks: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)

    def check(
        self, name: str, before: object, after: object, passed: bool | None, note: str = ""
    ) -> None:
        verdict = "INFO" if passed is None else ("PASS" if passed else "FAIL")
        self.checks.append((name, str(before), str(after), verdict, note))

    @property
    def failed(self) -> list[str]:
        return [check[0] for check in self.checks if check[3] == "FAIL"]

    def render(self) -> str:
        width = [max(len(check[i]) for check in self.checks) for i in range(3)]
        lines = [*self.sections, "", "Checks (baseline -> after):"]
        for name, before, after, verdict, note in self.checks:
            lines.append(
                f"  {verdict:4}  {name:{width[0]}}  {before:>{width[1]}} -> {after:<{width[2]}}"
            )
            if note:
                lines.append(f"        {note}")
        lines.append("")
        if self.failed:
            lines.append(
                f"soak on {self.backend}: FAIL ({len(self.failed)}: {'; '.join(self.failed)})"
            )
        else:
            lines.append(f"soak on {self.backend}: PASS")
        return "\n".join(lines)


async def quiet_period(state: StateManager) -> None:
    """On Redis, wait out the reply timeout before reading memory, without commands meanwhile.

    Each command runs under `asyncio.timeout(socket_timeout)`, whose cancelled timer stays in the
    event loop's heap until its deadline (a TimerHandle and a Context, a few blocks each): the
    commands just before a reading would otherwise count there, a few hundred blocks.
    """
    delay = getattr(state.backend, "socket_timeout", None)
    if isinstance(delay, (int, float)) and delay > 0:
        await anyio.sleep(delay + 0.5)


def make_config(backend: str, directory: Path, url: str | None) -> StateConfig:
    if backend == "memory":
        return StateConfig(backend="memory")
    if backend == "file":
        return StateConfig(backend="file", file_path=directory / "store" / "state.json")
    return StateConfig(backend="redis", redis_url=url, key_prefix="soak:")


async def clients(redis: RedisProbe | None) -> int | None:
    return (await redis.info())["connected_clients"] if redis is not None else None


async def soak(args: argparse.Namespace, directory: Path, url: str | None) -> int:
    logs = configure_logging()
    timings = Timings()
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    say(
        f"soak: {args.backend} backend, {args.ops:,} operations from {args.workers} tasks, "
        f"then a traced leg of {args.traced_ops:,} (warm-up {args.warmup:,}, seed {args.seed})"
    )
    redis = RedisProbe(url) if url is not None else None
    if redis is not None:
        await redis.client.ping()  # our own connection counts from the start
    await anyio.to_thread.run_sync(lambda: None)  # anyio's thread pool exists before step 1
    before_open = measure_process(await clients(redis))
    allocations = directory / "traced.tracemalloc"
    timeline = Timeline()

    async with StateManager(make_config(args.backend, directory, url)) as state:
        warm = await run_cycle(state, "warm-up", args.warmup, args, timings)
        if args.backend == "file":
            await state.flush()
        # What is allocated before the memory reading counts on both sides.
        base_store = await measure_store(state, redis)
        base_process = measure_process(await clients(redis), state)
        await quiet_period(state)
        base_types = object_types()
        base_memory = measure_memory()
        say(
            f"baseline: {base_store.keys} keys, {base_memory.blocks:,} blocks, "
            f"rss {mib(base_memory.rss)}, {len(base_process.tasks)} tasks, "
            f"{base_process.os_threads} threads, {base_process.fds} fds"
        )

        run = await run_cycle(state, "run", args.ops, args, timings, redis, timeline)
        if args.backend == "file":
            await state.flush()
        await quiet_period(state)
        end_memory = measure_memory()
        end_types = object_types()
        end_store = await measure_store(state, redis)
        end_process = measure_process(await clients(redis), state)
        stats = state.stats()

        traced: Cycle | None = None
        first: Cycle | None = None
        traced_memory: tuple[Memory, Memory] | None = None
        table_growth: int | None = None
        growth: list[str] = []
        if args.traced_ops:
            half = max(1, args.traced_ops // 2)
            say(f"traced leg: tracemalloc on, 2 cycles of {half:,} operations")
            tracemalloc.start()
            first = await run_cycle(state, "traced cycle 1", half, args, timings)
            if args.backend == "file":
                await state.flush()
            await quiet_period(state)
            traced_start = measure_memory()
            dump_allocations(allocations)
            traced = await run_cycle(state, "traced cycle 2", half, args, timings)
            if args.backend == "file":
                await state.flush()
            await quiet_period(state)
            traced_memory = (traced_start, measure_memory())
            growth, table_growth = traced_growth(allocations)
            tracemalloc.stop()
    closed_process, settle_seconds = await settle_process(before_open, redis, SETTLE_TIMEOUT, say)
    closed_keys = (await redis.info())["keys"] if redis is not None else None
    if redis is not None:
        await redis.aclose()
    total = time.perf_counter() - started
    load_after = os.getloadavg()[0]

    report = Report(args.backend)
    cycles = [c for c in (warm, run, first, traced) if c is not None]
    report.sections += [
        "",
        f"Soak on the {args.backend} backend: {machine()}",
        f"  run: {run.ops:,} operations in {run.seconds:.1f} s = {run.ops / run.seconds:,.0f} "
        f"ops/s from {args.workers} tasks; warm-up {warm.ops:,}"
        + (
            f", traced cycles 2 x {traced.ops:,} ({traced.ops / traced.seconds:,.0f} ops/s "
            "under tracemalloc)"
            if traced
            else ""
        )
        + f"; whole soak {total:.0f} s",
        f"  load average (1 min) {load_before:.1f} at the start, {load_after:.1f} at the end "
        f"(other work on the machine slows every figure here)",
        "  by area: "
        + ", ".join(
            f"{area} {n:,} ({n / run.ops:.0%})"
            for area, n in sorted(run.by_area.items(), key=lambda item: -item[1])
        ),
        "  outcomes in the mix: "
        + (", ".join(f"{name} {n:,}" for name, n in sorted(run.expected.items())) or "none"),
        f"  plain:* callback events {run.plain_events:,}; {stats}",
        "  drain: "
        + ", ".join(f"{name} {n:,}" for name, n in sorted(run.drained.items()))
        + f" ({run.drain_seconds:.1f} s)",
        f"  TTLs: waited {run.waited:.1f} s after the drain (longest TTL {timings.longest:.0f} s);"
        f" {run.keys_left:,} keys left, {run.still_expiring:,} of them with a TTL",
        f"  after close the process settled in {settle_seconds:.1f} s",
        "",
        timeline.render(args.backend),
        "",
        run.describe_residue(),
        "Log events at warning level: "
        + (", ".join(f"{name} {n:,}" for name, n in logs.at("warning").items()) or "none"),
        "Object types that grew most during the run (gc.get_objects): "
        + (", ".join(top_types(base_types, end_types, 6)) or "none"),
    ]
    if growth:
        report.sections.append(
            "Largest growth of traced allocations from traced cycle 1 to 2, by line:"
        )
        report.sections += [f"  {line}" for line in growth]

    errors = sum(sum(c.errors.values()) for c in cycles)
    report.check(
        "unexpected errors in the operations",
        "-",
        errors,
        errors == 0,
        "; ".join(sample for c in cycles for sample in c.error_samples[:3]),
    )
    violations = [v for c in cycles for v in c.retention]
    report.check(
        "retention held (max_snapshots, max_checkpoints)",
        "-",
        len(violations),
        not violations,
        "; ".join(violations[:3]),
    )
    error_logs = logs.at("error", "critical", "exception")
    report.check(
        "error-level log events",
        "-",
        sum(error_logs.values()),
        not error_logs,
        ", ".join(f"{name} {n}" for name, n in error_logs.items()),
    )
    report.check(
        "keys left after drain + TTLs: all explained, none growing",
        base_store.keys,
        sum(run.residue.values()) + run.unexplained_count,
        all(c.residue_ok for c in cycles),
        "; ".join(
            [f"{run.residue[name]:,} {name} grow with the operations" for name in run.growing]
            + run.over_bound
            + ([f"{run.unexplained_count} unexplained"] if run.unexplained_count else [])
        ),
    )
    report.check(
        "keys once the explained residue is deleted",
        base_store.keys,
        end_store.keys,
        end_store.keys == base_store.keys,
        f"the soak deleted {run.removed:,} residue keys with StateManager.delete",
    )
    if base_store.held_entries is not None:
        report.check(
            "expired entries still held by the idle store",
            "-",
            run.expired_held,
            None,
            f"{run.expired_blocks:,} live blocks, released by the next write (the soak makes "
            "one); until a write comes, an idle store keeps them",
        )
        report.check(
            "entries held after one write",
            base_store.held_entries,
            end_store.held_entries,
            end_store.held_entries == base_store.held_entries,
        )
        report.check(
            "sorted indexes held",
            base_store.indexes,
            end_store.indexes,
            end_store.indexes == base_store.indexes,
        )
    if base_store.redis_keys is not None:
        report.check(
            "Redis server keys (INFO keyspace, indexes included)",
            base_store.redis_keys,
            end_store.redis_keys,
            end_store.redis_keys == base_store.redis_keys,
        )
        assert base_store.redis_memory is not None
        assert end_store.redis_memory is not None
        report.check(
            "Redis used_memory",
            mib(base_store.redis_memory),
            mib(end_store.redis_memory),
            None,
            f"{(end_store.redis_memory - base_store.redis_memory) / 1024:+,.1f} KiB; "
            f"peak during the run {mib(timeline.peak('redis_memory'))}",
        )
    if base_store.snapshot_bytes is not None:
        assert end_store.snapshot_bytes is not None
        assert end_store.log_bytes is not None
        report.check(
            "file snapshot after flush()",
            f"{base_store.snapshot_bytes:,} B",
            f"{end_store.snapshot_bytes:,} B",
            abs(end_store.snapshot_bytes - base_store.snapshot_bytes) <= SNAPSHOT_TOLERANCE,
            f"tolerance {SNAPSHOT_TOLERANCE:,} B; log + snapshot peaked at "
            f"{mib(timeline.peak('disk'))} during the run",
        )
        report.check(
            "file log after flush()",
            f"{base_store.log_bytes:,} B",
            f"{end_store.log_bytes:,} B",
            end_store.log_bytes == base_store.log_bytes,
        )
        report.check(
            "files in the store directory",
            len(base_store.files or []),
            len(end_store.files or []),
            end_store.files == base_store.files,
            ", ".join(end_store.files or []),
        )
    report.check(
        "live allocated blocks (sys.getallocatedblocks)",
        f"{base_memory.blocks:,}",
        f"{end_memory.blocks:,}",
        end_memory.blocks - base_memory.blocks <= BLOCKS_TOLERANCE,
        f"{end_memory.blocks - base_memory.blocks:+,}, tolerance {BLOCKS_TOLERANCE:,} "
        f"(1 per {run.ops // BLOCKS_TOLERANCE} operations); bounded caches emptied before "
        "each reading: " + ", ".join(f"{name} {n:,}" for name, n in end_memory.caches.items()),
    )
    report.check(
        "RSS (/proc/self/status VmRSS)",
        mib(base_memory.rss),
        mib(end_memory.rss),
        end_memory.rss - base_memory.rss <= RSS_TOLERANCE,
        f"{(end_memory.rss - base_memory.rss) / MIB:+.1f} MiB, tolerance "
        f"{RSS_TOLERANCE // MIB} MiB; peak during the run {mib(timeline.peak('rss'))}",
    )
    if traced is not None and traced_memory is not None:
        before, after = traced_memory
        assert before.traced is not None
        assert after.traced is not None
        grown = after.traced - before.traced
        report.check(
            "traced bytes, traced cycle 1 -> 2 (tracemalloc)",
            f"{before.traced / 1024:,.1f} KiB",
            f"{after.traced / 1024:,.1f} KiB",
            grown - (table_growth or 0) <= TRACED_TOLERANCE,
            f"{grown / 1024:+,.1f} KiB after {traced.ops:,} operations"
            + (
                f", of which the store's dict table {table_growth / 1024:+,.1f} KiB (reallocated "
                "when it resized; bounded by the most keys ever held), the rest "
                f"{(grown - table_growth) / traced.ops:+.1f} B/op"
                if table_growth
                else f" ({grown / traced.ops:+.1f} B/op)"
            )
            + f"; tolerance {TRACED_TOLERANCE // 1024} KiB; "
            f"live blocks {after.blocks - before.blocks:+,}",
        )
    compare_open(report, base_process, end_process)
    compare_closed(report, before_open, closed_process, closed_keys, base_store.redis_keys)
    say(report.render())
    return 1 if report.failed else 0


def compare_open(report: Report, base: Process, end: Process) -> None:
    extra = Counter(end.tasks) - Counter(base.tasks)
    gone = Counter(base.tasks) - Counter(end.tasks)
    report.check(
        "asyncio tasks while open",
        len(base.tasks),
        len(end.tasks),
        not extra and not gone,
        "; ".join(
            [f"extra: {sorted(extra.elements())}"] * bool(extra)
            + [f"gone: {sorted(gone.elements())}"] * bool(gone)
        )
        or ", ".join(end.tasks),
    )
    report.check(
        "threads while open (anyio's worker pool aside)",
        base.threads_besides_pool,
        end.threads_besides_pool,
        end.threads_besides_pool == base.threads_besides_pool,
        f"anyio workers {base.anyio_workers} -> {end.anyio_workers}",
    )
    # The Redis backend checks connections out as it needs them and keeps them, up to its cap:
    # extra sockets are fine as long as the backend holds them.
    grown = (end.pool[0] - base.pool[0]) if end.pool and base.pool else 0
    held = (
        f"; the backend holds {base.pool[0]} -> {end.pool[0]} connections"
        if end.pool and base.pool
        else ""
    )
    report.check(
        "file descriptors while open",
        base.fds,
        end.fds,
        end.fds - base.fds <= grown,
        f"sockets the backend's pool took since the baseline: {grown}{held}" if end.pool else "",
    )
    report.check(
        "event loop timers while open (cancelled ones)",
        f"{base.timers[0]} ({base.timers[1]})",
        f"{end.timers[0]} ({end.timers[1]})",
        None,
        "cancelled timeouts stay in asyncio's heap until due (or until they are half of it)",
    )
    report.check(
        "child processes while open", base.children, end.children, end.children == base.children
    )
    if base.redis_clients is not None:
        assert end.redis_clients is not None
        assert end.pool is not None
        report.check(
            "Redis connected clients while open",
            base.redis_clients,
            end.redis_clients,
            end.redis_clients - base.redis_clients <= grown and end.pool[0] <= end.pool[1],
            f"the soak's own INFO connection included; the backend holds {end.pool[0]} command "
            f"connections (cap {end.pool[1]}) and 1 for pub/sub, {grown:+} since the baseline",
        )


def compare_closed(
    report: Report,
    before: Process,
    closed: Process,
    redis_keys: int | None,
    base_redis_keys: int | None,
) -> None:
    extra = Counter(closed.tasks) - Counter(before.tasks)
    report.check(
        "asyncio tasks after close (vs before open)",
        len(before.tasks),
        len(closed.tasks),
        not extra,
        f"extra: {sorted(extra.elements())}" if extra else "",
    )
    report.check(
        "threads after close (vs before open)",
        before.os_threads,
        closed.os_threads,
        closed.os_threads <= before.os_threads,
        f"anyio workers {before.anyio_workers} -> {closed.anyio_workers}",
    )
    report.check(
        "file descriptors after close (vs before open)",
        before.fds,
        closed.fds,
        closed.fds <= before.fds,
    )
    report.check(
        "child processes after close (vs before open)",
        before.children,
        closed.children,
        closed.children <= before.children,
    )
    if before.redis_clients is not None:
        assert closed.redis_clients is not None
        report.check(
            "Redis connected clients after close (vs before open)",
            before.redis_clients,
            closed.redis_clients,
            closed.redis_clients <= before.redis_clients,
        )
        report.check(
            "Redis server keys after close",
            base_redis_keys,
            redis_keys,
            redis_keys == base_redis_keys,
        )


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
