"""Real LangGraph graphs on the checkpointer: interrupt() resumed in another process, time travel
(replay and fork), and two workers on one thread (the stale write refused, never a silent fork)."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import pytest

pytest.importorskip("langgraph")

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from agenticstate import StateConfig, StateManager
from agenticstate.backends import open_backend
from agenticstate.langgraph import CheckpointSaver, StaleCheckpointError
from tests.helpers import LineProcess
from tests.langgraph._graph_worker import Counter, approval_graph, counter_graph, fan_graph

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig

WORKER = "tests.langgraph._graph_worker"


def _file_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    return {"url": f"file://{tmp_path / 'store'}", "options": {}}


def _redis_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    url = request.getfixturevalue("redis_url")
    return {"url": url, "options": {"key_prefix": f"t{uuid.uuid4().hex[:12]}:"}}


def _cluster_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    url = request.getfixturevalue("redis_cluster_url")
    return {"url": url, "options": {"key_prefix": f"t{uuid.uuid4().hex[:12]}:"}}


def _sqlite_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    return {"url": f"sqlite:///{tmp_path / 'graphs.db'}", "options": {}}


def _postgres_spec(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    url = request.getfixturevalue("postgres_url")
    return {"url": url, "options": {"key_prefix": f"t{uuid.uuid4().hex[:12]}:"}}


# Backends several processes can use, one after the other (file) or at once (the rest);
# `CONCURRENT` are those two processes may hold open together.
SHARED_SPECS: dict[str, Callable[[pytest.FixtureRequest, Path], dict[str, Any]]] = {
    "file": _file_spec,
    "redis": _redis_spec,
    "redis-cluster": _cluster_spec,
    "sqlite": _sqlite_spec,
    "postgres": _postgres_spec,
}
CONCURRENT = {"redis", "redis-cluster", "sqlite", "postgres"}
REDIS = {"redis", "redis-cluster"}


def _params(names: list[str]) -> list[Any]:
    return [
        pytest.param(n, marks=pytest.mark.redis)
        if n in REDIS
        else pytest.param(n, marks=pytest.mark.postgres)
        if n == "postgres"
        else n
        for n in names
    ]


@pytest.fixture(params=_params(list(SHARED_SPECS)))
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A backend spec other processes can open, with a fresh saver prefix."""
    spec = SHARED_SPECS[request.param](request, tmp_path)
    return {**spec, "prefix": f"g{uuid.uuid4().hex[:8]}"}


@pytest.fixture(params=_params(sorted(CONCURRENT)))
def concurrent(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A backend spec two processes can hold open at once."""
    spec = SHARED_SPECS[request.param](request, tmp_path)
    return {**spec, "prefix": f"g{uuid.uuid4().hex[:8]}"}


def _manager(spec: dict[str, Any]) -> StateManager:
    return StateManager(StateConfig(), backend=open_backend(spec["url"], **spec["options"]))


def _config(thread: str, **extra: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread, **extra}}


def _ours(lines: list[str]) -> list[str]:
    """The worker's protocol lines (the file backend currently logs to stdout too)."""
    return [line for line in lines if line in {"ready", "ok"} or line.startswith(("{", "stale "))]


def _finish(process: LineProcess) -> list[str]:
    """Wait for a worker to exit and return its protocol lines (stderr in the failure message)."""
    code = process.process.wait(timeout=60)
    errors = process.close()
    assert code == 0, errors
    return _ours(process.lines)


async def test_interrupt_resumed_in_another_process(shared: dict[str, Any]) -> None:
    """A graph stopped at interrupt() is resumed by a spawned process from the stored checkpoint."""
    thread = f"approve-{uuid.uuid4().hex[:6]}"
    async with _manager(shared) as state:
        graph = approval_graph(CheckpointSaver(state, prefix=shared["prefix"]))
        first = await graph.ainvoke({"steps": []}, _config(thread))
        assert first["__interrupt__"][0].value == {"question": "ship it?"}
        assert (await graph.aget_state(_config(thread))).next == ("ask",)
    # The file backend has one owner process at a time: this one has let go of it.
    worker = LineProcess(WORKER, json.dumps(shared), "resume", thread, "yes")
    lines = await anyio.to_thread.run_sync(_finish, worker)
    assert json.loads(lines[-1]) == {"steps": ["plan", "ask", "finish:yes"], "answer": "yes"}
    async with _manager(shared) as state:
        graph = approval_graph(CheckpointSaver(state, prefix=shared["prefix"]))
        final = await graph.aget_state(_config(thread))
        assert final.next == ()
        assert final.values["steps"] == ["plan", "ask", "finish:yes"]


async def test_time_travel_replay_and_fork(state: StateManager) -> None:
    """Replaying from an earlier checkpoint and forking it both work; the old branch survives."""
    graph = approval_graph(CheckpointSaver(state))
    config = _config("travel")
    await graph.ainvoke({"steps": []}, config)
    done = await graph.ainvoke(Command(resume="first"), config)
    assert done["steps"] == ["plan", "ask", "finish:first"]
    history = [snap async for snap in graph.aget_state_history(config)]
    original_head = history[0].config
    at_ask = next(snap for snap in history if snap.next == ("ask",))

    # Replay: run again from the checkpoint before `ask`: it interrupts again, then resumes.
    replayed = await graph.ainvoke(None, at_ask.config)
    assert replayed["__interrupt__"][0].value == {"question": "ship it?"}
    resumed = await graph.ainvoke(Command(resume="second"), config)
    assert resumed["steps"] == ["plan", "ask", "finish:second"]

    # Fork: write a new value on top of the checkpoint before `ask`, then resume from the fork.
    fork = await graph.aupdate_state(at_ask.config, {"steps": ["edited"]})
    assert fork["configurable"]["checkpoint_id"] != at_ask.config["configurable"]["checkpoint_id"]
    forked = await graph.ainvoke(Command(resume="third"), fork)
    assert forked["steps"] == ["plan", "edited", "ask", "finish:third"]

    # The thread's head is the fork's end; the first run's final checkpoint is still readable.
    assert (await graph.aget_state(config)).values["steps"][-1] == "finish:third"
    old = await graph.aget_state(original_head)
    assert old.values["steps"] == ["plan", "ask", "finish:first"]
    parents = [
        snap.parent_config["configurable"]["checkpoint_id"]
        async for snap in graph.aget_state_history(config)
        if snap.parent_config is not None
    ]
    branch_point = at_ask.config["configurable"]["checkpoint_id"]
    assert parents.count(branch_point) == 3  # the first run, the replay and the fork


async def test_stale_write_refused_in_process(state: StateManager) -> None:
    """Two runs continuing the same head: the second to write is refused, the thread unforked."""
    saver = CheckpointSaver(state)
    config = _config("race")
    await counter_graph(saver).ainvoke({"count": 0}, config)
    paused = await saver.aget_tuple(config)
    assert paused is not None
    inside = [anyio.Event(), anyio.Event()]
    go = [anyio.Event(), anyio.Event()]
    finished = [anyio.Event(), anyio.Event()]
    results: dict[int, object] = {}

    def worker(n: int) -> Any:
        async def work(s: Counter) -> Counter:
            inside[n].set()
            await go[n].wait()
            return {"count": s.get("count", 0) + 1, "by": [f"w{n}"]}

        async def run() -> None:
            try:
                results[n] = await counter_graph(saver, work).ainvoke(None, config)
            except StaleCheckpointError as exc:
                results[n] = exc
            finished[n].set()

        return run

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker(0))
            tg.start_soon(worker(1))
            await inside[0].wait()
            await inside[1].wait()
            go[0].set()
            await finished[0].wait()
            go[1].set()
    assert isinstance(results[0], dict)
    assert results[0]["by"] == ["start", "w0", "done"]
    stale = results[1]
    assert isinstance(stale, StaleCheckpointError)
    assert stale.expected_head == paused.config["configurable"]["checkpoint_id"]
    children = [t async for t in saver.alist(config) if t.parent_config == _parent(paused.config)]
    assert len(children) == 1


def _parent(config: RunnableConfig) -> RunnableConfig:
    c = config["configurable"]
    return _config(
        c["thread_id"], checkpoint_ns=c["checkpoint_ns"], checkpoint_id=c["checkpoint_id"]
    )


def _two_workers(spec: dict[str, Any], thread: str) -> tuple[list[str], list[str]]:
    first = LineProcess(WORKER, json.dumps(spec), "race", thread, "first")
    second = LineProcess(WORKER, json.dumps(spec), "race", thread, "second")
    try:
        assert first.wait_until(lambda lines: "ready" in lines), first.close()
        assert second.wait_until(lambda lines: "ready" in lines), second.close()
        assert first.process.stdin is not None
        first.process.stdin.write("go\n")
        first.process.stdin.flush()
        assert first.wait_until(lambda lines: "ok" in lines), first.close()
        assert second.process.stdin is not None
        second.process.stdin.write("go\n")
        second.process.stdin.flush()
        return _finish(first), _finish(second)
    finally:
        first.close()
        second.close()


@pytest.mark.slow
async def test_two_worker_processes_one_thread(concurrent: dict[str, Any]) -> None:
    """Two processes continue one thread from the same head: one wins, the other gets a typed
    refusal, and the thread's history has exactly one child of that head."""
    thread = f"race-{uuid.uuid4().hex[:6]}"
    async with _manager(concurrent) as state:
        saver = CheckpointSaver(state, prefix=concurrent["prefix"])
        await counter_graph(saver).ainvoke({"count": 0}, _config(thread))
        paused = await saver.aget_tuple(_config(thread))
        assert paused is not None
        head_id = paused.config["configurable"]["checkpoint_id"]
        first, second = await anyio.to_thread.run_sync(_two_workers, concurrent, thread)
        assert first[-1] == "ok"
        stale, expected, _actual = second[-1].split(" ")
        assert (stale, expected) == ("stale", head_id)
        final = await counter_graph(saver).aget_state(_config(thread))
        assert final.values == {"count": 3, "by": ["start", "first", "done"]}
        children = [
            t
            async for t in saver.alist(_config(thread))
            if t.parent_config == _parent(paused.config)
        ]
        assert len(children) == 1


async def _drive(graph: Any, durability: str) -> list[Any]:
    """Two runs of the fan-out graph on one thread, each resumed once; what a user sees."""
    config = _config("fan")
    seen: list[Any] = []
    for first, answer in (({"log": []}, "ok"), ({"log": ["again"]}, "ok2")):
        paused = await graph.ainvoke(first, config, durability=durability)
        seen.append([i.value for i in paused["__interrupt__"]])
        seen.append(await graph.ainvoke(Command(resume=answer), config, durability=durability))
        state = await graph.aget_state(config, subgraphs=True)
        seen.append((state.values, state.next))
    seen.append(len([s async for s in graph.aget_state_history(config)]))
    return seen


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
async def test_subgraphs_branches_and_sends_match_in_memory_saver(
    state: StateManager, durability: str
) -> None:
    """A subgraph interrupt, parallel branches and Send fan-out run exactly as on LangGraph's
    InMemorySaver, in every durability mode: the head guard never refuses a lone writer."""
    ours = await _drive(fan_graph(CheckpointSaver(state)), durability)
    theirs = await _drive(fan_graph(InMemorySaver()), durability)
    assert ours == theirs
    assert ours[1]["log"][-3:] == ["w:x", "w:y", "w:z"]


async def test_update_state_on_a_stale_snapshot_is_refused(state: StateManager) -> None:
    """update_state on the latest snapshot is refused once another writer has moved the head;
    on a snapshot from the history (a deliberate fork) it is accepted."""
    graph = approval_graph(CheckpointSaver(state))
    config = _config("stale-update")
    await graph.ainvoke({"steps": []}, config)
    snapshot = await graph.aget_state(config)
    await graph.aupdate_state(config, {"steps": ["other writer"]})
    with pytest.raises(StaleCheckpointError):
        await graph.aupdate_state(snapshot.config, {"steps": ["late writer"]})
    assert (await graph.aget_state(config)).values["steps"] == ["plan", "other writer"]
    history = [s async for s in graph.aget_state_history(config)]
    fork = await graph.aupdate_state(history[-1].config, {"steps": ["fork"]})
    assert (await graph.aget_state(config)).config["configurable"]["checkpoint_id"] == (
        fork["configurable"]["checkpoint_id"]
    )


async def _replay_kept_snapshot(graph: Any) -> list[Any]:
    """Keep get_state's snapshot, move the head on, replay from the snapshot; what a user sees."""
    config = _config("kept")
    seen: list[Any] = [await graph.ainvoke({"steps": []}, config)]
    kept = await graph.aget_state(config)
    seen.append(await graph.ainvoke(Command(resume="first"), config))
    # An explicit replay from the kept snapshot (the head has moved past it): a fork.
    seen.append(await graph.ainvoke(None, kept.config))
    seen.append(await graph.ainvoke(Command(resume="second"), config))
    head = await graph.aget_state(config)
    seen.append((head.values, head.next))
    seen.append(len([s async for s in graph.aget_state_history(config)]))
    return [_plain(item) for item in seen]


def _plain(value: Any) -> Any:
    """A run's output without interrupt ids (they differ between savers)."""
    if isinstance(value, dict):
        return {k: ([i.value for i in v] if k == "__interrupt__" else v) for k, v in value.items()}
    return value


async def test_replay_from_a_kept_get_state_snapshot_matches_in_memory_saver(
    state: StateManager,
) -> None:
    """A run started from a snapshot kept from get_state() is an explicit replay: accepted after
    the head moved on, exactly as InMemorySaver runs it (update_state on it stays guarded)."""
    ours = await _replay_kept_snapshot(approval_graph(CheckpointSaver(state)))
    theirs = await _replay_kept_snapshot(approval_graph(InMemorySaver()))
    assert ours == theirs
    assert ours[-2] == ({"steps": ["plan", "ask", "finish:second"], "answer": "second"}, ())
