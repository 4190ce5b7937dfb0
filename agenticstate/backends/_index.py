"""An in-memory sorted index (like a Redis sorted set) for the memory and file backends."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = ["SortedIndex"]


class SortedIndex:
    """Members with scores, kept in (score, member) order: O(log n) search, cheap inserts."""

    __slots__ = ("_order", "_scores")

    def __init__(self) -> None:
        self._scores: dict[str, float] = {}
        self._order: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._scores)

    def add(self, members: Mapping[str, float]) -> int:
        """Add or move members; return how many were new."""
        added = 0
        for member, score in members.items():
            old = self._scores.get(member)
            if old is not None:
                if old == score:
                    continue
                self._discard(old, member)
            else:
                added += 1
            self._scores[member] = score
            bisect.insort(self._order, (score, member))
        return added

    def score(self, member: str) -> float | None:
        """`member`'s score, or `None` if it is not in the index."""
        return self._scores.get(member)

    def remove(self, members: Iterable[str]) -> int:
        """Remove members; return how many were there."""
        removed = 0
        for member in members:
            score = self._scores.pop(member, None)
            if score is not None:
                self._discard(score, member)
                removed += 1
        return removed

    def _discard(self, score: float, member: str) -> None:
        position = bisect.bisect_left(self._order, (score, member))
        del self._order[position]

    def range(self, limit: int | None = None) -> list[tuple[str, float]]:
        """The lowest-scored members first (ties by member)."""
        picked = self._order if limit is None else self._order[:limit]
        return [(member, score) for score, member in picked]

    def items(self) -> dict[str, float]:
        """Every member with its score."""
        return dict(self._scores)
