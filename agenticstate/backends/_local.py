"""The in-process part the memory and file backends share: entries, expiry, indexes, feed.

Entries with expiry and sorted indexes (`LocalStore`), the retained change feed (`FeedRing`) and
per-key history (`LocalStore.keep`). `run_transaction` is the step that runs a transaction over
a `TxnTarget`; the memory and file backends run it on the event loop, SQLite in its writer
thread. `feed_from_query` reads the
feed's URL parameters (`feed=off`, `feed_max_changes=N`, `feed_max_age=SECONDS`).
"""

from __future__ import annotations

import heapq
from collections import deque
from datetime import timedelta
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol

from agenticstate._glob import compile_glob
from agenticstate.backends._index import SortedIndex
from agenticstate.backends._keyorder import (
    SortedKeys,
    after_prefix,
    is_braced,
    skip_plan,
    skip_scan,
    tag_scan,
)
from agenticstate.backends.base import (
    EARLIEST,
    Delete,
    Exists,
    FeedRetention,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Revision,
    TxnResult,
    Version,
)
from agenticstate.exceptions import ConfigurationError, CursorExpiredError, InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from datetime import datetime

    from agenticstate._glob import GlobMatcher
    from agenticstate.backends.base import Change, Entry, TxnCompare, TxnOp

__all__ = ["FeedRing", "LocalStore", "TxnTarget", "feed_from_query", "run_transaction"]

_HEAP_SLACK = 64  # stale heap items tolerated beyond twice the keys (small stores rebuild rarely)


class LocalStore:
    """Entries by key with wall-clock expiry, the keys in order, and named sorted indexes.

    Expired entries are dropped when read and, in order of expiry, whenever `sweep` runs (on
    writes, scans and batch reads), so memory stays bounded without a timer task. The sweep
    pops the expiry heap only while its head is due: it costs what expires, however many keys
    live.

    The expiry heap gets an item per write with a TTL; an item whose key was rewritten or
    deleted since is stale and skipped when popped. So that rewriting one key many times does
    not grow the heap with the write rate, it is rebuilt from the live entries whenever it
    holds more than twice as many items as there are keys (plus `_HEAP_SLACK`): it stays
    bounded by the keys, at an amortized constant cost per write.

    The keys are kept in order (`SortedKeys`) in the same step as each change of the dict (a key
    that appears, one deleted or expired), and the keys holding two `}` or more in a second one:
    a pattern with a literal prefix (`agent:*`) reads that range alone, O(log n + the range), and
    `agents:{*}:recovery` skips from one entity to the next (`skip_scan`). Rewriting a key that
    exists costs nothing more. `unordered()` stops the upkeep for a bulk load; the next listing
    (or `reorder()`) sorts the keys again.
    """

    __slots__ = ("_braced", "_keys", "data", "expiries", "history", "indexes")

    def __init__(self) -> None:
        self.data: dict[str, Entry] = {}
        # The retained versions of keys with a history rule, oldest first, the current one last.
        # A key that goes (deleted or expired) takes its history with it.
        self.history: dict[str, deque[Entry]] = {}
        self.expiries: list[tuple[datetime, str]] = []
        self.indexes: dict[str, SortedIndex] = {}
        # The keys of `data` in order, and those of them with two `}` or more (None: not kept).
        self._keys: SortedKeys | None = SortedKeys()
        self._braced = SortedKeys()

    def live(self, key: str, now: datetime) -> Entry | None:
        """The entry at `key` unless it is missing or expired."""
        entry = self.data.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            self._forget(key)
            return None
        return entry

    def get(self, key: str, clock: Callable[[], datetime]) -> Entry | None:
        """`live(key, clock())`, reading the clock only for an entry that can expire."""
        entry = self.data.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= clock():
            self._forget(key)
            return None
        return entry

    def sweep(self, now: datetime) -> int:
        """Drop every entry that has expired by `now`; return the heap items it took.

        Only items due by `now` are taken (each a key that expired, or a stale item of a key
        rewritten or deleted since), so a sweep costs what expired, not what lives.
        """
        expiries = self.expiries
        taken = 0
        while expiries and expiries[0][0] <= now:
            expires_at, key = heapq.heappop(expiries)
            taken += 1
            entry = self.data.get(key)
            if entry is not None and entry.expires_at == expires_at:
                self._forget(key)
        return taken

    def store(self, entry: Entry) -> None:
        """Keep `entry` (replacing the one at its key)."""
        key = entry.key
        if key not in self.data:
            keys = self._keys
            if keys is not None:
                keys.add(key)
                if is_braced(key):
                    self._braced.add(key)
        self.data[key] = entry
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
        if key in self.data:
            self._forget(key)

    def _forget(self, key: str) -> None:
        del self.data[key]
        if self.history:
            self.history.pop(key, None)
        keys = self._keys
        if keys is not None:
            keys.discard(key)
            if is_braced(key):
                self._braced.discard(key)

    def keep(self, entry: Entry, depth: int, prior: Entry | None) -> None:
        """Add the entry just stored to its key's history of `depth` versions.

        `prior` is the entry it replaced (`None`: none): a history that starts now starts with
        it, if it is the version before. Version 1 starts a history afresh (the key was missing
        before); depth 1 keeps none.
        """
        key = entry.key
        history = self.history
        if depth <= 1:
            if history:
                history.pop(key, None)
            return
        versions = history.get(key)
        if versions is None or entry.version == 1:
            versions = history[key] = deque(maxlen=depth)
            if prior is not None and prior.version == entry.version - 1:
                versions.append(prior)
        elif versions.maxlen != depth:
            versions = history[key] = deque(versions, maxlen=depth)
        versions.append(entry)

    def versions(self, key: str, now: datetime, limit: int | None) -> list[Entry]:
        """The retained versions of `key`, newest (the current one) first, at most `limit`."""
        current = self.live(key, now)
        if current is None or limit == 0:
            return []
        versions = self.history.get(key)
        if not versions or versions[-1] is not current:
            return [current]
        newest = reversed(versions)
        return list(newest if limit is None else islice(newest, limit))

    def unordered(self) -> None:
        """Stop keeping the keys in order (a bulk load follows); `reorder` resumes it."""
        self._keys = None
        self._braced = SortedKeys()

    def reorder(self) -> SortedKeys:
        """Keep the keys in order again (sorting them once, if that stopped); the ordered keys."""
        keys = self._keys
        if keys is None:
            keys = self._keys = SortedKeys(self.data)
            self._braced = SortedKeys(key for key in self.data if is_braced(key))
        return keys

    def ordered_keys(self) -> tuple[list[str], list[str]]:
        """Every key in order, and those with two `}` or more (for checks; O(n))."""
        return list(self.reorder()), list(self._braced)

    def matching(self, matcher: GlobMatcher, now: datetime) -> list[str]:
        """The present keys `matcher` selects, sorted (a new list: safe to keep while writing).

        Costs O(log n + the prefix's range) for a pattern with a literal prefix, one lookup for
        a literal pattern, O(entities x log n + result) for `<prefix>*}<rest>` (`skip_scan`), and
        a pass over every key for a pattern with no literal prefix.
        """
        self.sweep(now)  # after it every entry left is live at `now`
        if matcher.is_literal:
            key = matcher.literal_prefix
            return [key] if self.live(key, now) is not None else []
        keys = self.reorder()
        plan = skip_plan(matcher.pattern)
        if plan is None:
            return self._in_range(keys, matcher)
        braced = self._braced
        return skip_scan(
            *plan,
            matcher,
            lambda low, high, above: keys.first(low, high, above=above),
            lambda pattern: self._in_range(keys, compile_glob(pattern)),
            braced.range,
        )

    def tags(self, prefix: str, now: datetime) -> list[str]:
        """The distinct tags of the present keys starting `<prefix>{` (`tag_scan`), sorted.

        Costs O(tags x log n): one seek per tag, never a read of a tag's other keys.
        """
        self.sweep(now)
        keys = self.reorder()
        return tag_scan(prefix, lambda low, high, above: keys.first(low, high, above=above))

    @staticmethod
    def _in_range(keys: SortedKeys, matcher: GlobMatcher) -> list[str]:
        """The keys in `matcher`'s literal prefix range that it selects."""
        if matcher.is_literal:
            key = matcher.literal_prefix
            return [key] if key in keys else []
        prefix = matcher.literal_prefix
        selected = keys.range(prefix, after_prefix(prefix)) if prefix else list(keys)
        if matcher.is_prefix:
            return selected
        match = matcher.match
        return [key for key in selected if match(key)]

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

    def index_score(self, name: str, member: str) -> float | None:
        """`member`'s score in the sorted index `name`, or `None`."""
        found = self.indexes.get(name)
        return found.score(member) if found is not None else None

    def index_range(self, name: str, limit: int | None) -> list[tuple[str, float]]:
        """The lowest-scored members of the sorted index `name`."""
        found = self.indexes.get(name)
        return found.range(limit) if found is not None else []


class FeedRing:
    """A local store's retained change feed, bounded by a `FeedRetention`.

    Changes in commit order, each with a sequence number (increasing, not necessarily by one:
    the file backend's are its log sequence numbers). A cursor is `<prefix><seq>`, the prefix
    being `<kind tag>:<store id>:`. Count retention is the deque's `maxlen`; age retention drops
    changes older than `max_age` as changes are added. `trimmed` is the sequence number of the
    newest change dropped (0: none), so a cursor at or after it resumes with nothing missed.
    """

    __slots__ = (
        "_changes",
        "_max_age",
        "_max_bytes",
        "_seqs",
        "bytes",
        "head",
        "prefix",
        "store_id",
        "tag",
        "trimmed",
    )

    def __init__(
        self, retention: FeedRetention, tag: str, store_id: str, *, head: int = 0, trimmed: int = 0
    ) -> None:
        self.tag = tag
        self.store_id = store_id
        self.prefix = f"{tag}:{store_id}:"
        self._changes: deque[Change] = deque(maxlen=retention.max_changes)
        self._seqs: deque[int] = deque(maxlen=retention.max_changes)
        self._max_age = retention.max_age
        self._max_bytes = retention.max_bytes
        self.head = head  # the newest sequence number committed (a change's or not)
        self.trimmed = trimmed
        # What the retained changes hold: keys and old values (a new value is the stored
        # value itself, shared with the store, until a later change holds it as its old one).
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def cursor(self, seq: int) -> str:
        """The cursor of sequence number `seq`."""
        return f"{self.prefix}{seq}"

    def add(self, seq: int, change: Change) -> None:
        """Append `change` (committed at `seq`), dropping what retention no longer keeps."""
        seqs = self._seqs
        if len(seqs) == seqs.maxlen:
            self._drop_oldest()
        seqs.append(seq)
        self._changes.append(change)
        self.bytes += _held(change)
        self.head = seq
        if self._max_age is not None:
            self.age(change.timestamp)
        limit = self._max_bytes
        if limit is not None:
            while self.bytes > limit and len(seqs) > 1:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        self.bytes -= _held(self._changes.popleft())
        self.trimmed = self._seqs.popleft()

    def age(self, now: datetime) -> None:
        """Drop the changes older than `max_age` at `now`."""
        if self._max_age is None:
            return
        oldest = now - self._max_age
        changes, seqs = self._changes, self._seqs
        while changes and changes[0].timestamp < oldest:
            self.bytes -= _held(changes.popleft())
            self.trimmed = seqs.popleft()

    def items(self) -> list[tuple[int, Change]]:
        """Every retained change with its sequence number, oldest first."""
        return list(zip(self._seqs, self._changes, strict=True))

    def position(self, since: object) -> int:
        """The sequence number after which `since` resumes.

        Raises:
            InvalidArgumentError: `since` is not a cursor of this kind, or is past the head.
            CursorExpiredError: it is another store's, or changes after it were dropped.
        """
        if since == EARLIEST:
            return self.trimmed
        if type(since) is not str:
            raise InvalidArgumentError(f"since must be a cursor (a str), not {since!r}")
        tag, _, rest = since.partition(":")
        store_id, _, seq = rest.partition(":")
        if tag != self.tag or not store_id or not (seq.isascii() and seq.isdigit()):
            raise InvalidArgumentError(f"{since!r} is not a {self.tag!r} feed cursor")
        if store_id != self.store_id:
            raise CursorExpiredError(
                since, f"cursor {since!r} is another store's (this one is {self.store_id!r})"
            )
        position = int(seq)
        if position > self.head:
            raise InvalidArgumentError(f"cursor {since!r} is past the feed's head")
        if position < self.trimmed:
            raise CursorExpiredError(
                since, f"the changes after cursor {since!r} are no longer retained"
            )
        return position

    def since(self, since: object, matcher: GlobMatcher) -> list[Change]:
        """The retained changes after cursor `since` whose key `matcher` matches, in order."""
        position = self.position(since)
        count = 0
        for seq in reversed(self._seqs):
            if seq <= position:
                break
            count += 1
        later = islice(self._changes, len(self._seqs) - count, None)
        if matcher.is_prefix and not matcher.literal_prefix:
            return list(later)
        match = matcher.match
        return [change for change in later if match(change.key)]


def _held(change: Change) -> int:
    """The bytes a retained change holds of its own (see `FeedRing.bytes`)."""
    return len(change.key) + (len(change.old) if change.old is not None else 0)


def feed_from_query(params: Iterable[tuple[str, str]], options: dict[str, Any]) -> None:
    """Set `options["feed"]` from a URL's feed parameters, unless it is set already.

    They are `feed=off`, `feed_max_changes=N` and `feed_max_age=SECONDS`; others are ignored
    (memory and file URLs always ignored their query).

    Raises:
        ConfigurationError: A feed parameter's value is invalid.
    """
    names = ("feed", "feed_max_changes", "feed_max_age", "feed_max_bytes")
    found = {name: value for name, value in params if name in names}
    if not found or "feed" in options:
        return
    if "feed" in found:
        if found["feed"].lower() != "off":
            raise ConfigurationError(f"feed={found['feed']!r}: the only value is 'off'")
        if len(found) > 1:
            raise ConfigurationError("feed=off takes no other feed parameter")
        options["feed"] = None
        return
    max_changes: int | None = FeedRetention().max_changes
    max_age = None
    max_bytes: int | None = FeedRetention().max_bytes
    try:
        if "feed_max_changes" in found:
            max_changes = int(found["feed_max_changes"])
        if "feed_max_age" in found:
            max_age = timedelta(seconds=float(found["feed_max_age"]))
        if "feed_max_bytes" in found:
            max_bytes = int(found["feed_max_bytes"])
    except (ValueError, OverflowError):
        raise ConfigurationError(f"invalid feed parameters {found!r}") from None
    options["feed"] = FeedRetention(max_changes=max_changes, max_age=max_age, max_bytes=max_bytes)


class TxnTarget(Protocol):
    """What `run_transaction` needs of a store: synchronous reads and writes inside one step.

    Reads see the step's earlier writes; writes emit (or stage) their changes as the backend's
    `set` and `delete` do.
    """

    def txn_get(self, key: str) -> Entry | None:
        """The live entry at `key`."""
        ...

    def txn_put(self, key: str, value: bytes, ttl: timedelta | None) -> Change:
        """Write `key` unconditionally."""
        ...

    def txn_delete(self, key: str) -> Change | None:
        """Delete `key`; `None` if it was missing."""
        ...

    def txn_score(self, index: str, member: str) -> float | None:
        """`member`'s score in `index`, or `None`."""
        ...

    def txn_index_add(self, index: str, members: dict[str, float]) -> int:
        """Add members; how many were new."""
        ...

    def txn_index_remove(self, index: str, members: list[str]) -> int:
        """Remove members; how many were there."""
        ...

    def txn_index_range(self, index: str, limit: int | None) -> list[tuple[str, float]]:
        """The lowest-scored members."""
        ...


def run_transaction(
    target: TxnTarget,
    compare: Sequence[TxnCompare],
    then: Sequence[TxnOp],
    orelse: Sequence[TxnOp],
) -> TxnResult:
    """Check `compare` and run the branch it picks on `target`, without yielding anywhere.

    The caller has validated everything (`check_transaction`) and holds whatever makes the step
    atomic (the event loop, a database transaction).
    """
    succeeded = True
    for item in compare:
        entry = target.txn_get(item.key)
        if type(item) is Version:
            holds = (entry.version if entry is not None else 0) == item.version
        elif type(item) is Revision:
            holds = (entry.revision if entry is not None else 0) == item.revision
        else:
            assert type(item) is Exists  # noqa: S101  # check_transaction allows no other
            holds = entry is not None
        if not holds:
            succeeded = False
            break
    results: list[Any] = [_run(target, op) for op in (then if succeeded else orelse)]
    return TxnResult(succeeded, results)


def _run(target: TxnTarget, op: TxnOp) -> Any:
    match op:
        case Get(key=key):
            return target.txn_get(key)
        case Put(key=key, value=value, ttl=ttl):
            return target.txn_put(key, value, ttl)
        case Delete(key=key):
            return target.txn_delete(key)
        case IndexAdd(index=index, members=members):
            return target.txn_index_add(index, dict(members))
        case IndexRemove(index=index, members=members):
            return target.txn_index_remove(index, list(dict.fromkeys(members)))
        case IndexIncr(index=index, member=member, delta=delta):
            score = (target.txn_score(index, member) or 0.0) + delta
            target.txn_index_add(index, {member: score})
            return score
        case IndexRange(index=index, limit=limit):
            return target.txn_index_range(index, limit)
