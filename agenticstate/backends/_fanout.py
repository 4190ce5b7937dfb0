"""The in-process change fan-out every backend shares.

`ChangeFanout` delivers committed changes to every subscription whose glob matches, without ever
blocking the writer: each subscription has a bounded buffer, and one that falls behind is closed
with `SubscriptionClosedError(reason="overflow")` after it has read what was buffered. That is the
overflow policy everywhere in agenticstate: a slow subscriber is told, never silently dropped.

It lives under `backends/` because backends are its only users: it depends on `backends.base`
and the glob matcher, never on `events` or `manager` (see the Architecture page).
`agenticstate.events` re-exports `ChangeFanout` and `ChangeStream` under their old path.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from agenticstate._glob import GlobMatcher, compile_glob
from agenticstate._log import get_logger
from agenticstate._tasks import event_factory
from agenticstate.exceptions import InvalidArgumentError, SubscriptionClosedError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable

    from agenticstate._tasks import EventLike
    from agenticstate.backends.base import Change

__all__ = ["ChangeFanout", "ChangeStream"]

log = get_logger(__name__)


class _Subscriber:
    """One subscription's buffer, filled by `ChangeFanout.publish` and drained by its stream.

    A plain deque, not a memory object stream: a publish appends and wakes the consumer only if
    it is waiting (`waiter`), and a consumer that finds changes buffered takes them without
    touching the event loop. `ended`: nothing more will be added (the fan-out dropped it);
    `closed`: its stream was closed (the subscription was left). `backlog`: changes replayed
    from a feed (`since=`), read before the buffer and not counted against `max_buffer`.
    """

    __slots__ = (
        "backlog",
        "buffer",
        "closed",
        "ended",
        "event",
        "is_open",
        "label",
        "matcher",
        "max_buffer",
        "overflowed",
        "waiter",
    )

    def __init__(
        self, matcher: GlobMatcher, max_buffer: int, label: str, *, is_open: bool = True
    ) -> None:
        self.matcher = matcher
        self.max_buffer = max_buffer
        self.label = label  # the pattern as the user wrote it, for logs and errors
        self.is_open = is_open  # a subscription that starts closed drops changes until opened
        self.overflowed = False
        self.ended = False
        self.closed = False
        self.buffer: deque[Change] = deque()
        self.backlog: deque[Change] | None = None
        self.waiter: EventLike | None = None  # set by the next publish (or the end)
        self.event = event_factory()  # the event loop's cheapest event class

    def end(self) -> None:
        """Add nothing more: the stream ends once it has read what is buffered."""
        self.ended = True
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.set()


class ChangeStream:
    """An async iterator of `Change`s for one subscription.

    Iteration ends when the backend closes; it raises `SubscriptionClosedError(reason="overflow")`
    once the subscriber has read every change buffered before it fell behind. A change is taken
    from the buffer only when it is returned, so a cancelled wait loses none.
    """

    __slots__ = ("_subscriber",)

    def __init__(self, subscriber: _Subscriber) -> None:
        self._subscriber = subscriber

    def __aiter__(self) -> ChangeStream:
        return self

    @property
    def buffered(self) -> int:
        """How many changes wait unread in this subscription's buffer (0 while it is not open).

        A backend that paces its own reading by its subscribers' backlog (Redis) reads this.
        """
        subscriber = self._subscriber
        if not subscriber.is_open:
            return 0
        return len(subscriber.buffer)

    def open(self) -> None:
        """Start receiving (a subscription made with `start_open=False` drops changes until then).

        Backends call it at a barrier: every change published before it was committed before
        the subscription was asked for, every change after it is delivered.
        """
        self._subscriber.is_open = True

    def end(self) -> None:
        """Receive nothing more: iteration stops once what is buffered has been read."""
        self._subscriber.end()

    async def __anext__(self) -> Change:
        subscriber = self._subscriber
        buffer = subscriber.buffer
        while True:
            if subscriber.closed:
                raise StopAsyncIteration
            backlog = subscriber.backlog
            if backlog:
                return backlog.popleft()
            if buffer:
                return buffer.popleft()
            if subscriber.ended:
                if subscriber.overflowed:
                    raise SubscriptionClosedError(
                        "overflow",
                        f"subscription to {subscriber.label!r} fell more than "
                        f"{subscriber.max_buffer} changes behind; re-read the state and "
                        "subscribe again",
                    )
                raise StopAsyncIteration
            waiter = subscriber.waiter
            if waiter is None:
                waiter = subscriber.waiter = subscriber.event()
            await waiter.wait()


class _Index:
    """The subscribers of a fan-out, arranged so a key finds its candidates without a scan.

    A glob's literal prefix (the text before its first metacharacter) starts every key it
    matches, and its literal suffix (after its last wildcard or class) ends every such key.
    Subscribers are grouped by prefix, or by suffix when the pattern starts with a wildcard; a
    key looks up its own prefixes and suffixes of each length some group has. A change then
    costs one dict lookup per distinct length (a handful for patterns like `agent:{id}:*`) plus
    a glob for each real candidate, not one glob per subscriber. Literal patterns are found by
    the key itself; only patterns with wildcards at both ends (`*`, `*:x:*`) are tried one by
    one. Adding or removing a subscriber costs the size of its group, not of the index.
    """

    __slots__ = (
        "all",
        "by_prefix",
        "by_suffix",
        "exact",
        "lengths",
        "prefix_lengths",
        "scan",
        "subscribers",
        "suffix_lengths",
    )

    def __init__(self) -> None:
        self.subscribers: dict[_Subscriber, None] = {}  # in subscription order
        self.all: list[_Subscriber] = []  # the same, replaced (never changed) on each change
        self.exact: dict[str, list[_Subscriber]] = {}
        self.by_prefix: dict[str, list[_Subscriber]] = {}
        self.by_suffix: dict[str, list[_Subscriber]] = {}
        self.scan: list[_Subscriber] = []
        self.prefix_lengths: list[int] = []
        self.suffix_lengths: list[int] = []
        # How many groups of each dict have texts of each length.
        self.lengths: dict[int, dict[int, int]] = {id(self.by_prefix): {}, id(self.by_suffix): {}}

    def _group(self, subscriber: _Subscriber) -> tuple[dict[str, list[_Subscriber]] | None, str]:
        matcher = subscriber.matcher
        if matcher.is_literal:
            return self.exact, matcher.literal_prefix
        if matcher.literal_prefix:
            return self.by_prefix, matcher.literal_prefix
        if matcher.literal_suffix:
            return self.by_suffix, matcher.literal_suffix
        return None, ""

    def add(self, subscriber: _Subscriber) -> None:
        self.subscribers[subscriber] = None
        self.all = [*self.all, subscriber]
        groups, text = self._group(subscriber)
        if groups is None:
            self.scan = [*self.scan, subscriber]
            return
        group = groups.get(text)
        if group is None:
            groups[text] = [subscriber]
            self._count_length(groups, len(text), 1)
        else:
            # A new list, not an append: a lookup may be iterating the old one.
            groups[text] = [*group, subscriber]

    def remove(self, subscriber: _Subscriber) -> None:
        if self.subscribers.pop(subscriber, _MISSING) is _MISSING:
            return
        self.all = [s for s in self.all if s is not subscriber]
        groups, text = self._group(subscriber)
        if groups is None:
            self.scan = [s for s in self.scan if s is not subscriber]
            return
        rest = [s for s in groups[text] if s is not subscriber]
        if rest:
            groups[text] = rest
        else:
            del groups[text]
            self._count_length(groups, len(text), -1)

    def _count_length(self, groups: dict[str, list[_Subscriber]], length: int, step: int) -> None:
        counts = self.lengths.get(id(groups))
        if counts is None:  # the exact dict: looked up by the whole key, no lengths
            return
        count = counts.get(length, 0) + step
        if count:
            counts[length] = count
            if count > 1 or step < 0:
                return
        else:
            del counts[length]
        if groups is self.by_prefix:
            self.prefix_lengths = sorted(counts)
        else:
            self.suffix_lengths = sorted(counts)

    def matching(self, key: str) -> list[_Subscriber]:
        """The subscribers whose pattern matches `key` (each one's changes keep their order)."""
        found = [s for s in self.scan if s.matcher.match(key)] if self.scan else []
        exact = self.exact.get(key)
        if exact is not None:
            found.extend(exact)
        size = len(key)
        if self.prefix_lengths:
            by_prefix = self.by_prefix
            for length in self.prefix_lengths:
                if length > size:
                    break
                group = by_prefix.get(key[:length])
                if group is not None:
                    found.extend(s for s in group if s.matcher.match(key))
        if self.suffix_lengths:
            by_suffix = self.by_suffix
            for length in self.suffix_lengths:
                if length > size:
                    break
                group = by_suffix.get(key[size - length :])
                if group is not None:
                    found.extend(s for s in group if s.matcher.match(key))
        return found


_MISSING = object()


class ChangeFanout:
    """Deliver changes to glob subscriptions in one process, in publish order.

    Args:
        label: The pattern to name in logs and errors instead of each subscription's own (a
            backend that fans one server-side subscription out under `*` passes the user's).
    """

    __slots__ = ("_closed", "_index", "_label")

    def __init__(self, *, label: str | None = None) -> None:
        self._index = _Index()
        self._closed = False
        self._label = label

    @property
    def has_subscribers(self) -> bool:
        """Whether any subscription is open (so changes need building at all)."""
        return bool(self._index.subscribers)

    def publish(self, change: Change) -> None:
        """Hand `change` to every matching subscription without blocking."""
        index = self._index
        if index.subscribers:
            self._offer(index.matching(change.key), change)

    def publish_to_all(self, change: Change) -> None:
        """Hand `change` to every subscription, without matching its key.

        For a caller that knows every subscription's pattern matches it: a fan-out whose
        subscriptions all share the pattern the caller matched already (the Redis backend's).
        """
        self._offer(self._index.all, change)

    def _offer(self, subscribers: list[_Subscriber], change: Change) -> None:
        # `subscribers` is a list the index replaces, never changes: an overflow may drop one.
        for subscriber in subscribers:
            if not subscriber.is_open:
                continue
            buffer = subscriber.buffer
            if len(buffer) >= subscriber.max_buffer:
                self._overflow(subscriber)
                continue
            buffer.append(change)
            if subscriber.waiter is not None:
                subscriber.wake()

    def _overflow(self, subscriber: _Subscriber) -> None:
        subscriber.overflowed = True
        log.warning("subscriber_overflow", pattern=subscriber.label, buffer=subscriber.max_buffer)
        self._drop(subscriber)

    def _drop(self, subscriber: _Subscriber) -> None:
        subscriber.end()
        # _offer() iterates a list the index never changes: safe to change the index.
        self._index.remove(subscriber)

    @asynccontextmanager
    async def subscribe(
        self,
        pattern: str,
        max_buffer: int,
        *,
        start_open: bool = True,
        backlog: Callable[[GlobMatcher], Iterable[Change]] | None = None,
    ) -> AsyncIterator[ChangeStream]:
        """Open a subscription to keys matching `pattern`; it is active on entry.

        With `start_open=False` it receives nothing until `ChangeStream.open()`. `backlog`, if
        given, is called with the pattern's matcher on entry, in the same step as the
        subscription starts (no await between): the changes it returns are yielded first, then
        every change published after. A feed's replay uses it, so the switch from replayed to
        live changes has no gap and no duplicate. What it raises propagates from entry.
        """
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        label = pattern if self._label is None else self._label
        matcher = compile_glob(pattern)
        subscriber = _Subscriber(matcher, max_buffer, label, is_open=start_open)
        if backlog is not None:
            subscriber.backlog = deque(backlog(matcher))
        if self._closed:
            subscriber.end()
        else:
            self._index.add(subscriber)
        try:
            yield ChangeStream(subscriber)
        finally:
            self._drop(subscriber)
            subscriber.closed = True
            subscriber.buffer.clear()
            subscriber.backlog = None

    def overflow_all(self) -> None:
        """Close every subscription as overflowed: each reads what it buffered, then fails.

        For a backend whose feed lost changes it had not delivered yet.
        """
        for subscriber in list(self._index.subscribers):
            self._overflow(subscriber)

    def close(self) -> None:
        """End every subscription (their iteration stops) and refuse new ones."""
        self._closed = True
        for subscriber in self._index.subscribers:
            subscriber.end()
        self._index = _Index()
