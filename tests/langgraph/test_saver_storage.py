"""How `CheckpointSaver` stores channel values: a grown list as a delta on its previous version
(a whole copy every `delta_chain`), large values compressed, stores written before deltas still
read; storage grows linearly with a thread's turns and stays under a quarter of LangGraph's
`InMemorySaver` (memory) and `AsyncSqliteSaver` (SQLite). `bench.bench_langgraph_storage` reports
the figures up to 200 turns."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langgraph.checkpoint.memory import InMemorySaver

from agenticstate.exceptions import ConfigurationError, DecodeError
from agenticstate.langgraph import CheckpointSaver
from bench._thread_workload import sqlite_thread_bytes
from bench.bench_langgraph_storage import (
    async_sqlite_saver_bytes,
    in_memory_saver_bytes,
    memory_bytes,
    run_graph,
)
from tests.langgraph.test_saver_steps import _Recorder

if TYPE_CHECKING:
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig

    from agenticstate import StateManager


def _config(thread: str, checkpoint_id: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


async def _grow(saver: CheckpointSaver, thread: str, steps: int, start: int = 0) -> list[str]:
    """Put `steps` checkpoints on the thread's head, each adding one message; return their ids."""
    ids = []
    for step in range(start, start + steps):
        head = await saver.aget_tuple(_config(thread))
        config = head.config if head is not None else _config(thread)
        messages = list(head.checkpoint["channel_values"]["messages"]) if head else []
        messages.append((HumanMessage if step % 2 else AIMessage)(f"message {step} " * 30))
        previous = head.checkpoint["channel_versions"].get("messages") if head else None
        version = saver.get_next_version(None if previous is None else str(previous), None)
        checkpoint = generate_checkpoint(
            channel_values={"messages": messages, "step": step},
            channel_versions={"messages": version, "step": version},
        )
        stored = await saver.aput(
            config, checkpoint, generate_metadata(step=step), {"messages": version, "step": version}
        )
        ids.append(stored["configurable"]["checkpoint_id"])
    return ids


async def _stored(state: StateManager, saver: CheckpointSaver, thread: str) -> list[Any]:
    """The stored forms of the thread's `messages` values."""
    keys = await state.list_keys(f"{saver._tag(thread)}:b::messages:*")
    return list((await state.get_many(keys)).values())


async def test_a_growing_list_is_stored_as_deltas_with_a_whole_copy_every_delta_chain(
    state: StateManager,
) -> None:
    """A list grown by appends is stored as what each version appends, a whole copy every
    `delta_chain` versions (so a read fetches at most that many values), and every checkpoint
    reads back equal, message types included; this on every backend."""
    saver = CheckpointSaver(state, prefix=f"s{uuid.uuid4().hex[:6]}", delta_chain=4)
    ids = await _grow(saver, "t", 10)
    stored = await _stored(state, saver, "t")
    deltas = [value for value in stored if len(value) > 2 and value[2] >= 2]
    assert len(stored) == 10
    assert len(deltas) == 7  # versions 1, 5 and 9 whole; the rest deltas
    for key, record in (await state.get_many(await state.list_keys("*:cp:*"))).items():
        if key.startswith(saver.prefix):
            assert len((record.get("chains") or {}).get("messages", [])) <= 3
    reader = CheckpointSaver(state, prefix=saver.prefix)
    for step, checkpoint_id in enumerate(ids):
        got = await reader.aget_tuple(_config("t", checkpoint_id))
        assert got is not None
        messages = got.checkpoint["channel_values"]["messages"]
        assert [m.content for m in messages] == [f"message {i} " * 30 for i in range(step + 1)]
        assert [type(m) for m in messages] == [
            HumanMessage if i % 2 else AIMessage for i in range(step + 1)
        ]


async def test_graph_history_reads_back_as_in_memory_saver_gives_it(state: StateManager) -> None:
    """A chat graph's whole history (every checkpoint, values and pending writes) read from
    `CheckpointSaver` with deltas equals `InMemorySaver`'s for the same run."""
    ours = CheckpointSaver(state, prefix=f"g{uuid.uuid4().hex[:6]}", delta_chain=3)
    theirs = InMemorySaver()
    await run_graph(ours, 6)
    await run_graph(theirs, 6)
    config = _config("t1")
    mine = [item async for item in ours.alist(config)]
    reference = [item async for item in theirs.alist(config)]
    assert len(mine) == len(reference) == 24
    for a, b in zip(mine, reference, strict=True):
        assert a.checkpoint["channel_values"] == b.checkpoint["channel_values"]
        assert [w[1:] for w in a.pending_writes or []] == [w[1:] for w in b.pending_writes or []]


async def test_a_graph_turn_reads_nothing_between_its_writes(state: StateManager) -> None:
    """In a graph run with deltas, every `aput` and `aput_writes` after the run's first read is
    one `transact`: the chains of the values a checkpoint shares with its parent come from
    what the saver remembers, not from a read."""
    saver = CheckpointSaver(state, prefix=f"n{uuid.uuid4().hex[:6]}")
    await run_graph(saver, 3)
    recorder = _Recorder(state.backend)
    await run_graph(saver, 1, thread="t1")
    names = recorder.names()
    first = names.index("transact")
    assert names[first:] == ["transact"] * len(names[first:]), names
    stored = await state.get_many(await state.list_keys(f"{saver.prefix}:*:cp:*"))
    assert any(record.get("chains") for record in stored.values())


async def test_a_store_of_whole_values_without_chains_still_reads_and_grows_by_deltas(
    state: StateManager,
) -> None:
    """Values stored whole and records without `chains` or `at` (a store written before deltas)
    read back as they were, and a saver continuing such a thread stores its next list as a
    delta on the old whole value."""
    prefix = f"o{uuid.uuid4().hex[:6]}"
    old = CheckpointSaver(state, prefix=prefix, delta_chain=1, compress_above=None)
    ids = await _grow(old, "t", 3)
    for key in await state.list_keys(f"{prefix}:*:cp:*"):
        record = await state.get(key)
        await state.save(key, {k: v for k, v in record.items() if k not in {"at", "chains"}})
    assert all(len(value) == 2 for value in await _stored(state, old, "t"))
    new = CheckpointSaver(state, prefix=prefix)
    ids += await _grow(new, "t", 2, start=3)
    assert sum(len(value) > 2 for value in await _stored(state, new, "t")) == 2
    for step, checkpoint_id in enumerate(ids):
        got = await CheckpointSaver(state, prefix=prefix).aget_tuple(_config("t", checkpoint_id))
        assert got is not None
        assert len(got.checkpoint["channel_values"]["messages"]) == step + 1


async def test_a_delta_base_deleted_before_the_put_makes_it_a_whole_copy(
    state: StateManager,
) -> None:
    """A fork from an older checkpoint whose values a prune deleted meanwhile (after the fork
    loaded it) is written whole: the checkpoint reads back exact."""
    prefix = f"f{uuid.uuid4().hex[:6]}"
    saver = CheckpointSaver(state, prefix=prefix, delta_chain=3)
    ids = await _grow(saver, "t", 5)
    old = await saver.aget_tuple(_config("t", ids[0]))  # remembers version 1 as a base
    assert old is not None
    await CheckpointSaver(state, prefix=prefix).aprune(["t"])  # deletes versions 1-3
    messages = [*old.checkpoint["channel_values"]["messages"], HumanMessage("fork")]
    version = saver.get_next_version(str(old.checkpoint["channel_versions"]["messages"]), None)
    checkpoint = generate_checkpoint(
        channel_values={"messages": messages}, channel_versions={"messages": version}
    )
    stored = await saver.aput(old.config, checkpoint, generate_metadata(), {"messages": version})
    got = await CheckpointSaver(state, prefix=prefix).aget_tuple(stored)
    assert got is not None
    assert got.checkpoint["channel_values"]["messages"] == messages


async def test_a_delta_whose_base_changed_is_a_decode_error(state: StateManager) -> None:
    """A delta whose base value was overwritten with another (a corrupt or tampered store) is
    refused with DecodeError, never read as a wrong value."""
    prefix = f"c{uuid.uuid4().hex[:6]}"
    saver = CheckpointSaver(state, prefix=prefix, compress_above=None)
    ids = await _grow(saver, "t", 2)
    first = await saver.aget_tuple(_config("t", ids[0]))
    assert first is not None
    version = first.checkpoint["channel_versions"]["messages"]
    kind, data = saver.serde.dumps_typed([HumanMessage("another, longer value " * 9)])
    await state.save(saver._blob_key("t", "", "messages", version), [kind, data])
    with pytest.raises(DecodeError):
        await CheckpointSaver(state, prefix=prefix).aget_tuple(_config("t", ids[1]))


async def test_large_values_are_compressed_unless_turned_off(state: StateManager) -> None:
    """Values of `compress_above` bytes or more are stored zlib-compressed (and read back);
    `compress_above=None` stores every value as the serializer gave it."""
    for compress_above, compressed in ((1024, True), (None, False)):
        saver = CheckpointSaver(
            state, prefix=f"z{uuid.uuid4().hex[:6]}", compress_above=compress_above, delta_chain=1
        )
        ids = await _grow(saver, "t", 3)
        stored = await _stored(state, saver, "t")
        assert any(len(value) > 2 and value[2] == 1 for value in stored) is compressed
        got = await saver.aget_tuple(_config("t", ids[-1]))
        assert got is not None
        assert len(got.checkpoint["channel_values"]["messages"]) == 3


@pytest.mark.parametrize(
    "options",
    [
        {"delta_chain": 0},
        {"delta_chain": True},
        {"compress_above": -1},
        {"compress_above": 1.5},
        {"retention": {"keep_last": 3}},
    ],
)
async def test_bad_storage_options_are_refused(
    state: StateManager, options: dict[str, Any]
) -> None:
    """A `delta_chain` below 1, a `compress_above` that is not a byte count, or a retention
    that is not a `CheckpointRetention` is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        CheckpointSaver(state, **options)


TURNS = 25  # the growth test compares this many turns with twice as many


@pytest.mark.slow
async def test_memory_storage_grows_linearly_and_stays_under_a_quarter_of_in_memory_saver() -> None:
    """On memory, a thread of 50 turns holds at most 2.2x what 25 turns hold, and at most a
    quarter of what LangGraph's InMemorySaver holds for it."""
    short = await memory_bytes(TURNS)
    long = await memory_bytes(2 * TURNS)
    assert long <= 2.2 * short, f"{long} bytes against {short}: {long / short:.2f}x"
    theirs = await in_memory_saver_bytes(2 * TURNS)
    assert long <= theirs / 4, f"{long} bytes against InMemorySaver's {theirs}"


@pytest.mark.slow
async def test_sqlite_storage_grows_linearly_and_stays_under_a_quarter_of_async_sqlite_saver(
    tmp_path: Path,
) -> None:
    """On SQLite, the file of a 60-turn thread (change feed included) is at most 2.2x that of
    30 turns, and at most a quarter of LangGraph's AsyncSqliteSaver file for it."""
    short, _ = await sqlite_thread_bytes(tmp_path / "short.db", 30)
    long, _ = await sqlite_thread_bytes(tmp_path / "long.db", 60)
    assert long <= 2.2 * short, f"{long} bytes against {short}: {long / short:.2f}x"
    theirs = await async_sqlite_saver_bytes(tmp_path / "theirs.db", 60)
    assert long <= theirs / 4, f"{long} bytes against AsyncSqliteSaver's {theirs}"
