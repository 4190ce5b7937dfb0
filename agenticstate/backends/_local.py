"""The in-process part the memory and file backends share: entries, expiry, sorted indexes."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from agenticstate.backends._index import SortedIndex

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from datetime import datetime

    from agenticstate._glob import GlobMatcher
    from agenticstate.backends.base import Entry

__all__ = ["LocalStore"]

_HEAP_SLACK = 64  # stale heap items tolerated beyond twice the keys (small stores rebuild rarely)


class LocalStore:
    """Entries by key with wall-clock expiry, and named sorted indexes.

    Expired entries are dropped when read and, in order of expiry, whenever `sweep` runs (on
    writes, scans and batch reads), so memory stays bounded without a timer task.

    The expiry heap gets an item per write with a TTL; an item whose key was rewritten or
    deleted since is stale and skipped when popped. So that rewriting one key many times does
    not grow the heap with the write rate, it is rebuilt from the live entries whenever it
    holds more than twice as many items as there are keys (plus `_HEAP_SLACK`): it stays
    bounded by the keys, at an amortized constant cost per write.
    """

    __slots__ = ("data", "expiries", "indexes")

    def __init__(self) -> None:
        self.data: dict[str, Entry] = {}
        self.expiries: list[tuple[datetime, str]] = []
        self.indexes: dict[str, SortedIndex] = {}

    def live(self, key: str, now: datetime) -> Entry | None:
        """The entry at `key` unless it is missing or expired."""
        entry = self.data.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            del self.data[key]
            return None
        return entry

    def sweep(self, now: datetime) -> None:
        """Drop every entry that has expired by `now`."""
        expiries = self.expiries
        while expiries and expiries[0][0] <= now:
            expires_at, key = heapq.heappop(expiries)
            entry = self.data.get(key)
            if entry is not None and entry.expires_at == expires_at:
                del self.data[key]

    def store(self, entry: Entry) -> None:
        """Keep `entry` (replacing the one at its key)."""
        self.data[entry.key] = entry
        if entry.expires_at is not None:
            expiries = self.expiries
            heapq.heappush(expiries, (entry.expires_at, entry.key))
            if len(expiries) > 2 * len(self.data) + _HEAP_SLACK:
                self._rebuild_expiries()

    def _rebuild_expiries(self) -> None:
        """Keep one heap item per entry that expires, dropping the stale ones."""
        expiries = [
            (entry.expires_at, key)
            for key, entry in self.data.items()
            if entry.expires_at is not None
        ]
        heapq.heapify(expiries)
        self.expiries = expiries

    def drop(self, key: str) -> None:
        """Forget `key`."""
        self.data.pop(key, None)

    def matching(self, matcher: GlobMatcher, now: datetime) -> list[str]:
        """The present keys `matcher` selects (a snapshot: safe to iterate while writing)."""
        self.sweep(now)  # a store that is only read still lets go of what expired
        if matcher.is_literal:
            key = matcher.literal_prefix
            return [key] if self.live(key, now) is not None else []
        return [
            key
            for key, entry in self.data.items()
            if (entry.expires_at is None or entry.expires_at > now) and matcher.match(key)
        ]

    def index_add(self, name: str, members: Mapping[str, float]) -> int:
        """Add members to the sorted index `name`; return how many were new."""
        return self.indexes.setdefault(name, SortedIndex()).add(members)

    def index_remove(self, name: str, members: Iterable[str]) -> int:
        """Remove members from the sorted index `name`; return how many were there."""
        found = self.indexes.get(name)
        if found is None:
            return 0
        removed = found.remove(members)
        if not found:
            del self.indexes[name]
        return removed

    def index_range(self, name: str, limit: int | None) -> list[tuple[str, float]]:
        """The lowest-scored members of the sorted index `name`."""
        found = self.indexes.get(name)
        return found.range(limit) if found is not None else []
