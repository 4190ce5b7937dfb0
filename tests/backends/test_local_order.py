"""The sorted key list behind memory and file listings (`LocalStore.matching`), and when the
memory backend yields to the event loop.

`LocalStore` keeps its keys sorted once something lists them and folds later additions and
removals in at the next listing; these tests hold every listing to a plain filter of the live
keys, through random writes, deletes, expiries and rewrites, and through the point where the
list is dropped and rebuilt.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import anyio
import pytest

from agenticstate import MemoryBackend
from agenticstate._glob import compile_glob, glob_match
from agenticstate.backends._keyorder import after_prefix as _after_prefix
from agenticstate.backends._local import LocalStore
from agenticstate.backends.base import Entry
from agenticstate.backends.memory import _YIELD_EVERY

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PATTERNS = ["*", "a:*", "a:1*", "a:*:x", "a?", "*:x", "b:[0-3]*", "a:12", "\U0010ffff*", "c\\*"]


def _entry(key: str, expires_at: datetime | None = None) -> Entry:
    return Entry(key, b"v", 1, T0, T0, expires_at)


def _expected(store: LocalStore, pattern: str, now: datetime) -> list[str]:
    return sorted(
        key
        for key, entry in store.data.items()
        if (entry.expires_at is None or entry.expires_at > now) and glob_match(pattern, key)
    )


def _random_key(rng: random.Random) -> str:
    head = rng.choice(["a:", "b:", "c*", "\U0010ffff", "a", ""])
    tail = rng.choice(["1", "12", "2:x", "3", "x", "\U0010ffffz", ":x", "0"])
    return head + tail + rng.choice(["", "", str(rng.randrange(30))])


@pytest.mark.parametrize("seed", range(6))
def test_listings_match_a_plain_filter_through_random_changes(seed: int) -> None:
    """Every listing equals the sorted live keys the pattern selects, whatever came before."""
    rng = random.Random(seed)
    store = LocalStore()
    if seed % 2:
        store.unordered()  # as a bulk load leaves it: sorted again at the first listing
    now = T0
    for _step in range(3000):
        roll = rng.random()
        key = _random_key(rng)
        if roll < 0.45:
            expires = now + timedelta(seconds=rng.randrange(1, 5)) if rng.random() < 0.2 else None
            store.store(_entry(key, expires))
        elif roll < 0.7:
            store.drop(key)
        elif roll < 0.75:
            store.live(key, now)  # may drop an expired key
        elif roll < 0.8:
            now += timedelta(seconds=1)
        else:
            pattern = rng.choice(PATTERNS)
            expected = _expected(store, pattern, now)
            assert store.matching(compile_glob(pattern), now) == expected, (pattern, _step)


def test_a_listing_is_a_copy_the_store_never_changes() -> None:
    """What `matching` returns stays as it was when the store changes afterwards."""
    store = LocalStore()
    for key in ("a:1", "a:2", "b:1"):
        store.store(_entry(key))
    everything = store.matching(compile_glob("*"), T0)
    prefixed = store.matching(compile_glob("a:*"), T0)
    store.store(_entry("a:0"))
    store.drop("a:2")
    assert everything == ["a:1", "a:2", "b:1"]
    assert prefixed == ["a:1", "a:2"]
    assert store.matching(compile_glob("a:*"), T0) == ["a:0", "a:1"]


def test_a_key_deleted_and_written_again_is_listed_once() -> None:
    store = LocalStore()
    store.store(_entry("k"))
    assert store.matching(compile_glob("*"), T0) == ["k"]
    store.drop("k")
    store.store(_entry("k"))
    store.store(_entry("j"))
    store.drop("j")
    store.store(_entry("j"))
    assert store.matching(compile_glob("*"), T0) == ["j", "k"]


def test_the_bound_after_a_prefix() -> None:
    """Every string starting with the prefix sorts below the bound, and the bound above them."""
    assert _after_prefix("agent:") == "agent;"
    assert _after_prefix("a\U0010ffff") == "b"
    assert _after_prefix("\U0010ffff\U0010ffff") is None
    for text in ("agent:", "a\U0010ffff", "x\U0010ffff\U0010ffffy"):
        bound = _after_prefix(text)
        assert bound is not None
        assert text < bound
        assert text + "\U0010ffff" * 3 < bound


async def test_a_loop_of_gets_lets_another_task_run() -> None:
    """A task polling a memory key with nothing but `get` sees another task's write."""
    backend = MemoryBackend()
    reads = 0
    async with anyio.create_task_group() as task_group:

        async def writer() -> None:
            await backend.set("flag", b"1")

        task_group.start_soon(writer)
        with anyio.fail_after(5):
            while await backend.get("flag") is None:
                reads += 1
    assert 0 < reads <= 2 * _YIELD_EVERY


async def test_every_write_yields_to_the_event_loop() -> None:
    """Each memory write lets other tasks run first (a write loop never holds the loop)."""
    backend = MemoryBackend()
    ran = 0

    async def other() -> None:
        nonlocal ran
        while True:
            ran += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(other)
        await anyio.lowlevel.checkpoint()
        for i in range(5):
            before = ran
            await backend.set(f"k:{i}", b"v")
            assert ran > before
        for i in range(5):
            before = ran
            await backend.delete(f"k:{i}")
            assert ran > before
        task_group.cancel_scope.cancel()
