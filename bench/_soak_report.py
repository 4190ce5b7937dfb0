"""The soak's report: what each cycle did, the peaks of the run, and the checks.

`soak.py` runs the phases and hands their readings to `build_report`, which turns them into
sections and PASS / FAIL / INFO checks (tolerances below; docs/reliability.md says why).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench._soak_probe import MIB, top_types
from bench._util import machine

if TYPE_CHECKING:
    from agenticstate import StateStats
    from bench._soak_probe import Growth, Memory, Process, Store

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


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f} MiB"


def listed(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items())) or "none"


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


# ------------------------------------------------------------------ peaks


class Peaks(dict[str, float]):
    """The largest value of each figure the sampler saw during the run (rss, disk, ...)."""

    def add(self, name: str, value: float | None) -> None:
        if value is not None:
            self[name] = max(value, self.get(name, value))


# ------------------------------------------------------------------ what the phases found


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
    left: list[str] = field(default_factory=list)  # keys left after the sweep: the first few
    left_count: int = 0
    expired_blocks: int = 0  # live blocks the first write after the TTLs released


@dataclass
class Reading:
    """One reading of the store, the process and live memory (the baseline, or after the run)."""

    store: Store
    process: Process
    memory: Memory
    types: Counter[str]


@dataclass
class Traced:
    """The traced leg: two cycles under tracemalloc and what the second left alive."""

    first: Cycle
    second: Cycle
    start: Memory
    end: Memory
    growth: Growth


@dataclass
class Results:
    """Everything the phases measured, for the report."""

    backend: str
    workers: int
    longest_ttl: float
    pool_size: int | None  # Redis: the backend's connection_pool_size
    before_open: Process
    warm: Cycle
    base: Reading
    run: Cycle
    end: Reading
    stats: StateStats
    traced: Traced | None = None
    closed: Process | None = None
    closed_redis_keys: int | None = None
    settle_seconds: float = 0.0
    total_seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start, at the end
    peaks: Peaks = field(default_factory=Peaks)

    @property
    def cycles(self) -> list[Cycle]:
        traced = [self.traced.first, self.traced.second] if self.traced else []
        return [self.warm, self.run, *traced]


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


def build_report(results: Results, logs: LogCounter) -> Report:
    """The summary sections and every check."""
    report = Report(results.backend)
    report.sections += summary(results, logs)
    check_operations(report, results, logs)
    check_store(report, results)
    check_memory(report, results)
    check_traced(report, results.traced)
    check_open(report, results)
    check_closed(report, results)
    return report


def summary(results: Results, logs: LogCounter) -> list[str]:
    run, warm, traced = results.run, results.warm, results.traced
    second = traced.second if traced else None
    lines = [
        "",
        f"Soak on the {results.backend} backend: {machine()}",
        f"  run: {run.ops:,} operations in {run.seconds:.1f} s = {run.ops / run.seconds:,.0f} "
        f"ops/s from {results.workers} tasks; warm-up {warm.ops:,}"
        + (
            f", traced cycles 2 x {second.ops:,} ({second.ops / second.seconds:,.0f} ops/s "
            "under tracemalloc)"
            if second
            else ""
        )
        + f"; whole soak {results.total_seconds:.0f} s",
        f"  load average (1 min) {results.load[0]:.1f} at the start, {results.load[1]:.1f} at the "
        "end (other work on the machine slows every figure here)",
        "  by area: "
        + ", ".join(
            f"{area} {n:,} ({n / run.ops:.0%})"
            for area, n in sorted(run.by_area.items(), key=lambda item: -item[1])
        ),
        f"  outcomes in the mix: {listed(run.expected)}",
        f"  plain:* callback events {run.plain_events:,}; {results.stats}",
        f"  drain: {listed(run.drained)} ({run.drain_seconds:.1f} s)",
        f"  TTLs: waited {run.waited:.1f} s after the drain (longest TTL "
        f"{results.longest_ttl:.0f} s); {run.keys_left:,} keys left, {run.still_expiring:,} of "
        "them with a TTL",
        f"  after close the process settled in {results.settle_seconds:.1f} s",
        f"Log events at warning level: {listed(logs.at('warning'))}",
        "Object types that grew most during the run (gc.get_objects): "
        + (", ".join(top_types(results.base.types, results.end.types, 6)) or "none"),
    ]
    if traced and traced.growth.lines:
        lines.append("Largest growth of traced allocations from traced cycle 1 to 2, by line:")
        lines += [f"  {line}" for line in traced.growth.lines]
    return lines


def check_operations(report: Report, results: Results, logs: LogCounter) -> None:
    cycles = results.cycles
    errors = sum(sum(c.errors.values()) for c in cycles)
    samples = "; ".join(sample for c in cycles for sample in c.error_samples[:3])
    report.check("unexpected errors in the operations", "-", errors, errors == 0, samples)
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


def check_store(report: Report, results: Results) -> None:
    base, end = results.base.store, results.end.store
    left = {c.phase: c.left for c in results.cycles if c.left_count}
    report.check(
        "keys left after drain + TTLs (no API would remove them: a leak)",
        base.keys,
        end.keys,
        end.keys == base.keys and not left,
        "; ".join(f"{phase}: {keys}" for phase, keys in left.items()),
    )
    if base.redis_keys is not None and base.redis_memory is not None:
        report.check(
            "Redis server keys (INFO keyspace, indexes included)",
            base.redis_keys,
            end.redis_keys,
            end.redis_keys == base.redis_keys,
        )
        end_memory = end.redis_memory or 0
        report.check(
            "Redis used_memory",
            mib(base.redis_memory),
            mib(end_memory),
            None,
            f"{(end_memory - base.redis_memory) / 1024:+,.1f} KiB; "
            f"peak during the run {mib(results.peaks.get('redis_memory'))}",
        )
    if base.snapshot_bytes is not None and base.log_bytes is not None:
        snapshot, log = end.snapshot_bytes or 0, end.log_bytes or 0
        report.check(
            "file snapshot after flush()",
            f"{base.snapshot_bytes:,} B",
            f"{snapshot:,} B",
            abs(snapshot - base.snapshot_bytes) <= SNAPSHOT_TOLERANCE,
            f"tolerance {SNAPSHOT_TOLERANCE:,} B; log + snapshot peaked at "
            f"{mib(results.peaks.get('disk'))} during the run",
        )
        report.check(
            "file log after flush()", f"{base.log_bytes:,} B", f"{log:,} B", log == base.log_bytes
        )
        report.check(
            "files in the store directory",
            len(base.files or []),
            len(end.files or []),
            end.files == base.files,
            ", ".join(end.files or []),
        )


def check_memory(report: Report, results: Results) -> None:
    base, end, run = results.base.memory, results.end.memory, results.run
    report.check(
        "live blocks the first write after the TTLs released",
        "-",
        f"{run.expired_blocks:,}",
        None,
        "memory and file stores drop expired entries when a write comes; until then an idle "
        "store keeps them (the soak makes one write)",
    )
    report.check(
        "live allocated blocks (sys.getallocatedblocks)",
        f"{base.blocks:,}",
        f"{end.blocks:,}",
        end.blocks - base.blocks <= BLOCKS_TOLERANCE,
        f"{end.blocks - base.blocks:+,}, tolerance {BLOCKS_TOLERANCE:,} "
        f"(1 per {run.ops // BLOCKS_TOLERANCE} operations); the bounded caches are filled with "
        "the soak's own keys and patterns before each reading",
    )
    report.check(
        "RSS (/proc/self/status VmRSS)",
        mib(base.rss),
        mib(end.rss),
        end.rss - base.rss <= RSS_TOLERANCE,
        f"{(end.rss - base.rss) / MIB:+.1f} MiB, tolerance "
        f"{RSS_TOLERANCE // MIB} MiB; peak during the run {mib(results.peaks.get('rss'))}",
    )


def check_traced(report: Report, traced: Traced | None) -> None:
    if traced is None:
        return
    before, after, growth = traced.start.traced or 0, traced.end.traced or 0, traced.growth
    grown, ops = after - before, traced.second.ops
    rest = grown - growth.resized
    report.check(
        "traced bytes, traced cycle 1 -> 2 (tracemalloc)",
        f"{before / 1024:,.1f} KiB",
        f"{after / 1024:,.1f} KiB",
        rest <= TRACED_TOLERANCE,
        f"{grown / 1024:+,.1f} KiB after {ops:,} operations, of which containers that resized "
        f"(one block a line, bounded by the most items held) {growth.resized / 1024:+,.1f} KiB, "
        f"the rest {rest / ops:+.1f} B/op; tolerance {TRACED_TOLERANCE // 1024} KiB; live "
        f"blocks {traced.end.blocks - traced.start.blocks:+,}",
    )


def check_open(report: Report, results: Results) -> None:
    base, end = results.base.process, results.end.process
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
    # The Redis backend opens connections as it needs them and keeps them, up to its cap: extra
    # sockets are fine as long as the server counts as many more clients.
    sockets = (end.redis_clients or 0) - (base.redis_clients or 0)
    report.check(
        "file descriptors while open",
        base.fds,
        end.fds,
        end.fds - base.fds <= max(sockets, 0),
        f"Redis clients since the baseline: {sockets:+}" if end.redis_clients is not None else "",
    )
    report.check(
        "child processes while open", base.children, end.children, end.children == base.children
    )
    before = results.before_open.redis_clients
    if before is not None and end.redis_clients is not None and results.pool_size is not None:
        held = end.redis_clients - before
        report.check(
            "Redis connected clients while open",
            base.redis_clients,
            end.redis_clients,
            held <= results.pool_size + 1,
            f"the backend holds {held} (before it opened: {before}, the soak's INFO connection); "
            f"at most connection_pool_size ({results.pool_size}) for commands and 1 for pub/sub",
        )


def check_closed(report: Report, results: Results) -> None:
    before, closed = results.before_open, results.closed
    if closed is None:
        return
    extra = Counter(closed.tasks) - Counter(before.tasks)
    report.check(
        "asyncio tasks after close (vs before open)",
        len(before.tasks),
        len(closed.tasks),
        not extra,
        f"extra: {sorted(extra.elements())}" if extra else "",
    )
    counts = (
        ("threads", before.os_threads, closed.os_threads),
        ("file descriptors", before.fds, closed.fds),
        ("child processes", before.children, closed.children),
        ("Redis connected clients", before.redis_clients, closed.redis_clients),
    )
    for name, was, now in counts:
        if was is not None and now is not None:
            report.check(f"{name} after close (vs before open)", was, now, now <= was)
    if before.redis_clients is not None:
        keys, closed_keys = results.base.store.redis_keys, results.closed_redis_keys
        report.check("Redis server keys after close", keys, closed_keys, closed_keys == keys)
