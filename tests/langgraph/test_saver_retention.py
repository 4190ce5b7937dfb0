"""Retention and pruning never break a kept checkpoint: seeded random histories (puts on the
head, forks from older checkpoints, pending writes, `aprune`, savers with a `CheckpointRetention`)
on memory, SQLite, Redis and Redis Cluster, then every checkpoint left is read back, by a fresh
saver, exactly as it was put; plus the policy's rules one by one (keep_last, max_age,
thread_ttl) and writes made while a prune or a sweep is between its read and its deletes."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata

from agenticstate import StateConfig, StateManager
from agenticstate.exceptions import ConfigurationError
from agenticstate.langgraph import CheckpointRetention, CheckpointSaver
from agenticstate.langgraph import checkpoint as checkpoint_module
from tests.helpers import BACKEND_MAKERS
from tests.langgraph.test_saver_steps import _Recorder

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from langchain_core.runnables import RunnableConfig

SEEDS = range(6)


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
    ]
)
async def state(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateManager]:
    """A StateManager over memory, SQLite, Redis and Redis Cluster (a fresh namespace each)."""
    async with BACKEND_MAKERS[request.param](request, tmp_path) as backend:
        manager = StateManager(StateConfig(), backend=backend, close_backend=False)
        try:
            yield manager
        finally:
            await manager.aclose()


@dataclass
class _Put:
    """What one checkpoint was put with."""

    thread: str
    ns: str
    values: dict[str, Any]
    versions: dict[str, str]
    step: int
    writes: list[tuple[str, str, Any]] = field(default_factory=list)


def _message(rng: random.Random, n: int) -> Any:
    text = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(1, 400)))
    if rng.random() < 0.5:
        return HumanMessage(text, id=f"h{n}")
    return AIMessage(text, id=f"a{n}")


def _next_values(
    rng: random.Random, values: dict[str, Any], counter: list[int]
) -> tuple[dict[str, Any], set[str]]:
    """The parent's values changed as a graph step might: lists grown (mostly), replaced,
    shortened; a scalar set; a channel emptied."""
    new = dict(values)
    changed: set[str] = set()
    for channel in ("messages", "notes"):
        roll = rng.random()
        if roll < 0.55:
            extra = []
            for _ in range(rng.randint(0, 3)):
                counter[0] += 1
                extra.append(
                    _message(rng, counter[0])
                    if channel == "messages"
                    else (counter[0], {"t": uuid.UUID(int=counter[0])})
                )
            new[channel] = [*values.get(channel, []), *extra]
        elif roll < 0.65:
            new[channel] = list(values.get(channel, []))[: rng.randint(0, 2)]
        elif roll < 0.7:
            new.pop(channel, None)
        else:
            continue
        changed.add(channel)
    if rng.random() < 0.5:
        new["scalar"] = {"n": rng.randint(0, 9), "blob": b"x" * rng.randint(0, 2000)}
        changed.add("scalar")
    return new, changed


class _History:
    """Drives savers over one store at random and remembers what every checkpoint was put with."""

    def __init__(self, state: StateManager, rng: random.Random) -> None:
        self.state = state
        self.rng = rng
        self.prefix = f"r{uuid.uuid4().hex[:8]}"
        self.plain = CheckpointSaver(state, prefix=self.prefix, delta_chain=4, compress_above=300)
        self.kept = CheckpointSaver(
            state,
            prefix=self.prefix,
            delta_chain=3,
            retention=CheckpointRetention(keep_last=rng.randint(1, 4)),
        )
        self.puts: dict[tuple[str, str, str], _Put] = {}
        self.counter = [0]
        self.chained = 0  # checkpoints put with a channel stored as a delta
        self.races = False  # inject prunes between a run's read and its write

    def _config(self, thread: str, ns: str, checkpoint_id: str | None = None) -> RunnableConfig:
        configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ns}
        if checkpoint_id is not None:
            configurable["checkpoint_id"] = checkpoint_id
        return {"configurable": configurable}

    async def put(self, saver: CheckpointSaver, thread: str, ns: str, fork: bool) -> None:
        """Load the head (or, forking, an older checkpoint) as a graph run does, then put on it."""
        candidates = [key for key in self.puts if key[:2] == (thread, ns)]
        config = self._config(thread, ns)
        if fork and candidates:
            config = self._config(thread, ns, self.rng.choice(candidates)[2])
        loaded = await saver.aget_tuple(config)
        if self.races and self.rng.random() < 0.15:
            # A prune (another worker's) between the run's read and its write: the put's
            # parent and the values it shares may be gone; the put must still read back.
            await CheckpointSaver(self.state, prefix=self.prefix).aprune([thread])
        if loaded is None:
            parent_config, values, versions, step = self._config(thread, ns), {}, {}, -1
        else:
            parent_config = loaded.config
            parent = self.puts[(thread, ns, loaded.config["configurable"]["checkpoint_id"])]
            values, versions, step = parent.values, parent.versions, parent.step
        new_values, changed = _next_values(self.rng, values, self.counter)
        new_versions = {ch: saver.get_next_version(versions.get(ch), None) for ch in changed}
        all_versions = {**versions, **new_versions}
        checkpoint = generate_checkpoint(
            channel_values=new_values, channel_versions=dict(all_versions)
        )
        stored = await saver.aput(
            parent_config, checkpoint, generate_metadata(step=step + 1), dict(new_versions)
        )
        checkpoint_id = stored["configurable"]["checkpoint_id"]
        record = await self.state.get(saver._cp_key(thread, ns, checkpoint_id))
        self.chained += bool(record and record.get("chains"))
        # What LangGraph's serializer gives back for these values (a tuple comes back a list).
        serde = saver.serde
        expected = {ch: serde.loads_typed(serde.dumps_typed(v)) for ch, v in new_values.items()}
        self.puts[(thread, ns, checkpoint_id)] = _Put(thread, ns, expected, all_versions, step + 1)

    async def put_writes(self, thread: str, ns: str) -> None:
        """Record a task's writes against a random checkpoint of the thread."""
        candidates = [key for key in self.puts if key[:2] == (thread, ns)]
        if not candidates:
            return
        key = self.rng.choice(candidates)
        if await self.plain.aget_tuple(self._config(*key)) is None:
            return  # pruned already
        task = f"task{self.rng.randint(0, 10**9)}"
        writes = [("messages", [_message(self.rng, 0)]), ("scalar", self.rng.randint(0, 9))]
        await self.plain.aput_writes(self._config(*key), writes, task)
        self.puts[key].writes += [(task, channel, value) for channel, value in writes]

    async def racing_read(self, thread: str, ns: str) -> None:
        """Read a random checkpoint (by id, or the thread's list) while a prune lands between
        the read's records and its values: each comes back exact, or not at all."""
        candidates = [key for key in self.puts if key[:2] == (thread, ns)]
        if not candidates:
            return
        key = self.rng.choice(candidates)
        state = self.state
        real = state.get_many
        armed = [True]

        async def get_many(keys: Any, *args: Any, **kwargs: Any) -> Any:
            if armed[0] and any(":b:" in k for k in keys):
                armed[0] = False
                await CheckpointSaver(state, prefix=self.prefix).aprune([thread])
            return await real(keys, *args, **kwargs)

        state.get_many = get_many  # type: ignore[method-assign]
        try:
            reader = CheckpointSaver(state, prefix=self.prefix)
            if self.rng.random() < 0.5:
                got = await reader.aget_tuple(self._config(*key))
                read = [] if got is None else [got]
            else:
                read = [item async for item in reader.alist(self._config(thread, ns))]
        finally:
            state.get_many = real  # type: ignore[method-assign]
        for item in read:
            configurable = item.config["configurable"]
            expected = self.puts[(thread, ns, configurable["checkpoint_id"])]
            assert item.checkpoint["channel_values"] == expected.values

    async def check(self) -> None:
        """Every checkpoint left reads back (by a fresh saver) exactly as it was put."""
        reader = CheckpointSaver(self.state, prefix=self.prefix)
        left = [item async for item in reader.alist(None)]
        assert left, "every thread keeps at least its head"
        heads = set()
        for thread, ns in {key[:2] for key in self.puts}:
            head = await reader.aget_tuple(self._config(thread, ns))
            assert head is not None
            heads.add((thread, ns, head.config["configurable"]["checkpoint_id"]))
        seen = set()
        for listed in left:
            configurable = listed.config["configurable"]
            key = (
                configurable["thread_id"],
                configurable["checkpoint_ns"],
                configurable["checkpoint_id"],
            )
            seen.add(key)
            expected = self.puts[key]
            got = await reader.aget_tuple(listed.config)
            assert got is not None
            for read in (got, listed):
                assert read.checkpoint["channel_values"] == expected.values, key
                for channel, value in expected.values.items():
                    if isinstance(value, list):  # messages stay messages
                        read_value = read.checkpoint["channel_values"][channel]
                        assert [type(x) for x in read_value] == [type(x) for x in value]
                        assert [type(x[1]) for x in read_value if isinstance(x, tuple)] == [
                            type(x[1]) for x in value if isinstance(x, tuple)
                        ]
                assert read.checkpoint["channel_versions"] == expected.versions
                assert read.metadata["step"] == expected.step
                assert sorted(
                    (
                        (task, channel, repr(value))
                        for task, channel, value in read.pending_writes or []
                    ),
                ) == sorted(
                    (task, channel, repr(value)) for task, channel, value in expected.writes
                )
        assert heads <= seen


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_puts_forks_writes_and_prunes_keep_every_kept_checkpoint_exact(
    state: StateManager, seed: int
) -> None:
    """Seeded random histories (puts, forks, writes, `aprune`, retention, prunes landing between
    a run's read and its write and between a read's records and its values) leave every
    remaining checkpoint, the heads among them, readable exactly as it was put, with its
    pending writes; a read raced by a prune is exact or absent."""
    rng = random.Random(seed)
    history = _History(state, rng)
    history.races = True
    threads = ["a", "b"]
    for _ in range(60):
        thread = rng.choice(threads)
        ns = rng.choice(["", "", "child"])  # a namespace of its own (no task id)
        roll = rng.random()
        if roll < 0.55:
            await history.put(history.plain, thread, ns, fork=rng.random() < 0.2)
        elif roll < 0.75:
            await history.put(history.kept, thread, ns, fork=rng.random() < 0.2)
        elif roll < 0.85:
            await history.put_writes(thread, ns)
        elif roll < 0.93:
            await history.racing_read(thread, ns)
        else:
            await history.plain.aprune([thread])
        if rng.random() < 0.15:
            await history.check()
    await history.check()
    assert history.chained > 5  # the histories do store deltas


async def test_keep_last_keeps_that_many_per_namespace_and_they_read_back(
    state: StateManager,
) -> None:
    """With `keep_last=3`, each thread and namespace holds its 3 newest checkpoints after every
    put, and each reads back exact (the values their delta chains start from stayed)."""
    history = _History(state, random.Random(7))
    history.kept = CheckpointSaver(
        state, prefix=history.prefix, delta_chain=5, retention=CheckpointRetention(keep_last=3)
    )
    for count in range(1, 15):
        await history.put(history.kept, "t", "", fork=False)
        left = [item async for item in history.kept.alist(history._config("t", ""))]
        assert len(left) == min(count, 3)
        newest = sorted(key[2] for key in history.puts)[-3:]
        assert sorted(item.config["configurable"]["checkpoint_id"] for item in left) == newest
    await history.check()


async def test_max_age_deletes_older_checkpoints_but_never_the_head(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `max_age`, a put deletes the thread's checkpoints written longer ago than that; the
    latest one stays however old it is."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    history = _History(state, random.Random(3))
    history.kept = CheckpointSaver(
        state, prefix=history.prefix, retention=CheckpointRetention(max_age=timedelta(seconds=60))
    )
    for _ in range(4):
        await history.put(history.kept, "t", "", fork=False)
        clock[0] += 10
    clock[0] += 100  # the four are now older than 60 s
    await history.put(history.kept, "t", "", fork=False)
    left = [item async for item in history.kept.alist(history._config("t", ""))]
    assert len(left) == 1
    await history.check()


async def test_thread_ttl_deletes_idle_threads_and_keeps_active_ones(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `thread_ttl`, a thread nobody wrote for longer is deleted whole by the sweep that
    writes to other threads run; a thread written meanwhile (by another saver) stays."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    history = _History(state, random.Random(5))
    policy = CheckpointRetention(thread_ttl=timedelta(hours=1))
    saver = CheckpointSaver(state, prefix=history.prefix, retention=policy)
    other = CheckpointSaver(state, prefix=history.prefix, retention=policy)
    await history.put(saver, "idle", "", fork=False)
    await history.put(saver, "busy", "", fork=False)
    clock[0] += 3000
    await history.put(other, "busy", "", fork=False)  # `saver` has not seen this write
    clock[0] += 1000  # "idle" 4000 s idle, "busy" 1000 s
    await history.put(saver, "new", "", fork=False)
    assert await saver.aget_tuple(history._config("idle", "")) is None
    assert await saver.state.list_keys(f"{history.prefix}:{{idle}}:*") == []
    assert await saver.aget_tuple(history._config("busy", "")) is not None
    assert await saver.asweep_idle_threads() == 0
    clock[0] += 7200
    assert await saver.asweep_idle_threads() == 2  # "busy" and "new"


@pytest.mark.parametrize(
    "options",
    [
        {"keep_last": 0},
        {"keep_last": True},
        {"max_age": -1},
        {"thread_ttl": float("nan")},
        {"thread_ttl": 10**400},
        {"max_age": "1d"},
        {},
    ],
)
def test_a_bad_retention_is_refused(options: dict[str, Any]) -> None:
    """A retention without limits, or with a count below 1 or a duration not positive, is a
    ConfigurationError."""
    with pytest.raises(ConfigurationError):
        CheckpointRetention(**options)


async def test_a_put_between_a_prunes_read_and_its_deletes_keeps_its_delta_base(
    state: StateManager,
) -> None:
    """A fork written while `aprune` works out what to delete (a delta on a value the prune
    was about to drop) makes the prune's step fail and start over: the fork reads back exact."""
    prefix = f"p{uuid.uuid4().hex[:8]}"
    saver = CheckpointSaver(state, prefix=prefix, delta_chain=2)
    history = _History(state, random.Random(11))
    history.prefix, history.plain = prefix, saver
    for _ in range(4):  # versions: whole, delta, whole, delta
        await history.put(saver, "t", "", fork=False)
    first = min(key for key in history.puts if history.puts[key].values.get("messages"))
    forker = CheckpointSaver(state, prefix=prefix, delta_chain=2)
    recorder = _Recorder(state.backend)
    fired: list[bool] = []

    async def fork_during_the_prune(name: str, args: tuple[Any, ...]) -> None:
        deletes = name == "transact" and any(type(op).__name__ == "Delete" for op in args[1])
        if deletes and not fired:
            fired.append(True)
            await _fork(first)  # a delta on the first version, which the prune would drop

    async def _fork(key: tuple[str, str, str]) -> None:
        loaded = await forker.aget_tuple(history._config(*key))
        assert loaded is not None
        values = dict(history.puts[key].values)
        values["messages"] = [*values.get("messages", []), HumanMessage("fork")]
        version = forker.get_next_version(history.puts[key].versions.get("messages"), None)
        versions = {**history.puts[key].versions, "messages": version}
        checkpoint = generate_checkpoint(channel_values=values, channel_versions=dict(versions))
        stored = await forker.aput(
            loaded.config, checkpoint, generate_metadata(step=9), {"messages": version}
        )
        history.puts[(key[0], key[1], stored["configurable"]["checkpoint_id"])] = _Put(
            key[0], key[1], values, versions, 9
        )
        record = await state.get(forker._cp_key("t", "", stored["configurable"]["checkpoint_id"]))
        assert record["chains"]["messages"] == [history.puts[key].versions["messages"]]

    recorder.before = fork_during_the_prune
    await CheckpointSaver(state, prefix=prefix).aprune(["t"])
    recorder.before = None
    assert fired
    await history.check()


async def test_a_thread_written_during_its_ttl_sweep_stays_whole(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread past its TTL that another saver writes while the sweep deletes it is kept
    whole: the sweep's step fails, and every checkpoint, the new one included, reads back."""
    clock = [1_000_000.0]
    monkeypatch.setattr(checkpoint_module, "_now", lambda: clock[0])
    history = _History(state, random.Random(13))
    policy = CheckpointRetention(thread_ttl=timedelta(hours=1))
    saver = CheckpointSaver(state, prefix=history.prefix, retention=policy)
    writer = CheckpointSaver(state, prefix=history.prefix)
    for _ in range(3):
        await history.put(saver, "t", "", fork=False)
    clock[0] += 7200
    recorder = _Recorder(state.backend)
    fired: list[bool] = []

    async def write_during_the_sweep(name: str, args: tuple[Any, ...]) -> None:
        deletes = name == "transact" and any(type(op).__name__ == "Delete" for op in args[1])
        if deletes and not fired:
            fired.append(True)
            await history.put(writer, "t", "", fork=False)

    recorder.before = write_during_the_sweep
    assert await saver.asweep_idle_threads() == 0
    recorder.before = None
    assert fired
    await history.check()
    assert len([item async for item in writer.alist(history._config("t", ""))]) == 4
