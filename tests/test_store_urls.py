"""Store URLs: nothing is dropped, so two different URLs never open one store by accident.

`sqlite://data/run#1.db` and `sqlite://data/run#2.db` used to open the same `data/run` (the
fragment was dropped), and a query item without `=` was ignored. Now a fragment, an item without
`=` and a parameter given twice are refused for every scheme, memory and file URLs refuse
parameters they do not know, and a `#` or `?` meant for a path or password is written `%23` or
`%3F`. A table covers each form for each scheme; a property test builds paths from the
characters URLs treat specially and checks that the store opened is exactly the path written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import StateConfig, StateManager
from agenticstate._registry import backend_names, url_schemes
from agenticstate.backends import (
    Backend,
    FileBackend,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    open_backend,
    open_config_backend,
)
from agenticstate.exceptions import ConfigurationError

BASES = {
    "memory": "memory://",
    "file": "file://data/run",
    "sqlite": "sqlite://data/run.db",
    "redis": "redis://localhost:6379/0",
    "rediss": "rediss://localhost:6380/0",
    "unix": "unix:///tmp/redis.sock",
    "redis+cluster": "redis+cluster://localhost:7000,localhost:7001",
    "rediss+cluster": "rediss+cluster://localhost:7000,localhost:7001",
    "postgres": "postgres://app@localhost/app",
    "postgresql": "postgresql://app@localhost/app",
}


def identity(backend: Backend) -> Any:
    """What names the store a backend opens: two backends with one identity share a store."""
    if isinstance(backend, FileBackend):
        return ("file", os.path.abspath(backend.snapshot_path))
    if isinstance(backend, SQLiteBackend):
        return ("sqlite", os.path.abspath(backend.path))
    if isinstance(backend, RedisBackend):
        return ("redis", backend._url, backend.db, backend.key_prefix)
    assert isinstance(backend, MemoryBackend)
    return ("memory", id(backend))  # each memory:// is a store of its own


REFUSED_SUFFIXES = {
    "fragment": "#1",
    "empty-fragment": "#",
    "item-without-equals": "?feed_max_changes",
    "repeated-parameter": "?feed_max_changes=5&feed_max_changes=6",
    "item-without-equals-after-one": "?feed_max_changes=5&x",
    "empty-query": "?",
    "empty-item": "?feed_max_changes=5&",
    "empty-name": "?=5",
    "empty-value": "?feed_max_changes=",
    "only-equals": "?=",
}

REFUSED = [
    pytest.param(BASES[scheme] + suffix, id=f"{scheme}-{name}")
    for scheme in BASES
    for name, suffix in REFUSED_SUFFIXES.items()
] + [
    pytest.param("redis://:pa#ss@localhost/0", id="redis-raw-hash-in-password"),
    pytest.param("redis://:pa?ss@localhost/0", id="redis-raw-question-mark-in-password"),
    pytest.param("memory://?other=1", id="memory-unknown-parameter"),
    pytest.param("file://data/run?format=msgpack", id="file-unknown-parameter"),
    pytest.param("sqlite://data/run.db?journal=wal", id="sqlite-unknown-parameter"),
    pytest.param("postgresql://h/app?journal=wal", id="postgres-unknown-parameter"),
]


@pytest.mark.parametrize("url", REFUSED)
def test_a_url_part_that_would_be_dropped_is_refused(url: str) -> None:
    """A fragment, a query item without '=', a repeated or unknown parameter: refused with
    ConfigurationError saying how to write what was meant, never echoing the URL."""
    with pytest.raises(ConfigurationError) as raised:
        open_backend(url)
    message = str(raised.value)
    assert "pa" not in message.replace("parameter", "").replace("path", "").replace("pass", "")
    assert any(word in message for word in ("%23", "%3F", "twice", "unknown"))


DISTINCT = [
    pytest.param("sqlite://data/run%231.db", "sqlite://data/run%232.db", id="sqlite-encoded-hash"),
    pytest.param("file://data/run%231", "file://data/run%232", id="file-encoded-hash"),
    pytest.param("file://data/a%3Fb", "file://data/a", id="file-encoded-question-mark"),
    pytest.param("sqlite://a.db", "sqlite://a.db%3Fx", id="sqlite-encoded-question-mark"),
    pytest.param("redis://h/0?key_prefix=a:", "redis://h/0?key_prefix=b:", id="redis-prefix"),
    pytest.param("redis://h/0?key_prefix=a:", "redis://h/0", id="redis-prefix-or-none"),
    pytest.param("redis://h/0", "redis://h/1", id="redis-db"),
    pytest.param("redis://:a%23b@h/0", "redis://:a%23c@h/0", id="redis-encoded-password"),
    pytest.param("memory://", "memory://", id="memory"),
]


@pytest.mark.parametrize(("first", "second"), DISTINCT)
def test_different_urls_open_different_stores(first: str, second: str) -> None:
    """URLs that differ in a path, a prefix, a database or a percent-encoded character open
    stores of their own."""
    assert identity(open_backend(first)) != identity(open_backend(second))


SAME = [
    pytest.param("file://data/run", "file://data/run?feed_max_changes=5", id="file-options"),
    pytest.param("file://./data/run", "file://data/run", id="file-dot"),
    pytest.param("sqlite://data/run.db", "sqlite://data/run.db?synchronous=full", id="sqlite"),
    pytest.param("redis://h/0", "redis://h/0?feed=off", id="redis-options"),
]


@pytest.mark.parametrize(("first", "second"), SAME)
def test_options_and_spellings_of_one_path_open_one_store(first: str, second: str) -> None:
    """Options (feed retention, synchronous) and spellings of the same path are one store, as
    they should be: the table above is not refusing everything."""
    assert identity(open_backend(first)) == identity(open_backend(second))


SPECIAL = st.sampled_from(["a", "b", "-", ".", "#", "?", "&", "=", "%", "%23", "%3F", "%25", " "])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(SPECIAL, min_size=1, max_size=8), scheme=st.sampled_from(["file", "sqlite"]))
def test_the_store_opened_is_exactly_the_path_written(parts: list[str], scheme: str) -> None:
    """Any path built from the characters URLs treat specially is refused, or opens exactly the
    path its text decodes to: no character is dropped."""
    raw = "data/" + "".join(parts)
    url = f"{scheme}://{raw}"
    try:
        backend = open_backend(url)
    except ConfigurationError:
        assert any(mark in raw for mark in "#?") or "%" in raw
        return
    opened = backend.snapshot_path.parent if isinstance(backend, FileBackend) else backend.path  # type: ignore[attr-defined]
    assert Path(opened) == Path(unquote(raw))


@pytest.mark.parametrize("name", ["run#1", "run?1", "a&b=c", "100%", "sp ace"])
def test_a_quoted_path_opens_that_path(name: str, tmp_path: Path) -> None:
    """Percent-encoding any name (quote) gives a URL that opens exactly that name."""
    for scheme in ("file", "sqlite"):
        backend = open_backend(f"{scheme}://{quote(str(tmp_path / name))}")
        opened = backend.snapshot_path.parent if isinstance(backend, FileBackend) else backend.path  # type: ignore[attr-defined]
        assert Path(opened) == tmp_path / name


SNAPSHOT_NAMES = ["app_state.json", "nested/app.json", "store.msgpack", "UPPER.JSON", "no-suffix"]


@pytest.mark.parametrize("name", SNAPSHOT_NAMES)
@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_file_url_opens_what_a_file_path_config_wrote(
    name: str, form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`file://PATH` opens the store `StateConfig(backend="file", file_path=PATH)` wrote, its
    snapshot file named in the URL (the CLI reads the README's `./state/app_state.json`)."""
    monkeypatch.chdir(tmp_path)
    written = Path("state") / name
    url_path = str(tmp_path / written) if form == "absolute" else f"./{written}"

    async def main() -> None:
        config = StateConfig(backend="file", file_path=written)
        async with StateManager(config) as state:
            await state.save("agent:1", {"status": "idle"})
        backend = open_backend(f"file://{quote(url_path)}", create=False)
        assert identity(backend) == identity(open_config_backend(config))
        async with StateManager(backend=backend) as state:
            assert await state.get("agent:1") == {"status": "idle"}

    anyio.run(main)


def test_an_existing_directory_named_like_a_snapshot_is_a_directory(tmp_path: Path) -> None:
    """A store directory whose name ends in `.json` stays a directory: the URL opens the store
    in it, as before file names were read."""
    directory = tmp_path / "stores.json"

    async def main() -> None:
        async with StateManager(backend=FileBackend(base_path=directory)) as state:
            await state.save("k", 1)
        async with StateManager(backend=open_backend(f"file://{directory}", create=False)) as s:
            assert await s.get("k") == 1

    anyio.run(main)
    assert identity(open_backend(f"file://{directory}")) == (
        "file",
        str(directory / "state.json"),
    )


def test_a_new_path_without_a_snapshot_suffix_is_a_directory(tmp_path: Path) -> None:
    """Where nothing exists yet, a name without `.json` or `.msgpack` is the store's directory."""
    backend = open_backend(f"file://{tmp_path / 'fresh'}")
    assert identity(backend) == ("file", str(tmp_path / "fresh" / "state.json"))


def test_every_scheme_is_in_the_table() -> None:
    """BASES has a URL for every registered scheme (a new backend is checked here too)."""
    assert set(BASES) == set(url_schemes())


@pytest.mark.parametrize("scheme", sorted(BASES))
@pytest.mark.parametrize("prefix", ["app", "app:x", "a:b:c"])
def test_one_key_prefix_rule_for_every_backend(scheme: str, prefix: str) -> None:
    """A key prefix that does not end with ':' is refused by every backend, with the same
    words (SQLite used to take what Redis refused); one that does is taken."""
    with pytest.raises(ConfigurationError) as caught:
        open_backend(BASES[scheme], key_prefix=prefix)
    assert str(caught.value).startswith(f"key_prefix {prefix!r} must end with ':'")
    assert open_backend(BASES[scheme], key_prefix=prefix + ":").key_prefix == prefix + ":"


@pytest.mark.parametrize("name", backend_names())
def test_one_key_prefix_rule_for_every_backend_name(name: str, tmp_path: Path) -> None:
    """`StateConfig(backend=name, key_prefix="app")` is refused for every registered name."""
    with pytest.raises(ConfigurationError, match="must end with ':'"):
        open_config_backend(StateConfig(backend=name, key_prefix="app"))
