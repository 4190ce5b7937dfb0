"""The Redis backend's revision counters: one per key prefix (on a cluster, per prefix and slot).

Every write script takes its next revision from the counter of the written key's prefix (see
`_redis_scripts`, `revise`): `__agenticstate_rev__:{key_prefix}` on one server, so that an ACL
key pattern per prefix (`~__agenticstate_rev__:app:*`) grants it with the prefix's keys and no
tenant can touch another's. On Redis Cluster a script may not cross slots, so each slot has its
own: `__agenticstate_rev__:{key_prefix}{TAG}` (`TAG` from `slot_tag`; the tag first if the prefix
holds a brace), as the change feed's streams are named (`_redis_feed.FeedNames`).
"""

from __future__ import annotations

from agenticstate.backends._redis_slots import slot_tail

__all__ = ["REVISION_NAMESPACE", "RevisionNames"]

REVISION_NAMESPACE = "__agenticstate_rev__:"
"""What every revision counter's name starts with (it holds the last revision given)."""


class RevisionNames:
    """The revision counters of one key prefix: one (or one per cluster slot)."""

    __slots__ = ("_by_slot", "_prefix", "cluster", "plain")

    def __init__(self, key_prefix: str, *, cluster: bool) -> None:
        self.cluster = cluster
        self.plain = REVISION_NAMESPACE + key_prefix
        self._by_slot: dict[int, str] = {}
        self._prefix = key_prefix

    def for_slot(self, slot: int) -> str:
        """The counter of `slot` (on one server: the only one)."""
        if not self.cluster:
            return self.plain
        name = self._by_slot.get(slot)
        if name is None:
            name = self._by_slot[slot] = REVISION_NAMESPACE + slot_tail(self._prefix, slot)
        return name
