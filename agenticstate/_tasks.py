"""Background tasks for objects that are used without `async with`.

A `StateManager` entered with `async with` runs its subscription pumps in its own anyio task group,
on asyncio or trio. The AgenticAI Framework state-management API also lets users call
`subscribe()` on a manager they never entered; there is no task group to put the pump in then,
so on asyncio this module starts a plain `asyncio` task (the one place in the core that imports
asyncio). Trio has no detached tasks by design, so there `async with StateManager(...)` is
required before subscribing a callback.

A few resources need one long-lived task of their own whatever the caller does (the file
backend's reader of fsync acknowledgements): `spawn_service` starts it as an asyncio task or a
trio system task. Such a task must never raise; the resource ends it in `aclose()`.

`event_factory` gives hot paths the event loop's own event class: on asyncio, `asyncio.Event`
costs half of what `anyio.Event` does per wait (no wrapper, no backend lookup on creation).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import anyio

from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

__all__ = [
    "EventLike",
    "current_loop",
    "event_factory",
    "soon_scheduler",
    "spawn_detached",
    "spawn_service",
    "threadsafe_scheduler",
]


class EventLike(Protocol):
    """What `asyncio.Event` and `anyio.Event` share."""

    def set(self) -> None: ...
    def is_set(self) -> bool: ...
    async def wait(self) -> object: ...


class _SharedFutureEvent:
    """An asyncio event whose waiters all await one future.

    No future, list entry or removal per waiter: a wait costs about half of
    `asyncio.Event.wait`. Cancelling a task cancels the future it awaits, here the shared one:
    a waiter that sees `CancelledError` without being cancelled itself (`Task.cancelling()` is
    0) was woken by another waiter's cancellation, and waits again on a fresh future.
    """

    __slots__ = ("_future", "_is_set")

    def __init__(self) -> None:
        self._is_set = False
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._is_set = True
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def is_set(self) -> bool:
        return self._is_set

    async def wait(self) -> None:
        while not self._is_set:
            future = self._future
            if future is None or future.cancelled():
                future = self._future = asyncio.get_running_loop().create_future()
            try:
                await future
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise


def event_factory() -> Callable[[], EventLike]:
    """The cheapest event class for the running event loop.

    On asyncio, an event whose `wait()` does not yield when it is already set (callers that
    must yield check `is_set()` and call `anyio.lowlevel.checkpoint()`); elsewhere
    `anyio.Event`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.Event
    return _SharedFutureEvent


def soon_scheduler() -> Callable[[Callable[[], object]], object]:
    """A function that runs a callback on the running event loop soon, after the ready tasks.

    asyncio's `loop.call_soon`, or trio's `TrioToken.run_sync_soon`; the callback must not raise.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio  # only reached under trio, where it is installed

        return trio.lowlevel.current_trio_token().run_sync_soon
    return loop.call_soon


def spawn_detached(fn: Callable[[], Coroutine[Any, Any, None]], *, name: str) -> asyncio.Task[None]:
    """Start `fn()` as a free-standing asyncio task and return it.

    Raises:
        ConfigurationError: Not running under asyncio (under trio, enter the manager first).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            "subscribing a callback outside `async with StateManager(...)` needs asyncio; "
            "under trio, enter the manager with `async with` first"
        ) from None
    return loop.create_task(fn(), name=name)


def spawn_service(fn: Callable[[], Coroutine[Any, Any, None]], *, name: str) -> object:
    """Start `fn()` for the rest of the event loop's run, on asyncio or trio; return a handle.

    Keep the handle: asyncio holds only weak references to its tasks.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio  # only reached under trio, where it is installed

        return trio.lowlevel.spawn_system_task(fn, name=name)
    return loop.create_task(fn(), name=name)


def threadsafe_scheduler() -> Callable[[Callable[[], object]], object]:
    """A function another thread calls to run a callback on the running event loop, soon.

    asyncio's `loop.call_soon_threadsafe`, or trio's `TrioToken.run_sync_soon` (thread-safe by
    design); the callback must not raise. Worker threads that own a resource (the SQLite
    backend's connections) hand their results back through it without blocking.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio  # only reached under trio, where it is installed

        return trio.lowlevel.current_trio_token().run_sync_soon
    return loop.call_soon_threadsafe


def current_loop() -> object:
    """An object that identifies the running event loop (the asyncio loop or trio's token)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        import trio  # only reached under trio, where it is installed

        return trio.lowlevel.current_trio_token()
