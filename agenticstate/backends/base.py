r"""The contract every backend implements: a versioned byte store with expiry, scans and events.

`StateManager` does serialization, validation of values, callbacks and logging once, above every
backend; a backend stores bytes. The contract test suite (`agenticstate.testing.BackendContract`,
public so a third-party backend runs it too) runs against every backend, and a backend is done
when it passes all of it.

The rules, which every backend follows exactly:

- **Keys** are valid per `agenticstate._keys.validate_key`; an invalid key raises `InvalidKeyError`
  and changes nothing. A backend's `key_prefix` namespaces its keys: keys are given and returned
  without it, and no call can reach a key outside the prefix.
- **Missing** means never written, deleted, or expired. A missing key reads as `None`, is not
  listed by `scan`, and satisfies `expected_version=0`.
- **Versions.** A key's first write gives it version 1, and every later write adds exactly one.
  Deleting a key (or its expiry) removes its version with it: written again, it starts at 1.
- **Revisions** (a backend with `has_revisions`; every backend agenticstate ships). Every write
  and every delete also gets a revision: an int >= 1, unique and increasing within the store (on
  Redis Cluster, within a slot), never given again, whatever is deleted, expires, trimmed,
  compacted or reopened since (etcd's `mod_revision`). An `Entry` carries the revision of the
  write that made it (`revision`) and of the write that created the key's current life
  (`create_revision`; equal to `revision` after the first write). A `Change` carries its own
  revision (a delete's is new, not the deleted entry's). So a revision read from an earlier
  life of a key never matches the key again, where a version does (the ABA problem). A backend
  without revisions reports 0 for all three and refuses `expected_revision` and `Revision`
  compares with `UnsupportedOperationError`.
- **expected_version** on `set` and `delete`: `None` writes unconditionally; `0` requires that the
  key is missing; `n > 0` requires that the key exists at version `n`. A mismatch raises
  `ConflictError` (with `expected` and `actual`, 0 for missing) and changes nothing.
- **expected_revision** on `set` and `delete`, the same with revisions: `0` requires that the
  key is missing; `n > 0` that its current revision (the `Entry.revision`) is `n`. A mismatch
  raises `ConflictError` (with `expected` and `actual` revisions, 0 for missing) and changes
  nothing. One call takes `expected_version` or `expected_revision`, not both
  (`InvalidArgumentError`).
- **TTL.** `ttl=None` stores the key with no expiry; a positive `timedelta` makes it expire that
  long after the write. Every write states its TTL: writing a key again replaces its expiry. A
  TTL that is not positive raises `InvalidArgumentError`. Expiry emits no change event.
- **Atomic write-and-emit.** A write and its change event are one step: every subscriber whose
  pattern matches the key sees the change exactly as it committed, with the old and new bytes and
  the new version (for a delete, the version that was deleted), in commit order for each key.
  Across keys no order is promised (on Redis Cluster, each shard's changes travel apart).
- **Globs** follow Redis (`agenticstate._glob`): `*`, `?`, `[...]`, `[^...]`, `\` escapes;
  `*` crosses `:`. An invalid pattern raises `InvalidPatternError`.
- **Subscriptions** (`changes`) are active once the context manager has been entered: every change
  committed after that is delivered. Each has a bounded buffer of `max_buffer` changes; a subscriber
  that falls further behind receives what was buffered and then `SubscriptionClosedError` with
  `reason="overflow"`, so it knows to re-read state. It is never dropped silently. When the backend
  closes, iteration ends.
- **Sorted indexes** (`index_add`, `index_remove`, `index_range`) are named sets of members with
  float scores, read in ascending score order (ties by member), in a namespace of their own. A
  score is any 64-bit float but NaN: `inf` and `-inf` are scores (as in Redis), sorted after and
  before every other, and copied, exported and imported like any; they
  are never returned by `get`, listed by `scan` or announced as changes. Each call is atomic;
  Redis keeps them as sorted sets, the other backends in memory (the file backend logs them).
  Managers use them where a scan of keys would not scale (a task queue's pending tasks).
- **Transactions** (`transact`): compares (`Version`, `Revision`, `Exists`) and then one of two
  lists of operations (`Get`, `Put`, `Delete`, `IndexAdd`, `IndexRemove`, `IndexIncr`,
  `IndexRange`), all in one atomic step, modelled on etcd's `Txn`. See `Backend.transact`; a
  backend that cannot run it atomically raises `UnsupportedOperationError`, and callers fall
  back to the calls above.
- **The change feed** (`changes(..., since=cursor)`, `feed_cursor`): every write also appends its
  change to a durable feed in the same atomic step, kept under the backend's `FeedRetention` (the
  last `max_changes`, none older than `max_age`). Every `Change` a subscription yields carries its
  `cursor` (an opaque `str`); `since=cursor` first replays the retained changes after it that
  match the pattern, in feed order, then follows live: no gap, no duplicate. A cursor whose
  successors were trimmed raises `CursorExpiredError` on entry, never a silent gap. `EARLIEST`
  replays everything retained. A backend with the feed off (`feed=None`) yields `cursor=None`
  and refuses `since=` with `UnsupportedOperationError`.
- **History** (`keep_history`, `history`, `get_version`): a writer keeps the last `depth`
  versions of each key matching a history rule, in the same atomic step as the write. A delete
  or an expiry ends a key's history (its versions restart at 1, and so does its history).
- **Errors.** Storage failures raise `BackendError` subclasses; library exceptions (`OSError`,
  redis, msgpack) never leak.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio

from agenticstate._keys import escape_glob, validate_key
from agenticstate._retry import backoff  # re-exported: backends import it from here
from agenticstate.config import FeedRetention, HistoryRules  # defined with StateConfig
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

__all__ = [
    "DEFAULT_MAX_BUFFER",
    "DEFAULT_UPDATE_ATTEMPTS",
    "EARLIEST",
    "Backend",
    "Change",
    "ChangeOp",
    "Delete",
    "Entry",
    "EntryStat",
    "Exists",
    "FeedRetention",
    "FeedSize",
    "Get",
    "HistoryRules",
    "IndexAdd",
    "IndexIncr",
    "IndexRange",
    "IndexRemove",
    "Put",
    "Revision",
    "TxnCompare",
    "TxnOp",
    "TxnResult",
    "Version",
    "backoff",
    "check_expected",
    "check_expected_revision",
    "check_expected_version",
    "check_index_members",
    "check_limit",
    "check_transaction",
    "check_ttl",
    "conflict",
    "new_change",
    "new_entry",
    "utcnow",
]

DEFAULT_MAX_BUFFER = 1000
"""Changes a subscription buffers before it overflows."""
DEFAULT_UPDATE_ATTEMPTS = 64
"""Compare-and-set attempts `Backend.update` makes before it gives up with `ConflictError`."""
_SCAN_BATCH = 1000  # keys per list in the default `Backend.scan_batches`


def utcnow() -> datetime:
    """Return the current time as an aware UTC datetime."""
    return datetime.now(UTC)


class ChangeOp(StrEnum):
    """What happened to a key."""

    SET = "set"
    """The key was written (created or replaced)."""
    DELETE = "delete"
    """The key was deleted."""
    RESYNC = "resync"
    """The key's state was re-read after a gap in delivery (a reconnect); `old` may be unknown."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A stored value with its metadata.

    Attributes:
        key: The key, without the backend's prefix.
        value: The stored bytes.
        version: 1 after the first write, one more after each later write.
        created_at: When the key was first written (since it was last missing).
        updated_at: When it was last written.
        expires_at: When it expires, or `None` for never.
        revision: The revision of the write that made this version (etcd's `mod_revision`):
            unique and increasing within the store, never given twice. 0 from a backend that
            keeps no revisions (`Backend.has_revisions`).
        create_revision: The revision of the write that created the key's current life (its
            version 1); a key deleted or expired and written again gets a new one.
    """

    key: str
    value: bytes
    version: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None = None
    revision: int = 0
    create_revision: int = 0

    def ttl(self, now: datetime | None = None) -> timedelta | None:
        """Return the time left before expiry, or `None` if the key never expires."""
        if self.expires_at is None:
            return None
        return max(self.expires_at - (now or utcnow()), timedelta(0))


@dataclass(frozen=True, slots=True)
class EntryStat:
    """An entry's metadata and stored size, without its value (`Backend.stat_many`).

    Attributes:
        key: The key, without the backend's prefix.
        size: The stored value's length in bytes (as `Backend.value_sizes` gives it).
        version: As in `Entry`.
        created_at: As in `Entry`.
        updated_at: As in `Entry`.
        expires_at: As in `Entry`.
    """

    key: str
    size: int
    version: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None = None

    def ttl(self, now: datetime | None = None) -> timedelta | None:
        """Return the time left before expiry, or `None` if the key never expires."""
        if self.expires_at is None:
            return None
        return max(self.expires_at - (now or utcnow()), timedelta(0))


@dataclass(frozen=True, slots=True)
class FeedSize:
    """How much a backend's change feed holds now (`Backend.feed_size`).

    Attributes:
        changes: Changes retained.
        bytes: What they hold, as `FeedRetention.max_bytes` counts it: keys, headers and the
            values carried inline, plus the values the feed keeps after the store let them go
            (old values of overwritten and deleted keys). A value still in the store is held
            by reference and not counted.
    """

    changes: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Change:
    """One committed change to one key, exactly as it happened.

    Attributes:
        key: The key, without the backend's prefix.
        op: What happened.
        old: The bytes before the change, or `None` if the key was missing (or, for `RESYNC`,
            unknown).
        new: The bytes after the change, or `None` after a delete.
        version: The version written; for a delete, the version that was deleted.
        timestamp: When the change committed.
        cursor: This change's place in the backend's durable feed: pass it as `since=` to
            `changes` to resume right after it. `None` when the backend's feed is off, and for
            a `RESYNC` change (which is no change of the feed).
        revision: The revision of this change: for a write, the new entry's `revision`; a
            delete gets a revision of its own (as in etcd). For a `RESYNC`, the revision of the
            entry re-read (0 after a delete). 0 from a backend that keeps no revisions.
    """

    key: str
    op: ChangeOp
    old: bytes | None
    new: bytes | None
    version: int
    timestamp: datetime
    cursor: str | None = None
    revision: int = 0


# Hot-path constructors. A frozen dataclass's `__init__` sets each field through
# `object.__setattr__`; writing the slots directly builds the same object in a third of the time.
_new = object.__new__


def _slot_setters(cls: type, names: str) -> list[Callable[[object, object], None]]:
    return [vars(cls)[name].__set__ for name in names.split()]


(
    _set_key,
    _set_value,
    _set_version,
    _set_created,
    _set_updated,
    _set_expires,
    _set_revision,
    _set_create_revision,
) = _slot_setters(
    Entry, "key value version created_at updated_at expires_at revision create_revision"
)
(
    _set_change_key,
    _set_op,
    _set_old,
    _set_new,
    _set_change_version,
    _set_timestamp,
    _set_cursor,
    _set_change_revision,
) = _slot_setters(Change, "key op old new version timestamp cursor revision")


def new_entry(
    key: str,
    value: bytes,
    version: int,
    created_at: datetime,
    updated_at: datetime,
    expires_at: datetime | None,
    revision: int = 0,
    create_revision: int = 0,
) -> Entry:
    """Build an `Entry` (equal to `Entry(...)` with the same fields), fast."""
    entry: Entry = _new(Entry)
    _set_key(entry, key)
    _set_value(entry, value)
    _set_version(entry, version)
    _set_created(entry, created_at)
    _set_updated(entry, updated_at)
    _set_expires(entry, expires_at)
    _set_revision(entry, revision)
    _set_create_revision(entry, create_revision)
    return entry


def new_change(
    key: str,
    op: ChangeOp,
    old: bytes | None,
    new: bytes | None,
    version: int,
    timestamp: datetime,
    cursor: str | None = None,
    revision: int = 0,
) -> Change:
    """Build a `Change` (equal to `Change(...)` with the same fields), fast."""
    change: Change = _new(Change)
    _set_change_key(change, key)
    _set_op(change, op)
    _set_old(change, old)
    _set_new(change, new)
    _set_change_version(change, version)
    _set_timestamp(change, timestamp)
    _set_cursor(change, cursor)
    _set_change_revision(change, revision)
    return change


# The change feed and per-key history.

EARLIEST = "earliest"
"""`since=EARLIEST`: replay every change the feed still retains, then follow live."""


# Transactions (`Backend.transact`): compares, then operations, in one atomic step.


@dataclass(frozen=True, slots=True)
class Version:
    """Compare: `key` is at `version` (0: the key is missing)."""

    key: str
    version: int


@dataclass(frozen=True, slots=True)
class Revision:
    """Compare: `key`'s current revision (its `Entry.revision`) is `revision` (0: missing).

    Unlike `Version`, a revision read from an earlier life of the key (before a delete or an
    expiry) never matches again. A backend without revisions refuses it
    (`UnsupportedOperationError`).
    """

    key: str
    revision: int


@dataclass(frozen=True, slots=True)
class Exists:
    """Compare: `key` is present (written and not expired)."""

    key: str


@dataclass(frozen=True, slots=True)
class Get:
    """Operation: read `key`; its result is the `Entry`, or `None` if missing."""

    key: str


@dataclass(frozen=True, slots=True)
class Put:
    """Operation: store `value` at `key` with `ttl`; its result is the `Change`.

    It bumps the version and emits the change, as `set` does.
    """

    key: str
    value: bytes
    ttl: timedelta | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """Operation: delete `key`; its result is the `Change`, or `None` if it was missing.

    It emits the change, as `delete` does.
    """

    key: str


@dataclass(frozen=True, slots=True)
class IndexAdd:
    """Operation: `index_add`; its result is how many members were new."""

    index: str
    members: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class IndexRemove:
    """Operation: `index_remove`; its result is how many members were there."""

    index: str
    members: Sequence[str]


@dataclass(frozen=True, slots=True)
class IndexIncr:
    """Operation: add `delta` to `member`'s score in `index`; its result is the new score.

    A member that is not there is added with score `delta`: a counter. Scores are 64-bit floats:
    exact for whole numbers up to 2**53, and a sum past about 1.8e308 becomes an infinite score
    on every backend (as Redis's ZINCRBY does), a score like any other. `delta` itself must be
    finite: an infinite one could meet the opposite infinity and make NaN, which no score is.
    """

    index: str
    member: str
    delta: float


@dataclass(frozen=True, slots=True)
class IndexRange:
    """Operation: `index_range`; its result is the list of `(member, score)`, lowest first."""

    index: str
    limit: int | None = None


TxnCompare = Version | Revision | Exists
"""A condition of `Backend.transact`."""
TxnOp = Get | Put | Delete | IndexAdd | IndexRemove | IndexIncr | IndexRange
"""An operation of `Backend.transact`."""


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What `Backend.transact` did.

    Attributes:
        succeeded: Every compare held, so `then` ran (else `orelse` ran).
        results: One result per operation of the branch that ran, in order (see each
            operation's class for what it returns).
    """

    succeeded: bool
    results: list[Any]


def _checked_compare(compare: object) -> TxnCompare:
    if type(compare) is Version:
        validate_key(compare.key)
        if type(compare.version) is not int or compare.version < 0:
            raise InvalidArgumentError(
                f"Version({compare.key!r}) needs an int >= 0, not {compare.version!r}"
            )
        return compare
    if type(compare) is Revision:
        validate_key(compare.key)
        if type(compare.revision) is not int or compare.revision < 0:
            raise InvalidArgumentError(
                f"Revision({compare.key!r}) needs an int >= 0, not {compare.revision!r}"
            )
        return compare
    if type(compare) is Exists:
        validate_key(compare.key)
        return compare
    raise InvalidArgumentError(
        f"a transaction compare is Version, Revision or Exists, not {type(compare).__name__}"
    )


def _checked_op(op: object) -> TxnOp:
    if type(op) is Get or type(op) is Delete:
        validate_key(op.key)
        return op
    if type(op) is Put:
        validate_key(op.key)
        check_ttl(op.ttl)
        value = op.value
        if type(value) is not bytes:
            if not isinstance(value, (bytearray, memoryview)):
                raise InvalidArgumentError(
                    f"Put({op.key!r}) stores bytes, not {type(value).__name__}"
                )
            return Put(op.key, bytes(value), op.ttl)
        return op
    if type(op) is IndexAdd:
        validate_key(op.index)
        if not hasattr(op.members, "items"):
            raise InvalidArgumentError(f"IndexAdd({op.index!r}) takes a mapping of member: score")
        return IndexAdd(op.index, check_index_members(op.members))
    if type(op) is IndexRemove:
        validate_key(op.index)
        if isinstance(op.members, (str, bytes)) or not hasattr(op.members, "__iter__"):
            raise InvalidArgumentError(f"IndexRemove({op.index!r}) takes a list of members")
        return IndexRemove(op.index, [validate_key(member) for member in op.members])
    if type(op) is IndexIncr:
        validate_key(op.index)
        delta = op.delta
        if type(delta) is int or (type(delta) is float and delta - delta == 0.0):
            # The common case (a finite number), checked as `check_index_members` checks it.
            validate_key(op.member)
            if type(delta) is float:
                return op
            try:
                return IndexIncr(op.index, op.member, float(delta))
            except OverflowError:  # an int beyond a float's range
                raise InvalidArgumentError(
                    f"IndexIncr delta for {op.member!r} is beyond a 64-bit float's range"
                ) from None
        delta = check_index_members({op.member: op.delta})[op.member]
        if delta in (_INF, -_INF):
            raise InvalidArgumentError(f"IndexIncr delta for {op.member!r} must be finite")
        return IndexIncr(op.index, op.member, delta)
    if type(op) is IndexRange:
        validate_key(op.index)
        check_limit(op.limit)
        return op
    raise InvalidArgumentError(f"not a transaction operation: {type(op).__name__}")


def check_transaction(
    compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp]
) -> tuple[list[TxnCompare], list[TxnOp], list[TxnOp]]:
    """Validate a transaction's compares and operations, all of them, before any runs.

    Returns them normalized (index scores as floats, values as `bytes`).

    Raises:
        InvalidArgumentError: A compare or operation is invalid (`InvalidKeyError` for a key).
    """
    for part in (compare, then, orelse):
        if isinstance(part, (str, bytes)) or not hasattr(part, "__iter__"):
            raise InvalidArgumentError("compare, then and orelse are sequences")
    return (
        [_checked_compare(item) for item in compare],
        [_checked_op(item) for item in then],
        [_checked_op(item) for item in orelse],
    )


def check_ttl(ttl: timedelta | None) -> timedelta | None:
    """Return `ttl` if it is `None` or a positive `timedelta`.

    Raises:
        InvalidArgumentError: `ttl` is not a timedelta, or is zero or negative.
    """
    if ttl is None:
        return None
    if not isinstance(ttl, timedelta):
        raise InvalidArgumentError(f"ttl must be a timedelta or None, not {type(ttl).__name__}")
    if ttl <= timedelta(0):
        raise InvalidArgumentError(f"ttl must be positive, not {ttl}")
    try:
        utcnow() + ttl
    except OverflowError:
        raise InvalidArgumentError(
            f"ttl {ttl} is too long: it ends after the year 9999; give None for no expiry"
        ) from None
    return ttl


def check_index_members(members: Mapping[str, float]) -> dict[str, float]:
    """Validate index members (each a valid key-like str) and scores (numbers, not NaN).

    Infinite scores are valid (see the module docstring): a counter that overflowed holds one,
    and refusing them where `IndexIncr` makes them broke copies of such an index part-way.

    Raises:
        InvalidArgumentError: A member or score is invalid.
    """
    checked: dict[str, float] = {}
    for member, score in members.items():
        validate_key(member)
        if isinstance(score, bool) or not isinstance(score, (int, float)) or score != score:
            raise InvalidArgumentError(f"index score for {member!r} must be a number")
        try:
            checked[member] = float(score)
        except OverflowError:  # an int beyond a float's range
            raise InvalidArgumentError(
                f"index score for {member!r} is beyond a 64-bit float's range"
            ) from None
    return checked


_INF = float("inf")


def check_limit(limit: int | None) -> int | None:
    """Return `limit` if it is None or an int >= 0.

    Raises:
        InvalidArgumentError: It is negative or not an int.
    """
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InvalidArgumentError(f"limit must be an int >= 0 or None, not {limit!r}")
    return limit


def check_expected_version(expected_version: int | None) -> int | None:
    """Return `expected_version` if it is `None` or an int >= 0.

    Raises:
        InvalidArgumentError: It is negative or not an int.
    """
    if expected_version is None:
        return None
    if type(expected_version) is not int or expected_version < 0:
        raise InvalidArgumentError(
            f"expected_version must be an int >= 0 or None, not {expected_version!r}"
        )
    return expected_version


def check_expected_revision(expected_revision: int | None) -> int | None:
    """Return `expected_revision` if it is `None` or an int >= 0.

    Raises:
        InvalidArgumentError: It is negative or not an int.
    """
    if expected_revision is None:
        return None
    if type(expected_revision) is not int or expected_revision < 0:
        raise InvalidArgumentError(
            f"expected_revision must be an int >= 0 or None, not {expected_revision!r}"
        )
    return expected_revision


def check_expected(
    expected_version: int | None, expected_revision: int | None
) -> tuple[int | None, int | None]:
    """Check a write's condition: at most one of `expected_version`, `expected_revision`.

    Raises:
        InvalidArgumentError: Both are given, or one is not an int >= 0 or None.
    """
    if expected_version is not None and expected_revision is not None:
        raise InvalidArgumentError(
            "give expected_version or expected_revision, not both (a revision names one "
            "version of one life of the key already)"
        )
    return check_expected_version(expected_version), check_expected_revision(expected_revision)


def conflict(key: str, expected: int, actual: int, *, what: str = "version") -> ConflictError:
    """Build the `ConflictError` for a version (or, `what="revision"`, revision) mismatch."""
    found = "missing" if actual == 0 else f"at {what} {actual}"
    wanted = "missing" if expected == 0 else f"at {what} {expected}"
    return ConflictError(
        f"key {key!r} is {found}, expected {wanted}", key=key, expected=expected, actual=actual
    )


class Backend(ABC):
    """Async versioned byte store with expiry, glob scans and glob-pattern change events.

    Use it as an async context manager, or call `open()` and `aclose()`. Every call also opens the
    backend lazily, so `open()` is optional.
    """

    key_prefix: str = ""
    preferred_format: Literal["msgpack", "json"] | None = None
    """The value encoding this backend would like (a JSON file store wants readable JSON)."""
    has_revisions: bool = False
    """Whether this backend gives every write a revision (see "Revisions" above).

    `False` (this default) for a backend written before revisions: its entries and changes carry
    revision 0, and `StateManager` refuses `expected_revision` and `Revision` compares on it
    with `UnsupportedOperationError`. A backend that keeps revisions sets it to `True` and
    takes `expected_revision=` in `set` and `delete`.
    """

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:  # noqa: B027  # optional hook: most backends open lazily
        """Connect or load; idempotent. Backends that need no setup keep this no-op."""

    @abstractmethod
    async def get(self, key: str) -> Entry | None:
        """Return the entry stored at `key`, or `None` if it is missing or expired."""

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Return the entries at `keys`, in order, `None` for each missing one.

        Backends override this to read all keys in one round trip.
        """
        return [await self.get(key) for key in keys]

    async def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Return the stored size in bytes of each key's value, in order, `None` if missing.

        `StateManager.usage` adds these up. The default reads the entries with `get_many`;
        a backend that can measure without reading the values (Redis: STRLEN) overrides it.
        """
        return [None if entry is None else len(entry.value) for entry in await self.get_many(keys)]

    async def stat_many(self, keys: Sequence[str]) -> list[EntryStat | None]:
        """Return each key's metadata and stored size, in order, `None` if missing.

        For listings that show versions and sizes but not values (the web inspector). The
        default reads the entries with `get_many`; a backend that can read the metadata without
        the values (Redis: the record's header and STRLEN) overrides it, so that a listing's
        cost does not grow with the size of the values.
        """
        return [
            None
            if entry is None
            else EntryStat(
                key=entry.key,
                size=len(entry.value),
                version=entry.version,
                created_at=entry.created_at,
                updated_at=entry.updated_at,
                expires_at=entry.expires_at,
            )
            for entry in await self.get_many(keys)
        ]

    @abstractmethod
    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change:
        """Store `value` at `key`, bump its version and emit the change, atomically.

        The write gets the store's next revision; the key's `create_revision` is that revision
        when the key was missing, else it stays.

        Raises:
            ConflictError: `expected_version` or `expected_revision` does not match; nothing
                was written.
            InvalidArgumentError: Both are given.
            UnsupportedOperationError: `expected_revision` on a backend without revisions.
        """

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """Store several values; each one is atomic, the batch is not a transaction.

        Backends override this to write all keys in one round trip.
        """
        return [await self.set(key, value, ttl=ttl) for key, value in items]

    @abstractmethod
    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Change | None:
        """Delete `key` and emit the change; return `None` if it was missing.

        The delete gets a revision of its own (the change's `revision`).

        Raises:
            ConflictError: `expected_version` or `expected_revision` does not match; nothing
                was deleted. A missing key with `0` expected is not a conflict: the call
                returns `None`.
            InvalidArgumentError: Both are given.
            UnsupportedOperationError: `expected_revision` on a backend without revisions.
        """

    async def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Change:
        """Replace the value at `key` with `fn(current_entry)`, atomically.

        `fn` receives the current entry (`None` if missing) and returns the new bytes. It may run
        more than once, so it must not have side effects; if it raises, nothing is written and the
        exception propagates. This default is a compare-and-set loop over `get` and `set` with
        jittered backoff (on the revision read, where the backend keeps revisions, so a key
        deleted and written again meanwhile is read again); backends with a lock run `fn` under
        it instead.

        Raises:
            ConflictError: Every attempt lost a race (`max_attempts` of them).
        """
        for attempt in range(max_attempts):
            entry = await self.get(key)
            value = fn(entry)
            try:
                if self.has_revisions:
                    return await self.set(
                        key, value, ttl=ttl, expected_revision=entry.revision if entry else 0
                    )
                return await self.set(
                    key, value, ttl=ttl, expected_version=entry.version if entry else 0
                )
            except ConflictError:
                await anyio.sleep(backoff(attempt))
        raise ConflictError(
            f"update of {key!r} lost {max_attempts} races in a row; try again", key=key
        )

    @abstractmethod
    def scan(self, pattern: str) -> AsyncIterator[str]:
        """Yield every present key matching the Redis glob `pattern`, each once, in no order."""

    async def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        """Yield the keys `scan(pattern)` would, in lists (each key once over all of them).

        For callers that want every key (`StateManager.list_keys`): a backend that reads keys
        in pages (SCAN on Redis) hands each page over whole, with no step per key. The default
        gathers `scan` into lists of up to 1,000.
        """
        batch: list[str] = []
        async for key in self.scan(pattern):
            batch.append(key)
            if len(batch) >= _SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    async def scan_tags(self, prefix: str) -> list[str]:
        """The distinct hash tags of the present keys starting `<prefix>{`, sorted.

        A key's tag is its text between that `{` and the next `}` (`agents:{a1}:ckpt:7` under
        `agents:` has the tag `a1`; `agents:{a}x}:y` has `a`); a key with no `}` there has none.
        One tag per entity, however many keys it has: the managers list their ids so.

        The default reads every key matching `<prefix>{*}*` (`scan_batches`) and keeps one tag
        per group: O(keys under the prefix). The built-in backends seek from one tag to the
        next instead: O(tags x log n).
        """
        validate_key(prefix + "{")
        start = len(prefix) + 1
        tags: set[str] = set()
        async for batch in self.scan_batches(escape_glob(prefix) + "{*}*"):
            tags.update(key[start : key.index("}", start)] for key in batch)
        return sorted(tags)

    @abstractmethod
    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[Change]]:
        """Subscribe to changes of keys matching `pattern`.

        With `since=None` the subscription starts at entry. With `since=cursor` (a `Change`'s
        `cursor`, or `feed_cursor()`), it first yields the retained changes after that cursor
        that match `pattern`, in feed order, then the live ones, with none missed or repeated;
        `since=EARLIEST` replays everything retained.

        Raises (on entry):
            CursorExpiredError: Changes after `since` have been trimmed (or the cursor belongs
                to a store that no longer exists, like a closed memory backend's).
            InvalidArgumentError: `since` is not a cursor of this kind of backend.
            UnsupportedOperationError: `since` was given and the feed is off.

        <!-- snippet: setup=backend -->
        ```python
        async with backend.changes("agent:*") as changes:
            await backend.set("agent:1", b"raw bytes")
            async for change in changes:
                print(change.key, change.version)  # agent:1 1
                break
        ```
        """

    feed: FeedRetention | None = None
    """The change feed's retention, or `None` when this backend keeps no feed."""

    async def feed_cursor(self) -> str | None:
        """The cursor of the newest committed change (the feed's head), or `None` if off.

        `changes(since=await backend.feed_cursor())` misses nothing committed after this call.
        """
        return None

    async def feed_size(self) -> FeedSize | None:
        """What the change feed this store writes holds now, or `None` (no feed, or unknown).

        On Redis, this store's own streams (those of nested or outer prefixes are theirs); on
        SQLite, the database file's one feed.
        """
        return None

    history_rules: HistoryRules = HistoryRules()
    """Which keys keep history; set with `keep_history`."""

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """Keep versions of the keys `rules` names, from this backend's next write on.

        History is kept by the process that writes: every process writing such keys must set
        the same rules. This default raises `UnsupportedOperationError` for non-empty rules.
        """
        rules = rules if isinstance(rules, HistoryRules) else HistoryRules(rules)
        if rules:
            raise UnsupportedOperationError(f"{type(self).__name__} keeps no history")
        self.history_rules = rules

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """The retained versions of `key`, newest (the current one) first, at most `limit`.

        Each `Entry` is the key as that version left it (`updated_at`: when it was written).
        A missing key has no history (`[]`); a key no rule names has only its current version.
        """
        validate_key(key)
        limit = check_limit(limit)
        if limit == 0:
            return []
        entry = await self.get(key)
        return [] if entry is None else [entry]

    async def get_version(self, key: str, version: int) -> Entry | None:
        """Version `version` of `key` if it is retained (and the key is present), else `None`."""
        if type(version) is not int or version < 1:
            raise InvalidArgumentError(f"version must be an int >= 1, not {version!r}")
        for entry in await self.history(key):
            if entry.version == version:
                return entry
        return None

    @abstractmethod
    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members with their scores to a sorted index (re-adding moves them).

        Returns:
            How many members were not in the index before.
        """

    @abstractmethod
    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """Remove members from a sorted index; return how many were there."""

    @abstractmethod
    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Return up to `limit` members with their scores, lowest score first (ties by member)."""

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Check every compare and run `then` if all hold, else `orelse`: one atomic step.

        Modelled on etcd's `Txn`. No other write, by any task or process, comes between the
        compares and the operations; reads in the step see its earlier writes (a `Get` after a
        `Put` of the same key returns the new entry). `Put` and `Delete` emit their changes
        exactly as `set` and `delete` do. Everything is validated before anything runs: an
        invalid compare or operation raises `InvalidArgumentError` (`InvalidKeyError` for a
        key) and changes nothing. Empty `then` and `orelse` make a pure compare.

        <!-- snippet: setup=backend -->
        ```python
        from agenticstate.backends import IndexIncr, Put, Version

        result = await backend.transact(
            [Version("job:1", 0)],  # only while job:1 is missing
            [Put("job:1", b"claimed"), IndexIncr("stats", "claims", 1)],
        )
        print(result.succeeded, result.results[1])  # True 1.0
        ```

        Values stay opaque bytes: a transaction compares versions, revisions and existence,
        never values.
        On Redis Cluster every key and index of one call must hash to one slot (a `{...}` hash
        tag), or it raises `InvalidArgumentError`.

        This default raises `UnsupportedOperationError`: a backend that cannot run the step
        atomically must not pretend to. Callers (the managers) catch it once and fall back to
        the single-key calls (`set` with `expected_version`, `index_add`, ...), as they did
        before transactions existed.

        Raises:
            UnsupportedOperationError: This backend has no atomic transactions.
            InvalidArgumentError: A compare or operation is invalid; nothing ran.
        """
        check_transaction(compare, then, orelse)
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not implement transact(); "
            "use the single-key operations instead"
        )

    async def flush(self) -> None:  # noqa: B027  # optional hook: most backends have nothing to flush
        """Make every acknowledged write durable now (file snapshot); no-op where not needed."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections and files; end every open subscription. Idempotent."""
