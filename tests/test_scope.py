"""ScopedState on every backend: the StateManager API relative to a prefix, clear and get_all."""

from __future__ import annotations

import inspect
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agenticstate import (
    ConfigurationError,
    InvalidArgumentError,
    InvalidKeyError,
    ScopedState,
    StateManager,
)


class Cart(BaseModel):
    items: list[str]


async def test_agno_calls_map_onto_a_scope(state: StateManager) -> None:
    """Agno's get/set/has/delete/update/clear/get_all, on a scope."""
    s = state.scope("session:u1:")
    await s.save("user_name", "Alice")  # set
    await s.save("preferences", {"theme": "dark", "language": "en"})
    assert await s.get("user_name", "Unknown User") == "Alice"  # get
    assert await s.get("missing", "Unknown User") == "Unknown User"
    assert await s.exists("user_name")  # has
    await s.update("preferences", {"theme": "light"})  # update
    assert await s.get("preferences") == {"theme": "light", "language": "en"}
    assert await s.get_all() == {  # get_all
        "preferences": {"theme": "light", "language": "en"},
        "user_name": "Alice",
    }
    assert await s.delete("user_name")  # delete
    assert not await s.exists("user_name")
    assert await s.clear() == 1  # clear
    assert await s.get_all() == {}


async def test_scope_is_a_view_of_prefixed_keys(state: StateManager) -> None:
    """A scope writes prefixed keys, lists them relative, and never sees other scopes."""
    await state.save("session:u2:cart", ["x"])
    s = state.scope("session:u1:")
    await s.save("cart", ["milk"])
    assert await state.get("session:u1:cart") == ["milk"]
    assert await s.list_keys() == ["cart"]
    assert await s.list_keys("c*") == ["cart"]
    assert await s.get_all() == {"cart": ["milk"]}
    assert await s.clear() == 1
    assert await state.get("session:u2:cart") == ["x"]


async def test_glob_characters_in_the_prefix_match_only_themselves(state: StateManager) -> None:
    """A prefix with `*` or `[` is escaped: clear() never reaches keys of other prefixes."""
    await state.save("t[1]:a", 1)
    await state.save("t1:a", 2)
    await state.save("tX*:a", 3)
    await state.save("tXY:a", 4)
    assert await state.scope("t[1]:").clear() == 1
    assert await state.scope("tX*:").get_all() == {"a": 3}
    assert await state.get("t1:a") == 2
    assert await state.get("tXY:a") == 4


async def test_entries_models_batches_and_nested_scopes(state: StateManager) -> None:
    """get_entry, model=, get_many, save_many and scope() all stay relative."""
    s = state.scope("app:")
    versions = await s.save_many({"a": 1, "b": 2})
    assert versions == {"a": 1, "b": 1}
    assert await s.get_many(["a", "b", "c"]) == {"a": 1, "b": 2}
    entry = await s.get_entry("a")
    assert entry is not None
    assert (entry.key, entry.value, entry.version) == ("a", 1, 1)
    inner = s.scope("user:")
    await inner.save("cart", Cart(items=["tea"]))
    assert await state.get("app:user:cart") == {"items": ["tea"]}
    assert await inner.get("cart", model=Cart) == Cart(items=["tea"])
    assert await s.get_all() == {"a": 1, "b": 2, "user:cart": {"items": ["tea"]}}
    assert await s.update("counter", lambda n: n + 1, default=0) == 1


async def test_scoped_indexes(state: StateManager) -> None:
    """Sorted indexes of a scope live under its prefix."""
    s = state.scope("q:")
    await s.index_add("pending", {"t1": 2.0, "t2": 1.0})
    assert await s.index_range("pending") == [("t2", 1.0), ("t1", 2.0)]
    assert await state.index_range("q:pending") == [("t2", 1.0), ("t1", 2.0)]
    assert await s.index_remove("pending", ["t1"]) == 1


async def test_scoped_watch_and_subscribe_see_relative_keys(state: StateManager) -> None:
    """watch and subscribe report keys relative to the scope, and only the scope's."""
    s = state.scope("room:1:")
    seen: list[tuple[str, object]] = []
    got = anyio.Event()

    def callback(key: str, old: object, new: object) -> None:
        seen.append((key, new))
        got.set()

    s.subscribe("*", callback)
    s.subscribe("*", callback)  # twice: no second delivery
    async with s.watch("*") as changes:
        await state.save("room:2:x", "other")
        await s.save("x", "mine")
        with anyio.fail_after(5):
            change = await changes.__anext__()
            await got.wait()
    assert (change.key, change.new_value) == ("x", "mine")
    assert seen == [("x", "mine")]
    assert s.unsubscribe("*", callback)
    assert not s.unsubscribe("*", callback)


async def test_bad_prefixes_and_keys_are_refused(state: StateManager) -> None:
    """An empty or invalid prefix, or an empty key, raises a typed error and writes nothing."""
    with pytest.raises(InvalidArgumentError):
        state.scope("")
    with pytest.raises(InvalidArgumentError):
        state.scope("bad\x00")
    with pytest.raises(ConfigurationError):  # an object of the wrong kind, as everywhere
        ScopedState("not a manager", "p:")  # type: ignore[arg-type]
    s = state.scope("p:")
    with pytest.raises(InvalidKeyError):
        await s.save("", 1)
    with pytest.raises(InvalidKeyError):
        await s.save("a\nb", 1)
    assert await state.list_keys() == []


@settings(max_examples=40, deadline=None)
@given(
    prefix=st.text(alphabet="ab*?[]^\\:", min_size=1, max_size=4),
    others=st.lists(st.text(alphabet="ab*?[]^\\:", min_size=1, max_size=5), max_size=6),
)
def test_clear_and_get_all_touch_exactly_the_prefix(prefix: str, others: list[str]) -> None:
    """Whatever glob characters the prefix holds, a scope sees exactly the keys under it."""

    async def main() -> None:
        async with StateManager() as state:
            for key in [*others, prefix + "k"]:
                await state.save(key, key)
            inside = sorted(k for k in {*others, prefix + "k"} if k.startswith(prefix))
            scope = state.scope(prefix)
            assert sorted(await scope.get_all()) == [k[len(prefix) :] for k in inside]
            assert await scope.clear() == len(inside)
            left = await state.list_keys()
            assert left == sorted(k for k in set(others) if not k.startswith(prefix))

    anyio.run(main)


@pytest.mark.parametrize(
    "name",
    ["get", "get_entry", "history", "revert", "feed_cursor", "changes", "watch", "subscribe"],
)
def test_scope_methods_take_the_managers_arguments(name: str) -> None:
    """The feed and history methods of a scope take the same arguments as the manager's."""
    ours = inspect.signature(getattr(ScopedState, name)).parameters
    theirs = inspect.signature(getattr(StateManager, name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


async def test_scoped_subscribe_since_replays_relative_keys(state: StateManager) -> None:
    """A scope's subscribe(since=) replays the scope's changes after the cursor, keys relative."""
    if state.backend.feed is None:
        pytest.skip(f"{type(state.backend).__name__} keeps no change feed")
    scope = state.scope("{s}:u1:")
    cursor = await scope.feed_cursor()
    await scope.save("cart", ["milk"])
    await state.save("{s}:u2:cart", ["not this scope"])
    calls: list[tuple[str, Any, Any]] = []
    done = anyio.Event()

    def on_change(key: str, old: Any, new: Any) -> None:
        calls.append((key, old, new))
        if new == ["milk", "eggs"]:
            done.set()

    scope.subscribe("*", on_change, since=cursor)
    await scope.save("cart", ["milk", "eggs"])
    with anyio.fail_after(10):
        await done.wait()
    assert calls == [("cart", None, ["milk"]), ("cart", ["milk"], ["milk", "eggs"])]
