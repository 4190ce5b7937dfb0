"""The history contract: the last versions of the keys a rule names (`keep_history`).

A backend that keeps no history (its `keep_history` raises `UnsupportedOperationError` for a
non-empty rule, as `Backend`'s default does) skips these tests. One that keeps it must pass all
of them. Every key shares the hash tag `{h}`, so on Redis Cluster they live in one slot.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import InvalidArgumentError, UnsupportedOperationError
from agenticstate.backends import Delete, Put

if TYPE_CHECKING:
    from agenticstate.backends import Backend, Entry

K, OTHER, PLAIN = "{h}:k", "{h}:other", "{h}-plain"
SHORT = timedelta(milliseconds=150)


def _keep(backend: Backend, depth: int = 3) -> None:
    try:
        backend.keep_history({"{h}:*": depth})
    except UnsupportedOperationError:
        pytest.skip(f"{type(backend).__name__} keeps no history")


def _versions(entries: list[Entry]) -> list[tuple[int, bytes]]:
    return [(entry.version, entry.value) for entry in entries]


class HistoryContract:
    """The history contract: depth, newest first, `get_version`, and what ends a history.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_history_keeps_the_last_versions_newest_first(self, backend: Backend) -> None:
        """A key under a rule of depth 3 keeps its last 3 versions, the current one first."""
        _keep(backend)
        for n in range(1, 6):
            await backend.set(K, b"v%d" % n, ttl=timedelta(hours=n))
        history = await backend.history(K)
        assert _versions(history) == [(5, b"v5"), (4, b"v4"), (3, b"v3")]
        assert history[0] == await backend.get(K)
        assert all(entry.key == K for entry in history)
        assert history[0].updated_at >= history[1].updated_at >= history[2].updated_at
        assert history[0].created_at == history[2].created_at
        expiries = [entry.expires_at for entry in history]
        assert all(expires is not None for expires in expiries)
        assert expiries[0] > expiries[1] > expiries[2]  # type: ignore[operator]

    async def test_history_limit(self, backend: Backend) -> None:
        """limit caps the entries (newest kept); 0 gives none; a bad limit is refused."""
        _keep(backend, 10)
        for n in range(1, 5):
            await backend.set(K, b"v%d" % n)
        assert _versions(await backend.history(K, limit=2)) == [(4, b"v4"), (3, b"v3")]
        assert await backend.history(K, limit=0) == []
        assert len(await backend.history(K, limit=100)) == 4
        with pytest.raises(InvalidArgumentError):
            await backend.history(K, limit=-1)

    async def test_history_get_version(self, backend: Backend) -> None:
        """get_version returns a retained version, None for one dropped or never written."""
        _keep(backend)
        for n in range(1, 6):
            await backend.set(K, b"v%d" % n)
        found = await backend.get_version(K, 4)
        assert found is not None
        assert (found.version, found.value) == (4, b"v4")
        assert await backend.get_version(K, 5) == await backend.get(K)
        assert await backend.get_version(K, 2) is None
        assert await backend.get_version(K, 6) is None
        assert await backend.get_version("{h}:missing", 1) is None
        for bad in (0, -1, "1"):
            with pytest.raises(InvalidArgumentError):
                await backend.get_version(K, bad)  # type: ignore[arg-type]

    async def test_history_ends_with_a_delete(self, backend: Backend) -> None:
        """A deleted key has no history; written again it starts over at version 1."""
        _keep(backend)
        for n in range(1, 4):
            await backend.set(K, b"v%d" % n)
        await backend.delete(K)
        assert await backend.history(K) == []
        assert await backend.get_version(K, 2) is None
        await backend.set(K, b"new")
        assert _versions(await backend.history(K)) == [(1, b"new")]
        await backend.set(K, b"newer")
        assert _versions(await backend.history(K)) == [(2, b"newer"), (1, b"new")]

    async def test_history_ends_with_expiry(self, backend: Backend) -> None:
        """An expired key has no history; written again it starts over at version 1."""
        _keep(backend)
        await backend.set(K, b"v1")
        await backend.set(K, b"v2", ttl=SHORT)
        await anyio.sleep(SHORT.total_seconds() + 0.1)  # expiry is wall-clock time: let it pass
        assert await backend.history(K) == []
        assert await backend.get_version(K, 1) is None
        await backend.set(K, b"again")
        assert _versions(await backend.history(K)) == [(1, b"again")]

    async def test_history_of_every_kind_of_write(self, backend: Backend) -> None:
        """set_many, update and transact's Put keep history as set does; Delete ends it."""
        _keep(backend, 5)
        await backend.set_many([(K, b"1"), (OTHER, b"o1")])
        await backend.update(K, lambda entry: b"2")
        await backend.set_many([(K, b"3"), (OTHER, b"o2")])
        try:
            await backend.transact([], [Put(K, b"4"), Put(OTHER, b"o3")])
            transacted = True
        except UnsupportedOperationError:
            await backend.set(K, b"4")
            await backend.set(OTHER, b"o3")
            transacted = False
        assert _versions(await backend.history(K)) == [(4, b"4"), (3, b"3"), (2, b"2"), (1, b"1")]
        assert _versions(await backend.history(OTHER)) == [(3, b"o3"), (2, b"o2"), (1, b"o1")]
        if transacted:
            await backend.transact([], [Delete(OTHER), Put(OTHER, b"fresh")])
            assert _versions(await backend.history(OTHER)) == [(1, b"fresh")]

    async def test_history_of_a_key_no_rule_names(self, backend: Backend) -> None:
        """A key no rule names has only its current version; a missing key has none."""
        _keep(backend)
        for n in range(1, 4):
            await backend.set(PLAIN, b"v%d" % n)
        assert _versions(await backend.history(PLAIN)) == [(3, b"v3")]
        assert await backend.get_version(PLAIN, 2) is None
        assert await backend.history("{h}:missing") == []
        assert await backend.history("never") == []

    async def test_history_depth_one_is_the_current_version(self, backend: Backend) -> None:
        """A rule of depth 1 keeps only the current version, as no rule does."""
        _keep(backend, 1)
        for n in range(1, 4):
            await backend.set(K, b"v%d" % n)
        assert _versions(await backend.history(K)) == [(3, b"v3")]
