"""Change events: the records users see, and the in-process fan-out backends share.

`ChangeFanout` delivers committed changes to every subscription whose glob matches, without ever
blocking the writer: each subscription has a bounded buffer, and one that falls behind is closed
with `SubscriptionClosedError(reason="overflow")` after it has read what was buffered. That is the
overflow policy everywhere in agenticstate: a slow subscriber is told, never silently dropped.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from datetime import datetime  # pydantic needs it at runtime
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel, ConfigDict

from agenticstate._glob import GlobMatcher, compile_glob
from agenticstate._log import get_logger
from agenticstate.backends.base import Change, ChangeOp
from agenticstate.exceptions import InvalidArgumentError, SubscriptionClosedError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["ChangeFanout", "ChangeStream", "StateChange"]

log = get_logger(__name__)


class StateChange(BaseModel):
    """A committed change to one key, as subscribers receive it.

    Attributes:
        key: The key that changed.
        old_value: The value before the change (`None` if the key was missing).
        new_value: The value after it (`None` after a delete).
        version: The version written; for a delete, the version deleted.
        op: What happened.
        timestamp: When the change committed (UTC).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    old_value: Any
    new_value: Any
    version: int
    op: ChangeOp
    timestamp: datetime


class _Subscriber:
    __slots__ = ("is_open", "matcher", "max_buffer", "overflowed", "receive", "send")

    def __init__(self, matcher: GlobMatcher, max_buffer: int, *, is_open: bool = True) -> None:
        self.matcher = matcher
        self.max_buffer = max_buffer
        self.is_open = is_open  # a subscription that starts closed drops changes until opened
        self.overflowed = False
        self.send: MemoryObjectSendStream[Change]
        self.receive: MemoryObjectReceiveStream[Change]
        self.send, self.receive = anyio.create_memory_object_stream[Change](max_buffer)


class ChangeStream:
    """An async iterator of `Change`s for one subscription.

    Iteration ends when the backend closes; it raises `SubscriptionClosedError(reason="overflow")`
    once the subscriber has read every change buffered before it fell behind.
    """

    __slots__ = ("_subscriber",)

    def __init__(self, subscriber: _Subscriber) -> None:
        self._subscriber = subscriber

    def __aiter__(self) -> ChangeStream:
        return self

    def open(self) -> None:
        """Start receiving (a subscription made with `start_open=False` drops changes until then).

        Backends call it at a barrier: every change published before it was committed before
        the subscription was asked for, every change after it is delivered.
        """
        self._subscriber.is_open = True

    async def __anext__(self) -> Change:
        try:
            return await self._subscriber.receive.receive()
        except anyio.EndOfStream:
            if self._subscriber.overflowed:
                raise SubscriptionClosedError(
                    "overflow",
                    f"subscription to {self._subscriber.matcher.pattern!r} fell more than "
                    f"{self._subscriber.max_buffer} changes behind; re-read the state and "
                    "subscribe again",
                ) from None
            raise StopAsyncIteration from None
        except anyio.ClosedResourceError:
            raise StopAsyncIteration from None


class ChangeFanout:
    """Deliver changes to glob subscriptions in one process, in publish order."""

    __slots__ = ("_closed", "_subscribers")

    def __init__(self) -> None:
        self._subscribers: list[_Subscriber] = []
        self._closed = False

    @property
    def has_subscribers(self) -> bool:
        """Whether any subscription is open (so changes need building at all)."""
        return bool(self._subscribers)

    def publish(self, change: Change) -> None:
        """Hand `change` to every matching subscription without blocking."""
        for subscriber in self._subscribers:
            if not subscriber.is_open or not subscriber.matcher.match(change.key):
                continue
            try:
                subscriber.send.send_nowait(change)
            except anyio.WouldBlock:
                self._overflow(subscriber)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._drop(subscriber)

    def _overflow(self, subscriber: _Subscriber) -> None:
        subscriber.overflowed = True
        log.warning(
            "subscriber_overflow", pattern=subscriber.matcher.pattern, buffer=subscriber.max_buffer
        )
        self._drop(subscriber)

    def _drop(self, subscriber: _Subscriber) -> None:
        subscriber.send.close()
        # Rebuild rather than remove in place: publish() may be iterating the old list.
        self._subscribers = [s for s in self._subscribers if s is not subscriber]

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, max_buffer: int, *, start_open: bool = True
    ) -> AsyncIterator[ChangeStream]:
        """Open a subscription to keys matching `pattern`; it is active on entry.

        With `start_open=False` it receives nothing until `ChangeStream.open()`.
        """
        if type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        subscriber = _Subscriber(compile_glob(pattern), max_buffer, is_open=start_open)
        if self._closed:
            subscriber.send.close()
        else:
            self._subscribers = [*self._subscribers, subscriber]
        try:
            yield ChangeStream(subscriber)
        finally:
            self._drop(subscriber)
            subscriber.receive.close()

    def close(self) -> None:
        """End every subscription (their iteration stops) and refuse new ones."""
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.send.close()
        self._subscribers = []
