"""Key prefixes follow one rule on every backend.

- A prefix is empty or ends with `:`; anything else (`app1`, a control character, a lone
  surrogate, the reserved prefix, a non-str) is refused with `ConfigurationError` by every
  backend's constructor and by `open_backend` for every scheme, before anything is opened.
- On a store several prefixes share (SQLite, Redis), for every pair of prefixes, a prefix sees a
  key written under another exactly when that key starts with it: `app1:` never sees `app12:`'s
  keys, the empty prefix and `app:` see their nested prefixes' keys.
"""

from __future__ import annotations

import itertools
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    ConfigurationError,
    FileBackend,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
)
from agenticstate.backends import open_backend
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agenticstate.backends.base import Backend

BAD_PREFIXES: list[object] = [
    "app1",  # no boundary: would see every key of `app12:`
    "app1:x",
    "a\x00:",
    "a\n:",
    "\ud800:",
    "__agenticstate:",
    5,
    b"app:",
]

MAKERS: dict[str, Callable[[Path, Any], object]] = {
    "memory": lambda tmp, prefix: MemoryBackend(key_prefix=prefix),
    "file": lambda tmp, prefix: FileBackend(tmp / "store", key_prefix=prefix),
    "sqlite": lambda tmp, prefix: SQLiteBackend(tmp / "s.db", key_prefix=prefix),
    "redis": lambda tmp, prefix: RedisBackend(url="redis://127.0.0.1:1", key_prefix=prefix),
    "url-memory": lambda tmp, prefix: open_backend("memory://", key_prefix=prefix),
    "url-file": lambda tmp, prefix: open_backend(f"file://{tmp / 'store'}", key_prefix=prefix),
    "url-sqlite": lambda tmp, prefix: open_backend(f"sqlite://{tmp / 's.db'}", key_prefix=prefix),
}


@pytest.mark.parametrize("prefix", BAD_PREFIXES, ids=repr)
@pytest.mark.parametrize("maker", MAKERS)
def test_every_backend_refuses_a_bad_prefix(maker: str, prefix: object, tmp_path: Path) -> None:
    """Every backend and URL scheme refuses a bad prefix, and creates nothing."""
    with pytest.raises(ConfigurationError):
        MAKERS[maker](tmp_path, prefix)
    assert list(tmp_path.iterdir()) == []


# Prefixes relative to the store's base: nested (`app:` holds `app:x:`), one the start of
# another's name (`app1:` / `app12:`), glob metacharacters, the empty prefix.
PREFIXES = ["", "app:", "app:x:", "app1:", "app12:", "app1*:", "a[1]:"]


async def _shared(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Callable[[str], Backend]:
    if kind == "sqlite":
        return lambda prefix: SQLiteBackend(tmp_path / "shared.db", key_prefix=prefix)
    url = request.getfixturevalue("redis_url")
    base = unique_prefix()
    return lambda prefix: RedisBackend(url=url, key_prefix=base + prefix)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_every_prefix_pair_sees_exactly_its_nested_keys(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """On a shared store, a prefix lists and reads another prefix's key exactly when nested."""
    make = await _shared(kind, tmp_path, request)
    async with AsyncExitStack() as stack:
        stores: dict[str, Backend] = {}
        for prefix in PREFIXES:
            stores[prefix] = await stack.enter_async_context(make(prefix))
        for prefix, store in stores.items():
            await store.set(f"k{len(prefix)}", prefix.encode())
        for mine in PREFIXES:
            listed = {mine + key async for key in stores[mine].scan("*")}
            expected = {f"{other}k{len(other)}" for other in PREFIXES}
            assert listed == {full for full in expected if full.startswith(mine)}, mine
        for mine, other in itertools.product(PREFIXES, repeat=2):
            full = f"{other}k{len(other)}"
            if full.startswith(mine):
                entry = await stores[mine].get(full[len(mine) :])
                assert entry is not None, (mine, other)
                assert entry.value == other.encode(), (mine, other)
        # A prefix that is the start of another's name reads nothing of it.
        assert await stores["app1:"].get("2:k6") is None
