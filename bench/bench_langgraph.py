"""LangGraph checkpointing: agenticstate's `CheckpointSaver` against the saver a user would pick
instead, on graph runs and on the saver's own calls, in one run.

Run: `python -m bench.bench_langgraph [ROUNDS]` (starts its own redis-server, with
`appendfsync always`, and its own PostgreSQL server, `bench._postgres`).

Three pairs, each our backend against its baseline:

- memory: agenticstate's memory backend against LangGraph's `InMemorySaver` (target 0.8x);
- SQLite: agenticstate's SQLite backend against `AsyncSqliteSaver` (target 1.0x), both in WAL
  mode with `synchronous=FULL` (every put on disk before it returns);
- Redis with `appendfsync always` against `AsyncPostgresSaver` (target 1.0x), both durable per
  commit (PostgreSQL with its defaults, `fsync=on`, `synchronous_commit=on`).

Workloads, for every saver: one thread of 200 turns of the two-node chat graph
(`bench._thread_workload`: a `messages` channel with `add_messages`, three checkpoints a turn),
40 threads of 10 turns each run concurrently, the history of the 200-turn thread
(`aget_state_history`, per snapshot), resuming a graph paused in `interrupt()` (per resume),
and the saver's calls alone on a chain of 200 checkpoints: `aput`, `aget_tuple` by id and
`alist(limit=10)`. Each round runs both savers of a pair back to back, in alternating order,
on fresh stores, and takes the ratio within the round (ours over the baseline's rate: above 1
is faster); the report gives the median ratio and its range over the rounds.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import anyio
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from agenticstate import StateConfig, StateManager
from agenticstate.backends import open_backend
from agenticstate.langgraph import HEAD_GUARD_KEY, CheckpointSaver
from bench._thread_workload import chat_graph, user_message
from bench._util import publish, table

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

ROUNDS = 3
TURNS = 200  # one thread
THREADS, THREAD_TURNS = 40, 10  # concurrent threads, turns each
RESUMES = 40  # threads paused in interrupt(), each resumed once
CHECKPOINTS = 200  # direct calls: puts, then as many get_tuple by id
LIMITED_LISTS = 50  # then this many `alist(limit=10)` of the thread
WORKLOADS = {
    "turns": f"graph turns, one thread x {TURNS} (per turn)",
    "concurrent": f"graph turns, {THREADS} threads x {THREAD_TURNS} at once (per turn)",
    "history": f"aget_state_history of the {TURNS}-turn thread (per snapshot)",
    "resume": "resume after interrupt() (per resume)",
    "put": "aput (per call)",
    "get_tuple": "aget_tuple by id (per call)",
    "list10": "alist(limit=10) (per call)",
}
PAIRS = [  # (ours, baseline, target ratio)
    ("agenticstate memory", "InMemorySaver", 0.8),
    ("agenticstate SQLite", "AsyncSqliteSaver", 1.0),
    ("agenticstate Redis (appendfsync always)", "AsyncPostgresSaver", 1.0),
]


def _chain(count: int) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """`count` (checkpoint, metadata, new_versions), each step changing two channels."""
    chain = []
    messages: list[dict[str, str]] = []
    versions: dict[str, Any] = {}
    for step in range(count):
        messages = [*messages[-12:], {"role": "user", "content": f"message {step} " + "x" * 120}]
        checkpoint: Any = empty_checkpoint()
        checkpoint["id"] = str(uuid6(clock_seq=step))
        new = {"messages": f"{step + 1:032}.1", "scratch": f"{step + 1:032}.1"}
        if step == 0:
            new |= {"profile": "1".zfill(32) + ".1", "tools": "1".zfill(32) + ".1"}
        versions |= new
        checkpoint["channel_versions"] = dict(versions)
        checkpoint["channel_values"] = {
            "messages": messages,
            "scratch": {"step": step, "notes": "n" * 60},
            "profile": {"user": "ada", "tone": "short"},
            "tools": ["search", "calculator"],
        }
        metadata = {"source": "loop", "step": step, "parents": {}}
        chain.append((checkpoint, metadata, new))
    return chain


class _Approval(TypedDict, total=False):
    steps: list[str]
    answer: str


def _approval_graph(saver: Any) -> Any:
    """plan -> ask (pauses in `interrupt()` for an answer) -> finish."""

    def plan(state: _Approval) -> _Approval:
        return {"steps": ["plan"]}

    def ask(state: _Approval) -> _Approval:
        return {"answer": str(interrupt({"question": "ship it?"}))}

    def finish(state: _Approval) -> _Approval:
        return {"steps": [*state["steps"], f"finish:{state['answer']}"]}

    builder = StateGraph(_Approval)
    builder.add_node("plan", plan)
    builder.add_node("ask", ask)
    builder.add_node("finish", finish)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "ask")
    builder.add_edge("ask", "finish")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=saver)


async def _graph_runs(saver: Any, tag: str, scale: int = 1) -> dict[str, float]:
    """Rates of the graph workloads on `saver`: turns, concurrent turns, history, resume.

    `scale` divides every count (a warm-up runs the same code on less work).
    """
    turns, threads, thread_turns = TURNS // scale, THREADS // scale, THREAD_TURNS // scale
    resumes = RESUMES // scale
    rates: dict[str, float] = {}
    graph = chat_graph(saver)
    config: Any = {"configurable": {"thread_id": f"{tag}-chat"}}
    start = time.perf_counter()
    for turn in range(turns):
        await graph.ainvoke(user_message(turn), config)
    rates["turns"] = turns / (time.perf_counter() - start)

    start = time.perf_counter()
    snapshots = [snapshot async for snapshot in graph.aget_state_history(config)]
    rates["history"] = len(snapshots) / (time.perf_counter() - start)
    assert len(snapshots) >= 3 * turns

    async def thread(number: int) -> None:
        config: Any = {"configurable": {"thread_id": f"{tag}-many-{number}"}}
        for turn in range(thread_turns):
            await graph.ainvoke(user_message(turn), config)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for number in range(threads):
            group.start_soon(thread, number)
    rates["concurrent"] = threads * thread_turns / (time.perf_counter() - start)

    approval = _approval_graph(saver)
    paused = []
    for number in range(resumes):
        config = {"configurable": {"thread_id": f"{tag}-ask-{number}"}}
        await approval.ainvoke({"steps": []}, config)
        paused.append(config)
    start = time.perf_counter()
    for config in paused:
        done = await approval.ainvoke(Command(resume="yes"), config)
        assert done["steps"][-1] == "finish:yes"
    rates["resume"] = resumes / (time.perf_counter() - start)
    return rates


async def _calls(saver: Any, tag: str, chain: list[Any]) -> dict[str, float]:
    """Rates of `aput`, `aget_tuple` (by id) and `alist(limit=10)` on a chain of checkpoints."""
    config: Any = {"configurable": {"thread_id": f"{tag}-calls", "checkpoint_ns": ""}}
    stored = []
    start = time.perf_counter()
    for checkpoint, metadata, new in chain:
        config = await saver.aput(config, checkpoint, metadata, new)
        stored.append(config)
        # As in a graph run continuing a thread: every put after the first is head-guarded.
        config = {"configurable": {**config["configurable"], HEAD_GUARD_KEY: True}}
    put = len(chain) / (time.perf_counter() - start)
    start = time.perf_counter()
    for config in stored:
        assert await saver.aget_tuple(config) is not None
    get = len(stored) / (time.perf_counter() - start)
    thread: Any = {"configurable": {"thread_id": f"{tag}-calls"}}
    start = time.perf_counter()
    for _ in range(LIMITED_LISTS):
        page = [t async for t in saver.alist(thread, limit=10)]
        assert len(page) == 10
    limited = LIMITED_LISTS / (time.perf_counter() - start)
    return {"put": put, "get_tuple": get, "list10": limited}


def _openers(directory: Path, redis_url: str, postgres_url: str) -> dict[str, Callable[..., Any]]:
    """Each saver by name: `open(round)` is an async context manager yielding a fresh saver."""

    @asynccontextmanager
    async def memory(round_: int) -> AsyncIterator[Any]:
        async with StateManager(StateConfig(), backend=open_backend("memory://")) as state:
            yield CheckpointSaver(state)

    @asynccontextmanager
    async def sqlite(round_: int) -> AsyncIterator[Any]:
        url = f"sqlite://{directory / f'ours-{round_}.sqlite'}?synchronous=full"
        async with StateManager(StateConfig(), backend=open_backend(url)) as state:
            yield CheckpointSaver(state)

    @asynccontextmanager
    async def redis(round_: int) -> AsyncIterator[Any]:
        backend = open_backend(redis_url, key_prefix=f"lg{round_}:")
        async with StateManager(StateConfig(), backend=backend) as state:
            yield CheckpointSaver(state)

    @asynccontextmanager
    async def in_memory(round_: int) -> AsyncIterator[Any]:
        yield InMemorySaver()

    @asynccontextmanager
    async def lg_sqlite(round_: int) -> AsyncIterator[Any]:
        path = directory / f"lg-{round_}.sqlite"
        async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
            await saver.setup()
            # Like for like: WAL (its setup sets it) and synchronous=FULL, checked.
            await saver.conn.execute("PRAGMA synchronous=FULL")
            async with saver.conn.execute("PRAGMA synchronous") as cursor:
                assert (await cursor.fetchone()) == (2,)
            yield saver

    @asynccontextmanager
    async def postgres(round_: int) -> AsyncIterator[Any]:
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        async with AsyncPostgresSaver.from_conn_string(postgres_url) as saver:
            await saver.setup()
            yield saver

    return {
        "agenticstate memory": memory,
        "InMemorySaver": in_memory,
        "agenticstate SQLite": sqlite,
        "AsyncSqliteSaver": lg_sqlite,
        "agenticstate Redis (appendfsync always)": redis,
        "AsyncPostgresSaver": postgres,
    }


async def run(redis_url: str, postgres_url: str, rounds: int) -> str:
    chain = _chain(CHECKPOINTS)
    rates: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as temp:
        openers = _openers(Path(temp), redis_url, postgres_url)
        # A warm-up of every saver on a tenth of the work, not recorded: the first saver to
        # run would otherwise pay for the process's imports and LangGraph's first compiles.
        for name, opener in openers.items():
            async with opener(-1) as saver:
                await _graph_runs(saver, "warm-up", scale=10)
                await _calls(saver, "warm-up", chain[:20])
            _progress(f"warm-up: {name} done")
        for round_ in range(rounds):
            for ours, base, _ in PAIRS:
                order = (ours, base) if round_ % 2 == 0 else (base, ours)
                for name in order:
                    async with openers[name](round_) as saver:
                        tag = f"r{round_}"
                        measured = await _graph_runs(saver, tag)
                        measured |= await _calls(saver, tag, chain)
                    rates.setdefault(name, []).append(measured)
                    _progress(f"round {round_ + 1}/{rounds}: {name} done")
    return _report(rates, rounds)


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _report(rates: dict[str, list[dict[str, float]]], rounds: int) -> str:
    rows = []
    misses = []
    for ours, base, target in PAIRS:
        for op, label in WORKLOADS.items():
            ratios = sorted(m[op] / b[op] for m, b in zip(rates[ours], rates[base], strict=True))
            ratio = statistics.median(ratios)
            best = max(m[op] for m in rates[ours]) / max(b[op] for b in rates[base])
            met = ratio >= target
            if not met:
                misses.append(f"{ours} {op} {ratio:.2f}x {base} (target {target:.1f}x)")
            rows.append(
                [
                    ours,
                    label,
                    f"{statistics.median(m[op] for m in rates[ours]):,.0f}/s",
                    f"{statistics.median(b[op] for b in rates[base]):,.0f}/s {base}",
                    f"{ratio:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                    f"{best:.2f}x",
                    f"{target:.1f}x: " + ("met" if met else "**missed**"),
                ]
            )
    notes = [
        f"{rounds} rounds after a warm-up; in each, both savers of a pair run every workload "
        "on fresh stores, in alternating order. Ratios are ours over the baseline's rate "
        "within a round (above 1 is faster); shown: the median rates, the median ratio and "
        "its range. 'best-of' is the ratio of each saver's best round, the one least "
        "disturbed by other work on the machine. A target is met when the median ratio "
        "reaches it.",
        "Durability, like for like: agenticstate SQLite and AsyncSqliteSaver both run in WAL "
        "mode with synchronous=FULL (a put is one transaction, on disk before it returns); "
        "Redis runs with appendonly yes, appendfsync always; PostgreSQL with fsync=on and "
        "synchronous_commit=on. InMemorySaver and the memory backend keep nothing on disk.",
        "The graph workloads use LangGraph's default durability ('async': a checkpoint is "
        "written while the next step runs). Every saver runs the same graph code; the "
        "200-turn thread's checkpoints grow to about 480 KB of messages each.",
        "agenticstate does more per put than InMemorySaver: values are encoded into its store "
        "format (msgpack, checked, never pickled), every write is a versioned key with a "
        "change event on the store's feed, and the thread head moves with a compare-and-set "
        "in the same step.",
        "Misses: " + ("; ".join(misses) if misses else "none") + ".",
    ]
    return table(
        "LangGraph checkpointer against the saver a user would pick instead",
        ["agenticstate", "workload", "ours", "baseline", "ratio (range)", "best-of", "target"],
        rows,
        notes,
    )


async def _main(rounds: int) -> str:
    from bench._postgres import postgres_server
    from tests._redis_server import RedisServer

    with tempfile.TemporaryDirectory() as directory, postgres_server() as postgres_url:
        server = RedisServer(
            Path(directory), extra_args=("--appendonly", "yes", "--appendfsync", "always")
        )
        server.start()
        try:
            return await run(server.tcp_url, postgres_url, rounds)
        finally:
            server.stop()


def main(rounds: int | None = None) -> None:
    """Run the benchmark and publish it (`python -m bench` sets `ROUNDS` and calls this)."""
    publish("langgraph", anyio.run(_main, ROUNDS if rounds is None else rounds))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
