"""LangGraph checkpointing: `put`, `get_tuple`, `list` and `list(limit=10)`, against LangGraph's own
`InMemorySaver` and `AsyncSqliteSaver` (langgraph-checkpoint-sqlite), in one run.

Run: `python -m bench.bench_langgraph` (starts its own redis-server on loopback TCP).

Every saver stores the same chain of checkpoints: four channels, two of which change per step
(a message list that grows to about 2 KB and a small dict), as a chat agent's graph does. Each
round times every saver back to back and takes the ratios within the round (agenticstate's rate
over the baseline's: above 1 is faster); the report gives the median ratio and its range. The
first round is a warm-up and is not reported.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from agenticstate import ConfigurationError, StateConfig, StateManager
from agenticstate.backends import FileBackend, open_backend
from agenticstate.langgraph import HEAD_GUARD_KEY, CheckpointSaver
from bench._util import publish, redis_server, table

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

ROUNDS = 5
WARMUP_ROUNDS = 1
CHECKPOINTS = 200  # per round and saver: puts, then as many get_tuple, then one full list
LIMITED_LISTS = 50  # then this many `alist(limit=10)` of the thread


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


async def _time(saver: Any, thread: str, chain: list[Any]) -> dict[str, float]:
    """Operations per second for put, get_tuple (by id) and list (per checkpoint listed)."""
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
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
    start = time.perf_counter()
    listed = [t async for t in saver.alist({"configurable": {"thread_id": thread}})]
    assert len(listed) == len(chain)
    listing = len(listed) / (time.perf_counter() - start)
    # A history page, as a UI or `get_state_history(limit=10)` asks for it.
    start = time.perf_counter()
    for _ in range(LIMITED_LISTS):
        page = [t async for t in saver.alist({"configurable": {"thread_id": thread}}, limit=10)]
        assert len(page) == 10
    limited = LIMITED_LISTS / (time.perf_counter() - start)
    return {"put": put, "get_tuple": get, "list": listing, "list10": limited}


def _makers(directory: Path, redis_url: str) -> dict[str, Callable[[], Any]]:
    def ours(make_backend: Callable[[], Any]) -> Callable[[], Any]:
        async def open_saver() -> AsyncIterator[Any]:
            async with StateManager(StateConfig(), backend=make_backend()) as state:
                yield CheckpointSaver(state)

        return open_saver

    async def in_memory() -> AsyncIterator[Any]:
        yield InMemorySaver()

    async def sqlite() -> AsyncIterator[Any]:
        async with AsyncSqliteSaver.from_conn_string(str(directory / "lg.sqlite")) as saver:
            yield saver

    makers: dict[str, Callable[[], Any]] = {
        "InMemorySaver": in_memory,
        "AsyncSqliteSaver": sqlite,
        "agenticstate memory": ours(lambda: open_backend("memory://")),
        "agenticstate file": ours(lambda: FileBackend(base_path=directory / "file")),
        "agenticstate redis": ours(lambda: open_backend(redis_url, key_prefix="lg:")),
    }
    try:
        open_backend(f"sqlite://{directory / 'ours.sqlite'}")
    except ConfigurationError:
        pass  # the SQLite backend is not in this build
    else:
        makers["agenticstate sqlite"] = ours(
            lambda: open_backend(f"sqlite://{directory / 'ours.sqlite'}")
        )
    return makers


async def run(redis_url: str) -> str:
    chain = _chain(CHECKPOINTS)
    rates: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as temp:
        makers = _makers(Path(temp), redis_url)
        for round_ in range(WARMUP_ROUNDS + ROUNDS):
            for name, maker in makers.items():
                generator = maker()
                saver = await generator.__anext__()
                try:
                    measured = await _time(saver, f"r{round_}", chain)
                finally:
                    await generator.aclose()
                if round_ >= WARMUP_ROUNDS:
                    rates.setdefault(name, []).append(measured)
    baselines = {
        "agenticstate memory": "InMemorySaver",
        "agenticstate file": "AsyncSqliteSaver",
        "agenticstate redis": "AsyncSqliteSaver",
        "agenticstate sqlite": "AsyncSqliteSaver",
    }
    rows = []
    for name, samples in rates.items():
        row = [name]
        for op in ("put", "get_tuple", "list", "list10"):
            median = statistics.median(m[op] for m in samples)
            cell = f"{median:,.0f}/s"
            base = baselines.get(name)
            if base is not None:
                ratios = sorted(m[op] / b[op] for m, b in zip(samples, rates[base], strict=True))
                best = max(m[op] for m in samples) / max(b[op] for b in rates[base])
                cell += (
                    f" ({statistics.median(ratios):.2f}x {base}, "
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}; best-of {best:.2f}x)"
                )
            row.append(cell)
        rows.append(row)
    notes = [
        f"{ROUNDS} rounds after {WARMUP_ROUNDS} warm-up; each round runs every saver on a chain "
        f"of {CHECKPOINTS} checkpoints (put), reads each back by id (get_tuple) and lists the "
        "thread (list, per checkpoint listed), then lists its newest 10 checkpoints "
        f"{LIMITED_LISTS} times (list(limit=10), per call). Ratios are taken within a round; "
        "shown: median rate, median ratio and range.",
        "Taken on a shared, loaded 2-core machine (other benchmarks and test runs at the same "
        "time): the ratios are the figures to read, and their ranges are wide. 'best-of' is the "
        "ratio of each saver's best round, the least disturbed by load.",
        "Targets: agenticstate memory within 2x InMemorySaver (ratio at least 0.5); "
        "agenticstate SQLite at least 1x AsyncSqliteSaver (when the SQLite backend is present).",
        "agenticstate does more per put than InMemorySaver: it serializes the checkpoint record, "
        "stores each changed channel as a versioned key (isolated copies, change events) and "
        "moves the thread head atomically (puts after the first carry the head guard, "
        "as in a graph run; LangGraph's savers ignore the extra config key).",
        "Both file savers are durable per put: the file backend fsyncs every write before "
        "returning (a put is one atomic step: the values, the checkpoint and the head move); "
        "AsyncSqliteSaver commits one transaction in WAL mode with synchronous=FULL.",
    ]
    return table(
        "LangGraph checkpointer: operations per second",
        ["saver", "put", "get_tuple (by id)", "list (per checkpoint)", "list(limit=10) (per call)"],
        rows,
        notes,
    )


async def _main() -> str:
    with redis_server() as url:
        return await run(url)


def main() -> None:
    publish("langgraph", anyio.run(_main))


if __name__ == "__main__":
    main()
