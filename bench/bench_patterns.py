"""Memory saves per second with 0, 1, 10, 100 and 1,000 callback patterns subscribed.

Run: `python -m bench.bench_patterns`. Issue #15 measured a memory save falling from 42,700/s
to 2,900/s as 1,000 patterns were subscribed: every change was matched against every pattern.
The fan-out now indexes patterns by their literal prefix (and suffix, for patterns starting
with a wildcard), so a change costs a few dict lookups plus the patterns that really match.

The workload: N callbacks on `agent:{i}:*` patterns, and one in a hundred on a pattern with a
wildcard up front (`*:{i}:done`, found by its suffix). Each save writes `agent:0:x`, so
with any pattern subscribed exactly one callback receives each change: the figures compare the
cost of having more patterns, not of delivering more. Every round measures each N back to back
and reports its rate against the one-pattern run of the same round (the target: 1,000 patterns
cost at most 2x a save with one, a ratio of at least 0.5).
"""

from __future__ import annotations

import statistics
from typing import Any

import anyio

from agenticstate import StateConfig, StateManager
from bench._util import publish, rate, table

COUNTS = [0, 1, 10, 100, 1000]
ROUNDS = 5
SAVES = 4000
VALUE = {"status": "running", "progress": 0.45}


def patterns(count: int) -> list[str]:
    """`count` patterns: `agent:{i}:*`, and one in a hundred with a wildcard up front."""
    fronted = count // 100
    return [f"agent:{i}:*" for i in range(count - fronted)] + [
        f"*:{i}:done" for i in range(fronted)
    ]


async def saves_per_second(count: int) -> float:
    """Memory saves per second with `count` callback patterns subscribed."""
    delivered = 0
    all_delivered = anyio.Event()

    def on_change(key: str, old: Any, new: Any) -> None:
        nonlocal delivered
        delivered += 1
        if delivered == SAVES:
            all_delivered.set()

    async with StateManager(StateConfig(backend="memory", subscriber_buffer=SAVES + 1)) as state:
        handles = [state.subscribe(pattern, on_change) for pattern in patterns(count)]
        for handle in handles:
            await handle.wait_live()
        per_second = await rate(lambda j: state.save("agent:0:x", {**VALUE, "j": j}), SAVES)
        # Every change reaches its callback: what is measured is a save that is delivered.
        if count:
            with anyio.fail_after(60):
                await all_delivered.wait()
    return per_second


async def run() -> tuple[str, list[tuple[str, float]]]:
    rates: dict[int, list[float]] = {count: [] for count in COUNTS}
    ratios: dict[int, list[float]] = {count: [] for count in COUNTS}
    await saves_per_second(1)  # warm-up
    for _ in range(ROUNDS):
        measured = {count: await saves_per_second(count) for count in COUNTS}
        for count, value in measured.items():
            rates[count].append(value)
            ratios[count].append(value / measured[1])
    rows = []
    bars = []
    for count in COUNTS:
        ratio = statistics.median(ratios[count])
        rows.append(
            [
                f"{count:,}",
                f"{statistics.median(rates[count]):,.0f}/s",
                f"{ratio:.2f}x ({min(ratios[count]):.2f}-{max(ratios[count]):.2f})",
            ]
        )
        bars.append((f"{count:,} patterns", ratio))
    text = table(
        "Subscribed patterns: memory saves per second",
        ["patterns subscribed", "saves", "vs one pattern (range over rounds)"],
        rows,
        [
            f"{SAVES:,} saves of `agent:0:x` per run, {ROUNDS} rounds, median ratio to "
            "the one-pattern run of the same round. With any pattern, one callback receives "
            "each change (the run waits until all are delivered after timing the saves).",
            "Patterns: `agent:{i}:*`, and one in a hundred `*:{i}:done` (a wildcard up front, "
            "indexed by its literal suffix).",
            "Target: 1,000 patterns at most 2x the cost of one (a ratio of at least 0.50).",
        ],
    )
    return text, bars


def main() -> None:
    text, bars = anyio.run(run)
    publish("patterns", text, bars)


if __name__ == "__main__":
    main()
