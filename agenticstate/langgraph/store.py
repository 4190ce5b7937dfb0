"""`Store`: LangGraph's long-term memory (`BaseStore`) on any `StateManager`.

Key layout (`p` is the store's `prefix`; namespace labels and item keys are percent-encoded, so
`/` and `|` never occur inside them):

| key                          | value                                                     |
|------------------------------|-----------------------------------------------------------|
| `p:label1/label2/...|key`     | `{"value": {...}, "created_at", "updated_at", "ttl"}`     |

Values must be JSON-like (what a `StateManager` stores); TTLs are per item, in minutes, and
expire on every backend. Vector (semantic) search is not supported: `search(query=...)` raises.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    PutOp,
    SearchItem,
    SearchOp,
    TTLConfig,
)

from agenticstate._checks import seconds
from agenticstate.exceptions import ConflictError, InvalidArgumentError
from agenticstate.langgraph._common import check_prefix, decode, encode, run_sync, unwrap_state

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterable

    from anyio.from_thread import BlockingPortal
    from langgraph.store.base import Op, Result

    from agenticstate import sync
    from agenticstate.manager import StateManager

T = TypeVar("T")

__all__ = ["Store"]

_PAGE = 128


class Store(BaseStore):
    """LangGraph's long-term memory store over a `StateManager`.

    Namespaces, `get` / `put` / `delete`, `search` with filters (equality, nested dicts and the
    `$eq`, `$ne`, `$gt`, `$gte`, `$lt`, `$lte` operators) and pagination, `list_namespaces` with
    prefix / suffix / depth, and per-item TTL (refreshed on read unless told otherwise).

    Args:
        state: The state manager to keep items in (the caller opens and closes it), or an
            `agenticstate.sync.StateManager`, whose loop then runs `batch`.
        prefix: The first segment of every key.
        ttl: LangGraph's `TTLConfig` (`default_ttl` in minutes, `refresh_on_read`).
        portal: Where the synchronous `batch` runs `abatch` (see `CheckpointSaver`).
    """

    supports_ttl = True

    def __init__(
        self,
        state: StateManager | sync.StateManager,
        *,
        prefix: str = "langgraph-store",
        ttl: TTLConfig | None = None,
        portal: BlockingPortal | None = None,
    ) -> None:
        self.state, self._runner = unwrap_state(state)
        self.prefix = check_prefix(prefix)
        self.ttl_config = ttl
        self.portal = portal

    def _sync(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        return run_sync(self.portal, fn, *args, runner=self._runner)

    def __repr__(self) -> str:
        return f"Store(state={self.state!r}, prefix={self.prefix!r})"

    def _ns(self, namespace: tuple[str, ...]) -> str:
        return "/".join(encode(label) for label in namespace)

    def _key(self, namespace: tuple[str, ...], key: str) -> str:
        return f"{self.prefix}:{self._ns(namespace)}|{encode(key)}"

    def _parse(self, key: str) -> tuple[tuple[str, ...], str]:
        body = key[len(self.prefix) + 1 :]
        ns, _, item = body.rpartition("|")
        return tuple(decode(label) for label in ns.split("/")) if ns else (), decode(item)

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Blocking `abatch` (through `portal`)."""
        return self._sync(self.abatch, list(ops))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run the operations in order and return one result each."""
        results: list[Result] = []
        for op in ops:
            if isinstance(op, GetOp):
                results.append(await self._get(op))
            elif isinstance(op, PutOp):
                await self._put(op)
                results.append(None)
            elif isinstance(op, SearchOp):
                results.append(await self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(await self._list_namespaces(op))
            else:
                raise InvalidArgumentError(f"unknown store operation {type(op).__name__}")
        return results

    @staticmethod
    def _item(namespace: tuple[str, ...], key: str, record: dict[str, Any]) -> Item:
        return Item(
            value=record["value"],
            key=key,
            namespace=namespace,
            created_at=datetime.fromisoformat(record["created_at"]),
            updated_at=datetime.fromisoformat(record["updated_at"]),
        )

    async def _refresh(self, key: str, record: dict[str, Any]) -> None:
        """Restart an item's TTL, unless it was changed or deleted meanwhile."""
        minutes = record.get("ttl")
        if minutes is None:
            return
        entry = await self.state.get_entry(key)
        if entry is None or entry.value != record:
            return
        # On the revision read (where the backend keeps them): an item deleted and written
        # again meanwhile is not refreshed, whatever its version.
        condition = (
            {"expected_revision": entry.revision}
            if self.state.backend.has_revisions
            else {"expected_version": entry.version}
        )
        try:
            await self.state.save(key, record, ttl=timedelta(minutes=minutes), **condition)
        except ConflictError:
            return  # a newer write carries its own TTL

    async def _get(self, op: GetOp) -> Item | None:
        key = self._key(op.namespace, op.key)
        record = await self.state.get(key)
        if record is None:
            return None
        if op.refresh_ttl:
            await self._refresh(key, record)
        return self._item(op.namespace, op.key, record)

    async def _put(self, op: PutOp) -> None:
        if op.index not in (None, False):
            raise InvalidArgumentError("this store has no vector index: pass index=False or None")
        if not op.namespace or any(not label or "." in label for label in op.namespace):
            raise InvalidArgumentError(f"invalid namespace {op.namespace!r}")
        key = self._key(op.namespace, op.key)
        if op.value is None:
            await self.state.delete(key)
            return
        now = datetime.now(UTC).isoformat()
        ttl = None if op.ttl is None else seconds(op.ttl, "ttl", unit="minutes")

        def write(current: dict[str, Any] | None) -> dict[str, Any]:
            return {
                "value": dict(op.value or {}),
                "created_at": current["created_at"] if current else now,
                "updated_at": now,
                "ttl": ttl,
            }

        life = None if ttl is None else timedelta(minutes=ttl)
        await self.state.update(key, write, default=None, ttl=life)

    async def _records(self, pattern: str) -> dict[str, Any]:
        keys = await self.state.list_keys(pattern)
        found: dict[str, Any] = {}
        for start in range(0, len(keys), _PAGE):
            found.update(await self.state.get_many(keys[start : start + _PAGE]))
        return found

    async def _search(self, op: SearchOp) -> list[SearchItem]:
        if op.query:
            raise InvalidArgumentError("this store has no vector index: search without query=")
        prefix = self._ns(op.namespace_prefix)
        records = await self._records(f"{self.prefix}:{prefix}*")
        hits: list[SearchItem] = []
        for key, record in records.items():
            namespace, item_key = self._parse(key)
            if namespace[: len(op.namespace_prefix)] != op.namespace_prefix:
                continue
            if op.filter and not all(
                _matches(record["value"].get(field), wanted) for field, wanted in op.filter.items()
            ):
                continue
            hits.append(
                SearchItem(
                    namespace=namespace,
                    key=item_key,
                    value=record["value"],
                    created_at=datetime.fromisoformat(record["created_at"]),
                    updated_at=datetime.fromisoformat(record["updated_at"]),
                )
            )
        hits.sort(key=lambda item: (item.updated_at, item.namespace, item.key), reverse=True)
        page = hits[op.offset : op.offset + op.limit]
        if op.refresh_ttl:
            for item in page:
                key = self._key(item.namespace, item.key)
                await self._refresh(key, records[key])
        return page

    async def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        keys = await self.state.list_keys(f"{self.prefix}:*")
        found: set[tuple[str, ...]] = set()
        for key in keys:
            namespace, _ = self._parse(key)
            if not all(_namespace_matches(c, namespace) for c in op.match_conditions or ()):
                continue
            found.add(namespace if op.max_depth is None else namespace[: op.max_depth])
        return sorted(found)[op.offset : op.offset + op.limit]


def _namespace_matches(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    path = condition.path
    if len(namespace) < len(path):
        return False
    pairs = (
        zip(namespace, path, strict=False)
        if condition.match_type == "prefix"
        else zip(reversed(namespace), reversed(path), strict=False)
    )
    return all(wanted in ("*", label) for label, wanted in pairs)


_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": lambda a, b: a == b,
    "$ne": lambda a, b: a != b,
    "$gt": lambda a, b: float(a) > float(b),
    "$gte": lambda a, b: float(a) >= float(b),
    "$lt": lambda a, b: float(a) < float(b),
    "$lte": lambda a, b: float(a) <= float(b),
}


def _matches(value: Any, wanted: Any) -> bool:
    """Compare a stored value with a filter value, as LangGraph's `InMemoryStore` does."""
    if isinstance(wanted, dict):
        if any(key.startswith("$") for key in wanted):
            for operator, operand in wanted.items():
                compare = _OPERATORS.get(operator)
                if compare is None:
                    raise InvalidArgumentError(f"unsupported filter operator {operator!r}")
                try:
                    if not compare(value, operand):
                        return False
                except (TypeError, ValueError):
                    return False  # a number compared with a missing or non-numeric field
            return True
        return isinstance(value, dict) and all(
            _matches(value.get(key), sub) for key, sub in wanted.items()
        )
    if isinstance(wanted, list | tuple):
        return (
            isinstance(value, list | tuple)
            and len(value) == len(wanted)
            and all(_matches(v, w) for v, w in zip(value, wanted, strict=True))
        )
    return bool(value == wanted)
