"""StateManager over per-key history: `history`, `get(version=)`, `revert`, `StateConfig.history`.

Every test runs on each backend (the `backend` fixture from conftest); a backend that keeps no
history yet (`keep_history` raises `UnsupportedOperationError`) skips them. Keys share the hash
tag `{h}`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel

from agenticstate import (
    ChangeOp,
    ConfigurationError,
    ConflictError,
    InvalidArgumentError,
    MemoryBackend,
    NotFoundError,
    StateConfig,
    StateManager,
    UnsupportedOperationError,
    sync,
)
from agenticstate.backends import Backend, HistoryRules

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

K = "{h}:doc"
RULES = {"{h}:*": 3}


@pytest.fixture
async def state(backend: Backend) -> AsyncIterator[StateManager]:
    """A manager keeping 3 versions of `{h}:*` keys, over each backend that keeps history."""
    try:
        backend.keep_history(HistoryRules(RULES))
    except UnsupportedOperationError:
        pytest.skip(f"{type(backend).__name__} keeps no history yet")
    backend.keep_history(HistoryRules())
    manager = StateManager(StateConfig(history=RULES), backend=backend, close_backend=False)
    try:
        yield manager
    finally:
        await manager.aclose()


class Doc(BaseModel):
    text: str


async def write(state: StateManager, *values: object, key: str = K) -> None:
    for value in values:
        await state.save(key, value)


# ------------------------------------------------------------------ reading history


async def test_history_is_newest_first_within_the_depth(state: StateManager) -> None:
    """history() returns the retained versions, newest (the current one) first, at most 3."""
    await write(state, "v1", "v2", "v3", "v4")
    entries = await state.history(K)
    assert [(e.key, e.version, e.value) for e in entries] == [
        (K, 4, "v4"),
        (K, 3, "v3"),
        (K, 2, "v2"),
    ]
    assert entries[0] == await state.get_entry(K)
    assert entries[0].updated_at >= entries[1].updated_at >= entries[2].updated_at
    assert [e.version for e in await state.history(K, limit=2)] == [4, 3]
    assert await state.history(K, limit=0) == []


async def test_history_of_an_unnamed_or_missing_key(state: StateManager) -> None:
    """A key no rule names has only its current version; a missing key has no history."""
    await write(state, 1, 2, key="plain")
    assert [(e.version, e.value) for e in await state.history("plain")] == [(2, 2)]
    assert await state.history("{h}:missing") == []
    await write(state, "a", "b")
    await state.delete(K)
    assert await state.history(K) == []
    await write(state, "again")
    assert [(e.version, e.value) for e in await state.history(K)] == [(1, "again")]


async def test_history_validates_as_a_model(state: StateManager) -> None:
    """history(model=) validates every retained value."""
    await write(state, {"text": "a"}, {"text": "b"})
    entries = await state.history(K, model=Doc)
    assert [e.value for e in entries] == [Doc(text="b"), Doc(text="a")]


async def test_get_and_get_entry_by_version(state: StateManager) -> None:
    """get(version=n) reads a retained version; one not retained reads as the default."""
    await write(state, "v1", "v2", "v3", "v4")
    assert await state.get(K, version=2) == "v2"
    assert await state.get(K, version=4) == "v4"
    assert await state.get(K, "gone", version=1) == "gone"
    assert await state.get(K, version=9) is None
    entry = await state.get_entry(K, version=3)
    assert entry is not None
    assert (entry.version, entry.value) == (3, "v3")
    assert await state.get_entry(K, version=1) is None
    await write(state, {"text": "x"})
    assert await state.get(K, model=Doc, version=5) == Doc(text="x")


@pytest.mark.parametrize("version", [0, -1, 1.0, "2", True], ids=repr)
async def test_bad_version_is_an_invalid_argument(state: StateManager, version: Any) -> None:
    """version= and to_version= that are not ints >= 1 raise InvalidArgumentError."""
    await write(state, "v1")
    with pytest.raises(InvalidArgumentError):
        await state.get(K, version=version)
    with pytest.raises(InvalidArgumentError):
        await state.get_entry(K, version=version)
    with pytest.raises(InvalidArgumentError):
        await state.revert(K, to_version=version)
    assert (await state.get_entry(K)).version == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("limit", [-1, 1.5, "2"], ids=repr)
async def test_bad_limit_is_an_invalid_argument(state: StateManager, limit: Any) -> None:
    """history(limit=) must be an int >= 0 or None."""
    with pytest.raises(InvalidArgumentError):
        await state.history(K, limit=limit)


# ------------------------------------------------------------------ revert


async def test_revert_writes_the_old_value_as_a_new_version(state: StateManager) -> None:
    """revert(to_version=n) writes version n's value as a new version, seen by subscribers."""
    await write(state, "good", "bad")
    async with state.watch("{h}:*") as changes:
        assert await state.revert(K, to_version=1) == 3
        with anyio.fail_after(10):
            change = await anext(changes)
    assert (change.op, change.old_value, change.new_value, change.version) == (
        ChangeOp.SET,
        "bad",
        "good",
        3,
    )
    assert await state.get(K) == "good"
    assert [e.value for e in await state.history(K)] == ["good", "bad", "good"]


async def test_revert_takes_a_ttl(state: StateManager) -> None:
    """revert(ttl=) sets the written version's time to live, as save does."""
    await write(state, "a", "b")
    await state.revert(K, to_version=1, ttl=timedelta(hours=1))
    entry = await state.get_entry(K)
    assert entry is not None
    assert entry.ttl is not None
    assert entry.ttl <= timedelta(hours=1)


async def test_revert_to_what_is_not_retained_changes_nothing(state: StateManager) -> None:
    """revert to a version not retained, or of a missing key, raises NotFoundError."""
    await write(state, "v1", "v2", "v3", "v4")
    with pytest.raises(NotFoundError):
        await state.revert(K, to_version=1)
    with pytest.raises(NotFoundError):
        await state.revert(K, to_version=5)
    with pytest.raises(NotFoundError):
        await state.revert("{h}:missing", to_version=1)
    assert [e.version for e in await state.history(K)] == [4, 3, 2]


async def test_concurrent_reverts_and_saves_all_land(state: StateManager) -> None:
    """Reverts racing saves each retry their conditional write: every call lands once."""
    await write(state, "base")

    async def revert() -> None:
        await state.revert(K, to_version=1)

    async def save(n: int) -> None:
        await state.save(K, n)

    try:
        async with anyio.create_task_group() as group:
            for n in range(10):
                group.start_soon(revert)
                group.start_soon(save, n)
    except* NotFoundError:
        pass  # version 1 left the 3 retained versions before that revert read it
    except* ConflictError:  # pragma: no cover  # 64 lost races in a row
        pytest.fail("a revert lost every race")
    entry = await state.get_entry(K)
    assert entry is not None
    assert entry.version >= 11


# ------------------------------------------------------------------ configuration


class NoHistoryBackend(MemoryBackend):
    """A backend that keeps no history: `Backend`'s default `keep_history`."""

    keep_history = Backend.keep_history


async def test_history_rules_on_a_backend_without_history_is_a_configuration_error() -> None:
    """StateConfig(history=) over a backend that keeps none raises ConfigurationError on open."""
    state = StateManager(StateConfig(history=RULES), backend=NoHistoryBackend())
    with pytest.raises(ConfigurationError, match="NoHistoryBackend"):
        await state.save(K, 1)
    async with StateManager(backend=NoHistoryBackend()) as plain:  # no rules: no error
        await plain.save(K, 1)
        assert [e.version for e in await plain.history(K)] == [1]


@pytest.mark.parametrize(
    "history", [{"{h}:*": 0}, {"{h}:*": "3"}, {"": 2}, {1: 2}, ["{h}:*"]], ids=repr
)
def test_bad_history_rules_are_a_configuration_error(history: Any) -> None:
    """StateConfig(history=) checks patterns and depths."""
    with pytest.raises(ConfigurationError):
        StateConfig(history=history)


# ------------------------------------------------------------------ scopes and the sync API


async def test_a_scope_reads_history_and_reverts_with_relative_keys(state: StateManager) -> None:
    """A scope's history, get(version=) and revert take and return relative keys."""
    scope = state.scope("{h}:")
    await scope.save("doc", "one")
    await scope.save("doc", "two")
    assert [(e.key, e.value) for e in await scope.history("doc")] == [
        ("doc", "two"),
        ("doc", "one"),
    ]
    assert await scope.get("doc", version=1) == "one"
    entry = await scope.get_entry("doc", version=1)
    assert entry is not None
    assert entry.key == "doc"
    assert await scope.revert("doc", to_version=1) == 3
    assert await state.get(K) == "one"


def test_sync_history_and_revert() -> None:
    """The blocking API reads history and reverts."""
    with sync.StateManager(StateConfig(history=RULES)) as state:
        try:
            state.save(K, "one")
        except ConfigurationError:
            pytest.skip("MemoryBackend keeps no history yet")
        state.save(K, "two")
        assert [e.value for e in state.history(K)] == ["two", "one"]
        assert state.get(K, version=1) == "one"
        assert state.revert(K, to_version=1) == 3
