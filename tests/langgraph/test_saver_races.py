"""`CheckpointSaver` against the interleavings a red-team pass found: reads racing a prune, forks
on a pruned parent, reused versions, deletes killed part-way, sweeps racing new namespaces,
retention errors after a committed put, and storage bounds with subgraphs."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from agenticstate import StateConfig, StateManager
from agenticstate.exceptions import ConfigurationError, DecodeError, InvalidArgumentError
from agenticstate.langgraph import CheckpointRetention, CheckpointSaver
from agenticstate.langgraph import checkpoint as checkpoint_module
from tests.langgraph import test_saver_retention
from tests.langgraph.test_saver_steps import _Recorder

state = test_saver_retention.state  # the backend fixture: memory, SQLite, Redis, Redis Cluster

if TYPE_CHECKING:
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig


class _Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _cp(values: dict[str, Any], versions: dict[str, str]) -> Any:
    checkpoint = empty_checkpoint()
    checkpoint["id"] = str(uuid.uuid1())
    checkpoint["channel_values"] = dict(values)
    checkpoint["channel_versions"] = dict(versions)
    return checkpoint


def _thread(thread: str = "t", ns: str = "") -> RunnableConfig:
    return {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}


def _prefix() -> str:
    return f"x{uuid.uuid4().hex[:8]}"


async def test_a_read_racing_a_prune_reads_the_checkpoint_whole_or_not_at_all(
    state: StateManager,
) -> None:
    """A prune landing between a read's record and its values makes `aget_tuple` return `None`
    and `alist` skip the checkpoint: never a checkpoint without its values."""
    prefix = _prefix()
    saver = CheckpointSaver(state, prefix=prefix)
    v = saver.get_next_version
    x1, x2, x3 = v(None, None), v("1", None), v("2", None)
    first = await saver.aput(
        _thread(), _cp({"x": "1", "m": ["a"]}, {"x": x1, "m": x1}), {}, {"x": x1, "m": x1}
    )
    second = await saver.aput(
        first, _cp({"x": "2", "m": ["a", "b"]}, {"x": x2, "m": x2}), {}, {"x": x2, "m": x2}
    )
    await saver.aput(
        second, _cp({"x": "3", "m": ["c"]}, {"x": x3, "m": x3}), {}, {"x": x3, "m": x3}
    )
    recorder = _Recorder(state.backend)
    armed = [True]

    async def prune_between(name: str, args: tuple[Any, ...]) -> None:
        if name == "get_many" and armed[0] and any(":b:" in key for key in args[0]):
            armed[0] = False
            await CheckpointSaver(state, prefix=prefix).aprune(["t"])

    recorder.before = prune_between
    assert await CheckpointSaver(state, prefix=prefix).aget_tuple(first) is None
    armed[0] = True  # the prune lands inside this read of the head: it is read again
    loaded = await saver.aget_tuple(_thread())
    assert loaded is not None
    assert loaded.checkpoint["channel_values"] == {"x": "3", "m": ["c"]}
    assert not armed[0]
    x4 = v(x3, None)
    await saver.aput(loaded.config, _cp({"x": "4", "m": ["c"]}, {"x": x4, "m": x3}), {}, {"x": x4})
    head = await saver.aget_tuple(_thread())
    assert head is not None
    v5 = v(str(head.checkpoint["channel_versions"]["x"]), None)
    await saver.aput(head.config, _cp({"x": "5", "m": ["c"]}, {"x": v5, "m": x3}), {}, {"x": v5})
    armed[0] = True
    listed = [
        item.checkpoint["channel_values"]
        async for item in CheckpointSaver(state, prefix=prefix).alist(_thread())
    ]
    recorder.before = None
    assert not armed[0]
    assert listed == [{"x": "5", "m": ["c"]}]


CHILD = r"""
import os, signal, sys, anyio
from agenticstate import StateConfig, StateManager
from agenticstate.exceptions import ConfigurationError, DecodeError, InvalidArgumentError
from agenticstate.langgraph import CheckpointRetention, CheckpointSaver
from agenticstate.langgraph import checkpoint as checkpoint_module
async def main():
    async with StateManager(StateConfig(backend="sqlite", sqlite_path=sys.argv[1])) as state:
        saver = CheckpointSaver(state)
        real_delete, real_transact = state.delete, state.transact
        async def delete(key, *args, **kwargs):
            await real_delete(key, *args, **kwargs)
            if ":cp:" in key:
                os.kill(os.getpid(), signal.SIGKILL)  # right after a record's delete
        async def transact(*args, **kwargs):
            await real_transact(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)  # right after the first step
        state.delete, state.transact = delete, transact
        await saver.adelete_for_runs(["run-2"])
anyio.run(main)
"""


async def test_a_delete_for_runs_killed_part_way_leaves_the_thread_usable(tmp_path: Path) -> None:
    """A process killed inside `adelete_for_runs` (right after its first write) leaves a
    thread whose latest checkpoint is the newest left, and which a new run continues."""
    path = str(tmp_path / "s.db")
    config = StateConfig(backend="sqlite", sqlite_path=path)
    async with StateManager(config) as state:
        saver = CheckpointSaver(state)
        cfg = _thread()
        version = None
        for n, run in ((1, "run-1"), (2, "run-1"), (3, "run-2")):
            version = saver.get_next_version(version, None)
            cfg = await saver.aput(
                cfg, _cp({"x": n}, {"x": version}), {"run_id": run}, {"x": version}
            )
    child = subprocess.run([sys.executable, "-c", CHILD, path], check=False, timeout=120)
    assert child.returncode == -signal.SIGKILL
    async with StateManager(config) as state:
        saver = CheckpointSaver(state)
        latest = await saver.aget_tuple(_thread())
        assert latest is not None
        assert latest.checkpoint["channel_values"] == {"x": 2}
        version = saver.get_next_version(str(latest.checkpoint["channel_versions"]["x"]), None)
        stored = await saver.aput(latest.config, _cp({"x": 4}, {"x": version}), {}, {"x": version})
        again = await CheckpointSaver(state).aget_tuple(_thread())
        assert again is not None
        assert (
            again.config["configurable"]["checkpoint_id"] == stored["configurable"]["checkpoint_id"]
        )


async def test_a_fork_on_a_pruned_parent_keeps_its_unchanged_values(state: StateManager) -> None:
    """A checkpoint forked from one a prune deleted (after the fork read it) reads back with
    the values it shares with it: they are written again, whole."""
    prefix = _prefix()
    saver = CheckpointSaver(state, prefix=prefix)
    x1 = saver.get_next_version(None, None)
    first = await saver.aput(_thread(), _cp({"x": "old"}, {"x": x1}), {}, {"x": x1})
    x2 = saver.get_next_version(x1, None)
    await saver.aput(first, _cp({"x": "new"}, {"x": x2}), {}, {"x": x2})
    loaded = await saver.aget_tuple(first)
    assert loaded is not None
    await CheckpointSaver(state, prefix=prefix).aprune(["t"])  # the fork's parent goes
    y1 = saver.get_next_version(None, None)
    fork = await saver.aput(
        loaded.config, _cp({"x": "old", "y": "fork"}, {"x": x1, "y": y1}), {}, {"y": y1}
    )
    got = await CheckpointSaver(state, prefix=prefix).aget_tuple(fork)
    assert got is not None
    assert got.checkpoint["channel_values"] == {"x": "old", "y": "fork"}


async def test_a_delta_on_a_base_rewritten_with_other_bytes_of_its_size_is_a_decode_error(
    state: StateManager,
) -> None:
    """A delta's base overwritten with other bytes of the same length (another client) makes
    the read a `DecodeError` (the delta records its base's digest), never a wrong value."""
    prefix = _prefix()
    saver = CheckpointSaver(state, prefix=prefix, compress_above=None)
    v1 = saver.get_next_version(None, None)
    first = await saver.aput(_thread(), _cp({"m": ["aaaa"]}, {"m": v1}), {}, {"m": v1})
    v2 = saver.get_next_version(v1, None)
    second = await saver.aput(first, _cp({"m": ["aaaa", "bbbb"]}, {"m": v2}), {}, {"m": v2})
    key = saver._blob_key("t", "", "m", v1)
    stored = await state.get(key)
    await state.save(key, [stored[0], stored[1].replace(b"aaaa", b"zzzz")], ttl=None)
    with pytest.raises(DecodeError):
        await CheckpointSaver(state, prefix=prefix).aget_tuple(second)


@pytest.mark.parametrize("reader", ["fresh", "same"])
async def test_versions_a_caller_reuses_across_branches_never_mix_values(
    state: StateManager, reader: str
) -> None:
    """Two branches that write the same caller-chosen version of a list: every checkpoint reads
    back as `InMemorySaver` reads it (a delta is only built on the saver's own unique versions)."""
    saver = CheckpointSaver(state, prefix=_prefix())

    async def history(s: Any) -> list[Any]:
        root = await s.aput(_thread(), _cp({"m": ["q"]}, {"m": "1"}), {}, {"m": "1"})
        a2 = await s.aput(root, _cp({"m": ["q", "aa"]}, {"m": "2"}), {}, {"m": "2"})
        await s.aget_tuple(a2)  # the run continues from a2
        a3 = await s.aput(a2, _cp({"m": ["q", "aa", "tail"]}, {"m": "3"}), {}, {"m": "3"})
        await s.aget_tuple(root)  # another run forks from root
        b2 = await s.aput(root, _cp({"m": ["q", "bb"]}, {"m": "2"}), {}, {"m": "2"})
        read = (
            CheckpointSaver(state, prefix=saver.prefix) if reader == "fresh" and s is saver else s
        )
        tuples = [await read.aget_tuple(config) for config in (root, a2, a3, b2)]
        return [got.checkpoint["channel_values"]["m"] for got in tuples if got is not None]

    assert await history(saver) == await history(InMemorySaver())


async def test_a_ttl_sweep_keeps_a_namespace_begun_during_it(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written to a new namespace of an expiring thread while the sweep lists the
    thread's keys is kept (the thread is active), and reads back."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    prefix = _prefix()
    policy = CheckpointRetention(thread_ttl=timedelta(hours=1))
    sweeper = CheckpointSaver(state, prefix=prefix, retention=policy)
    writer = CheckpointSaver(state, prefix=prefix)
    await sweeper.aput(_thread(), _cp({"x": 1}, {"x": "1"}), {}, {"x": "1"})
    clock[0] += 7200
    real = state.list_keys
    written: list[RunnableConfig] = []

    async def list_keys(pattern: str, *args: Any, **kwargs: Any) -> list[str]:
        if pattern.endswith("}:*") and not written:  # the sweep's listing of the whole thread
            written.append(
                await writer.aput(_thread("t", "child"), _cp({"y": 2}, {"y": "1"}), {}, {"y": "1"})
            )
        return await real(pattern, *args, **kwargs)

    monkeypatch.setattr(state, "list_keys", list_keys)
    await sweeper.asweep_idle_threads()
    monkeypatch.setattr(state, "list_keys", real)
    assert written
    got = await CheckpointSaver(state, prefix=prefix).aget_tuple(written[0])
    assert got is not None
    assert got.checkpoint["channel_values"] == {"y": 2}


@pytest.mark.parametrize("damage", ["head", "record"])
async def test_a_bad_thread_in_the_ttl_sweep_never_fails_a_committed_put(
    state: StateManager,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    """A thread another client left unreadable (a head without its id, a record with a bad
    write time) does not make the puts to other threads raise after they were written; the
    failure is logged at INFO under agenticstate, without values."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    prefix = _prefix()
    saver = CheckpointSaver(
        state, prefix=prefix, retention=CheckpointRetention(thread_ttl=timedelta(hours=1))
    )
    bad = await saver.aput(_thread("bad"), _cp({"x": 1}, {"x": "1"}), {}, {"x": "1"})
    if damage == "head":
        await state.save(saver._head_key("bad", ""), {"oops": "secret"}, ttl=None)
    else:
        key = saver._cp_key("bad", "", bad["configurable"]["checkpoint_id"])
        record = await state.get(key)
        await state.save(key, {**record, "at": "secret"}, ttl=None)
    clock[0] += 7200
    caplog.set_level("INFO", logger="agenticstate")
    for n in range(2):
        checkpoint = _cp({"x": n}, {"x": str(n + 2)})
        clock[0] += 1000
        stored = await saver.aput(_thread("good"), checkpoint, {}, {"x": str(n + 2)})
        assert stored["configurable"]["checkpoint_id"] == checkpoint["id"]
    assert "secret" not in caplog.text
    if damage == "record":
        assert "checkpoint_thread_expiry_failed" in caplog.text


async def test_an_empty_thread_id_is_refused_before_anything_is_written(
    state: StateManager,
) -> None:
    """`aput` with `thread_id=""` raises InvalidArgumentError and stores nothing."""
    prefix = _prefix()
    saver = CheckpointSaver(
        state, prefix=prefix, retention=CheckpointRetention(thread_ttl=timedelta(hours=1))
    )
    with pytest.raises(InvalidArgumentError):
        await saver.aput(_thread(""), _cp({"x": 1}, {"x": "1"}), {}, {"x": "1"})
    assert await state.list_keys(f"{prefix}:*") == []


async def test_max_age_still_applies_past_records_without_write_times(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread whose oldest record predates write times (no `at`) still has its timed
    checkpoints aged out by `max_age`; the untimed one and the latest stay."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    prefix = _prefix()
    plain = CheckpointSaver(state, prefix=prefix)
    config = await plain.aput(_thread(), _cp({"x": 0}, {"x": "0"}), {}, {"x": "0"})
    key = plain._cp_key("t", "", config["configurable"]["checkpoint_id"])
    record = await state.get(key)
    del record["at"]
    await state.save(key, record, ttl=None)
    saver = CheckpointSaver(state, prefix=prefix, retention=CheckpointRetention(max_age=60))
    for n in (1, 2, 3):
        config = await saver.aput(config, _cp({"x": n}, {"x": str(n)}), {}, {"x": str(n)})
    clock[0] += 120
    await saver.aput(config, _cp({"x": 4}, {"x": "4"}), {}, {"x": "4"})
    left = [item.checkpoint["channel_values"]["x"] async for item in saver.alist(_thread())]
    assert left == [4, 0]


@pytest.mark.parametrize("option", ["max_age", "thread_ttl"])
def test_a_retention_duration_too_large_for_a_float_is_a_configuration_error(option: str) -> None:
    """An int duration no float holds (10**400 seconds) is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        CheckpointRetention(**{option: 10**400})


@pytest.mark.parametrize("gone_by", ["ttl_sweep", "keep_last"])
async def test_pending_writes_against_a_deleted_checkpoint_leave_no_key(
    state: StateManager, monkeypatch: pytest.MonkeyPatch, gone_by: str
) -> None:
    """Writes a slow task records against a checkpoint a TTL sweep or `keep_last` already
    deleted do not stay: the next sweep (the writes keep the thread in the TTL index), or the
    next prune of the namespace, deletes them."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    prefix = _prefix()
    policy = (
        CheckpointRetention(thread_ttl=timedelta(hours=1))
        if gone_by == "ttl_sweep"
        else CheckpointRetention(keep_last=1)
    )
    saver = CheckpointSaver(state, prefix=prefix, retention=policy)
    first = await saver.aput(_thread(), _cp({"x": 1}, {"x": "1"}), {}, {"x": "1"})
    if gone_by == "ttl_sweep":
        clock[0] += 7200
        assert await saver.asweep_idle_threads() == 1
    else:
        await saver.aput(first, _cp({"x": 2}, {"x": "2"}), {}, {"x": "2"})
        assert await saver.aget_tuple(first) is None
    for writer in (saver, CheckpointSaver(state, prefix=prefix, retention=policy)):
        await writer.aput_writes(first, [("x", 3)], "slow-task")
    if gone_by == "ttl_sweep":
        clock[0] += 7200
        assert await saver.asweep_idle_threads() == 1
    else:
        head = await saver.aget_tuple(_thread())
        assert head is not None
        await saver.aput(head.config, _cp({"x": 4}, {"x": "4"}), {}, {"x": "4"})
    checkpoint_id = first["configurable"]["checkpoint_id"]
    assert [key for key in await state.list_keys(f"{prefix}:*") if checkpoint_id in key] == []


async def test_keep_last_bounds_a_thread_whose_graph_runs_a_subgraph_each_turn() -> None:
    """With `keep_last`, a graph that invokes a subgraph every turn (a new namespace per turn)
    holds a bounded number of namespaces and keys however many turns it runs."""
    inner = StateGraph(_Chat)
    inner.add_node("inner", lambda _: {"messages": [AIMessage("inner " + "x" * 50)]})
    inner.add_edge(START, "inner")
    inner.add_edge("inner", END)
    outer = StateGraph(_Chat)
    outer.add_node("sub", inner.compile())
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    async with StateManager() as state:
        saver = CheckpointSaver(state, delta_chain=4, retention=CheckpointRetention(keep_last=2))
        graph = outer.compile(checkpointer=saver)
        config: Any = {"configurable": {"thread_id": "T"}}
        counts = {}
        for turn in range(1, 25):
            await graph.ainvoke({"messages": [HumanMessage("hi")]}, config)
            if turn in (12, 24):
                keys = await state.list_keys("langgraph:*")
                assert sum(":head:" in key for key in keys) <= 3
                counts[turn] = len(keys)
        assert counts[24] <= counts[12]
        state_now = await graph.aget_state(config)
        assert len(state_now.values["messages"]) == 48


branching = st.lists(
    st.tuples(
        st.integers(0, 30),  # which earlier checkpoint to build on (or none)
        st.sampled_from(["grow", "grow", "replace", "same"]),  # what happens to the list
        st.sampled_from(["1", "2", "3", "4", "unique", "unique"]),  # the list's new version
        st.booleans(),  # whether the scalar channel changes too
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=branching)
def test_branches_with_reused_or_unique_versions_read_as_in_memory_saver(
    steps: list[tuple[int, str, str, bool]],
) -> None:
    """Generated branching histories (lists grown, replaced or kept; versions the caller reuses
    across branches, or unique ones) read back, checkpoint by checkpoint through a fresh saver,
    exactly as LangGraph's `InMemorySaver` reads the same history."""

    async def main() -> None:
        model = InMemorySaver()
        async with StateManager() as state:
            saver = CheckpointSaver(state, delta_chain=3)
            made: list[tuple[RunnableConfig, dict[str, Any], dict[str, str]]] = []
            for n, (pick, change, version, scalar) in enumerate(steps):
                config: RunnableConfig = _thread()
                values: dict[str, Any] = {}
                versions: dict[str, str] = {}
                if made and pick % 5:
                    config, values, versions = made[pick % len(made)]
                    await saver.aget_tuple(config)  # a run continues from it (deltas on it)
                new: dict[str, str] = {}
                values = dict(values)
                if change != "same" or "m" not in values:
                    grown = [*values.get("m", []), f"item {n}"] if change == "grow" else [n]
                    values["m"] = grown
                    new["m"] = (
                        saver.get_next_version(versions.get("m"), None)
                        if version == "unique"
                        else version
                    )
                if scalar or "x" not in values:
                    values["x"] = n
                    new["x"] = saver.get_next_version(versions.get("x"), None)
                all_versions = {**versions, **new}
                checkpoint = _cp(values, all_versions)
                stored = await saver.aput(config, checkpoint, {}, dict(new))
                await model.aput(config, checkpoint, {}, dict(new))
                made.append((stored, values, all_versions))
            reader = CheckpointSaver(state)
            for config, _, _ in made:
                got = await reader.aget_tuple(config)
                want = await model.aget_tuple(config)
                assert got is not None
                assert want is not None
                assert got.checkpoint["channel_values"] == want.checkpoint["channel_values"]

    anyio.run(main)


async def test_a_head_naming_a_deleted_checkpoint_is_repaired_by_the_next_read(
    state: StateManager,
) -> None:
    """A head left naming a checkpoint that is gone (a delete killed part-way, key by key) is
    pointed at the newest checkpoint left by the next `aget_tuple`, and the thread continues."""
    prefix = _prefix()
    saver = CheckpointSaver(state, prefix=prefix)
    first = await saver.aput(_thread(), _cp({"x": 1}, {"x": "1"}), {}, {"x": "1"})
    second = await saver.aput(first, _cp({"x": 2}, {"x": "2"}), {}, {"x": "2"})
    await state.delete(saver._cp_key("t", "", second["configurable"]["checkpoint_id"]))
    latest = await CheckpointSaver(state, prefix=prefix).aget_tuple(_thread())
    assert latest is not None
    assert latest.checkpoint["channel_values"] == {"x": 1}
    stored = await saver.aput(latest.config, _cp({"x": 3}, {"x": "3"}), {}, {"x": "3"})
    again = await CheckpointSaver(state, prefix=prefix).aget_tuple(_thread())
    assert again is not None
    assert again.config["configurable"]["checkpoint_id"] == stored["configurable"]["checkpoint_id"]
