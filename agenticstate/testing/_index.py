"""The sorted-index contract: ordered members, atomic add/remove, their own namespace."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import InvalidArgumentError, InvalidKeyError, UnsupportedOperationError
from agenticstate.backends import IndexIncr

if TYPE_CHECKING:
    from agenticstate.backends import Backend


class IndexContract:
    """The sorted-index contract: ordered members, atomic add/remove, their own namespace.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_range_is_ordered_by_score_then_member(self, backend: Backend) -> None:
        """Members come back lowest score first; equal scores order by member."""
        assert await backend.index_add("q", {"b": 2.0, "a": 2.0, "c": 1.0, "d": 3e15 + 7}) == 4
        assert await backend.index_range("q") == [
            ("c", 1.0),
            ("a", 2.0),
            ("b", 2.0),
            ("d", 3e15 + 7),
        ]
        assert await backend.index_range("q", limit=2) == [("c", 1.0), ("a", 2.0)]
        assert await backend.index_range("q", limit=0) == []
        assert await backend.index_range("missing") == []
        with pytest.raises(InvalidArgumentError):
            await backend.index_range("q", limit=-1)

    async def test_add_moves_and_remove_reports(self, backend: Backend) -> None:
        """Re-adding moves a member (not counted as new); remove counts what was there."""
        await backend.index_add("q", {"a": 1, "b": 2})
        assert await backend.index_add("q", {"a": 5, "c": 3}) == 1
        assert [m for m, _ in await backend.index_range("q")] == ["b", "c", "a"]
        assert await backend.index_remove("q", ["a", "zzz"]) == 1
        assert await backend.index_remove("q", []) == 0
        assert [m for m, _ in await backend.index_range("q")] == ["b", "c"]
        assert await backend.index_remove("q", ["b", "c"]) == 2
        assert await backend.index_range("q") == []

    async def test_indexes_live_apart_from_keys(self, backend: Backend) -> None:
        """An index is invisible to get, scan and change subscriptions, even under a key's name."""
        async with backend.changes("*") as changes:
            await backend.index_add("shared", {"m": 1})
            await backend.set("shared", b"value")
            with anyio.fail_after(5):
                first = await changes.__anext__()
        assert first.key == "shared"
        assert first.new == b"value"
        assert [key async for key in backend.scan("*")] == ["shared"]
        entry = await backend.get("shared")
        assert entry is not None
        assert entry.value == b"value"
        assert await backend.index_range("shared") == [("m", 1.0)]

    async def test_concurrent_adds_and_removes(self, backend: Backend) -> None:
        """Many tasks adding and removing: the index ends exactly as the operations say."""

        async def worker(n: int) -> None:
            await backend.index_add("q", {f"m{n}:{i}": float(i) for i in range(10)})
            await backend.index_remove("q", [f"m{n}:{i}" for i in range(0, 10, 2)])

        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(worker, n)
        members = await backend.index_range("q")
        assert len(members) == 100
        assert all(int(member.split(":")[1]) % 2 == 1 for member, _ in members)

    @pytest.mark.parametrize("score", [float("nan"), 10**400, "1", True, None])
    async def test_bad_scores_are_refused(self, backend: Backend, score: object) -> None:
        """Scores must be numbers a float holds, never NaN; nothing is added otherwise."""
        with pytest.raises(InvalidArgumentError):
            await backend.index_add("q", {"m": score})  # type: ignore[dict-item]
        assert await backend.index_range("q") == []

    async def test_infinite_scores_sort_last_and_first(self, backend: Backend) -> None:
        """inf and -inf are scores: stored, sorted after and before every other, and reached
        by a counter (IndexIncr) that overflows, as in Redis."""
        inf = float("inf")
        await backend.index_add("q", {"top": inf, "bottom": -inf, "mid": 1e308})
        assert await backend.index_range("q") == [("bottom", -inf), ("mid", 1e308), ("top", inf)]
        try:
            result = await backend.transact([], [IndexIncr("q", "mid", 1e308)])
        except UnsupportedOperationError:
            return  # transact is optional
        assert result.results == [inf]
        assert await backend.index_range("q") == [("bottom", -inf), ("mid", inf), ("top", inf)]
        with pytest.raises(InvalidArgumentError, match="must be finite"):
            await backend.transact([], [IndexIncr("q", "mid", -inf)])  # inf - inf: no NaN

    async def test_bad_names_are_refused(self, backend: Backend) -> None:
        """Index names and members follow the key rules, reserved prefix included."""
        with pytest.raises(InvalidKeyError):
            await backend.index_add("", {"m": 1})
        with pytest.raises(InvalidKeyError):
            await backend.index_add("q", {"bad\nmember": 1})
        with pytest.raises(InvalidKeyError):
            await backend.set("__agenticstate_idx__:q", b"x")
