"""What one `CheckpointSaver` write costs: `aput` and `aput_writes` are one atomic step on every
backend (counted at the backend, on Redis by the server, on SQLite in commits), a backend without
`transact` keeps the multi-call path, two processes racing on one thread (one killed mid-run)
leave it consistent, and `alist(limit=...)` reads only the page it returns."""

from __future__ import annotations

import inspect
import json
import uuid
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("langgraph")

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.test_utils import (
    generate_checkpoint,
    generate_config,
    generate_metadata,
)

from agenticstate import RedisBackend, SQLiteBackend, StateConfig, StateManager
from agenticstate.backends import Backend, MemoryBackend, TxnCompare, TxnOp, TxnResult
from agenticstate.langgraph import HEAD_GUARD_KEY, CheckpointSaver, StaleCheckpointError
from tests._commandstats import command_counts
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Sequence
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig

_CALLS = (
    "get",
    "get_many",
    "value_sizes",
    "stat_many",
    "set",
    "set_many",
    "delete",
    "update",
    "transact",
    "index_add",
    "index_remove",
    "index_range",
    "history",
    "get_version",
    "scan",
    "scan_batches",
)


class _Recorder:
    """Records, by name, every call a `StateManager` makes on its backend (the real backend's
    methods run; the instance's attributes only wrap them). `before` runs ahead of each call."""

    def __init__(self, backend: Backend) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.before: Callable[[str, tuple[Any, ...]], Any] | None = None
        for name in _CALLS:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        if inspect.isasyncgenfunction(method):

            async def generator(*args: Any, **kwargs: Any) -> Any:
                self.calls.append((name, args))
                async for item in method(*args, **kwargs):
                    yield item

            return generator

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.before is not None:
                await self.before(name, args)
            self.calls.append((name, args))
            return await method(*args, **kwargs)

        return call

    def names(self) -> list[str]:
        """The calls' names since the last `clear`, in order."""
        return [name for name, _ in self.calls]

    def clear(self) -> None:
        """Forget the calls so far."""
        self.calls.clear()


def _checkpoint(step: int) -> tuple[Any, dict[str, str | int | float]]:
    versions: dict[str, str | int | float] = {"messages": f"{step + 1}", "scratch": f"{step + 1}"}
    checkpoint = generate_checkpoint(
        channel_values={"messages": [f"m{i}" for i in range(step + 1)], "scratch": step},
        channel_versions=versions,
    )
    return checkpoint, versions


async def _put(
    saver: CheckpointSaver, config: RunnableConfig, step: int, *, guard: bool = True
) -> RunnableConfig:
    checkpoint, versions = _checkpoint(step)
    if guard:
        config = {"configurable": {**config["configurable"], HEAD_GUARD_KEY: True}}
    stored: RunnableConfig = await saver.aput(
        config, checkpoint, generate_metadata(step=step), versions
    )
    return stored


async def test_aput_and_aput_writes_are_one_backend_step(state: StateManager) -> None:
    """On every backend a graph run's `aput` (after `aget_tuple`, or after its last `aput`) and
    each `aput_writes` make exactly one backend call, a `transact`; a cold guarded `aput` adds one
    read of the head; a refused one writes nothing."""
    recorder = _Recorder(state.backend)
    saver = CheckpointSaver(state, prefix="steps")
    thread = generate_config("t")

    recorder.clear()
    first = await _put(saver, thread, 0, guard=False)
    assert recorder.names() == ["transact"]

    latest = await saver.aget_tuple(thread)
    assert latest is not None
    recorder.clear()
    second = await _put(saver, latest.config, 1)
    assert recorder.names() == ["transact"]

    recorder.clear()
    third = await _put(saver, second, 2)  # continues from its own put, as a graph run does
    assert recorder.names() == ["transact"]

    for task in ("a", "b", "a"):  # two tasks of a superstep, then a repeat of the first
        recorder.clear()
        await saver.aput_writes(third, [("messages", f"from {task}")], task)
        assert recorder.names() == ["transact"]

    # Another saver (another process, say) has seen nothing: one read of the head, one step.
    cold = CheckpointSaver(state, prefix="steps")
    recorder.clear()
    fourth = await _put(cold, third, 3)
    assert recorder.names() == ["get", "transact"]
    # ... and its writes to a checkpoint that has some already: the step returns them, then one
    # more step merges.
    recorder.clear()
    await cold.aput_writes(third, [("scratch", 9)], "c")
    assert recorder.names() == ["transact", "transact"]

    # The first saver's remembered head is stale now: its guarded put is refused in one step.
    keys = await state.list_keys("*")
    recorder.clear()
    with pytest.raises(StaleCheckpointError) as caught:
        await _put(saver, third, 3)
    assert recorder.names() == ["transact"]
    assert caught.value.actual_head == fourth["configurable"]["checkpoint_id"]
    assert await state.list_keys("*") == keys

    found = await saver.aget_tuple(third)
    assert found is not None
    assert found.checkpoint["channel_values"] == {"messages": ["m0", "m1", "m2"], "scratch": 2}
    assert sorted(found.pending_writes or []) == [
        ("a", "messages", "from a"),
        ("b", "messages", "from b"),
        ("c", "scratch", 9),
    ]
    assert [t.checkpoint["id"] async for t in saver.alist(thread)] == [
        c["configurable"]["checkpoint_id"] for c in (fourth, third, second, first)
    ]


@pytest.fixture(
    params=[pytest.param(kind, marks=pytest.mark.redis) for kind in ("redis", "redis-cluster")]
)
def redis_address(request: pytest.FixtureRequest) -> str:
    """A plain redis-server's URL and a 3-primary cluster's."""
    address: str = request.getfixturevalue(
        "redis_url" if request.param == "redis" else "redis_cluster_url"
    )
    return address


async def test_one_script_per_write_on_redis(redis_address: str) -> None:
    """On Redis and a Redis Cluster, a graph run's `aput` and each `aput_writes` send one
    command, the EVALSHA of one script (the server's own counts)."""
    async with RedisBackend(url=redis_address, key_prefix=unique_prefix()) as backend:
        state = StateManager(StateConfig(), backend=backend, close_backend=False)
        saver = CheckpointSaver(state)
        warm = await _put(saver, generate_config("warm"), 0, guard=False)  # scripts loaded
        await saver.aput_writes(warm, [("messages", "w")], "w")
        config = await _put(saver, generate_config("t"), 0, guard=False)
        for step in range(1, 4):
            async with command_counts(redis_address) as put:
                config = await _put(saver, config, step)
            assert put.sent == {"evalsha": 1}, put.describe()
            async with command_counts(redis_address) as writes:
                await saver.aput_writes(config, [("messages", step)], f"task{step}")
            assert writes.sent == {"evalsha": 1}, writes.describe()
        await state.aclose()


async def test_one_commit_per_write_on_sqlite(tmp_path: Path) -> None:
    """On SQLite a graph run's `aput` and each `aput_writes` are one transaction: one COMMIT."""
    async with SQLiteBackend(tmp_path / "s.db") as backend:
        state = StateManager(StateConfig(), backend=backend, close_backend=False)
        saver = CheckpointSaver(state)
        seen: list[str] = []
        await backend._call(True, lambda conn: conn.set_trace_callback(seen.append))
        try:
            config = await _put(saver, generate_config("t"), 0, guard=False)
            for step in range(1, 4):
                seen.clear()
                config = await _put(saver, config, step)
                assert _commits(seen) == 1, seen
                seen.clear()
                await saver.aput_writes(config, [("messages", step)], f"task{step}")
                assert _commits(seen) == 1, seen
        finally:
            await backend._call(True, lambda conn: conn.set_trace_callback(None))
            await state.aclose()


def _commits(statements: list[str]) -> int:
    return sum(1 for sql in statements if sql.strip().upper().startswith(("COMMIT", "END")))


# ------------------------------------------------------------------ a backend without transact


class _NoTransactBackend(MemoryBackend):
    """A third-party backend that leaves `transact` out (the base class refuses it)."""

    async def transact(
        self, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp] = ()
    ) -> TxnResult:
        return await Backend.transact(self, compare, then, orelse)


async def test_a_backend_without_transact_keeps_the_multi_call_path() -> None:
    """Without `transact` the saver writes in several calls and still passes LangGraph's
    conformance suite; the head guard still refuses a stale write."""
    async with StateManager(StateConfig(), backend=_NoTransactBackend()) as state:

        @checkpointer_test(name="agenticstate-no-transact")
        async def saver() -> AsyncIterator[CheckpointSaver]:
            yield CheckpointSaver(state, prefix=f"c{uuid.uuid4().hex[:8]}")

        report = await validate(saver)
        assert all(result.passed for result in report.results.values()), report.results

        recorder = _Recorder(state.backend)
        ours = CheckpointSaver(state, prefix="multi")
        first = await _put(ours, generate_config("t"), 0, guard=False)
        recorder.clear()
        await _put(ours, first, 1)
        assert recorder.names() == ["get", "set_many", "update"]
        with pytest.raises(StaleCheckpointError):
            await _put(ours, first, 1)


# ------------------------------------------------------------------ alist reads one page


async def test_alist_with_a_limit_reads_only_that_page(state: StateManager) -> None:
    """`alist(limit=n)` reads n checkpoint records (and their values), not a page of 64, and
    matches the full listing's first n for every limit and `before`."""
    saver = CheckpointSaver(state)
    thread = generate_config("t")
    config = await _put(saver, thread, 0, guard=False)
    for step in range(1, 80):
        config = await _put(saver, config, step)
    everything = [t.checkpoint["id"] async for t in saver.alist(thread)]
    assert len(everything) == 80
    recorder = _Recorder(state.backend)
    for limit in (1, 3, 10, 64, 65, 79, 80, 81):
        for start in (None, 0, 5, 78):
            before = None if start is None else _at(thread, everything[start])
            expected = everything[(start + 1 if start is not None else 0) :][:limit]
            recorder.clear()
            listed = [
                t.checkpoint["id"] async for t in saver.alist(thread, before=before, limit=limit)
            ]
            assert listed == expected
            records = [
                key
                for name, args in recorder.calls
                if name == "get_many"
                for key in args[0]
                if ":cp:" in key
            ]
            assert len(records) == len(expected), (limit, start, len(records))


async def test_alist_with_a_limit_fills_gaps_left_by_deletions(state: StateManager) -> None:
    """A checkpoint deleted between `alist`'s scan and its read is skipped and the next older
    ones fill the page: `limit` results still, newest first."""
    saver = CheckpointSaver(state)
    thread = generate_config("t")
    config = await _put(saver, thread, 0, guard=False)
    for step in range(1, 12):
        config = await _put(saver, config, step)
    everything = [t.checkpoint["id"] async for t in saver.alist(thread)]
    recorder = _Recorder(state.backend)
    doomed = {everything[1], everything[3]}

    async def delete_first(name: str, args: tuple[Any, ...]) -> None:
        if name == "get_many" and recorder.before is not None:
            recorder.before = None
            for key in args[0]:
                if any(key.endswith(f":{checkpoint_id}") for checkpoint_id in doomed):
                    await state.delete(key)

    recorder.before = delete_first
    listed = [t.checkpoint["id"] async for t in saver.alist(thread, limit=5)]
    assert listed == [c for c in everything if c not in doomed][:5]


def _at(thread: RunnableConfig, checkpoint_id: str) -> RunnableConfig:
    return {"configurable": {**thread["configurable"], "checkpoint_id": checkpoint_id}}


# ------------------------------------------------------------------ two processes, one killed

WORKER = "tests.langgraph._put_race_worker"


def _spec(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    prefix = f"g{uuid.uuid4().hex[:8]}"
    if kind == "sqlite":
        return {"url": f"sqlite:///{tmp_path / 'race.db'}", "options": {}, "prefix": prefix}
    server = {"redis": "redis_url", "postgres": "postgres_url"}.get(kind, "redis_cluster_url")
    url = request.getfixturevalue(server)
    return {"url": url, "options": {"key_prefix": unique_prefix()}, "prefix": prefix}


def _reports(process: LineProcess) -> Iterator[dict[str, int]]:
    for line in list(process.lines):
        if line.startswith("{"):
            yield json.loads(line)


def _puts(process: LineProcess) -> int:
    return max((report["puts"] for report in _reports(process)), default=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_two_processes_racing_on_a_thread_one_killed_leave_it_consistent(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two processes extend one thread with guarded puts at once; one is SIGKILLed mid-run: the
    thread stays one chain from its head, every checkpoint has all its values and writes' owner,
    no value is left behind by a refused or killed put, and no acknowledged put is lost."""
    spec = _spec(kind, request, tmp_path)
    thread = "shared"
    first = LineProcess(WORKER, json.dumps(spec), thread, "a")
    second = LineProcess(WORKER, json.dumps(spec), thread, "b")
    try:
        assert first.wait_until(lambda _: _puts(first) >= 15), first.close()
        assert second.wait_until(lambda _: _puts(second) >= 15), second.close()
        first.kill()  # mid-run: it is looping on aget_tuple / aput / aput_writes
        killed_puts = _puts(first)
        target = _puts(second) + 15
        assert second.wait_until(lambda _: _puts(second) >= target), second.close()
        second.stop()
        survivor_puts = _puts(second)
        stale = sum(max((r["stale"] for r in _reports(p)), default=0) for p in (first, second))
    finally:
        first.close()
        second.close()
    async with StateManager(StateConfig(), backend=_open(spec)) as state:
        saver = CheckpointSaver(state, prefix=spec["prefix"])
        chain = await _check_consistent(state, saver, thread)
    # Each printed put is in the chain; the killed one may have made one more before printing.
    assert killed_puts + survivor_puts <= len(chain) <= killed_puts + survivor_puts + 1
    assert stale > 0  # the two really raced


def _open(spec: dict[str, Any]) -> Backend:
    from agenticstate.backends import open_backend

    return open_backend(spec["url"], **spec["options"])


async def _check_consistent(state: StateManager, saver: CheckpointSaver, thread: str) -> list[str]:
    """Assert the thread's invariants; return its chain of checkpoint ids, newest first."""
    tag = f"{saver.prefix}:{{{thread}}}:"
    keys = await state.list_keys(f"{tag}*")
    values = await state.get_many(keys)
    head = values[f"{tag}head:"]["id"]
    records = {key.rsplit(":", 1)[1]: values[key] for key in keys if key.startswith(f"{tag}cp:")}
    chain = []
    at: str | None = head
    while at is not None:
        assert at in records, f"checkpoint {at} is named but missing"
        chain.append(at)
        at = records[at]["parent"]
    assert set(chain) == set(records), "a checkpoint off the head's chain (a fork or a leftover)"
    used = {
        f"{tag}b::{channel}:{version}"
        for record in records.values()
        for channel, version in record["versions"].items()
    }
    blobs = {key for key in keys if key.startswith(f"{tag}b:")}
    assert used <= blobs, f"values missing: {sorted(used - blobs)[:3]}"
    assert blobs <= used, f"values no checkpoint uses: {sorted(blobs - used)[:3]}"
    writes = {key.rsplit(":", 1)[1] for key in keys if key.startswith(f"{tag}w:")}
    assert writes <= set(records), "writes recorded against a missing checkpoint"
    latest = await saver.aget_tuple(generate_config(thread))
    assert latest is not None
    assert latest.checkpoint["id"] == head
    assert set(latest.checkpoint["channel_values"]) == {"messages", "by", "tools"}
    return chain


async def test_the_race_checker_sees_a_leftover() -> None:
    """The consistency check above fails on a value no checkpoint uses (it can catch one)."""
    async with StateManager(StateConfig(), backend=MemoryBackend()) as state:
        saver = CheckpointSaver(state, prefix="chk")
        from tests.langgraph._put_race_worker import next_checkpoint

        config: Any = {"configurable": {"thread_id": "x", "checkpoint_ns": ""}}
        for step in range(3):
            latest = await saver.aget_tuple(generate_config("x"))
            checkpoint, new = next_checkpoint(saver, latest, "a", step)
            config = await saver.aput(
                latest.config if latest else config, checkpoint, {"step": step}, new
            )
        assert len(await _check_consistent(state, saver, "x")) == 3
        await state.save("chk:{x}:b::messages:stray", ["json", b"1"])
        with pytest.raises(AssertionError, match="no checkpoint uses"):
            await _check_consistent(state, saver, "x")
