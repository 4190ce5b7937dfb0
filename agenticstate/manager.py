"""StateManager: save, read, update and watch state on any backend.

```python
state = StateManager(config=StateConfig(backend="memory"))
await state.save("agent:researcher", {"status": "running", "progress": 0.45})
await state.update("agent:researcher", {"progress": 0.75})         # deep merge, atomic
await state.update("counter", lambda n: n + 1, default=0)            # read-modify-write, atomic
state.subscribe("agent:*", on_change)                                # callback(key, old, new)
async with state.watch("agent:*") as changes:                        # or an async iterator
    async for change in changes: ...
```

The manager validates keys and values, serializes them (`agenticstate.serialization`), and turns
the backend's byte-level changes into `StateChange`s for watchers and callbacks. It opens its
backend lazily on first use; `async with StateManager(...)` opens it eagerly and closes it on exit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime, timedelta  # pydantic needs them at runtime
from typing import TYPE_CHECKING, Any, Self, TypeVar, overload

import anyio
from pydantic import BaseModel, ConfigDict

from agenticstate import _otel
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._log import get_logger
from agenticstate._tasks import spawn_detached
from agenticstate.backends import Backend, open_config_backend
from agenticstate.backends.base import Change, Entry, check_expected_version
from agenticstate.config import StateConfig, _as_ttl
from agenticstate.encryption import ENCRYPTED_HEADER
from agenticstate.events import StateChange
from agenticstate.exceptions import (
    BackendError,
    BackendTimeoutError,
    ConfigurationError,
    ConflictError,
    DecryptionError,
    InvalidArgumentError,
    MergeError,
    NotFoundError,
    SubscriptionClosedError,
)
from agenticstate.serialization import Serializer

if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Awaitable, Generator, Iterable
    from contextlib import AbstractAsyncContextManager
    from types import TracebackType

    from anyio.abc import TaskGroup

    from agenticstate._usage import StateUsage
    from agenticstate.scope import ScopedState

__all__ = [
    "DEFAULT",
    "OverflowCallback",
    "StateCallback",
    "StateEntry",
    "StateManager",
    "StateStats",
    "Subscription",
    "Watch",
]

log = get_logger(__name__)

M = TypeVar("M", bound=BaseModel)
D = TypeVar("D")
T = TypeVar("T")

StateCallback = Callable[[str, Any, Any], "Awaitable[None] | None"]
"""A subscription callback: `callback(key, old_value, new_value)`, sync or async."""
OverflowCallback = Callable[[str], "Awaitable[None] | None"]
"""Called with the pattern when a callback subscription fell behind and changes were missed."""


class _Default:
    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""Use the configured default (for `ttl`: `StateConfig.ttl`)."""
_MISSING: Any = object()
_SUBSCRIBE_WAIT = 30.0  # seconds a write waits for a callback's subscription to start
_CLOSE_GRACE = 5.0  # seconds aclose() lets callbacks receive what was committed before it
_ENCRYPTED = bytes((ENCRYPTED_HEADER,))


class StateEntry(BaseModel):
    """A value with its metadata, as `StateManager.get_entry` returns it.

    Attributes:
        key: The key.
        value: The stored value (or the validated model, with `model=`).
        version: 1 after the first write, one more after each later write.
        created_at: When the key was first written (UTC).
        updated_at: When it was last written (UTC).
        expires_at: When it expires (UTC), or `None` for never.
        ttl: The time left before it expires, or `None` for never.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    value: Any
    version: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    ttl: timedelta | None


class StateStats(BaseModel):
    """Counters of what a `StateManager` has done since it was created."""

    model_config = ConfigDict(frozen=True)

    backend: str
    """The backend's class name."""
    saves: int = 0
    """Values written by `save` and `save_many`."""
    reads: int = 0
    """Keys read by `get`, `get_entry`, `get_many` and `exists`."""
    updates: int = 0
    """Successful `update` calls."""
    deletes: int = 0
    """Keys deleted."""
    conflicts: int = 0
    """Writes refused with `ConflictError`."""
    events_delivered: int = 0
    """Changes handed to callbacks."""
    callback_errors: int = 0
    """Callbacks that raised (logged, never failing the write)."""
    overflows: int = 0
    """Callback subscriptions that fell behind and were re-opened."""
    subscriptions: int = 0
    """Callbacks currently subscribed."""


def deep_merge(base: dict[str, Any], partial: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `partial` into `base` in place: nested dicts merge, everything else replaces."""
    for key, value in partial.items():
        current = base.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            base[key] = deep_merge(current, value)
        else:
            base[key] = value
    return base


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
        manager: StateManager,
        pattern: str,
        callback: StateCallback,
        on_overflow: OverflowCallback | None,
    ) -> None:
        self.pattern = pattern
        self.callback = callback
        self.on_overflow = on_overflow
        self.handle = Subscription(manager, self)
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

    __slots__ = ("_manager", "_pump")

    def __init__(self, manager: StateManager, pump: _Pump) -> None:
        self._manager = manager
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
        return pump.live.is_set() and not pump.stopped and not self._manager._closed

    async def wait_live(self) -> None:
        """Wait until every change committed from now on, by any process, will be delivered.

        Raises:
            BackendError: The attempt to subscribe failed (the subscription keeps retrying
                in the background; call again to wait for the next attempt).
            SubscriptionClosedError: It was unsubscribed, or the manager closed.
        """
        pump = self._pump
        while True:
            if pump.stopped or self._manager._closed:
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
        if self._manager._pumps.get((pump.pattern, pump.callback)) is not pump:
            return False
        return self._manager.unsubscribe(pump.pattern, pump.callback)


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

    def __init__(self, manager: StateManager, pattern: str, max_buffer: int) -> None:
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
        return self._manager._state_change(change)


class StateManager:
    """Save, read, update, delete, list and watch state on a pluggable backend.

    Args:
        config: Which backend and how to encode values; defaults to `StateConfig()` (memory).
        backend: A backend instance to use instead of building one from `config`. The manager
            closes it on `aclose()` unless `close_backend=False`.
        close_backend: Whether `aclose()` closes the backend too.

    Use it directly (it opens its backend on first use) or as `async with StateManager(...)`.
    """

    def __init__(
        self,
        config: StateConfig | None = None,
        *,
        backend: Backend | None = None,
        close_backend: bool = True,
    ) -> None:
        if config is not None and not isinstance(config, StateConfig):
            raise ConfigurationError(f"config must be a StateConfig, not {type(config).__name__}")
        self.config = config or StateConfig()
        self.backend: Backend = backend if backend is not None else open_config_backend(self.config)
        self.serializer = Serializer(
            self.config.format or self.backend.preferred_format or "msgpack",
            compression=self.config.compression,
            compression_threshold=self.config.compression_threshold,
            max_size=self.config.max_value_size,
            max_depth=self.config.max_depth,
        )
        self._encryption = self.config.encryption
        self._close_backend = close_backend
        self._is_open = False
        self._closed = False
        self._open_lock: anyio.Lock | None = None
        self._pumps: dict[tuple[str, StateCallback], _Pump] = {}
        self._pending: set[_Pump] = set()
        self._task_group: TaskGroup | None = None
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "saves",
                "reads",
                "updates",
                "deletes",
                "conflicts",
                "events_delivered",
                "callback_errors",
                "overflows",
            ),
            0,
        )
        _otel.auto_instrument()  # once a tracer or meter provider is configured; else free

    def __repr__(self) -> str:
        return f"StateManager(backend={self.backend!r})"

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        await self.open()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task_group, self._task_group = self._task_group, None
        try:
            await self.aclose()
        finally:
            if task_group is not None:
                await task_group.__aexit__(None, None, None)

    async def open(self) -> None:
        """Open the backend now (otherwise the first call does). Idempotent."""
        await self._opened_backend()

    def _ready_backend(self) -> Backend | None:
        # The hot path: open, not closed, no subscription still starting. Saves an await.
        if self._is_open and not self._pending and not self._closed:
            return self.backend
        return None

    async def _opened_backend(self) -> Backend:
        backend = await self._ensure_open()
        if self._pending:
            await self._wait_pumps_ready()
        return backend

    async def _ensure_open(self) -> Backend:
        if self._closed:
            raise BackendError("this StateManager is closed")
        if not self._is_open:
            if self._open_lock is None:
                self._open_lock = anyio.Lock()
            async with self._open_lock:
                if not self._is_open:
                    await self.backend.open()
                    self._is_open = True
        return self.backend

    async def _wait_pumps_ready(self) -> None:
        # A callback subscribed just before a write must see that write: wait until every new
        # pump's backend subscription is active (or has failed and logged why). That depends
        # on the backend only: a pump never runs a user's callback or overflow handler before
        # its subscription is ready, so a callback that reads or writes cannot wait on itself.
        for pump in list(self._pending):
            with anyio.move_on_after(_SUBSCRIBE_WAIT):
                await pump.ready.wait()
            if not pump.ready.is_set():
                raise BackendTimeoutError(
                    f"the subscription to {pump.pattern!r} did not start within "
                    f"{_SUBSCRIBE_WAIT:g} s; nothing was done"
                )

    async def flush(self) -> None:
        """Make every acknowledged write durable now (the file backend's snapshot)."""
        backend = await self._opened_backend()
        await backend.flush()

    async def aclose(self) -> None:
        """Close the backend and stop subscriptions. Idempotent.

        When the manager owns its backend, callbacks first receive every change committed before
        the close (for up to 5 seconds); otherwise they stop at once.
        """
        if self._closed:
            return
        self._closed = True
        # Called from a callback or overflow handler, the pump running it cannot finish before
        # this returns: wait for the others, and let that one end when its callback returns.
        current = _running_pump.get()
        others = [pump for pump in self._pumps.values() if pump is not current]
        with anyio.CancelScope(shield=True):
            if self._close_backend:
                # Closing the backend ends each subscription after its buffered changes, so the
                # pumps deliver what was committed and then finish by themselves.
                await self.backend.aclose()
                with anyio.move_on_after(_CLOSE_GRACE):
                    for pump in others:
                        await pump.done.wait()
            for pump in list(self._pumps.values()):
                self._stop(pump, force=pump is not current)
            with anyio.move_on_after(_CLOSE_GRACE):
                for pump in others:
                    await pump.done.wait()
            self._pumps.clear()
            self._pending.clear()

    # ---------------------------------------------------------------- reads

    @overload
    async def get(self, key: str, default: None = None, *, model: None = None) -> Any: ...
    @overload
    async def get(self, key: str, default: D, *, model: None = None) -> Any: ...
    @overload
    async def get(self, key: str, default: None = None, *, model: type[M]) -> M | None: ...
    @overload
    async def get(self, key: str, default: D, *, model: type[M]) -> M | D: ...

    async def get(
        self, key: str, default: object = None, *, model: type[BaseModel] | None = None
    ) -> Any:
        """Return the value at `key`, or `default` if it is missing or expired.

        Args:
            key: The key.
            default: What to return when the key is missing.
            model: A pydantic model to validate the stored value as.

        Raises:
            DecodeError: The stored bytes are corrupt or do not validate as `model`.
        """
        validate_key(key)
        backend = self._ready_backend() or await self._opened_backend()
        entry = await backend.get(key)
        self._counters["reads"] += 1
        if entry is None:
            return default
        return self._decode(key, entry.value, model)

    async def get_entry(
        self, key: str, *, model: type[BaseModel] | None = None
    ) -> StateEntry | None:
        """Return the value at `key` with its version, timestamps and time to live, or `None`."""
        validate_key(key)
        backend = await self._opened_backend()
        entry = await backend.get(key)
        self._counters["reads"] += 1
        return None if entry is None else self._state_entry(entry, model)

    async def get_many(
        self, keys: Iterable[str], *, model: type[BaseModel] | None = None
    ) -> dict[str, Any]:
        """Return `{key: value}` for every key in `keys` that exists, in one backend call."""
        wanted = [validate_key(key) for key in keys]
        backend = await self._opened_backend()
        entries = await backend.get_many(wanted)
        self._counters["reads"] += len(wanted)
        return {
            key: self._decode(key, entry.value, model)
            for key, entry in zip(wanted, entries, strict=True)
            if entry is not None
        }

    async def exists(self, key: str) -> bool:
        """Return whether `key` is present (written and not deleted or expired)."""
        validate_key(key)
        backend = await self._opened_backend()
        self._counters["reads"] += 1
        return await backend.get(key) is not None

    async def list_keys(self, pattern: str = "*") -> list[str]:
        r"""Return the present keys matching the Redis glob `pattern`, sorted.

        `*` matches anything (`:` included), `?` one character, `[abc]`/`[a-z]`/`[^a]` one of a
        set; a backslash makes the next character literal (`list_keys(r"job\*")`).
        """
        validate_pattern(pattern)
        backend = await self._opened_backend()
        keys: list[str] = []
        async for batch in backend.scan_batches(pattern):  # whole pages, each key once
            keys += batch
        keys.sort()
        return keys

    async def usage(
        self,
        pattern: str = "*",
        *,
        batch_size: int = 500,
        max_time: timedelta | float | None = None,
        progress: Callable[[StateUsage], Awaitable[None] | None] | None = None,
    ) -> StateUsage:
        """Count the keys matching `pattern` and the bytes their values take, per namespace.

        Keys are scanned (SCAN on Redis, never KEYS) and measured `batch_size` at a time without
        decoding a value: exact on memory and file, STRLEN on Redis. See `StateUsage` for what
        the bytes include.

        Args:
            pattern: A Redis glob, as for `list_keys`.
            batch_size: Keys measured per backend call.
            max_time: Stop after about this long and return what was counted, with
                `complete=False`; by default run to the end.
            progress: Called after each batch with the running totals, sync or async.
        """
        from agenticstate._usage import measure_usage  # here: the module is only needed here

        validate_pattern(pattern)
        backend = await self._opened_backend()
        return await measure_usage(
            backend, pattern, batch_size=batch_size, max_time=max_time, progress=progress
        )

    # ---------------------------------------------------------------- writes

    def _ttl(self, ttl: object) -> timedelta | None:
        if ttl is DEFAULT:
            return self.config.ttl
        try:
            return _as_ttl(ttl)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None

    async def save(
        self,
        key: str,
        value: object,
        *,
        ttl: timedelta | float | None = DEFAULT,
        expected_version: int | None = None,
    ) -> int:
        """Store `value` at `key` and return its new version.

        Args:
            key: The key.
            value: A JSON-like value, datetime, date, UUID, bytes or pydantic model.
            ttl: Seconds or a timedelta until it expires; `None` for never; by default the
                configured `StateConfig.ttl`.
            expected_version: Write only if the key is at this version (0: only if missing).

        Raises:
            SerializationError: The value cannot be stored; nothing was written.
            ConflictError: `expected_version` did not match; nothing was written.
        """
        validate_key(key)
        if expected_version is not None:
            check_expected_version(expected_version)
        life = self.config.ttl if ttl is DEFAULT else self._ttl(ttl)
        raw = self.serializer.dumps(value)
        if self._encryption is not None:
            raw = self._encryption.encrypt(self.backend.key_prefix, key, raw)
        backend = self._ready_backend() or await self._opened_backend()
        try:
            change = await backend.set(key, raw, ttl=life, expected_version=expected_version)
        except ConflictError:
            self._counters["conflicts"] += 1
            raise
        self._counters["saves"] += 1
        return change.version

    async def save_many(
        self, items: Mapping[str, object], *, ttl: timedelta | float | None = DEFAULT
    ) -> dict[str, int]:
        """Store several values in one backend call; return `{key: new_version}`.

        Every value is validated and encoded before anything is written. Each write is atomic;
        the batch is not a transaction.
        """
        life = self._ttl(ttl)
        encoded = [(validate_key(key), self._encode(key, value)) for key, value in items.items()]
        backend = await self._opened_backend()
        changes = await backend.set_many(encoded, ttl=life)
        self._counters["saves"] += len(changes)
        return {change.key: change.version for change in changes}

    async def update(
        self,
        key: str,
        change: Mapping[str, Any] | Callable[[Any], Any],
        *,
        default: object = _MISSING,
        ttl: timedelta | float | None = DEFAULT,
    ) -> Any:
        """Change the value at `key` atomically and return the new value.

        With a dict, deep-merge it into the stored dict (nested dicts merge, other values
        replace). With a function, store `fn(current_value)`. Either way, concurrent updates from
        any number of tasks or processes lose nothing. The function may run more than once under
        contention, so it must not have side effects; it receives its own copy of the value.

        Args:
            key: The key.
            change: A partial dict to merge, or a function from the old value to the new one.
            default: The current value to assume when the key is missing; without it, a
                missing key raises `NotFoundError`.
            ttl: As for `save`.

        Raises:
            NotFoundError: The key is missing and no `default` was given.
            MergeError: A dict was given but the stored value is not a dict.
            ConflictError: The update lost `update_max_attempts` races in a row.
        """
        validate_key(key)
        apply: Callable[[Any], Any]
        if isinstance(change, Mapping):
            partial = change

            def merge(current: Any) -> Any:
                if not isinstance(current, dict):
                    raise MergeError(
                        f"cannot merge a dict into the {type(current).__name__} stored at {key!r}"
                    )
                return deep_merge(current, partial)

            apply = merge

        elif callable(change):
            apply = change
        else:
            raise InvalidArgumentError(
                f"update() takes a dict or a function, not {type(change).__name__}"
            )
        life = self._ttl(ttl)
        result: list[Any] = []
        attempts = [0]  # more than one: the compare-and-set lost a race and retried

        def step(entry: Entry | None) -> bytes:
            attempts[0] += 1
            if entry is None:
                if default is _MISSING:
                    raise NotFoundError(f"no state at key {key!r}")
                current = self.serializer.loads(self.serializer.dumps(default))
            else:
                current = self._decode(key, entry.value, None)
            new = apply(current)
            if inspect.isawaitable(new):
                if inspect.iscoroutine(new):
                    new.close()
                raise InvalidArgumentError("update() functions must be synchronous")
            raw = self._encode(key, new)
            result[:] = [new]
            return raw

        backend = await self._opened_backend()
        try:
            await self._counted_write(
                backend.update(key, step, ttl=life, max_attempts=self.config.update_max_attempts)
            )
        finally:
            _otel.record_retry(self.backend, "update", attempts[0] - 1)
        self._counters["updates"] += 1
        return result[0]

    async def delete(self, key: str, *, expected_version: int | None = None) -> bool:
        """Delete `key`; return whether it existed.

        Raises:
            ConflictError: `expected_version` did not match; nothing was deleted.
        """
        validate_key(key)
        check_expected_version(expected_version)
        backend = await self._opened_backend()
        change = await self._counted_write(backend.delete(key, expected_version=expected_version))
        if change is None:
            return False
        self._counters["deletes"] += 1
        return True

    async def reencrypt(self, pattern: str = "*") -> int:
        """Rewrite the values matching `pattern` that are not under the current encryption key.

        The step that lets an old key be dropped from the keyring after a rotation (see
        `Encryption`). Each rewrite is a compare-and-set on the version: a value written
        meanwhile is read again (it is usually under the current key already). Rewrites keep
        the value and its remaining time to live, bump the version and emit a change like any
        write. Values stored in plain (read with `allow_plaintext=True`) are encrypted too.

        Returns:
            How many values were rewritten.

        Raises:
            ConfigurationError: The manager has no `StateConfig(encryption=...)`.
            DecryptionError: A value is under a key the keyring lacks, or was altered.
        """
        encryption = self._encryption
        if encryption is None:
            raise ConfigurationError("reencrypt() needs StateConfig(encryption=...)")
        validate_pattern(pattern)
        backend = await self._opened_backend()
        namespace = backend.key_prefix
        rewritten = 0
        for key in sorted({key async for key in backend.scan(pattern)}):
            while True:
                entry = await backend.get(key)
                if entry is None or encryption.key_id_of(entry.value) == encryption.current:
                    break
                life = entry.ttl()
                if life is not None and life <= timedelta(0):
                    break  # expiring this instant: nothing to keep
                raw = encryption.encrypt(
                    namespace, key, encryption.decrypt(namespace, key, entry.value)
                )
                try:
                    await backend.set(key, raw, ttl=life, expected_version=entry.version)
                except ConflictError:
                    continue
                rewritten += 1
                break
        return rewritten

    async def _counted_write(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except ConflictError:
            self._counters["conflicts"] += 1
            raise

    def scope(self, prefix: str) -> ScopedState:
        """Return a view of this manager where every key is relative to `prefix`.

        See `agenticstate.ScopedState`: the same API, plus `clear()` and `get_all()`.
        """
        from agenticstate.scope import ScopedState  # here: scope.py imports this module

        return ScopedState(self, prefix)

    # ---------------------------------------------------------------- sorted indexes

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members with scores to a sorted index; return how many were new.

        Re-adding a member moves it. Sorted indexes live beside the keys, in a namespace of
        their own (never returned by `get` or `list_keys`, never announced to subscribers).
        Redis keeps them as sorted sets.
        """
        validate_key(index)
        backend = await self._opened_backend()
        return await backend.index_add(index, members)

    async def index_remove(self, index: str, members: Iterable[str]) -> int:
        """Remove members from a sorted index; return how many were there."""
        validate_key(index)
        backend = await self._opened_backend()
        return await backend.index_remove(index, list(members))

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Return up to `limit` members with scores, lowest score first (ties by member)."""
        validate_key(index)
        backend = await self._opened_backend()
        return await backend.index_range(index, limit=limit)

    # ---------------------------------------------------------------- subscriptions

    def subscribe(
        self,
        pattern: str,
        callback: StateCallback,
        *,
        on_overflow: OverflowCallback | None = None,
    ) -> Subscription:
        """Call `callback(key, old_value, new_value)` for every change to keys matching `pattern`.

        The callback may be sync or async. Its calls run one at a time, in commit order for each
        key; one that raises is logged and counted, and never fails the write. Each callback has
        a subscription of its own, so a slow callback never holds up another. Subscribing the
        same callback to the same pattern twice has no further effect (the first handle is
        returned again).

        What is delivered: every write made through this manager after `subscribe()` returns
        (such writes wait until the subscription is live), and every write by any other
        manager or process once the subscription is live. `subscribe()` returns before that;
        `await` its result (or call `wait_live()` on it) to know:

        <!-- snippet: setup=state -->
        ```python
        def on_change(key, old, new):
            print(key, old, new)

        state.subscribe("agent:*", on_change)  # returns at once, goes live in the background
        subscription = await state.subscribe("job:*", on_change)  # returns once live
        ```

        If the callback falls more than `StateConfig.subscriber_buffer` changes behind, the
        changes beyond the buffer are missed: the manager logs `subscription_reopened`, counts
        it in `stats().overflows`, subscribes again, and then calls `on_overflow(pattern)` (sync
        or async). The new subscription is live before the handler runs, so a handler that
        re-reads the state it needs misses nothing: every later change follows it.

        Under trio, enter the manager (`async with`) before subscribing callbacks.

        Returns:
            A `Subscription`: await it to wait until it is live.
        """
        validate_pattern(pattern)
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, not {type(callback).__name__}")
        if self._closed:
            raise BackendError("this StateManager is closed")
        if on_overflow is not None and not callable(on_overflow):
            raise InvalidArgumentError("on_overflow must be callable")
        existing = self._pumps.get((pattern, callback))
        if existing is not None:
            return existing.handle
        pump = _Pump(self, pattern, callback, on_overflow)
        if self._task_group is not None:
            self._task_group.start_soon(self._run_pump, pump, name=f"agenticstate:{pattern}")
        else:
            pump.task = spawn_detached(lambda: self._run_pump(pump), name=f"agenticstate:{pattern}")
        self._pumps[pattern, callback] = pump
        self._pending.add(pump)
        return pump.handle

    def unsubscribe(self, pattern: str, callback: StateCallback) -> bool:
        """Stop calling `callback` for `pattern`; return whether it was subscribed.

        A call of the callback already running (an async callback that unsubscribes itself,
        say) runs to its end; no later change is delivered.
        """
        pump = self._pumps.pop((pattern, callback), None)
        if pump is None:
            return False
        self._stop(pump, force=False)
        return True

    def watch(self, pattern: str, *, max_buffer: int | None = None) -> Watch:
        """Return a `Watch`: an async iterator (and context manager) of `StateChange`s.

        Entered with `async with`, the watch is live on entry: it receives every change
        committed after that, by this manager or any other process.
        """
        validate_pattern(pattern)
        if max_buffer is None:
            max_buffer = self.config.subscriber_buffer
        elif type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        return Watch(self, pattern, max_buffer)

    def _stop(self, pump: _Pump, *, force: bool) -> None:
        """End `pump`: at once if it is idle (or `force`), else when its running call returns."""
        pump.stopped = True
        self._pending.discard(pump)
        pump.ready.set()  # writes waiting for it need not any more
        pump.settled.set()
        if force or not pump.busy:
            pump.scope.cancel()

    async def _run_pump(self, pump: _Pump) -> None:
        _running_pump.set(pump)
        try:
            with pump.scope:
                await self._pump_changes(pump)
        finally:
            pump.stopped = True
            self._pending.discard(pump)
            pump.ready.set()
            pump.settled.set()
            pump.done.set()

    def _mark_ready(self, pump: _Pump, error: BackendError | None = None) -> None:
        pump.error = error
        if error is None:
            pump.live.set()
        pump.ready.set()
        pump.settled.set()
        self._pending.discard(pump)

    async def _pump_changes(self, pump: _Pump) -> None:
        failures = 0
        missed = False  # an overflow lost changes: tell on_overflow once subscribed again
        while not self._closed and not pump.stopped:
            try:
                backend = await self._ensure_open()
                async with backend.changes(
                    pump.pattern, max_buffer=self.config.subscriber_buffer
                ) as changes:
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
                _otel.record_overflow(self.backend, "callback")
                log.warning("subscription_reopened", pattern=pump.pattern, reason="overflow")
                # Writes from now on wait until the pump has subscribed again, so none is missed.
                if pump.ready.is_set():
                    pump.ready = anyio.Event()
                self._pending.add(pump)
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
            old = None if change.old is None else self._decode(change.key, change.old, None)
            new = None if change.new is None else self._decode(change.key, change.new, None)
            _otel.record_subscriber_lag(self.backend, change.timestamp, "callback")
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

    # ---------------------------------------------------------------- helpers

    def _encode(self, key: str, value: object) -> bytes:
        raw = self.serializer.dumps(value)
        if self._encryption is None:
            return raw
        return self._encryption.encrypt(self.backend.key_prefix, key, raw)

    def _decode(self, key: str, raw: bytes, model: type[BaseModel] | None) -> Any:
        if self._encryption is not None:
            raw = self._encryption.decrypt(self.backend.key_prefix, key, raw)
        elif raw[:1] == _ENCRYPTED:
            raise DecryptionError(
                f"the value at {key!r} is encrypted; open the store with its keys "
                "(StateConfig(encryption=...))",
                path="",
            )
        if model is None:
            return self.serializer.loads(raw)
        return self.serializer.load_model(raw, model)

    def _state_entry(self, entry: Entry, model: type[BaseModel] | None) -> StateEntry:
        return StateEntry(
            key=entry.key,
            value=self._decode(entry.key, entry.value, model),
            version=entry.version,
            created_at=entry.created_at,
            updated_at=entry.updated_at,
            expires_at=entry.expires_at,
            ttl=entry.ttl(),
        )

    def _state_change(self, change: Change) -> StateChange:
        return StateChange.model_construct(
            key=change.key,
            old_value=None if change.old is None else self._decode(change.key, change.old, None),
            new_value=None if change.new is None else self._decode(change.key, change.new, None),
            version=change.version,
            op=change.op,
            timestamp=change.timestamp,
        )

    def stats(self) -> StateStats:
        """Return counters of saves, reads, updates, conflicts, events and callback errors."""
        return StateStats(
            backend=type(self.backend).__name__,
            subscriptions=len(self._pumps),
            **self._counters,
        )
