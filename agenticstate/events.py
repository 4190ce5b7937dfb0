"""Change events and the callback runtime: what subscribers receive, and how it reaches them.

- `StateChange`: a committed change, as `StateManager.subscribe` callbacks and `watch()`
  iterators receive it.
- `Watch`: the async iterator `StateManager.watch` returns, over one backend subscription.
- `CallbackPumps`: a `StateManager`'s callback subscriptions. Each subscribed callback has a
  pump: a task with a backend subscription of its own that decodes each change and calls the
  callback, one call at a time, re-subscribing after an overflow or a failure (from the last
  change's cursor when the backend keeps a change feed, so nothing is missed). `Subscription`
  is the handle `subscribe()` returns.
- `enter_changes`: a backend subscription from a feed cursor, with the `on_gap="resync"`
  fallback (`Resync`) both of the above use when the cursor has expired.

This module sits below `agenticstate.manager` and never imports it: a `Watch` uses the few
members of its manager the `_Manager` protocol names, and `CallbackPumps` is handed what it needs
(open the backend, the codec, the counters) when the manager builds it.

The in-process fan-out backends share (`ChangeFanout`, `ChangeStream`) lives in
`agenticstate.backends._fanout`, below this layer; it is re-exported here under its old import
path, unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime  # pydantic needs it at runtime
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self

import anyio
from pydantic import BaseModel, ConfigDict

from agenticstate import _otel
from agenticstate._log import get_logger
from agenticstate._retry import retry_delay
from agenticstate._tasks import spawn_detached
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends.base import ChangeOp, new_change
from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    BackendTimeoutError,
    CursorExpiredError,
    InvalidArgumentError,
    SubscriptionClosedError,
)

if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Awaitable, Generator
    from contextlib import AbstractAsyncContextManager
    from types import TracebackType

    from anyio.abc import TaskGroup

    from agenticstate._codec import Codec
    from agenticstate.backends.base import Backend, Change, Entry

__all__ = [
    "ChangeFanout",
    "ChangeStream",
    "OnGap",
    "OverflowCallback",
    "StateCallback",
    "StateChange",
    "Subscription",
    "Watch",
]

log = get_logger(__name__)

StateCallback = Callable[[str, Any, Any], "Awaitable[None] | None"]
"""A subscription callback: `callback(key, old_value, new_value)`, sync or async."""
OverflowCallback = Callable[[str], "Awaitable[None] | None"]
"""Called with the pattern when a callback subscription fell behind and changes were missed."""
OnGap = Literal["raise", "resync"]
"""What a subscription from an expired feed cursor does: raise `CursorExpiredError`, or start
live and first deliver the current value of every matching key (`ChangeOp.RESYNC`)."""


class StateChange(BaseModel):
    """A committed change to one key, as subscribers receive it.

    Attributes:
        key: The key that changed.
        old_value: The value before the change (`None` if the key was missing).
        new_value: The value after it (`None` after a delete).
        version: The version written; for a delete, the version deleted.
        op: What happened.
        timestamp: When the change committed (UTC).
        cursor: The change's place in the backend's change feed: store it, and pass it as
            `since=` to `changes`, `watch` or `subscribe` to resume right after this change.
            `None` when the backend keeps no feed (`StateConfig(feed=None)`), and for a
            `RESYNC` change (a re-read value, not a change of the feed).
        revision: The change's revision: a write's is the new entry's `revision`, a delete
            gets one of its own; a `RESYNC` carries the revision of the entry it re-read. 0 from
            a backend that keeps no revisions.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    old_value: Any
    new_value: Any
    version: int
    op: ChangeOp
    timestamp: datetime
    cursor: str | None = None
    revision: int = 0


def check_on_gap(on_gap: object) -> OnGap:
    """Return `on_gap` if it is `"raise"` or `"resync"`.

    Raises:
        InvalidArgumentError: It is anything else.
    """
    if on_gap == "raise":
        return "raise"
    if on_gap == "resync":
        return "resync"
    raise InvalidArgumentError(f"on_gap must be 'raise' or 'resync', not {on_gap!r}")


def check_since(since: object) -> str | None:
    """Return `since` if it is a cursor (a non-empty str) or `None`.

    Raises:
        InvalidArgumentError: It is anything else.
    """
    if since is None or (isinstance(since, str) and since):
        return since
    raise InvalidArgumentError(f"since must be a feed cursor (a str) or None, not {since!r}")


class Resync:
    """What an `on_gap="resync"` subscription read: the current entries, and what they cover.

    The backend subscription is entered (live) before the keys are read, so a change committed
    meanwhile is both read and delivered live. `covers` drops such a live change: one that is
    not newer than the version the resync delivered for its key (for a delete, older than it,
    since a delete carries the version it deleted). The first live change of a key that is
    newer ends the filtering of that key.
    """

    __slots__ = ("entries", "versions")

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.versions = {entry.key: entry.version for entry in entries}

    @classmethod
    async def read(cls, backend: Backend, pattern: str) -> Self:
        """Read every present key matching `pattern`, in key order."""
        entries: list[Entry] = []
        async for batch in backend.scan_batches(pattern):
            entries += [entry for entry in await backend.get_many(batch) if entry is not None]
        entries.sort(key=lambda entry: entry.key)
        return cls(entries)

    def covers(self, change: Change) -> bool:
        """Whether the resync already delivered `change`'s effect (so drop it)."""
        versions = self.versions
        if not versions:
            return False
        version = versions.get(change.key)
        if version is None:
            return False
        if change.version < version or (
            change.version == version and change.op is not ChangeOp.DELETE
        ):
            return True
        del versions[change.key]
        return False


async def enter_changes(
    backend: Backend, pattern: str, max_buffer: int, since: str | None, on_gap: OnGap
) -> tuple[
    AbstractAsyncContextManager[AsyncIterator[Change]], AsyncIterator[Change], Resync | None
]:
    """Enter `backend.changes(pattern, since=since)`; the caller exits the returned context.

    Returns:
        The entered context, its stream, and, if `since` had expired and `on_gap` is
        `"resync"`, the `Resync` to deliver before the (then live) stream.

    Raises:
        CursorExpiredError: `since` has expired and `on_gap` is `"raise"`.
    """
    if since is None:  # no `since=` at all: a backend written before the feed still works
        context = backend.changes(pattern, max_buffer=max_buffer)
        return context, await context.__aenter__(), None
    try:
        context = backend.changes(pattern, max_buffer=max_buffer, since=since)
        return context, await context.__aenter__(), None
    except CursorExpiredError:
        if on_gap == "raise":
            raise
    context = backend.changes(pattern, max_buffer=max_buffer)
    stream = await context.__aenter__()
    try:
        resync = await Resync.read(backend, pattern)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await context.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    log.warning("subscription_resynced", pattern=pattern, keys=len(resync.entries))
    return context, stream, resync


_Entered = tuple[
    "AbstractAsyncContextManager[AsyncIterator[Change]]",
    "AsyncIterator[Change]",
    Resync | None,
    bool,
]


class _Manager(Protocol):
    """What a `Watch` uses of its `StateManager` (a protocol: manager.py imports this module)."""

    backend: Backend
    _codec: Codec
    _closed: bool

    async def _opened_backend(self) -> Backend: ...


class Watch:
    """A live stream of `StateChange`s for keys matching a pattern.

    Enter it to subscribe before you write, so nothing is missed:

    <!-- snippet: setup=state -->
    ```python
    async with state.watch("agent:*") as changes:
        await state.save("agent:1", {"status": "idle"})
        async for change in changes:
            print(change.key, change.old_value, change.new_value)  # agent:1 None {...}
            break
    ```

    Entered with `async with`, it is live on entry: every change committed after that, by this
    manager or any other process, is delivered. Iterating without `async with` subscribes on
    the first `__anext__` (changes committed before that are not). Iteration ends when the
    manager closes, and raises `SubscriptionClosedError(reason="overflow")` if the consumer falls
    more than the buffer behind: open a new watch with `since=watch.cursor` and nothing is lost.

    With `since=cursor` (see `StateManager.changes`) it first yields the changes the feed
    retains after that cursor, then the live ones. `cursor` is the cursor of the last change
    it yielded: store it to resume from there later.
    """

    def __init__(
        self,
        manager: _Manager,
        pattern: str,
        max_buffer: int,
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
    ) -> None:
        self._manager = manager
        self._pattern = pattern
        self._max_buffer = max_buffer
        self._since = since
        self._on_gap = on_gap
        self._context: AbstractAsyncContextManager[AsyncIterator[Change]] | None = None
        self._stream: AsyncIterator[Change] | None = None
        self._resync: Resync | None = None
        self._pending: list[Entry] = []  # resynced entries not yielded yet
        self._implicit = False
        self.cursor: str | None = since
        """The cursor of the last change yielded (at first, `since`): resume from it."""

    def __repr__(self) -> str:
        return f"Watch({self._pattern!r})"

    async def __aenter__(self) -> Self:
        if self._context is not None:
            raise InvalidArgumentError("this watch is already open")
        backend = await self._manager._opened_backend()
        context, self._stream, resync = await enter_changes(
            backend, self._pattern, self._max_buffer, self.cursor, self._on_gap
        )
        self._context = context
        if resync is not None:
            self._resync = resync
            self._pending = resync.entries[::-1]  # popped from the end: key order
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        context, self._context, self._stream = self._context, None, None
        self._resync, self._pending = None, []
        if context is not None:
            await context.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Unsubscribe."""
        await self.__aexit__()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StateChange:
        if self._stream is None:
            if self._implicit:
                raise StopAsyncIteration
            self._implicit = True
            try:
                await self.__aenter__()
            except BackendError:
                if self._manager._closed:
                    raise StopAsyncIteration from None  # iteration ends with the manager
                raise
        assert self._stream is not None  # noqa: S101  # set by __aenter__
        if self._pending:
            return self._manager._codec.resync_change(self._pending.pop())
        try:
            change = await self._stream.__anext__()
            resync = self._resync
            while resync is not None and resync.covers(change):
                if change.cursor is not None:
                    self.cursor = change.cursor
                change = await self._stream.__anext__()
        except BaseException as exc:
            if isinstance(exc, SubscriptionClosedError):
                _otel.record_overflow(self._manager.backend, "watch")
            if self._implicit:
                with anyio.CancelScope(shield=True):
                    await self.__aexit__()
            if isinstance(exc, BackendError) and self._manager._closed:
                # The manager closed while its backend was being read (a replay's page, a
                # reconnect): iteration ends, as it does when the close finds it waiting.
                raise StopAsyncIteration from None
            raise
        _otel.record_subscriber_lag(self._manager.backend, change.timestamp, "watch")
        if change.cursor is not None:
            self.cursor = change.cursor
        return self._manager._codec.state_change(change)


class _Pump:
    """Delivers one pattern's changes to one callback, in order, in one task.

    Each subscribed callback has its own pump and backend subscription, opened when it is
    subscribed: so it receives exactly the changes committed after `subscribe()`, never ones a
    pattern's earlier callbacks still had queued.
    """

    __slots__ = (
        "busy",
        "callback",
        "cursor",
        "done",
        "error",
        "handle",
        "live",
        "on_gap",
        "on_overflow",
        "pattern",
        "ready",
        "scope",
        "settled",
        "stopped",
        "task",
    )

    def __init__(
        self,
        pumps: CallbackPumps,
        pattern: str,
        callback: StateCallback,
        on_overflow: OverflowCallback | None,
        since: str | None = None,
        on_gap: OnGap = "raise",
    ) -> None:
        self.pattern = pattern
        self.callback = callback
        self.on_overflow = on_overflow
        # Where a (re-)subscription starts: `since=`, then the cursor of each change handled.
        self.cursor = since
        self.on_gap = on_gap
        self.handle = Subscription(pumps, self)
        # Set while the backend subscription is active, or once an attempt failed: writes of
        # this manager wait on it, so none made after subscribe() is missed.
        self.ready = anyio.Event()
        self.live = anyio.Event()  # set once the backend subscription was first active
        self.settled = anyio.Event()  # live, failed once, or stopped: wait_live() may answer
        # The last failed attempt, while not live; a CursorExpiredError ends the subscription.
        self.error: AgenticStateError | None = None
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        self.busy = False  # a callback or overflow handler is running: never cancel it
        self.stopped = False  # unsubscribed: deliver nothing more
        self.task: asyncio.Task[None] | None = None


_running_pump: ContextVar[_Pump | None] = ContextVar("agenticstate_running_pump", default=None)
"""The pump whose task is running: set in each pump's task (tasks copy their context)."""


class Subscription:
    """A callback subscribed with `StateManager.subscribe`.

    `subscribe()` returns at once; the subscription becomes live (its backend subscription
    active) in the background. Writes through the same manager wait for that, so each one
    made after `subscribe()` returned is delivered. Writes from other managers or processes are
    delivered once it is live: `await` the handle, or call `wait_live()`, to know when.

    <!-- snippet: setup=state -->
    ```python
    def on_change(key, old, new):
        print(key, old, new)

    subscription = await state.subscribe("agent:*", on_change)  # live: nothing is missed
    subscription.unsubscribe()
    ```
    """

    __slots__ = ("_pump", "_pumps")

    def __init__(self, pumps: CallbackPumps, pump: _Pump) -> None:
        self._pumps = pumps
        self._pump = pump

    def __repr__(self) -> str:
        state = "live" if self.is_live else "closed" if self._pump.stopped else "starting"
        return f"Subscription({self._pump.pattern!r}, {state})"

    @property
    def pattern(self) -> str:
        """The pattern subscribed to."""
        return self._pump.pattern

    @property
    def callback(self) -> StateCallback:
        """The callback it calls."""
        return self._pump.callback

    @property
    def is_live(self) -> bool:
        """Whether it is subscribed and its backend subscription has been active."""
        pump = self._pump
        return pump.live.is_set() and not pump.stopped and not self._pumps.closed

    async def wait_live(self) -> None:
        """Wait until every change committed from now on, by any process, will be delivered.

        Raises:
            BackendError: The attempt to subscribe failed (the subscription keeps retrying
                in the background; call again to wait for the next attempt).
            CursorExpiredError: It was subscribed with `since=` a cursor that has expired and
                `on_gap="raise"`: it is closed.
            SubscriptionClosedError: It was unsubscribed, or the manager closed.
        """
        pump = self._pump
        while True:
            if isinstance(pump.error, CursorExpiredError):
                raise pump.error
            if pump.stopped or self._pumps.closed:
                raise SubscriptionClosedError(
                    "closed", f"the subscription to {pump.pattern!r} was closed"
                )
            if pump.live.is_set():
                return
            if pump.error is not None:
                raise pump.error
            await pump.settled.wait()

    def __await__(self) -> Generator[Any, None, Subscription]:
        return self._live().__await__()

    async def _live(self) -> Subscription:
        await self.wait_live()
        return self

    def unsubscribe(self) -> bool:
        """Stop calling the callback; see `StateManager.unsubscribe`."""
        pump = self._pump
        if self._pumps.running.get((pump.pattern, pump.callback)) is not pump:
            return False
        return self._pumps.unsubscribe(pump.pattern, pump.callback)


class CallbackPumps:
    """The callback subscriptions of one `StateManager`: one `_Pump` per (pattern, callback).

    Args:
        open_backend: Opens the manager's backend (raises `BackendError` once it is closed).
        codec: Decodes the changes' values.
        counters: The manager's counters (`events_delivered`, `callback_errors`, `overflows`).
        buffer: How many changes a pump's backend subscription holds (`subscriber_buffer`).
        backend: The backend, as telemetry names it.
    """

    __slots__ = (
        "_backend",
        "_buffer",
        "_codec",
        "_counters",
        "_open",
        "closed",
        "pending",
        "running",
    )

    def __init__(
        self,
        *,
        open_backend: Callable[[], Awaitable[Backend]],
        codec: Codec,
        counters: dict[str, int],
        buffer: int,
        backend: Backend,
    ) -> None:
        self._open = open_backend
        self._codec = codec
        self._counters = counters
        self._buffer = buffer
        self._backend = backend
        self.running: dict[tuple[str, StateCallback], _Pump] = {}
        self.pending: set[_Pump] = set()  # backend subscription not active yet: writes wait
        self.closed = False

    def subscribe(
        self,
        pattern: str,
        callback: StateCallback,
        on_overflow: OverflowCallback | None,
        task_group: TaskGroup | None,
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
    ) -> Subscription:
        """Start a pump for `callback` (in `task_group`, else a detached asyncio task)."""
        existing = self.running.get((pattern, callback))
        if existing is not None:
            return existing.handle
        pump = _Pump(self, pattern, callback, on_overflow, since, on_gap)
        if task_group is not None:
            task_group.start_soon(self._run, pump, name=f"agenticstate:{pattern}")
        else:
            pump.task = spawn_detached(lambda: self._run(pump), name=f"agenticstate:{pattern}")
        self.running[pattern, callback] = pump
        self.pending.add(pump)
        return pump.handle

    def unsubscribe(self, pattern: str, callback: StateCallback) -> bool:
        """Stop `callback`'s pump (after its running call, if any); return whether it ran."""
        pump = self.running.pop((pattern, callback), None)
        if pump is None:
            return False
        self._stop(pump, force=False)
        return True

    async def wait_ready(self, *, within: float) -> None:
        """Wait until every new pump's backend subscription is active (or failed and logged why).

        A callback subscribed just before a write must see that write. This depends on the
        backend only: a pump never runs a user's callback or overflow handler before its
        subscription is ready, so a callback that reads or writes cannot wait on itself.

        Raises:
            BackendTimeoutError: A subscription did not start within `within` seconds.
        """
        for pump in list(self.pending):
            with anyio.move_on_after(within):
                await pump.ready.wait()
            if not pump.ready.is_set():
                raise BackendTimeoutError(
                    f"the subscription to {pump.pattern!r} did not start within "
                    f"{within:g} s; nothing was done"
                )

    async def close(self, backend: Backend | None, *, grace: float) -> None:
        """Stop every pump, closing `backend` first if given.

        Closing the backend ends each subscription after its buffered changes, so the pumps
        deliver what was committed before the close (for up to `grace` seconds) and then
        finish. Called from a callback or overflow handler, the pump running it cannot finish
        before this returns: the others are waited for, and that one ends when its callback
        returns.
        """
        self.closed = True
        current = _running_pump.get()
        others = [pump for pump in self.running.values() if pump is not current]
        with anyio.CancelScope(shield=True):
            if backend is not None:
                await backend.aclose()
                with anyio.move_on_after(grace):
                    for pump in others:
                        await pump.done.wait()
            for pump in list(self.running.values()):
                self._stop(pump, force=pump is not current)
            with anyio.move_on_after(grace):
                for pump in others:
                    await pump.done.wait()
            self.running.clear()
            self.pending.clear()

    def _stop(self, pump: _Pump, *, force: bool) -> None:
        """End `pump`: at once if it is idle (or `force`), else when its running call returns."""
        pump.stopped = True
        self.pending.discard(pump)
        pump.ready.set()  # writes waiting for it need not any more
        pump.settled.set()
        if force or not pump.busy:
            pump.scope.cancel()

    async def _run(self, pump: _Pump) -> None:
        _running_pump.set(pump)
        try:
            with pump.scope:
                await self._pump_changes(pump)
        finally:
            pump.stopped = True
            self.pending.discard(pump)
            pump.ready.set()
            pump.settled.set()
            pump.done.set()

    def _mark_ready(self, pump: _Pump, error: AgenticStateError | None = None) -> None:
        pump.error = error
        if error is None:
            pump.live.set()
        pump.ready.set()
        pump.settled.set()
        self.pending.discard(pump)

    async def _pump_changes(self, pump: _Pump) -> None:
        failures = 0
        missed = False  # an overflow lost changes: tell on_overflow once subscribed again
        while not self.closed and not pump.stopped:
            try:
                backend = await self._open()
                entered = await self._enter(backend, pump)
                if entered is None:  # the cursor expired: the subscription is over
                    return
                context, changes, resync, lost = entered
                async with _Exit(context):
                    self._mark_ready(pump)
                    failures = 0
                    if missed or lost:
                        missed = False
                        await self._notify_overflow(pump)
                        if pump.stopped:  # the handler unsubscribed
                            return
                    if resync is not None:
                        for entry in resync.entries:
                            await self._dispatch_entry(pump, entry)
                            if pump.stopped:
                                return
                    async for change in changes:
                        if pump.stopped:
                            return
                        if resync is None or not resync.covers(change):
                            await self._dispatch(pump, change)
                        if change.cursor is not None:
                            pump.cursor = change.cursor
                        if pump.stopped:  # unsubscribed during the call: deliver no more
                            return
                return
            except SubscriptionClosedError as exc:
                if exc.reason != "overflow":
                    return
                self._counters["overflows"] += 1
                _otel.record_overflow(self._backend, "callback")
                # With a change feed the pump resumes from the last change it handled and
                # misses nothing; without one, the changes beyond the buffer are lost.
                resumes = pump.cursor is not None
                log.warning(
                    "subscription_reopened",
                    pattern=pump.pattern,
                    reason="overflow",
                    resumes=resumes,
                )
                # Writes from now on wait until the pump has subscribed again, so none is missed.
                if pump.ready.is_set():
                    pump.ready = anyio.Event()
                self.pending.add(pump)
                missed = not resumes
            except BackendError as exc:
                if self.closed:
                    return  # the manager closed while the pump read: no failure, the end
                failures += 1
                self._mark_ready(pump, exc)
                log.warning(
                    "subscription_failed",
                    pattern=pump.pattern,
                    error=type(exc).__name__,
                    attempt=failures,
                )
                await anyio.sleep(retry_delay(failures, base=0.05, cap=5.0))
                pump.error = None
                pump.settled = anyio.Event()

    async def _enter(self, backend: Backend, pump: _Pump) -> _Entered | None:
        """Subscribe from the pump's cursor; `None` if it expired and the pump must end.

        The last item of what it returns tells whether changes were lost (an expired cursor
        resumed live): `on_overflow` is then due.

        An expired cursor with `on_gap="resync"` starts live after a resync. With
        `on_gap="raise"` it ends the subscription if it was never live (the `since=` given to
        `subscribe`: `wait_live()` raises the error); a pump that was live and fell behind
        the feed's retention resumes live instead and calls `on_overflow`, as without a feed.
        """
        try:
            return (
                *await enter_changes(backend, pump.pattern, self._buffer, pump.cursor, pump.on_gap),
                False,
            )
        except CursorExpiredError as exc:
            log.warning("subscription_cursor_expired", pattern=pump.pattern)
            if not pump.live.is_set():
                self._mark_ready(pump, exc)
                if self.running.get((pump.pattern, pump.callback)) is pump:
                    del self.running[pump.pattern, pump.callback]
                return None
        entered = await enter_changes(backend, pump.pattern, self._buffer, None, "raise")
        pump.cursor = None  # only now: if that failed, the next attempt still knows of the gap
        return (*entered, True)

    async def _notify_overflow(self, pump: _Pump) -> None:
        handler = pump.on_overflow
        if handler is None:
            return
        pump.busy = True
        try:
            outcome = handler(pump.pattern)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception as exc:  # noqa: BLE001  # a handler must never stop the pump
            self._counters["callback_errors"] += 1
            log.error("overflow_handler_failed", pattern=pump.pattern, error=type(exc).__name__)
        finally:
            pump.busy = False

    async def _dispatch_entry(self, pump: _Pump, entry: Entry) -> None:
        # A resync's re-read value: the callback sees it as a change from an unknown old value.
        await self._dispatch(
            pump,
            new_change(
                entry.key, ChangeOp.RESYNC, None, entry.value, entry.version, entry.updated_at
            ),
        )

    async def _dispatch(self, pump: _Pump, change: Change) -> None:
        callback = pump.callback
        pump.busy = True
        try:
            old, new = self._codec.change_values(change)
            _otel.record_subscriber_lag(self._backend, change.timestamp, "callback")
            outcome = callback(change.key, old, new)
            if inspect.isawaitable(outcome):
                await outcome
            self._counters["events_delivered"] += 1
        except Exception as exc:  # noqa: BLE001  # a callback must never break delivery
            self._counters["callback_errors"] += 1
            log.error(
                "subscriber_callback_failed",
                pattern=pump.pattern,
                key=change.key,
                callback=getattr(callback, "__qualname__", type(callback).__name__),
                error=type(exc).__name__,
            )
        finally:
            pump.busy = False


class _Exit:
    """Exit an already entered context manager on leaving an `async with` (see `enter_changes`)."""

    __slots__ = ("_context",)

    def __init__(self, context: AbstractAsyncContextManager[Any]) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._context.__aexit__(exc_type, exc, tb)
