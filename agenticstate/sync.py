"""Blocking versions of `StateManager` and every manager, for tools, scripts and notebooks.

```python
from agenticstate import sync

with sync.StateManager() as state:             # same arguments as agenticstate.StateManager
    state.save("agent:1", {"status": "idle"})  # same methods, blocking
    state.get("agent:1")                       # {"status": "idle"}

sessions = sync.SessionManager(persistence="memory", default_state={"shopping_list": []})
session = sessions.create_session("u1")
```

Every class here wraps its async namesake: each public coroutine method becomes a blocking
method with the same name, arguments and docstring, run on one event loop that the module keeps
in a daemon thread (an anyio `BlockingPortal` on asyncio). So the blocking API works from any
plain thread, and from a thread whose own event loop is running (a Jupyter cell, the sync tool of
an async framework): the call blocks that thread, never the module's loop.

- Other public methods (`subscribe`, `stats`, `scope`, ...) run on the loop thread too, so the
  objects are only ever touched from one thread.
- A result that is itself wrapped here comes back wrapped (`state.scope("u1:")` is a blocking
  `ScopedState`); an async context manager or iterator comes back as a blocking one
  (`with state.watch("agent:*") as changes: for change in changes: ...`).
- A sync subscription callback runs in a worker thread, so it may call the blocking API. Code
  that runs on the loop thread itself (an async callback, a function passed to `update`) must not:
  the call raises `SyncDeadlockError` instead of hanging.
- Objects you build here are closed by `close()`, by `with`, or at interpreter exit; then the loop
  stops. After `os.fork()` the child starts a loop of its own; objects built before the fork
  belong to the parent.

`run(fn)` runs an async function on the wrapped object with full static types, for code checked
with mypy: `state.run(lambda s: s.get("k", model=Record))` is `Record | None`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from agenticstate import commits as _commits
from agenticstate import events as _events
from agenticstate import managers as _managers
from agenticstate import scope as _scope
from agenticstate import view as _view
from agenticstate._log import get_logger
from agenticstate.exceptions import AgenticStateError, BackendError, InvalidArgumentError
from agenticstate.manager import StateManager as _AsyncStateManager

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from types import TracebackType

__all__ = [
    "AgentRecoveryManager",
    "AgentStateStore",
    "Blocking",
    "BlockingStream",
    "Checkout",
    "KnowledgeStateManager",
    "LocalView",
    "OrchestrationStateManager",
    "ScopedState",
    "SessionManager",
    "SpeechStateManager",
    "StateManager",
    "Subscription",
    "SyncDeadlockError",
    "ToolStateManager",
    "WorkflowStateManager",
    "close_all",
]

A = TypeVar("A")
T = TypeVar("T")

_CLOSE_TIMEOUT = 10.0
log = get_logger(__name__)


class SyncDeadlockError(AgenticStateError, RuntimeError):
    """A blocking call was made from the sync API's own event loop thread.

    It would wait for the loop it is blocking. Call the async API there (an async callback has
    the async objects at hand), or use a sync callback, which runs in a worker thread.
    """


class _Loop:
    """One asyncio event loop in a daemon thread, behind an anyio blocking portal.

    A daemon thread (not `start_blocking_portal`'s executor thread) so that interpreter exit
    never waits on it: the `atexit` handler closes what is open and then stops the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.thread_id: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def portal(self) -> BlockingPortal:
        portal = self._portal
        if portal is not None and self._pid == os.getpid():
            return portal
        with self._lock:
            if self._portal is None or self._pid != os.getpid():
                self._start()
            assert self._portal is not None  # noqa: S101  # set by _start
            return self._portal

    def _start(self) -> None:
        handoff: queue.SimpleQueue[BlockingPortal | BaseException] = queue.SimpleQueue()

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            async with BlockingPortal() as portal:
                handoff.put(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            self.thread_id = threading.get_ident()
            try:
                anyio.run(serve, backend="asyncio")
            except BaseException as exc:  # noqa: BLE001  # handed to the thread that waits
                handoff.put(exc)

        thread = threading.Thread(target=run, name="agenticstate-sync", daemon=True)
        thread.start()
        made = handoff.get()
        if isinstance(made, BaseException):
            raise made
        self._portal, self._thread, self._pid = made, thread, os.getpid()

    def check_thread(self) -> None:
        if threading.get_ident() == self.thread_id and self._pid == os.getpid():
            raise SyncDeadlockError(
                "a blocking agenticstate.sync call was made on the sync API's event loop thread "
                "(from an async callback or a function the loop runs); use the async API there"
            )

    def stop(self) -> None:
        with self._lock:
            portal, thread, self._portal, self._thread = self._portal, self._thread, None, None
            if portal is None or self._pid != os.getpid():
                return
            with contextlib.suppress(RuntimeError):  # already stopped
                portal.call(portal.stop)
            if thread is not None:
                thread.join(_CLOSE_TIMEOUT)
            self.thread_id = None

    def after_fork(self) -> None:
        # The loop thread does not exist in a forked child; the next call starts a new one. The
        # parent's objects stay the parent's: the child must not close (flush, disconnect) them.
        self._lock = threading.Lock()
        self._portal = self._thread = None
        self.thread_id = None
        self.loop = None
        _OWNED.clear()


_LOOP = _Loop()
# Strong references: what the module built is closed at exit even if the caller dropped it
# (the file backend flushes, Redis connections close). `close()` removes an object.
_OWNED: set[Blocking[Any]] = set()
_WRAPPERS: dict[type, type[Blocking[Any]]] = {}


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _LOOP.check_thread()
    portal = _LOOP.portal()
    if kwargs:
        return portal.call(functools.partial(fn, *args, **kwargs))
    return portal.call(fn, *args)


def _call_plain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`_call` for a plain method: its result comes back as it is, even an awaitable one.

    (`BlockingPortal.call` awaits whatever awaitable its function returns: a `Subscription`
    would be waited on until live, and raise there, where the async call returns at once.)
    """
    boxed: list[Any] = _call(lambda: [fn(*args, **kwargs)])
    return boxed[0]


def _await(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """Run a coroutine function on the loop and wait for it: the hot path of every method.

    The loop is an asyncio loop this module owns, so a coroutine goes straight to it with
    `run_coroutine_threadsafe`, which costs about half of `BlockingPortal.call` per hop (no
    task group spawn and cancel scope per call); anyio code runs unchanged in that task.
    """
    _LOOP.check_thread()
    _LOOP.portal()
    loop = _LOOP.loop
    assert loop is not None  # noqa: S101  # set before the portal is handed over
    awaitable = fn(*args, **kwargs)
    if not asyncio.iscoroutine(awaitable):  # an async generator's __anext__, a Future, ...
        awaitable = _as_coroutine(awaitable)
    future = asyncio.run_coroutine_threadsafe(awaitable, loop)
    try:
        return future.result()
    except BaseException:
        # Interrupted (Ctrl-C in a notebook) or failed: make sure the call stops on the loop.
        future.cancel()
        raise


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _unwrap(value: Any) -> Any:
    return value._async if isinstance(value, Blocking) else value


def _wrap(value: Any) -> Any:
    for kind in type(value).__mro__:
        wrapper = _WRAPPERS.get(kind)
        if wrapper is not None:
            return wrapper.wrap(value)
    if hasattr(value, "__aenter__") or hasattr(value, "__anext__"):
        return BlockingStream(value)
    return value


_JOBS: dict[tuple[str, str], str] = {
    ("ToolStateManager", "run_with_retries"): "fn",
    ("ToolStateManager", "cached_call"): "fn",
    ("AgentRecoveryManager", "run"): "job",
}
"""The methods that run a job the caller hands over, and its parameter: a plain function given
there runs in a worker thread (it may block, and call this API)."""


def _check_process(view: Any) -> None:
    """Refuse to use, in a forked child, an object built before the fork (in the parent).

    Its connections, files and tasks belong to the parent's loop, which the child does not
    have: every call would fail on them (a bare `RuntimeError` from deep inside), or worse,
    share the parent's connection. A `BackendError` says so.
    """
    if view._pid != os.getpid():
        raise BackendError(
            f"this sync.{type(view).__name__} was built in process {view._pid}, before a fork; "
            "objects built before os.fork() belong to the parent: build what the child needs "
            "in the child"
        )


def _blocking_method(name: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    job = _JOBS.get((method.__qualname__.split(".")[0], name))
    signature = inspect.signature(method) if job else None

    @functools.wraps(method)
    def call(self: Blocking[Any], *args: Any, **kwargs: Any) -> Any:
        _check_process(self)
        bound = getattr(self._async, name)
        args = tuple(_unwrap(arg) for arg in args)
        kwargs = {key: _unwrap(value) for key, value in kwargs.items()}
        if job is not None and signature is not None:
            try:
                given = signature.bind(self._async, *args, **kwargs)
            except TypeError:
                pass  # the async method says what is wrong
            else:
                if job in given.arguments:
                    given.arguments[job] = _in_thread_job(given.arguments[job])
                    args, kwargs = given.args[1:], given.kwargs
        return _wrap(_await(bound, *args, **kwargs))

    return call


def _in_thread_job(fn: Any) -> Any:
    """A job to await: a plain function runs in a worker thread, an async one as it is.

    A plain function that returns an awaitable (`lambda: client.fetch()`) has it awaited.
    """
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        return fn
    if inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
        return fn

    async def job() -> Any:
        value = await anyio.to_thread.run_sync(fn)
        if inspect.isawaitable(value):
            value = await value
        return value

    return job


def _loop_method(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Blocking[Any], *args: Any, **kwargs: Any) -> Any:
        _check_process(self)
        bound = getattr(self._async, name)
        return _wrap(_call_plain(bound, *args, **kwargs))

    return call


class Blocking(Generic[A]):
    """The one wrapper class: a blocking view of an async object, driven by its methods.

    A subclass names the async class (`class StateManager(Blocking[...], wraps=...)`); every
    public coroutine method of that class (inherited ones included) becomes a blocking method,
    every other public method a method run on the loop thread. Attributes read through.
    Constructing a subclass builds the async object on the loop thread with the same arguments.
    """

    _async_class: ClassVar[type]
    _async: A

    def __init_subclass__(cls, *, wraps: type, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._async_class = wraps
        _WRAPPERS[wraps] = cls
        # Methods written by hand, on the class or on a mixin before Blocking, are kept.
        own = cls.__mro__[: cls.__mro__.index(Blocking)]
        for name, member in inspect.getmembers(wraps):
            if name.startswith("_") or any(name in klass.__dict__ for klass in own):
                continue
            if inspect.iscoroutinefunction(member):
                setattr(cls, name, _blocking_method(name, member))
            elif inspect.isfunction(member):
                setattr(cls, name, _loop_method(name, member))
        if cls.__doc__ is None:
            cls.__doc__ = f"Blocking `{wraps.__module__}.{wraps.__qualname__}`."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        args = tuple(_unwrap(arg) for arg in args)
        kwargs = {key: _unwrap(value) for key, value in kwargs.items()}
        self._async = _call(self._async_class, *args, **kwargs)
        self._owned = True
        self._pid = os.getpid()
        _OWNED.add(self)

    @classmethod
    def wrap(cls, obj: A) -> Self:
        """Return a blocking view of an existing async object (closing it stays your call)."""
        if not isinstance(obj, cls._async_class):
            raise InvalidArgumentError(
                f"{cls.__name__}.wrap() takes a {cls._async_class.__name__}, "
                f"not {type(obj).__name__}"
            )
        view = cls.__new__(cls)
        view._async = obj
        view._owned = False
        view._pid = os.getpid()
        return view

    @property
    def async_object(self) -> A:
        """The async object this wraps (use it from async code on the sync API's loop)."""
        return self._async

    def run(self, fn: Callable[[A], Awaitable[T]]) -> T:
        """Run `fn(async_object)` on the loop and return its result (typed for mypy)."""
        _check_process(self)
        obj = self._async

        async def call() -> T:
            return await fn(obj)

        result: T = _await(call)
        return result

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_async", "_owned", "_pid"):
            raise AttributeError(name)
        _check_process(self)
        return _wrap(getattr(self._async, name))

    def __setattr__(self, name: str, value: Any) -> None:
        # Public attributes are the async object's (`tools.max_retries = 5` configures it).
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            _check_process(self)
            setattr(self._async, name, _unwrap(value))

    def __repr__(self) -> str:
        return f"sync.{type(self).__name__}({self._async!r})"

    def close(self) -> None:
        """Close the wrapped object (its `aclose()`); in a forked child, nothing (the parent's)."""
        _OWNED.discard(self)
        if self._pid != os.getpid():
            return
        closer = getattr(self._async, "aclose", None)
        if closer is not None:
            _call(closer)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BlockingStream:
    """A blocking view of an async context manager and/or async iterator (`watch`, `step`).

    Public attributes read through (a watch's `cursor`: the last change's, to resume from).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._pid = os.getpid()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __enter__(self) -> Any:
        _check_process(self)
        entered = _call(self._inner.__aenter__)
        return self if entered is self._inner else _wrap(entered)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        _check_process(self)
        result: bool | None = _call(self._inner.__aexit__, exc_type, exc, tb)
        return result

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        _check_process(self)
        try:
            return _await(self._inner.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Close the stream (its `aclose()`); in a forked child, nothing (the parent's)."""
        if self._pid == os.getpid():
            _call(self._inner.aclose)


# ------------------------------------------------------------------ the blocking classes


class Subscription(Blocking[_events.Subscription], wraps=_events.Subscription):
    """Blocking `agenticstate.Subscription`, what the blocking `subscribe` returns.

    `wait_live()` blocks until the subscription is live (and raises what the async one
    raises: `CursorExpiredError` for an expired `since=` cursor, ...); `unsubscribe()` stops it;
    `pattern`, `callback` and `is_live` read through.
    """


class _Subscriptions(Generic[A]):
    """`subscribe`/`unsubscribe` for a blocking view: sync callbacks run in a worker thread."""

    _async: Any

    def subscribe(
        self,
        pattern: str,
        callback: Any,
        *,
        on_overflow: Any = None,
        since: str | None = None,
        on_gap: str = "raise",
    ) -> Subscription:
        """As the async `subscribe`, returning its handle as a blocking `Subscription`.

        It returns at once, as the async call does; `wait_live()` on the handle blocks until
        the subscription is live, and raises what awaiting the async handle raises
        (`CursorExpiredError` for an expired `since=` cursor). Sync callbacks run in a worker
        thread. Subscribing the same callback to the same pattern again returns the first
        handle.
        """
        _check_process(self)
        handle = _call_plain(
            self._async.subscribe,
            pattern,
            _threaded(callback),
            on_overflow=_threaded(on_overflow),
            since=since,
            on_gap=on_gap,
        )
        return Subscription.wrap(handle)

    def unsubscribe(self, pattern: str, callback: Any) -> bool:
        """Stop calling `callback` for `pattern`; return whether it was subscribed."""
        _check_process(self)
        result: bool = _call(self._async.unsubscribe, pattern, _threaded(callback))
        return result


class StateManager(
    _Subscriptions[_AsyncStateManager], Blocking[_AsyncStateManager], wraps=_AsyncStateManager
):
    """Blocking `agenticstate.StateManager`.

    `subscribe` runs a sync callback in a worker thread, so the callback may use this API.
    """


class ScopedState(
    _Subscriptions[_scope.ScopedState], Blocking[_scope.ScopedState], wraps=_scope.ScopedState
):
    """Blocking `agenticstate.ScopedState` (from `sync.StateManager.scope(prefix)`)."""


class Checkout(Blocking[_commits.Checkout], wraps=_commits.Checkout):
    """Blocking `agenticstate.Checkout` (from `sync.StateManager.checkout(commit_id)`).

    `get` and `items` block while they read the blobs; `keys`, `len` and `in` are plain calls.
    """

    def __len__(self) -> int:
        return len(self._async)

    def __contains__(self, key: object) -> bool:
        return key in self._async


class LocalView(Blocking[_view.LocalView], wraps=_view.LocalView):
    """Blocking `agenticstate.LocalView`: `with state.view("agent:*") as view:` opens it.

    Reads (`get`, `entry`, `keys`, `len`, `in`) are plain calls; `update` blocks until written.
    """

    def __enter__(self) -> Self:
        _await(self._async.open)
        return self

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        result: bool = _call(self._async.__contains__, key)
        return result

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


class AgentStateStore(Blocking[_managers.AgentStateStore], wraps=_managers.AgentStateStore):
    """Blocking `agenticstate.AgentStateStore`."""


class AgentRecoveryManager(
    Blocking[_managers.AgentRecoveryManager], wraps=_managers.AgentRecoveryManager
):
    """Blocking `agenticstate.AgentRecoveryManager`."""


class WorkflowStateManager(
    Blocking[_managers.WorkflowStateManager], wraps=_managers.WorkflowStateManager
):
    """Blocking `agenticstate.WorkflowStateManager` (`step` is a blocking context manager)."""


class OrchestrationStateManager(
    Blocking[_managers.OrchestrationStateManager], wraps=_managers.OrchestrationStateManager
):
    """Blocking `agenticstate.OrchestrationStateManager`."""


class KnowledgeStateManager(
    Blocking[_managers.KnowledgeStateManager], wraps=_managers.KnowledgeStateManager
):
    """Blocking `agenticstate.KnowledgeStateManager`."""


class ToolStateManager(Blocking[_managers.ToolStateManager], wraps=_managers.ToolStateManager):
    """Blocking `agenticstate.ToolStateManager`."""


class SpeechStateManager(
    Blocking[_managers.SpeechStateManager], wraps=_managers.SpeechStateManager
):
    """Blocking `agenticstate.SpeechStateManager`."""


class SessionManager(Blocking[_managers.SessionManager], wraps=_managers.SessionManager):
    """Blocking `agenticstate.SessionManager`."""


def _threaded(callback: Any) -> Any:
    """Run a sync callback in a worker thread (so it may block); pass async ones through."""
    if callback is None or not callable(callback):
        return callback
    if inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
        getattr(callback, "__call__", None)  # noqa: B004  # an object with an async __call__
    ):
        return callback
    return _InThread(callback)


class _InThread:
    """A sync callback run in a worker thread.

    Equal to every other one wrapping the same callback: the async manager keys its
    subscriptions by pattern and callback, so subscribing again finds the running one and
    `unsubscribe` stops it, with no table of wrappers kept here.
    """

    def __init__(self, callback: Callable[..., Any]) -> None:
        self.callback = callback
        # What the manager's log lines name a callback by.
        self.__qualname__ = getattr(callback, "__qualname__", type(callback).__name__)

    async def __call__(self, *args: Any) -> None:
        await anyio.to_thread.run_sync(lambda: self.callback(*args))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _InThread):
            return NotImplemented
        return bool(self.callback == other.callback)

    def __hash__(self) -> int:
        return hash(self.callback)


def close_all() -> None:
    """Close every object built by this module, then stop its event loop (run at exit).

    Idempotent; the next blocking call starts a new loop.
    """
    if _LOOP.thread_id is None:
        return
    for obj in list(_OWNED):
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001  # at exit, close what can be closed
            log.warning("sync_close_failed", obj=type(obj).__name__, error=type(exc).__name__)
    _LOOP.stop()


atexit.register(close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LOOP.after_fork)
