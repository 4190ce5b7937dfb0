"""State size: `StateManager.usage()` on every backend, and `agenticstate usage`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import (
    InvalidArgumentError,
    InvalidPatternError,
    MemoryBackend,
    NamespaceUsage,
    StateConfig,
    StateManager,
    StateUsage,
)
from agenticstate.backends import FileBackend, RedisBackend
from tests.helpers import unique_prefix
from tests.test_cli import on_terminal, screen

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend
    from agenticstate.serialization import Serializer


VALUES: dict[str, Any] = {
    "agent:a1:status": {"status": "running", "progress": 0.5},
    "agent:a2:status": {"status": "idle", "notes": "x" * 3000},
    "session:s1": ["hello", "world"],
    "counter": 7,
    "big": "y" * 70_000,
}


def expected(state: StateManager, values: dict[str, Any]) -> StateUsage:
    """The usage computed independently: the serializer's size of each value, per namespace."""
    sizes = {key: len(state.serializer.dumps(value)) for key, value in values.items()}
    spaces: dict[str, list[int]] = {}
    for key, size in sizes.items():
        head, colon, _ = key.partition(":")
        counts = spaces.setdefault(head if colon else "", [0, 0])
        counts[0] += 1
        counts[1] += size
    return StateUsage(
        pattern="*",
        keys=len(sizes),
        bytes=sum(sizes.values()),
        namespaces={name: NamespaceUsage(keys=k, bytes=b) for name, (k, b) in spaces.items()},
    )


def same(found: StateUsage, wanted: StateUsage) -> None:
    assert (found.keys, found.bytes, found.namespaces, found.complete) == (
        wanted.keys,
        wanted.bytes,
        wanted.namespaces,
        True,
    )


async def test_usage_is_exact_on_every_backend(state: StateManager) -> None:
    """Keys and stored bytes, in total and per namespace, match the serialized sizes exactly."""
    await state.save_many(VALUES)
    await state.save("gone:soon", "z" * 100, ttl=timedelta(milliseconds=20))
    await state.save("gone:deleted", 1)
    await state.delete("gone:deleted")
    await anyio.sleep(0.05)  # let the TTL run out: wall-clock expiry
    usage = await state.usage()
    same(usage, expected(state, VALUES))
    assert usage.pattern == "*"
    assert usage.namespaces["agent"] == NamespaceUsage(
        keys=2,
        bytes=len(state.serializer.dumps(VALUES["agent:a1:status"]))
        + len(state.serializer.dumps(VALUES["agent:a2:status"])),
    )
    assert usage.namespaces[""].keys == 2  # counter and big: no colon
    agents = await state.usage("agent:*")
    assert (agents.keys, agents.pattern, list(agents.namespaces)) == (2, "agent:*", ["agent"])
    nothing = await state.usage("nothing:*")
    assert (nothing.keys, nothing.bytes, nothing.namespaces, nothing.complete) == (0, 0, {}, True)


async def test_value_sizes_follow_the_contract_on_every_backend(backend: Backend) -> None:
    """value_sizes gives each stored value's length in order, None for missing or deleted keys."""
    await backend.set("a:1", b"x" * 10)
    await backend.set("a:2", b"")
    await backend.set("a:3", b"y" * 5000)
    await backend.set("a:3", b"z" * 7)  # rewritten: the new size counts
    await backend.set("gone", b"abc")
    await backend.delete("gone")
    assert await backend.value_sizes(["a:3", "missing", "a:1", "gone", "a:2"]) == [
        7,
        None,
        10,
        None,
        0,
    ]
    assert await backend.value_sizes([]) == []


async def test_stat_many_matches_the_entries_on_every_backend(backend: Backend) -> None:
    """stat_many gives each key's version, times, expiry and stored size, in order, as the
    entries hold them (None for missing or deleted keys), without needing the values."""
    await backend.set("a:1", b"x" * 10, ttl=timedelta(hours=1))
    await backend.set("a:2", b"")
    await backend.set("a:3", b"y" * 5000)
    await backend.set("a:3", b"z" * 7)
    await backend.set("gone", b"abc")
    await backend.delete("gone")
    keys = ["a:3", "missing", "a:1", "gone", "a:2", "a:1"]
    entries = await backend.get_many(keys)
    stats = await backend.stat_many(keys)
    assert [None if s is None else (s.key, s.size, s.version) for s in stats] == [
        ("a:3", 7, 2),
        None,
        ("a:1", 10, 1),
        None,
        ("a:2", 0, 1),
        ("a:1", 10, 1),
    ]
    for stat, entry in zip(stats, entries, strict=True):
        assert (stat is None) == (entry is None)
        if stat is not None and entry is not None:
            times = (stat.created_at, stat.updated_at, stat.expires_at)
            assert times == (entry.created_at, entry.updated_at, entry.expires_at)
    first = stats[2]
    assert first is not None
    ttl = first.ttl()
    assert ttl is not None
    assert timedelta(minutes=59) < ttl <= timedelta(hours=1)
    assert await backend.stat_many([]) == []


async def test_usage_reports_progress_batch_by_batch(state: StateManager) -> None:
    """The progress callback sees running totals after each batch; the result is complete."""
    values = {f"item:{n:03}": n for n in range(23)}
    await state.save_many(values)
    seen: list[StateUsage] = []

    async def progress(running: StateUsage) -> None:
        seen.append(running)

    usage = await state.usage("item:*", batch_size=5, progress=progress)
    assert [running.keys for running in seen] == [5, 10, 15, 20, 23]
    assert not any(running.complete for running in seen)
    assert [running.bytes for running in seen] == sorted(running.bytes for running in seen)
    same(usage, expected(state, values).model_copy(update={"pattern": "item:*"}))


async def test_max_time_stops_early_with_a_lower_bound(state: StateManager) -> None:
    """A budget that runs out stops the scan and returns what was counted, marked incomplete."""
    await state.save_many({f"item:{n:03}": n for n in range(30)})
    usage = await state.usage(batch_size=10, max_time=1e-9)
    assert usage.complete is False
    assert 1 <= usage.keys < 30
    assert usage.bytes == sum(part.bytes for part in usage.namespaces.values()) > 0
    assert (await state.usage(max_time=timedelta(seconds=60))).complete


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"pattern": ""}, InvalidPatternError),
        ({"batch_size": 0}, InvalidArgumentError),
        ({"batch_size": 1.5}, InvalidArgumentError),
        ({"max_time": -1}, InvalidArgumentError),
        ({"max_time": timedelta(0)}, InvalidArgumentError),
        ({"max_time": True}, InvalidArgumentError),
        ({"progress": "not callable"}, InvalidArgumentError),
    ],
)
async def test_bad_arguments_raise_typed_errors(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    """Invalid patterns, batch sizes, budgets and callbacks are refused before any scan."""
    async with StateManager() as state:
        await state.save("agent:a", 1)
        with pytest.raises(error):
            await state.usage(**kwargs)


async def test_usage_counts_stored_bytes_compressed_and_encrypted() -> None:
    """Bytes are as stored: after compression (smaller than the value) and encryption (larger)."""
    from agenticstate import Encryption

    text = "repetitive " * 2000
    async with StateManager(StateConfig(compression=True)) as compressed:
        await compressed.save("doc:1", text)
        assert (await compressed.usage()).bytes == len(compressed.serializer.dumps(text))
        assert (await compressed.usage()).bytes < len(text) / 5
    pytest.importorskip("cryptography")
    encryption = Encryption({"k1": Encryption.generate_key()})
    async with StateManager(StateConfig(encryption=encryption)) as sealed:
        await sealed.save("doc:1", "abc")
        backend_entry = await sealed.backend.get("doc:1")
        assert backend_entry is not None
        assert (await sealed.usage()).bytes == len(backend_entry.value) > 3


async def test_redis_usage_counts_only_its_prefix_and_never_reads_values(redis_url: str) -> None:
    """On Redis, another prefix on the same server is not counted; sizes come from STRLEN."""
    first, second = unique_prefix(), unique_prefix()
    async with (
        StateManager(backend=RedisBackend(url=redis_url, key_prefix=first)) as mine,
        StateManager(backend=RedisBackend(url=redis_url, key_prefix=second)) as other,
    ):
        await mine.save_many({f"agent:{n}": "v" * n for n in range(1, 40)})
        await other.save_many({f"agent:{n}": "w" * 1000 for n in range(50)})
        sizes = await mine.backend.value_sizes(["agent:1", "agent:39", "missing"])
        assert sizes == [
            len(mine.serializer.dumps("v")),
            len(mine.serializer.dumps("v" * 39)),
            None,
        ]
        usage = await mine.usage(batch_size=7)
        assert usage.keys == 39
        assert await mine.backend.value_sizes([f"agent:{n % 39 + 1}" for n in range(2500)]) == [
            len(mine.serializer.dumps("v" * (n % 39 + 1))) for n in range(2500)
        ]  # more keys than one script takes
        assert usage.bytes == sum(len(mine.serializer.dumps("v" * n)) for n in range(1, 40))


keys_strategy = st.dictionaries(
    st.from_regex(r"[a-c]{1,2}(:[a-z0-9]{1,3}){0,2}", fullmatch=True),
    st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.text(max_size=40),
        st.lists(st.integers(0, 9), max_size=5),
    ),
    max_size=30,
)


@settings(max_examples=20, deadline=None)
@given(values=keys_strategy, batch=st.integers(1, 8), pattern=st.sampled_from(["*", "a*", "?:*"]))
def test_usage_matches_a_model_for_generated_stores(
    values: dict[str, Any], batch: int, pattern: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """For generated keys, values, batch sizes and patterns, usage equals the model's sum."""
    from agenticstate._glob import glob_match

    chosen = {key: value for key, value in values.items() if glob_match(pattern, key)}
    base = tmp_path_factory.mktemp("store")  # a fresh directory per example

    async def main() -> None:
        for backend in [MemoryBackend(), FileBackend(base_path=base / "s")]:
            async with StateManager(backend=backend) as state:
                if values:
                    await state.save_many(values)
                usage = await state.usage(pattern, batch_size=batch)
                same(usage, expected(state, chosen))

    anyio.run(main)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agenticstate.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _fill(url: str, prefix: str, count: int) -> Serializer:
    from agenticstate.backends import open_backend

    async with StateManager(backend=open_backend(url, key_prefix=prefix)) as state:
        await state.save_many({f"agent:{n:05}": {"n": n} for n in range(count)})
        await state.save("config", {"mode": "fast"})
        return state.serializer


@pytest.mark.parametrize(
    "kind",
    [
        "file",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_cli_prints_usage_as_a_table_and_as_json(kind: str, tmp_path: Path, request: Any) -> None:
    """`agenticstate usage` prints namespaces, keys and bytes; --json gives the StateUsage."""
    url = (
        f"file://{tmp_path / 'store'}" if kind == "file" else request.getfixturevalue(f"{kind}_url")
    )
    prefix = unique_prefix() if kind != "file" else ""
    serializer = anyio.run(_fill, url, prefix, 120)
    wanted = sum(len(serializer.dumps({"n": n})) for n in range(120))
    shown = cli("--url", url, "--prefix", prefix, "--json", "usage", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    usage = StateUsage.model_validate(json.loads(shown.stdout))
    assert (usage.keys, usage.namespaces["agent"].bytes, usage.complete) == (121, wanted, True)
    table = cli("--url", url, "--prefix", prefix, "usage", "agent:*", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert re.search(rf"^agent\s+120\s+{wanted:,}$", table.stdout, re.MULTILINE), table.stdout
    assert f"total: 120 keys, {wanted:,} bytes of values (agent:*)" in table.stdout
    bad = cli("--url", url, "usage", "", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stdout == ""


def test_cli_usage_shows_progress_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal, usage counts the keys measured on stderr and erases the line."""
    url = f"file://{tmp_path / 'store'}"
    anyio.run(_fill, url, "", 1500)
    terminal, stdout = on_terminal("--url", url, "usage", cwd=tmp_path)
    assert re.search(r"\rmeasuring\.\.\. [0-9,]+ keys", terminal), terminal
    assert screen(terminal) == []
    assert "total: 1,501 keys" in stdout
