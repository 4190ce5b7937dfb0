"""Change events and the callback runtime: what subscribers receive, and how it reaches them.

- `StateChange`: a committed change, as `StateManager.subscribe` callbacks and `watch()`
  iterators receive it.
- `Watch`: the async iterator `StateManager.watch` returns, over one backend subscription.
- `CallbackPumps`: a `StateManager`'s callback subscriptions. Each subscribed callback has a
  pump: a task with a backend subscription of its own that decodes each change and calls the
  callback, one call at a time, re-subscribing after an overflow or a failure. `Subscription`
  is the handle `subscribe()` returns.

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
from typing import TYPE_CHECKING, Any, Protocol, Self

import anyio
from pydantic import BaseModel, ConfigDict

from agenticstate import _otel
from agenticstate._log import get_logger
from agenticstate._tasks import spawn_detached
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends.base import ChangeOp
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
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
    from agenticstate.backends.base import Backend, Change

__all__ = [
    "ChangeFanout",
    "ChangeStream",
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


class _Manager(Protocol):
    """What a `Watch` uses of its `StateManager` (a protocol: manager.py imports this module)."""

    backend: Backend
    _codec: Codec

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
    more than the buffer behind.
    """

    def __init__(self, manager: _Manager, pattern: str, max_buffer: int) -> None:
        self._manager = manager
        self._pattern = pattern
        self._max_buffer = max_buffer
        self._context: AbstractAsyncContextManager[AsyncIterator[Change]] | None = None
        self._stream: AsyncIterator[Change] | None = None
        self._implicit = False

    def __repr__(self) -> str:
        return f"Watch({self._pattern!r})"

    async def __aenter__(self) -> Self:
        if self._context is not None:
            raise InvalidArgumentError("this watch is already open")
        backend = await self._manager._opened_backend()
        context = backend.changes(self._pattern, max_buffer=self._max_buffer)
        self._stream = await context.__aenter__()
        self._context = context
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        context, self._context, self._stream = self._context, None, None
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
            await self.__aenter__()
        assert self._stream is not None  # noqa: S101  # set by __aenter__
        try:
            change = await self._stream.__anext__()
        except BaseException as exc:
            if isinstance(exc, SubscriptionClosedError):
                _otel.record_overflow(self._manager.backend, "watch")
            if self._implicit:
                with anyio.CancelScope(shield=True):
                    await self.__aexit__()
            raise
        _otel.record_subscriber_lag(self._manager.backend, change.timestamp, "watch")
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
        "done",
        "error",
        "handle",
        "live",
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
    ) -> None:
        self.pattern = pattern
        self.callback = callback
        self.on_overflow = on_overflow
        self.handle = Subscription(pumps, self)
        # Set while the backend subscription is active, or once an attempt failed: writes of
        # this manager wait on it, so none made after subscribe() is missed.
        self.ready = anyio.Event()
        self.live = anyio.Event()  # set once the backend subscription was first active
        self.settled = anyio.Event()  # live, failed once, or stopped: wait_live() may answer
        self.error: BackendError | None = None  # the last failed attempt, while not live
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
            SubscriptionClosedError: It was unsubscribed, or the manager closed.
        """
        pump = self._pump
        while True:
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
    ) -> Subscription:
        """Start a pump for `callback` (in `task_group`, else a detached asyncio task)."""
        existing = self.running.get((pattern, callback))
        if existing is not None:
            return existing.handle
        pump = _Pump(self, pattern, callback, on_overflow)
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

    def _mark_ready(self, pump: _Pump, error: BackendError | None = None) -> None:
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
                async with backend.changes(pump.pattern, max_buffer=self._buffer) as changes:
                    self._mark_ready(pump)
                    failures = 0
                    if missed:
                        missed = False
                        await self._notify_overflow(pump)
                        if pump.stopped:  # the handler unsubscribed
                            return
                    async for change in changes:
                        if pump.stopped:
                            return
                        await self._dispatch(pump, change)
                        if pump.stopped:  # unsubscribed during the call: deliver no more
                            return
                return
            except SubscriptionClosedError as exc:
                if exc.reason != "overflow":
                    return
                self._counters["overflows"] += 1
                _otel.record_overflow(self._backend, "callback")
                log.warning("subscription_reopened", pattern=pump.pattern, reason="overflow")
                # Writes from now on wait until the pump has subscribed again, so none is missed.
                if pump.ready.is_set():
                    pump.ready = anyio.Event()
                self.pending.add(pump)
                missed = True
            except BackendError as exc:
                failures += 1
                self._mark_ready(pump, exc)
                log.warning(
                    "subscription_failed",
                    pattern=pump.pattern,
                    error=type(exc).__name__,
                    attempt=failures,
                )
                await anyio.sleep(min(0.05 * 2**failures, 5.0))
                pump.error = None
                pump.settled = anyio.Event()

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
