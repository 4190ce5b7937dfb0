"""Atomic compound steps over values: `StateManager.transact`.

One call checks conditions and, depending on them, runs one of two lists of operations, as one
atomic step on every backend (one Lua script on Redis, one transaction on SQLite, one step under
the store's lock on memory and file), in the manner of etcd's `Txn`:

<!-- snippet: setup=state -->
```python
from agenticstate.txn import Exists, Get, IndexIncr, Put, Version

# Count a hit only when the cached value is there, in one round trip.
result = await state.transact(
    compare=[Exists("cache:q1")],
    then=[Get("cache:q1"), IndexIncr("cache:counters", "hits", 1)],
)
if result.succeeded:
    entry, hits = result.results

# Write only if nobody wrote since version 3 was read.
await state.transact(compare=[Version("cache:q1", 3)], then=[Put("cache:q1", {"answer": 42})])
```

`Revision(key, revision)` compares the key's revision (`StateEntry.revision`) instead of its
version: a revision read before the key was deleted (or expired) and written again never matches
again, where a version does; compare revisions to guard a token or a claim
(`docs/concepts/versions.md`). `TransactResult.revisions` gives each write's revision.

The compares (`Version`, `Revision`, `Exists`) and the index operations (`IndexAdd`, `IndexRemove`,
`IndexIncr`, `IndexRange`) are the backend's own (`agenticstate.backends`); `Get`, `Put` and
`Delete` here take and return values the way `get_entry`, `save` and `delete` do. On a Redis
Cluster every key and index of one call must share a hash tag (`InvalidArgumentError` otherwise,
before anything is sent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agenticstate.backends import base
from agenticstate.backends.base import (
    Exists,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Revision,
    TxnCompare,
    Version,
)
from agenticstate.exceptions import DecodeError, InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from datetime import timedelta

    from pydantic import BaseModel

    from agenticstate._codec import Codec, StateEntry


class _Configured:
    """The default of `Put.ttl`: the configured `StateConfig.ttl`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CONFIGURED"


CONFIGURED: Any = _Configured()
"""`Put`'s default TTL: the one `StateConfig.ttl` configures."""

__all__ = [
    "CONFIGURED",
    "Delete",
    "Exists",
    "Get",
    "IndexAdd",
    "IndexIncr",
    "IndexRange",
    "IndexRemove",
    "Op",
    "Put",
    "Revision",
    "TransactResult",
    "Version",
]


@dataclass(frozen=True, slots=True)
class Get:
    """Operation: read `key`; its result is the `StateEntry` (decoded as `model`), or `None`."""

    key: str
    model: type[BaseModel] | None = None


@dataclass(frozen=True, slots=True)
class Put:
    """Operation: store `value` at `key`; its result is the new version.

    `ttl` is seconds or a timedelta, `None` for never; unset, the configured `StateConfig.ttl`.
    """

    key: str
    value: object
    ttl: timedelta | float | None = CONFIGURED


@dataclass(frozen=True, slots=True)
class Delete:
    """Operation: delete `key`; its result is whether it was there."""

    key: str


Op = Get | Put | Delete | IndexAdd | IndexRemove | IndexIncr | IndexRange
"""An operation of `StateManager.transact`."""


@dataclass(frozen=True, slots=True)
class TransactResult:
    """What `StateManager.transact` did.

    Attributes:
        succeeded: Every compare held, so `then` ran (else `orelse` ran).
        results: One result per operation of the branch that ran, in order: a `StateEntry` or
            `None` for `Get`, the new version for `Put`, whether the key was there for `Delete`,
            and the backend's result for the index operations.
        revisions: One per operation of the branch that ran, in order: the revision of a
            `Put`'s write or of a `Delete` that deleted (a new one, as in etcd), else 0 (and 0
            everywhere on a backend that keeps no revisions).
    """

    succeeded: bool
    results: list[Any]
    revisions: list[int] = field(default_factory=list)


def to_backend(
    ops: Sequence[Op],
    codec: Codec,
    ttl: Callable[[object], timedelta | None],
    done: dict[int, base.Put] | None = None,
) -> list[base.TxnOp]:
    """The backend's operations for `ops`: values encoded, TTLs resolved (nothing written).

    `done`: the `Put`s already mapped, by id, filled as they are: a `Put` in both branches (a
    write that happens either way) is encoded once.
    """
    mapped: list[base.TxnOp] = []
    for op in ops:
        kind = type(op)
        if kind in _BACKEND_OWN:  # the common cases first, by exact type
            mapped.append(op)  # type: ignore[arg-type]  # an index operation
        elif kind is Get:
            mapped.append(base.Get(op.key))  # type: ignore[union-attr]
        elif isinstance(op, Put):
            put = done.get(id(op)) if done is not None else None
            if put is None:
                put = base.Put(op.key, codec.encode(op.key, op.value), ttl(op.ttl))
                if done is not None:
                    done[id(op)] = put
            mapped.append(put)
        elif isinstance(op, Get):
            mapped.append(base.Get(op.key))
        elif isinstance(op, Delete):
            mapped.append(base.Delete(op.key))
        elif isinstance(op, IndexAdd | IndexRemove | IndexIncr | IndexRange):
            mapped.append(op)
        else:
            raise _NotTransactError(f"not a transact operation: {op!r}")
    return mapped


def from_backend(
    ops: Sequence[Op], results: Sequence[Any], codec: Codec, counters: dict[str, int]
) -> tuple[list[Any], list[int]]:
    """The results of `ops` as `StateManager.transact` returns them, and each op's revision.

    One pass: each `Get`'s entry decoded, each write's revision (0 for the other operations),
    and the saves, reads and deletes (of a key that was there) counted in `counters`.
    """
    out: list[Any] = []
    revisions: list[int] = []
    saves = reads = deletes = 0
    for op, result in zip(ops, results, strict=True):
        kind = type(op)
        if kind is Put:  # the common case first, by exact type
            out.append(result.version)
            revisions.append(result.revision)
            saves += 1
        elif kind in _BACKEND_OWN:
            out.append(result)
            revisions.append(0)
        elif isinstance(op, Get):
            out.append(None if result is None else _entry(codec, result, op.model))
            revisions.append(0)
            reads += 1
        elif isinstance(op, Put):
            out.append(result.version)
            revisions.append(result.revision)
            saves += 1
        elif isinstance(op, Delete):
            out.append(result is not None)
            revisions.append(0 if result is None else result.revision)
            deletes += result is not None
        else:
            out.append(result)
            revisions.append(0)
    counters["saves"] += saves
    counters["reads"] += reads
    counters["deletes"] += deletes
    return out, revisions


_BACKEND_OWN = frozenset((IndexAdd, IndexRemove, IndexIncr, IndexRange))
"""The operations passed to the backend as they are (exact types: subclasses go the long way)."""


def _entry(codec: Codec, entry: base.Entry, model: type[BaseModel] | None) -> StateEntry:
    try:
        return codec.state_entry(entry, model)
    except DecodeError as exc:  # DecryptionError too
        # Decoding runs after the step: say so, or a caller would retry a step that happened.
        exc.add_note(
            "the transact step had already committed (its writes happened); only reading "
            f"{entry.key!r} back failed"
        )
        raise


class _NotTransactError(InvalidArgumentError, TypeError):
    """A compare or operation of the wrong type (a `TypeError` too, as it was first)."""


def _listed(part: Iterable[Any], name: str) -> list[Any]:
    # Listed once: a generator read twice (encode, then decode the results) would be empty.
    if isinstance(part, str | bytes) or not hasattr(part, "__iter__"):
        raise _NotTransactError(f"{name} is a sequence, not {type(part).__name__}")
    return list(part)


def check_ops(ops: Iterable[Op], name: str) -> list[Op]:
    """The operations as a list (`then` or `orelse`; each is checked by `to_backend`)."""
    return _listed(ops, name)


def check_compares(compare: Sequence[TxnCompare]) -> list[TxnCompare]:
    """The compares, each checked to be one (their keys are checked by the backend)."""
    listed = _listed(compare, "compare")
    for item in listed:
        if type(item) is not Version and not isinstance(item, Version | Revision | Exists):
            raise _NotTransactError(f"not a transact compare: {item!r}")
    return listed
