"""`Store`, LangGraph's long-term memory, on every backend; generated against LangGraph's own
`InMemoryStore` as the model."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("langgraph")

from langgraph.store.memory import InMemoryStore

from agenticstate import InvalidArgumentError, SerializationError, StateManager
from agenticstate.langgraph import Store

if TYPE_CHECKING:
    from collections.abc import Sequence

    from langgraph.store.base import Item

WEIRD = ("users", "a/b|c:d{x}*?[1]%", "é 漢")


async def test_put_get_delete(state: StateManager) -> None:
    """An item round-trips with its namespace, key and timestamps, and is gone after delete."""
    store = Store(state)
    await store.aput(WEIRD, "k:1|/", {"text": "likes tea", "n": 1})
    item = await store.aget(WEIRD, "k:1|/")
    assert item is not None
    assert (item.namespace, item.key, item.value) == (WEIRD, "k:1|/", {"text": "likes tea", "n": 1})
    assert item.created_at == item.updated_at
    await store.aput(WEIRD, "k:1|/", {"text": "likes coffee"})
    again = await store.aget(WEIRD, "k:1|/")
    assert again is not None
    assert again.value == {"text": "likes coffee"}
    assert again.created_at == item.created_at
    assert again.updated_at >= item.updated_at
    assert await store.aget(("users",), "k:1|/") is None
    await store.adelete(WEIRD, "k:1|/")
    assert await store.aget(WEIRD, "k:1|/") is None


async def test_search_filters_and_pages(state: StateManager) -> None:
    """Search keeps to the namespace prefix, applies filters and operators, and pages."""
    store = Store(state)
    for n in range(7):
        await store.aput(
            ("mem", "alice"), f"m{n}", {"n": n, "tag": {"kind": "even" if n % 2 else "odd"}}
        )
    await store.aput(("mem", "bob"), "m0", {"n": 100, "tag": {"kind": "odd"}})
    await store.aput(("memo",), "m0", {"n": 5})
    alice = await store.asearch(("mem", "alice"), limit=100)
    assert sorted(item.key for item in alice) == [f"m{n}" for n in range(7)]
    both = await store.asearch(("mem",), limit=100)
    assert len(both) == 8  # ("memo",) is not under ("mem",)
    big = await store.asearch(("mem",), filter={"n": {"$gte": 4}}, limit=100)
    assert sorted(item.value["n"] for item in big) == [4, 5, 6, 100]
    odd = await store.asearch(("mem",), filter={"tag": {"kind": "odd"}}, limit=100)
    assert sorted(item.value["n"] for item in odd) == [0, 2, 4, 6, 100]
    pages = [await store.asearch(("mem", "alice"), limit=3, offset=o) for o in (0, 3, 6)]
    assert [len(page) for page in pages] == [3, 3, 1]
    assert len({item.key for page in pages for item in page}) == 7
    with pytest.raises(InvalidArgumentError):
        await store.asearch(("mem",), query="tea")


async def test_list_namespaces(state: StateManager) -> None:
    """Namespaces list by prefix, suffix (with wildcards) and depth, paged and sorted."""
    store = Store(state)
    for ns in [("a", "x", "1"), ("a", "y", "1"), ("b", "x"), ("a", "x", "2")]:
        await store.aput(ns, "k", {"v": 1})
    assert await store.alist_namespaces() == [
        ("a", "x", "1"),
        ("a", "x", "2"),
        ("a", "y", "1"),
        ("b", "x"),
    ]
    assert await store.alist_namespaces(prefix=("a", "*", "1")) == [
        ("a", "x", "1"),
        ("a", "y", "1"),
    ]
    assert await store.alist_namespaces(suffix=("x",)) == [("b", "x")]
    assert await store.alist_namespaces(max_depth=1) == [("a",), ("b",)]
    assert await store.alist_namespaces(limit=2, offset=1) == [("a", "x", "2"), ("a", "y", "1")]


async def test_ttl_set_refreshed_and_expires(state: StateManager) -> None:
    """A TTL in minutes is set on the stored key, restarted by a read, and the item expires."""
    store = Store(state, prefix="ttl")
    await store.aput(("t",), "k", {"v": 1}, ttl=1.0)
    entry = await state.get_entry("ttl:t|k")
    assert entry is not None
    assert entry.ttl is not None
    assert timedelta(seconds=50) < entry.ttl <= timedelta(minutes=1)
    before = entry.expires_at
    assert await store.aget(("t",), "k") is not None
    refreshed = await state.get_entry("ttl:t|k")
    assert refreshed is not None
    assert refreshed.expires_at is not None
    assert before is not None
    assert refreshed.expires_at >= before
    await store.aput(("t",), "short", {"v": 1}, ttl=0.005)  # 300 ms
    assert await store.aget(("t",), "short", refresh_ttl=False) is not None
    await anyio.sleep(0.4)  # wall-clock expiry: wait for the time itself
    assert await store.aget(("t",), "short", refresh_ttl=False) is None


async def test_bad_values_change_nothing(state: StateManager) -> None:
    """A value the backend cannot store, or a vector index, is refused; nothing is written."""
    store = Store(state)
    with pytest.raises(SerializationError):
        await store.aput(("x",), "k", {"bad": object()})
    with pytest.raises(InvalidArgumentError):
        await store.aput(("x",), "k", {"v": 1}, index=["v"])
    assert await store.aget(("x",), "k") is None
    assert await state.list_keys("*") == []


labels = st.sampled_from(["a", "b", "c/d", "e|f"])
namespaces = st.lists(labels, min_size=1, max_size=3).map(tuple)
keys = st.sampled_from(["k1", "k2", "k:3"])
values = st.fixed_dictionaries({"n": st.integers(0, 5), "s": st.sampled_from(["x", "y"])})
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), namespaces, keys, values),
        st.tuples(st.just("delete"), namespaces, keys, st.none()),
        st.tuples(st.just("search"), namespaces, st.none(), st.one_of(st.none(), values)),
        st.tuples(st.just("namespaces"), st.one_of(st.none(), namespaces), st.none(), st.none()),
    ),
    max_size=25,
)


def _seen(items: Sequence[Item]) -> list[tuple[Any, ...]]:
    return sorted((item.namespace, item.key, sorted(item.value.items())) for item in items)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_matches_langgraph_in_memory_store(ops: list[tuple[Any, ...]]) -> None:
    """Any sequence of puts, deletes, searches and namespace listings reads exactly as on
    LangGraph's InMemoryStore."""

    async def main() -> None:
        model = InMemoryStore()
        async with StateManager() as state:
            store = Store(state)
            for op, ns, key, value in ops:
                if op == "put":
                    await store.aput(ns, key, value)
                    await model.aput(ns, key, value)
                elif op == "delete":
                    await store.adelete(ns, key)
                    await model.adelete(ns, key)
                elif op == "search":
                    got = await store.asearch(ns, filter=value, limit=1000)
                    want = await model.asearch(ns, filter=value, limit=1000)
                    assert _seen(got) == _seen(want)
                else:
                    prefix = ns
                    got_ns = await store.alist_namespaces(prefix=prefix, limit=1000)
                    want_ns = [
                        n
                        for n in await model.alist_namespaces(prefix=prefix, limit=1000)
                        if any(i.namespace == n for i in await model.asearch(n, limit=1000))
                    ]  # InMemoryStore keeps emptied namespaces; a namespace here is its items
                    assert sorted(got_ns) == sorted(want_ns)

    anyio.run(main)
