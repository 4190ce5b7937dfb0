"""Moving state between stores: copy, export and import, with every value type and manager
records, memory -> SQLite -> Redis Cluster -> file."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    AgentSnapshot,
    AgentStateStore,
    FileBackend,
    MemoryBackend,
    OrchestrationStateManager,
    PostgresBackend,
    RedisBackend,
    SerializationError,
    SQLiteBackend,
    StateConfig,
    StateManager,
    TeamState,
    WorkflowState,
    WorkflowStateManager,
)
from agenticstate.exceptions import ConfigurationError
from agenticstate.transfer import DUMP_FORMAT, copy_state, export_state, import_state
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend

VALUES: dict[str, Any] = {
    "dict": {"a": 1, "nested": {"b": [1, 2, {"c": None}]}, "ünï": "cødé"},
    "list": [1, "two", 3.5, None, True, [], {}],
    "str": "hello \u2603 \U0001f600",
    "empty-str": "",
    "int": 2**62,
    "negative": -17,
    "float": 0.1 + 0.2,
    "bool": False,
    "none": None,
    "datetime": datetime(2026, 11, 24, 4, 0, 1, 123456, tzinfo=UTC),
    "date": date(2026, 11, 24),
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "bytes": bytes(range(256)),
    "big": {"text": "x" * 20_000, "items": list(range(2000))},
}
TEAM = "crew"


async def _populate(state: StateManager) -> None:
    for key, value in VALUES.items():
        await state.save(f"v:{key}", value)
    await state.save("v:ttl", {"short": "lived"}, ttl=timedelta(hours=1))
    await state.save("v:model", WorkflowState(workflow_id="as-value", total_steps=2))
    workflows = WorkflowStateManager(state_manager=state)
    await workflows.create(WorkflowState(workflow_id="wf", total_steps=4))
    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(TeamState(team_id=TEAM))
    for n in range(5):
        await orch.enqueue_task(TEAM, {"id": n})
    agents = AgentStateStore(state_manager=state)
    await agents.save_snapshot(AgentSnapshot(agent_id="a1", memory_state={"goal": "copy"}))


async def _read(state: StateManager) -> dict[str, Any]:
    keys = await state.list_keys("*")
    return await state.get_many(keys)


async def _check_managers(state: StateManager) -> None:
    """The records read back through the managers, and the queue still hands out its tasks."""
    workflow = await WorkflowStateManager(state_manager=state).get("wf")
    assert workflow is not None
    assert workflow.total_steps == 4
    snapshot = await AgentStateStore(state_manager=state).get_latest_snapshot("a1")
    assert snapshot is not None
    assert snapshot.memory_state == {"goal": "copy"}
    orch = OrchestrationStateManager(state_manager=state)
    assert len((await orch.get_queue_status(TEAM)).pending) == 5
    claim = await orch.claim_task(TEAM, "w1", lease=timedelta(seconds=30))
    assert claim is not None  # the pending index travelled with the records


@pytest.mark.redis
async def test_memory_to_sqlite_to_cluster_to_file_keeps_every_value(
    tmp_path: Path, redis_cluster_url: str
) -> None:
    """Every value type and manager record round-trips through four stores, equal at each."""
    memory = MemoryBackend()
    sqlite = SQLiteBackend(tmp_path / "state.db")
    cluster = RedisBackend(url=redis_cluster_url, key_prefix=unique_prefix())
    file = FileBackend(base_path=tmp_path / "files")
    dump = tmp_path / "state.jsonl"
    async with memory, sqlite, cluster, file:
        async with StateManager(StateConfig(), backend=memory, close_backend=False) as state:
            await _populate(state)
            original = await _read(state)
        await copy_state(memory, sqlite)
        await copy_state(sqlite, cluster)
        exported = await export_state(cluster, dump)
        imported = await import_state(dump, file)
        assert (exported.entries, exported.indexes) == (imported.entries, imported.indexes)
        assert exported.indexes >= 1
        for backend in (sqlite, cluster, file):
            async with StateManager(StateConfig(), backend=backend, close_backend=False) as state:
                assert await _read(state) == original, f"{backend!r} differs"
                entry = await state.get_entry("v:ttl")
                assert entry is not None
                assert entry.ttl is not None
                assert timedelta(minutes=50) < entry.ttl <= timedelta(hours=1)
                await _check_managers(state)
    assert original["v:bytes"] == VALUES["bytes"]
    assert original["v:datetime"] == VALUES["datetime"]


@pytest.mark.postgres
async def test_sqlite_to_postgres_to_dump_to_postgres_to_file_keeps_every_value(
    tmp_path: Path, postgres_url: str
) -> None:
    """Every value type and manager record is copied into Postgres, exported from it, imported
    into another Postgres namespace and copied out to a file store, equal at each step."""
    memory = MemoryBackend()
    sqlite = SQLiteBackend(tmp_path / "state.db")
    first = PostgresBackend(postgres_url, key_prefix=unique_prefix())
    second = PostgresBackend(postgres_url, key_prefix=unique_prefix())
    file = FileBackend(base_path=tmp_path / "files")
    dump = tmp_path / "state.jsonl"
    async with memory, sqlite, first, second, file:
        async with StateManager(StateConfig(), backend=memory, close_backend=False) as state:
            await _populate(state)
            original = await _read(state)
        await copy_state(memory, sqlite)
        await copy_state(sqlite, first)
        exported = await export_state(first, dump)
        imported = await import_state(dump, second)
        assert (exported.entries, exported.indexes) == (imported.entries, imported.indexes)
        assert exported.indexes >= 1
        await copy_state(second, file)
        for backend in (first, second, file):
            async with StateManager(StateConfig(), backend=backend, close_backend=False) as state:
                assert await _read(state) == original, f"{backend!r} differs"
                entry = await state.get_entry("v:ttl")
                assert entry is not None
                assert entry.ttl is not None
                assert timedelta(minutes=50) < entry.ttl <= timedelta(hours=1)
                await _check_managers(state)


async def test_every_backend_exports_its_values_and_indexes(
    backend: Backend, tmp_path: Path
) -> None:
    """copy_state and export_state read the values and sorted indexes of every backend the
    contract suite runs on (a new backend without an index listing fails here)."""
    await backend.set("k", b"v")
    await backend.index_add("idx:a", {"m": 1.5, "n": 2.0})
    await backend.index_add("other", {"x": 0.0})
    async with MemoryBackend() as memory:
        copied = await copy_state(backend, memory, "idx:*")
        assert copied.indexes == 1
        assert await memory.index_range("idx:a") == [("m", 1.5), ("n", 2.0)]
        assert await memory.index_range("other") == []
    exported = await export_state(backend, tmp_path / "dump.jsonl")
    assert (exported.entries, exported.indexes) == (1, 2)


async def test_copy_is_idempotent_and_follows_the_pattern(tmp_path: Path) -> None:
    """Copying twice leaves the same state; a pattern copies only its keys."""
    async with MemoryBackend() as source, SQLiteBackend(tmp_path / "s.db") as destination:
        for n in range(1200):  # more than one batch
            await source.set(f"a:{n}", b"%d" % n)
        await source.set("b:1", b"other")
        seen: list[int] = []
        first = await copy_state(
            source, destination, "a:*", progress=lambda p: seen.append(p.entries)
        )
        again = await copy_state(source, destination, "a:*")
        keys = sorted([key async for key in destination.scan("*")])
        entry = await destination.get("a:7")
    assert first.entries == again.entries == 1200
    assert seen[-1] == 1200
    assert seen == sorted(seen)
    assert len(keys) == 1200
    assert "b:1" not in keys
    assert entry is not None
    assert entry.value == b"7"


async def _export_one(tmp_path: Path) -> Path:
    dump = tmp_path / "d.jsonl"
    async with MemoryBackend() as source:
        await source.set("k1", b"one")
        await source.set("k2", b"two")
        await source.index_add("idx", {"m": 1.0})
        await export_state(source, dump)
    return dump


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        (lambda lines: lines[:-1], SerializationError, "truncated"),
        (lambda lines: [lines[0], "{not json", *lines[1:]], SerializationError, "not JSON"),
        (
            lambda lines: [lines[0].replace('"version": 1', '"version": 99'), *lines[1:]],
            ConfigurationError,
            "upgrade",
        ),
        (
            lambda lines: [lines[0].replace(DUMP_FORMAT, "other"), *lines[1:]],
            SerializationError,
            "not an agenticstate dump",
        ),
        (
            lambda lines: [lines[0], lines[1].replace('"value": "', '"value": "%%'), *lines[2:]],
            SerializationError,
            "base64",
        ),
        (
            lambda lines: [
                lines[0],
                json.dumps({"type": "entry", "key": "", "value": ""}),
                *lines[1:],
            ],
            SerializationError,
            "key",
        ),
    ],
    ids=["truncated", "not-json", "newer", "foreign", "bad-base64", "bad-key"],
)
async def test_a_damaged_dump_is_refused_and_writes_nothing(
    tmp_path: Path, damage: Any, error: type[Exception], match: str
) -> None:
    """A truncated, malformed, foreign or newer dump raises a typed error before any write."""
    dump = await _export_one(tmp_path)
    lines = dump.read_text(encoding="utf-8").splitlines()
    dump.write_text("\n".join(damage(lines)) + "\n", encoding="utf-8")
    destination: Backend
    async with SQLiteBackend(tmp_path / "s.db") as destination:
        with pytest.raises(error, match=match):
            await import_state(dump, destination)
        assert [key async for key in destination.scan("*")] == []
        assert await destination.index_range("idx") == []


async def test_export_writes_the_documented_format(tmp_path: Path) -> None:
    """Header first, one entry per key with base64 bytes, the index, an end line with counts."""
    dump = await _export_one(tmp_path)
    records = [json.loads(line) for line in dump.read_text(encoding="utf-8").splitlines()]
    assert records[0]["format"] == DUMP_FORMAT
    assert records[0]["version"] == 1
    assert sorted(r["key"] for r in records if r.get("type") == "entry") == ["k1", "k2"]
    assert [r for r in records if r.get("type") == "index"] == [
        {"type": "index", "name": "idx", "members": [["m", 1.0]]}
    ]
    assert records[-1] == {"type": "end", "entries": 2, "indexes": 1}
    assert not (tmp_path / "d.jsonl.partial").exists()


def test_cli_copy_export_import_round_trip(tmp_path: Path) -> None:
    """The copy, export and import commands move a store and report their totals."""
    from tests.test_cli import cli

    first, second = f"sqlite://{tmp_path / 'a.db'}", f"sqlite://{tmp_path / 'b.db'}"
    files = f"file://{tmp_path / 'files'}"
    for n in range(3):
        saved = cli("--url", first, "set", f"agent:{n}", json.dumps({"n": n}), cwd=tmp_path)
        assert saved.returncode == 0, saved.stderr
    copied = cli("--json", "copy", first, files, "agent:*", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert json.loads(copied.stdout) == {"entries": 3, "indexes": 0, "skipped": 0}
    exported = cli("export", files, str(tmp_path / "dump.jsonl"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.startswith("export: 3 keys")
    imported = cli("import", str(tmp_path / "dump.jsonl"), second, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    shown = cli("--url", second, "--json", "get", "agent:2", cwd=tmp_path)
    assert json.loads(shown.stdout)["value"] == {"n": 2}
    missing = cli("import", str(tmp_path / "nope.jsonl"), second, cwd=tmp_path)
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr


def test_transfer_module_exports_a_sorted_all() -> None:
    """agenticstate.transfer is public: its __all__ is sorted (RUF022's order) and importable."""
    import agenticstate.transfer as module

    names = list(module.__all__)
    constants = [name for name in names if name.isupper()]
    assert names == sorted(constants) + sorted(name for name in names if not name.isupper())
    for name in names:
        assert getattr(module, name) is not None
