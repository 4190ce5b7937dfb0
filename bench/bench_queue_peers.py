"""The managers against what users would pick instead (issue #21, point 4), in one run on one Redis.

Run: `python -m bench.bench_queue_peers` (starts its own redis-server on loopback TCP). SAQ comes
with the `bench` dependency group; arq is installed apart (`make bench` runs
`pip install --no-deps arq`: arq caps redis-py below 6, see pyproject.toml). A peer that is not
installed is left out of the table, with a note.

- Task queues: arq and SAQ (PyPI) draining no-op jobs, against agenticstate's
  OrchestrationStateManager `claim_task` + `complete_task`, with 1 and 4 worker processes each.
- Single operations, interleaved rounds with each ratio taken within its round: a tool cache hit
  (`ToolStateManager.cached_call`) against a raw redis-py GET; a speech interim update
  (`SpeechStateManager.update_stt_state`) and a `StateManager.update` against a raw SET.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from importlib.util import find_spec
from typing import TYPE_CHECKING

import anyio
import redis.asyncio as aioredis

from agenticstate import (
    OrchestrationStateManager,
    SpeechStateManager,
    StateConfig,
    StateManager,
    STTState,
    TeamState,
    ToolStateManager,
)
from bench._util import ROOT, Row, median, publish, rate, redis_server, table

# Rounds of queue runs (each system in turn) and of the single operations. The queue runs are
# what takes the time (each starts its worker processes): 2 rounds keep the module near a minute.
ROUNDS = 2
OPS = 2000  # sequential operations per single-operation measurement (a round)
SLICE = 100  # calls in a row before the next operation takes its turn
TASKS = 500  # jobs per queue run
WORKERS = (1, 4)
QUEUE_TARGET = 2000.0  # tasks/s, claim + complete with one worker (issue #21)
RATIO_TARGET = 0.8  # cache hit against raw GET; speech update and update against raw SET
VALUE = {"status": "running", "task": "analyze_data", "progress": 0.45, "notes": "x" * 120}
RAW = json.dumps(VALUE).encode()
PEERS = {"arq": "arq", "saq": "SAQ"}

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    Operation = Callable[[int], Awaitable[object]]


def peers() -> list[str]:
    """The peer queues installed here (the `bench` dependency group)."""
    return [kind for kind in PEERS if find_spec(kind) is not None]


def versions(kinds: list[str]) -> str:
    return " and ".join(f"{PEERS[kind]} {metadata.version(kind)}" for kind in kinds) or "The peers"


async def enqueue(kind: str, url: str, queue: str, tasks: int) -> None:
    if kind == "agenticstate":
        config = StateConfig(backend="redis", redis_url=url, key_prefix=queue)
        async with StateManager(config) as state:
            orch = OrchestrationStateManager(state_manager=state)
            await orch.create_team(TeamState(team_id="bench"))
            for n in range(tasks):
                await orch.enqueue_task("bench", {"id": f"t{n}"})
    elif kind == "arq":
        from arq.connections import RedisSettings, create_pool

        pool = await create_pool(RedisSettings.from_dsn(url), default_queue_name=queue)
        for _ in range(tasks):
            await pool.enqueue_job("noop")
        await pool.aclose()
    else:
        from saq import Queue

        saq_queue = Queue.from_url(url, name=queue)
        await saq_queue.connect()
        for _ in range(tasks):
            await saq_queue.enqueue("noop")
        await saq_queue.disconnect()


def race(kind: str, url: str, queue: str, workers: int) -> tuple[int, float]:
    """Start the workers, let them go together; the count done and seconds to the last completion.

    Blocking on purpose: the workers are other processes, and nothing else runs meanwhile.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench._queue_peer_worker", kind, url, queue, f"w{n}"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(workers)
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()  # one clock for every process on Linux (CLOCK_MONOTONIC)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    done, last = 0, start
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        count, stamp = out.strip().splitlines()[-1].split()
        done += int(count)
        last = max(last, float(stamp))
    return done, last - start


def queue_rate(kind: str, url: str, workers: int, run: str) -> float:
    queue = f"{kind}{workers}{run}:"
    anyio.run(enqueue, kind, url, queue, TASKS)
    done, seconds = race(kind, url, queue, workers)
    assert done == TASKS, (kind, workers, done, TASKS)
    return TASKS / seconds


async def singles(url: str) -> list[Row]:
    raw = aioredis.Redis.from_url(url)
    config = StateConfig(backend="redis", redis_url=url, key_prefix="p:")
    async with StateManager(config) as state:
        tools = ToolStateManager(state_manager=state)
        speech = SpeechStateManager(state_manager=state)
        session_id = await speech.create_session()
        await state.save("update", VALUE)
        await raw.set("raw:get", RAW)

        async def search() -> dict[str, list[str]]:
            return {"results": ["a", "b", "c"]}

        operations = {
            "raw_get": lambda _: raw.get("raw:get"),
            "raw_set": lambda i: raw.set("raw:set", RAW),
            "hit": lambda _: tools.cached_call("search_web", {"query": "AI news"}, search),
            "speech": lambda i: speech.update_stt_state(
                STTState(
                    session_id=session_id, interim_transcript=f"word {i}", audio_received_bytes=i
                )
            ),
            "update": lambda i: state.update("update", {"progress": i}),
        }
        for operation in operations.values():  # warm up: first-use costs stay out
            await rate(operation, 200)
        rounds = [await interleaved(operations) for _ in range(ROUNDS)]
    await raw.aclose()
    return [
        Row.over(label, ours, base, base_label, rounds)
        for label, ours, base, base_label in [
            ("tool cache hit (cached_call)", "hit", "raw_get", "raw GET"),
            ("speech interim update (update_stt_state)", "speech", "raw_set", "raw SET"),
            ("StateManager.update (merge)", "update", "raw_set", "raw SET"),
        ]
    ]


async def interleaved(
    operations: Mapping[str, Callable[[int], Awaitable[object]]],
) -> dict[str, float]:
    """Each operation's rate over OPS calls, run in alternating slices of SLICE calls.

    On a small machine shared with redis-server (and whatever else runs) the speed drifts within
    seconds; slices this short put every operation and its baseline through the same drift.
    """
    seconds = dict.fromkeys(operations, 0.0)
    for start in range(0, OPS, SLICE):
        for name, operation in operations.items():
            began = time.perf_counter()
            for i in range(start, start + SLICE):
                await operation(i)
            seconds[name] += time.perf_counter() - began
    return {name: OPS / spent for name, spent in seconds.items()}


def met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def run() -> tuple[str, list[tuple[str, float]]]:
    kinds = peers()
    # rounds[r][kind, workers]: the rate of run r. The systems take turns within a round, and
    # ratios are taken within a round, as for the single operations.
    rounds: list[dict[tuple[str, int], float]] = []
    with redis_server() as url:
        for r in range(ROUNDS):
            figures: dict[tuple[str, int], float] = {}
            for workers in WORKERS:
                for kind in [*kinds, "agenticstate"]:
                    figures[kind, workers] = queue_rate(kind, url, workers, f"r{r}")
            rounds.append(figures)
        single = anyio.run(singles, url)
    rows: list[list[str]] = []
    bars: list[tuple[str, float]] = []
    for workers in WORKERS:
        processes = f"{workers} worker process{'es' if workers > 1 else ''}"
        for kind in kinds:
            peer = median([figures[kind, workers] for figures in rounds])
            rows.append(
                [f"queue: {PEERS[kind]}, {processes}", f"{peer:,.0f} jobs/s", "-", "-", "-"]
            )
        ours = median([figures["agenticstate", workers] for figures in rounds])
        cells, ok = [], ours >= QUEUE_TARGET or workers > 1
        for kind in kinds:
            ratios = [
                figures["agenticstate", workers] / figures[kind, workers] for figures in rounds
            ]
            ratio = median(ratios)
            cells.append(f"{ratio:.2f}x {PEERS[kind]} ({min(ratios):.2f}-{max(ratios):.2f})")
            ok = ok and ratio >= 1
            bars.append((f"claim + complete, {workers}w vs {PEERS[kind]}", ratio))
        goal = [f">= {QUEUE_TARGET:,.0f} tasks/s"] if workers == 1 else []
        goal += [f">= {PEERS[kind]}" for kind in kinds]
        rows.append(
            [
                f"queue: agenticstate claim + complete, {processes}",
                f"{ours:,.0f} tasks/s",
                ", ".join(cells) or "-",
                ", ".join(goal),
                met(ok),
            ]
        )
    for row in single:
        rows.append(
            [
                f"{row.label}, Redis",
                f"{row.rate:,.0f}/s",
                f"{row.ratio:.2f}x {row.base_label} ({row.base:,.0f}/s; "
                f"{row.low:.2f}-{row.high:.2f})",
                f">= {RATIO_TARGET}x {row.base_label}",
                met(row.ratio >= RATIO_TARGET),
            ]
        )
        bars.append((row.label, row.ratio))
    notes = [
        f"Queues: {TASKS:,} no-op jobs enqueued first, then the worker processes start together; "
        "the clock runs from their start signal to the last job's completion (start-up and "
        f"each library's empty-queue detection left out). {ROUNDS} rounds, the systems taking "
        "turns in each; shown: the median rate, the median of the rounds' ratios and their "
        "range. All on one redis-server (loopback TCP).",
        "agenticstate: each worker loops claim_task + complete_task, one task at a time. "
        f"{versions(kinds)} run their defaults (10 jobs at a time per worker, results kept), "
        "except arq's poll_delay, set to 0 (its default 0.5 s pauses between queue reads).",
        f"Single operations: {ROUNDS} rounds of {OPS:,} sequential calls each (asyncio, "
        f"hiredis, loopback TCP), the operations taking turns every {SLICE} calls; each ratio is "
        "taken within a round; shown: the median rate, the median ratio and the range of ratios "
        "over the rounds.",
        "Targets: a cache hit at least 0.8x a raw GET; claim + complete at least "
        "2,000 tasks/s with one worker and at least arq's and SAQ's rate beside it; a speech "
        "update and update at least 0.8x a raw SET.",
    ]
    if len(kinds) < len(PEERS):
        missing = ", ".join(PEERS[kind] for kind in PEERS if kind not in kinds)
        notes.append(f"Not installed here, so not measured: {missing} (see `make bench`).")
    text = table(
        "Managers against the peers users would pick instead (Redis)",
        ["workload", "rate", "ratio", "target", "target met"],
        rows,
        notes,
    )
    return text, bars


def main() -> None:
    text, bars = run()
    publish("queue_peers", text, bars)


if __name__ == "__main__":
    main()
