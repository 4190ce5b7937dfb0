"""A small backend over a dict, passing the whole contract suite (see "Writing a backend").

Install: `pip install .` (from a checkout; see the README).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from agenticstate import StateConfig, StateManager
from agenticstate.backends import (
    Backend,
    Change,
    ChangeFanout,
    ChangeOp,
    Delete,
    Entry,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    TxnResult,
    Version,
    glob_match,
    open_backend,
    register_backend,
    validate_key,
    validate_pattern,
)
from agenticstate.backends.base import (
    DEFAULT_MAX_BUFFER,
    check_expected_version,
    check_index_members,
    check_limit,
    check_transaction,
    check_ttl,
    conflict,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

    from agenticstate.backends import TxnCompare, TxnOp


class DictBackend(Backend):
    """Keep entries in a dict; every method runs without awaiting between read and write, so
    each call is atomic on one event loop (the base class's `update` is a compare-and-set loop)."""

    def __init__(self, *, key_prefix: str = "") -> None:
        self.key_prefix = key_prefix
        self._entries: dict[str, Entry] = {}
        self._indexes: dict[str, dict[str, float]] = {}
        self._fanout = ChangeFanout()  # bounded buffers and the overflow rule, done for you

    @classmethod
    def from_url(cls, url: str, **options: Any) -> DictBackend:
        return cls(**options)

    def _live(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        expires_at = entry.expires_at if entry is not None else None
        if expires_at is not None and expires_at <= datetime.now(UTC):
            del self._entries[key]  # expired: missing everywhere, and no change event
            return None
        return entry

    async def get(self, key: str) -> Entry | None:
        validate_key(key)
        await anyio.lowlevel.checkpoint()
        return self._live(key)

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
    ) -> Change:
        validate_key(key)
        check_ttl(ttl)
        check_expected_version(expected_version)
        await anyio.lowlevel.checkpoint()
        return self._write(key, value, ttl, expected_version)

    def _write(
        self, key: str, value: bytes, ttl: timedelta | None, expected_version: int | None
    ) -> Change:
        current = self._live(key)
        version = current.version if current else 0
        if expected_version is not None and expected_version != version:
            raise conflict(key, expected_version, version)
        now = datetime.now(UTC)
        self._entries[key] = Entry(
            key=key,
            value=value,
            version=version + 1,
            created_at=current.created_at if current else now,
            updated_at=now,
            expires_at=now + ttl if ttl else None,
        )
        old = current.value if current else None
        change = Change(key, ChangeOp.SET, old, value, version + 1, now)
        self._fanout.publish(change)  # in the same step as the write
        return change

    async def delete(self, key: str, *, expected_version: int | None = None) -> Change | None:
        validate_key(key)
        check_expected_version(expected_version)
        await anyio.lowlevel.checkpoint()
        return self._drop(key, expected_version)

    def _drop(self, key: str, expected_version: int | None) -> Change | None:
        current = self._live(key)
        version = current.version if current else 0
        if expected_version is not None and expected_version != version:
            raise conflict(key, expected_version, version)
        if current is None:
            return None
        del self._entries[key]
        change = Change(key, ChangeOp.DELETE, current.value, None, version, datetime.now(UTC))
        self._fanout.publish(change)
        return change

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        validate_pattern(pattern)
        await anyio.lowlevel.checkpoint()
        for key in [k for k in self._entries if glob_match(pattern, k)]:
            if self._live(key) is not None:
                yield key

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER
    ) -> AbstractAsyncContextManager[AsyncIterator[Change]]:
        return self._fanout.subscribe(validate_pattern(pattern), max_buffer)

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        validate_key(index)
        checked = check_index_members(members)
        await anyio.lowlevel.checkpoint()
        return self._index_add(index, checked)

    def _index_add(self, index: str, members: dict[str, float]) -> int:
        scores = self._indexes.setdefault(index, {})
        added = len(members.keys() - scores.keys())
        scores.update(members)
        return added

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        validate_key(index)
        await anyio.lowlevel.checkpoint()
        return self._index_remove(index, members)

    def _index_remove(self, index: str, members: Sequence[str]) -> int:
        scores = self._indexes.get(index, {})
        return sum(scores.pop(member, None) is not None for member in set(members))

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        validate_key(index)
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        return self._index_range(index, limit)

    def _index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        ranked = sorted(self._indexes.get(index, {}).items(), key=lambda item: (item[1], item[0]))
        return ranked if limit is None else ranked[:limit]

    async def transact(
        self, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp] = ()
    ) -> TxnResult:
        # Optional: without this method the base class raises UnsupportedOperationError, the
        # contract's transaction tests skip, and the managers use the single-key calls.
        compare, then, orelse = check_transaction(compare, then, orelse)  # all, before anything
        await anyio.lowlevel.checkpoint()
        # Nothing awaits from here to the return: on one event loop, the step is atomic.
        holds = all(
            self._version(item.key) == item.version
            if isinstance(item, Version)
            else self._version(item.key) > 0
            for item in compare
        )
        return TxnResult(holds, [self._run(op) for op in (then if holds else orelse)])

    def _version(self, key: str) -> int:
        entry = self._live(key)
        return entry.version if entry else 0

    def _run(self, op: TxnOp) -> Any:
        match op:
            case Get(key=key):
                return self._live(key)
            case Put(key=key, value=value, ttl=ttl):
                return self._write(key, value, ttl, None)
            case Delete(key=key):
                return self._drop(key, None)
            case IndexAdd(index=index, members=members):
                return self._index_add(index, dict(members))
            case IndexRemove(index=index, members=members):
                return self._index_remove(index, members)
            case IndexIncr(index=index, member=member, delta=delta):
                score = self._indexes.get(index, {}).get(member, 0.0) + delta
                self._index_add(index, {member: score})
                return score
            case IndexRange(index=index, limit=limit):
                return self._index_range(index, limit)

    async def aclose(self) -> None:
        self._fanout.close()  # ends every subscription's iteration


async def main() -> None:
    # Registered once, the name works wherever a backend name or URL does.
    register_backend("dict", DictBackend.from_url)
    async with StateManager(StateConfig(backend="dict")) as state:
        await state.save("agent:1", {"status": "running"})
        await state.update("agent:1", {"progress": 0.5})
        print(await state.get("agent:1"))
        assert await state.get("agent:1") == {"status": "running", "progress": 0.5}
    async with open_backend("dict://") as backend:
        assert isinstance(backend, DictBackend)


if __name__ == "__main__":
    anyio.run(main)
