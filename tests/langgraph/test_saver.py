"""`CheckpointSaver` beyond the conformance suite: the head guard under concurrency, awkward
thread ids, LangGraph's serializer without pickle, the sync API, and a generated comparison with
LangGraph's own `InMemorySaver`."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, TypedDict

import anyio
import anyio.lowlevel
import pytest
from anyio.from_thread import start_blocking_portal
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph")

from langgraph.checkpoint.conformance.test_utils import (
    generate_checkpoint,
    generate_config,
    generate_metadata,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Command

from agenticstate import ConfigurationError, FileBackend, StateConfig, StateManager
from agenticstate.langgraph import HEAD_GUARD_KEY, CheckpointSaver, StaleCheckpointError
from tests.langgraph._graph_worker import approval_graph

if TYPE_CHECKING:
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import CheckpointTuple


async def _put(
    saver: Any, thread: str, parent: RunnableConfig | None = None, **metadata: Any
) -> RunnableConfig:
    config = generate_config(thread)
    if parent is not None:
        config["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
        if HEAD_GUARD_KEY in parent["configurable"]:
            config["configurable"][HEAD_GUARD_KEY] = parent["configurable"][HEAD_GUARD_KEY]
    checkpoint = generate_checkpoint(channel_values={"x": 1}, channel_versions={"x": "1"})
    stored: RunnableConfig = await saver.aput(
        config, checkpoint, generate_metadata(**metadata), {"x": "1"}
    )
    return stored


def _guarded(config: RunnableConfig) -> RunnableConfig:
    return {"configurable": {**config["configurable"], HEAD_GUARD_KEY: True}}


async def test_concurrent_guarded_writers_exactly_one_wins(state: StateManager) -> None:
    """Eight writers continue the same head at once: one wins, seven get StaleCheckpointError,
    and the head has exactly one child."""
    saver = CheckpointSaver(state)
    head = await _put(saver, "t")
    outcomes: list[object] = []

    async def writer() -> None:
        try:
            outcomes.append(await _put(saver, "t", _guarded(head)))
        except StaleCheckpointError as exc:
            outcomes.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(writer)
    winners = [o for o in outcomes if isinstance(o, dict)]
    losers = [o for o in outcomes if isinstance(o, StaleCheckpointError)]
    assert (len(winners), len(losers)) == (1, 7)
    assert {loser.expected_head for loser in losers} == {head["configurable"]["checkpoint_id"]}
    listed = [t async for t in saver.alist(generate_config("t"))]
    assert [t.config["configurable"]["checkpoint_id"] for t in listed] == [
        winners[0]["configurable"]["checkpoint_id"],
        head["configurable"]["checkpoint_id"],
    ]
    latest = await saver.aget_tuple(generate_config("t"))
    assert latest is not None
    assert (
        latest.config["configurable"]["checkpoint_id"]
        == winners[0]["configurable"]["checkpoint_id"]
    )


async def test_stale_write_changes_nothing(state: StateManager) -> None:
    """A guarded write on a head that moved is refused before anything is stored."""
    saver = CheckpointSaver(state)
    first = await _put(saver, "t")
    second = await _put(saver, "t", first)
    keys = await state.list_keys("*")
    with pytest.raises(StaleCheckpointError) as caught:
        await _put(saver, "t", _guarded(first))
    assert caught.value.actual_head == second["configurable"]["checkpoint_id"]
    assert await state.list_keys("*") == keys
    # Without the guard (an explicit fork), the same write is accepted and becomes the head.
    fork = await _put(saver, "t", first)
    latest = await saver.aget_tuple(generate_config("t"))
    assert latest is not None
    assert latest.config["configurable"]["checkpoint_id"] == fork["configurable"]["checkpoint_id"]
    assert latest.config["configurable"][HEAD_GUARD_KEY] is True


@pytest.mark.parametrize("thread", ["a:b", "{tag}", "x*", "[ab]?", "back\\slash", "é 漢 %41", "1"])
async def test_awkward_thread_ids_stay_apart(state: StateManager, thread: str) -> None:
    """Thread ids with key, glob and hash-tag characters round-trip and never touch others."""
    saver = CheckpointSaver(state)
    other = await _put(saver, "x")
    mine = await _put(saver, thread)
    got = await saver.aget_tuple(generate_config(thread))
    assert got is not None
    assert got.config["configurable"]["thread_id"] == thread
    assert [
        t.config["configurable"]["thread_id"] async for t in saver.alist(generate_config(thread))
    ] == [thread]
    everything = {t.config["configurable"]["checkpoint_id"] async for t in saver.alist(None)}
    assert {
        mine["configurable"]["checkpoint_id"],
        other["configurable"]["checkpoint_id"],
    } <= everything
    await saver.adelete_thread(thread)
    assert await saver.aget_tuple(generate_config(thread)) is None
    assert await saver.aget_tuple(generate_config("x")) is not None


class _AesGcm:
    """LangGraph's CipherProtocol over `cryptography`'s AES-GCM."""

    def __init__(self) -> None:
        self.aead = AESGCM(AESGCM.generate_key(bit_length=128))

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        nonce = os.urandom(12)
        return "aesgcm", nonce + self.aead.encrypt(nonce, plaintext, None)

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        assert ciphername == "aesgcm"
        return self.aead.decrypt(ciphertext[:12], ciphertext[12:], None)


async def test_encrypted_serializer_round_trips(state: StateManager) -> None:
    """LangGraph's EncryptedSerializer works as the saver's serde: values are stored encrypted
    and read back whole."""
    saver = CheckpointSaver(state, serde=EncryptedSerializer(_AesGcm()))
    graph = approval_graph(saver)
    config = generate_config("secret")
    await graph.ainvoke({"steps": []}, config)
    done = await graph.ainvoke(Command(resume="classified"), config)
    assert done["steps"] == ["plan", "ask", "finish:classified"]
    stored = await state.get_many(await state.list_keys("langgraph:*:b:*"))
    blobs = {key: blob for key, blob in stored.items() if blob[0] != "empty"}
    assert blobs
    assert all(kind.endswith("+aesgcm") for kind, _ in blobs.values()), blobs
    assert not any(b"classified" in data for _, data in blobs.values())


def test_serializer_never_pickles(tmp_path: Path) -> None:
    """The default serializer is LangGraph's JsonPlusSerializer with pickle off; one that falls
    back to pickle is refused."""

    async def main() -> None:
        async with StateManager() as state:
            saver = CheckpointSaver(state)
            assert isinstance(saver.serde, JsonPlusSerializer)
            assert saver.serde.pickle_fallback is False
            with pytest.raises(ConfigurationError):
                CheckpointSaver(state, serde=JsonPlusSerializer(pickle_fallback=True))
            wrapped = EncryptedSerializer(_AesGcm(), JsonPlusSerializer(pickle_fallback=True))
            with pytest.raises(ConfigurationError):
                CheckpointSaver(state, serde=wrapped)
            config = generate_config("t")
            checkpoint = generate_checkpoint(
                channel_values={"lock": threading.Lock()}, channel_versions={"lock": "1"}
            )
            with pytest.raises(Exception, match=r"(?i)serializ|type"):
                await saver.aput(config, checkpoint, generate_metadata(), {"lock": "1"})
            assert await state.list_keys("*") == []  # nothing half-written
            graph = approval_graph(saver)
            await graph.ainvoke({"steps": []}, generate_config("g"))
            stored = await state.get_many(await state.list_keys("langgraph:*:b:*"))
            kinds = {value[0] for value in stored.values()}
            assert kinds
            assert "pickle" not in kinds

    anyio.run(main)


def test_sync_graph_through_a_portal(tmp_path: Path) -> None:
    """A synchronous graph (`invoke`) runs on the saver through a blocking portal."""
    with start_blocking_portal() as portal:
        state = StateManager(StateConfig(), backend=FileBackend(base_path=tmp_path / "s"))
        portal.call(state.open)
        try:
            saver = CheckpointSaver(state, portal=portal)
            graph = approval_graph(saver)
            config = generate_config("sync")
            assert graph.invoke({"steps": []}, config)["__interrupt__"]
            done = graph.invoke(Command(resume="ok"), config)
            assert done["steps"] == ["plan", "ask", "finish:ok"]
            assert len(list(saver.list(config, limit=2))) == 2
            saver.delete_thread("sync")
            assert saver.get_tuple(config) is None
        finally:
            portal.call(state.aclose)


def test_sync_without_portal_is_a_clear_error() -> None:
    """A sync call with no portal and no loop worker thread says what to do."""
    saver = CheckpointSaver(StateManager())
    with pytest.raises(ConfigurationError, match="portal"):
        saver.get_tuple(generate_config("t"))


# ---------------------------------------------------------------- generated, against InMemorySaver

steps = st.lists(
    st.tuples(
        st.sampled_from(["put", "writes"]),
        st.sampled_from(["t1", "t2"]),
        st.integers(0, 50),  # which earlier checkpoint of that thread to build on (or none)
        st.sampled_from(["input", "loop", "update"]),
    ),
    min_size=1,
    max_size=20,
)


def _view(t: CheckpointTuple) -> tuple[Any, ...]:
    return (
        t.config["configurable"]["thread_id"],
        t.checkpoint["id"],
        t.checkpoint["channel_values"],
        t.metadata,
        t.parent_config["configurable"]["checkpoint_id"] if t.parent_config else None,
        t.pending_writes,
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=steps,
    limit=st.one_of(st.none(), st.integers(1, 5)),
    source=st.sampled_from([None, "loop"]),
)
def test_matches_langgraph_in_memory_saver(
    steps: list[tuple[str, str, int, str]], limit: int | None, source: str | None
) -> None:
    """Any sequence of puts (chains and forks) and writes lists, filters and pages exactly as on
    LangGraph's InMemorySaver."""

    async def main() -> None:
        model = InMemorySaver()
        async with StateManager() as state:
            saver = CheckpointSaver(state)
            made: dict[str, list[RunnableConfig]] = {"t1": [], "t2": []}
            for n, (op, thread, pick, kind) in enumerate(steps):
                earlier = made[thread]
                if op == "writes":
                    if earlier:
                        target = earlier[pick % len(earlier)]
                        writes = [("x", n), ("__error__", f"e{n}")]
                        await saver.aput_writes(target, writes, f"task{pick % 3}")
                        await model.aput_writes(target, writes, f"task{pick % 3}")
                    continue
                config = generate_config(thread)
                if earlier and pick % 4:
                    config["configurable"]["checkpoint_id"] = earlier[pick % len(earlier)][
                        "configurable"
                    ]["checkpoint_id"]
                version = model.get_next_version(None, None)
                checkpoint = generate_checkpoint(
                    channel_values={"x": n, "y": [n, kind]},
                    channel_versions={"x": version, "y": version},
                )
                metadata = generate_metadata(source=kind, step=n)
                stored = await saver.aput(
                    config, checkpoint, metadata, {"x": version, "y": version}
                )
                await model.aput(config, checkpoint, metadata, {"x": version, "y": version})
                earlier.append(stored)
            filters = {"source": source} if source else None
            for config in (generate_config("t1"), generate_config("t2")):
                got = [_view(t) async for t in saver.alist(config, filter=filters, limit=limit)]
                want = [_view(t) async for t in model.alist(config, filter=filters, limit=limit)]
                assert got == want
            # Across threads the order is not specified: compare everything as sets.
            got = [_view(t) async for t in saver.alist(None, filter=filters)]
            want = [_view(t) async for t in model.alist(None, filter=filters)]
            assert sorted(got, key=repr) == sorted(want, key=repr)
            for thread, configs in made.items():
                if configs:
                    before = configs[len(configs) // 2]
                    got = [
                        _view(t) async for t in saver.alist(generate_config(thread), before=before)
                    ]
                    want = [
                        _view(t) async for t in model.alist(generate_config(thread), before=before)
                    ]
                    assert got == want
                    got_latest = await saver.aget_tuple(generate_config(thread))
                    want_latest = await model.aget_tuple(generate_config(thread))
                    assert got_latest is not None
                    assert want_latest is not None
                    assert _view(got_latest) == _view(want_latest)

    anyio.run(main)


def test_sync_graph_on_the_sync_api(tmp_path: Path) -> None:
    """With an `agenticstate.sync.StateManager`, a synchronous graph and the store's sync
    methods run on the sync API's own loop, with no portal to manage."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.store.base import BaseStore  # noqa: TC002 (LangGraph injects by annotation)

    from agenticstate import sync
    from agenticstate.langgraph import Store

    class Note(TypedDict):
        text: str

    def remember(state: Note, *, store: BaseStore) -> Note:
        store.put(("notes",), "last", {"text": state["text"]})
        item = store.get(("notes",), "last")
        assert item is not None
        return {"text": item.value["text"] + "!"}

    with sync.StateManager(
        StateConfig(backend="file", file_path=str(tmp_path / "s.json"))
    ) as state:
        saver = CheckpointSaver(state)
        store = Store(state)
        builder = StateGraph(Note)
        builder.add_node("remember", remember)
        builder.add_edge(START, "remember")
        builder.add_edge("remember", END)
        graph = builder.compile(checkpointer=saver, store=store)
        thread = generate_config("sync-api")
        assert graph.invoke({"text": "hi"}, thread) == {"text": "hi!"}
        assert graph.get_state(thread).values == {"text": "hi!"}
        assert len(list(saver.list(thread))) == 3
        assert [i.key for i in store.search(("notes",))] == ["last"]
        assert approval_graph(saver).invoke({"steps": []}, generate_config("a"))["__interrupt__"]


async def test_racing_workers_build_one_linear_history(state: StateManager) -> None:
    """Four workers each add ten checkpoints to one thread, reloading the head whenever they are
    refused: the history is one chain (no checkpoint has two children), holding every success."""
    saver = CheckpointSaver(state)
    await _put(saver, "chain")
    written: list[str] = []
    refusals = 0

    async def worker() -> None:
        nonlocal refusals
        done = 0
        while done < 10:
            head = await saver.aget_tuple(generate_config("chain"))
            assert head is not None
            await anyio.lowlevel.checkpoint()  # let the other workers interleave here
            try:
                stored = await _put(saver, "chain", head.config)
            except StaleCheckpointError:
                refusals += 1
                continue
            written.append(stored["configurable"]["checkpoint_id"])
            done += 1

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(worker)
    history = [t async for t in saver.alist(generate_config("chain"))]
    assert len(history) == 1 + 40
    parents = [
        t.parent_config["configurable"]["checkpoint_id"] if t.parent_config else None
        for t in history[:-1]
    ]
    assert len(set(parents)) == len(parents)  # no fork anywhere
    ids = [t.checkpoint["id"] for t in history]
    assert parents == ids[1:]  # each checkpoint's parent is the one just before it
    assert set(written) == set(ids[:-1])
    assert refusals > 0  # the workers really did race


@pytest.mark.parametrize("prefix", ["", "a:b", "x*", "{t}", "é", "a" * 65])
def test_bad_arguments_are_refused(prefix: str) -> None:
    """A prefix that could collide with key syntax, or a state that is not a StateManager, is a
    ConfigurationError at construction."""
    from agenticstate.langgraph import Store

    with pytest.raises(ConfigurationError):
        CheckpointSaver(StateManager(), prefix=prefix)
    with pytest.raises(ConfigurationError):
        Store(StateManager(), prefix=prefix)
    with pytest.raises(ConfigurationError):
        CheckpointSaver({"not": "a manager"})  # type: ignore[arg-type]


async def test_unknown_prune_strategy_changes_nothing(state: StateManager) -> None:
    """aprune with an unknown strategy raises InvalidArgumentError and deletes nothing."""
    from agenticstate import InvalidArgumentError

    saver = CheckpointSaver(state)
    first = await _put(saver, "p")
    await _put(saver, "p", first)
    keys = await state.list_keys("*")
    with pytest.raises(InvalidArgumentError):
        await saver.aprune(["p"], strategy="keep_everything")
    assert await state.list_keys("*") == keys


async def test_sync_invoke_inside_async_code_says_to_await_ainvoke() -> None:
    """`graph.invoke` called from async code (on the event loop's thread) says to use
    `await graph.ainvoke`, rather than to pass a portal."""
    async with StateManager() as state:
        graph = approval_graph(CheckpointSaver(state))
        with pytest.raises(ConfigurationError) as caught:
            graph.invoke({"steps": []}, generate_config("in-async"))
        assert "await graph.ainvoke(...)" in str(caught.value)
        done = await graph.ainvoke({"steps": []}, generate_config("in-async"))  # the advice works
        assert done["__interrupt__"]
