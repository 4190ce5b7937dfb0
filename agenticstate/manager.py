"""StateManager: save, read, update and watch state on any backend.

```python
state = StateManager(config=StateConfig(backend="memory"))
await state.save("agent:researcher", {"status": "running", "progress": 0.45})
await state.update("agent:researcher", {"progress": 0.75})         # deep merge, atomic
await state.update("counter", lambda n: n + 1, default=0)            # read-modify-write, atomic
state.subscribe("agent:*", on_change)                                # callback(key, old, new)
async with state.watch("agent:*") as changes:                        # or an async iterator
    async for change in changes: ...
async with state.changes("agent:*", since=cursor) as changes: ...    # resume from a cursor
await state.history("agent:researcher")                              # past versions (opt-in)
await state.revert("agent:researcher", to_version=2)                 # an old value, rewritten
```

The manager is the facade: it validates arguments, counts what it does and opens its backend
lazily on first use (`async with StateManager(...)` opens it eagerly and closes it on exit). The
work is done below it:

- `agenticstate._codec.Codec`: values to bytes and back (serializer, encryption, namespace).
- `agenticstate.events`: `Watch`, and the callback pumps behind `subscribe` (`CallbackPumps`).
- `agenticstate._reencrypt`, `agenticstate._usage`: operations over the backend.

`Watch`, `Subscription`, `StateCallback`, `OverflowCallback` (from `events`), `StateEntry` (from
`_codec`) and `deep_merge` (from `_merge`) are re-exported here under their old import paths.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Self, TypeVar, overload

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict

from agenticstate import _otel, txn
from agenticstate._checks import as_ttl
from agenticstate._codec import Codec, StateEntry
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._merge import deep_merge, updater
from agenticstate._reencrypt import reencrypt
from agenticstate.backends import Backend, open_config_backend
from agenticstate.backends.base import HistoryRules, Revision, backoff, check_expected, check_limit
from agenticstate.config import StateConfig
from agenticstate.events import (
    CallbackPumps,
    OnGap,
    OverflowCallback,
    StateCallback,
    Subscription,
    Watch,
    check_on_gap,
    check_since,
)
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
    from datetime import timedelta
    from types import TracebackType

    from anyio.abc import TaskGroup

    from agenticstate._usage import StateUsage
    from agenticstate.backends.base import Entry, TxnCompare
    from agenticstate.backends.base import Put as BackendPut
    from agenticstate.scope import ScopedState
    from agenticstate.serialization import Serializer
    from agenticstate.view import LocalView

if TYPE_CHECKING:  # the commits of a scope (issue #23, point 4)
    from agenticstate.commits import Checkout, CommitDiff, CommitInfo, CommitStore

__all__ = [
    "DEFAULT",
    "OverflowCallback",
    "StateCallback",
    "StateEntry",
    "StateManager",
    "StateStats",
    "Subscription",
    "Watch",
    "deep_merge",
]

M = TypeVar("M", bound=BaseModel)
D = TypeVar("D")
T = TypeVar("T")


class _Default:
    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""Use the configured default (for `ttl`: `StateConfig.ttl`)."""
_MISSING: Any = object()
_SUBSCRIBE_WAIT = 30.0  # seconds a write waits for a callback's subscription to start
_ENCODE_CHUNK = 512  # values `save_many` encodes between two yields to the event loop
_CLOSE_GRACE = 5.0  # seconds aclose() lets callbacks receive what was committed before it
_COUNTERS = (  # what `stats()` reports, besides the backend and the subscriptions
    "saves",
    "reads",
    "updates",
    "deletes",
    "conflicts",
    "events_delivered",
    "callback_errors",
    "overflows",
)


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


def _require_revisions(backend: Backend, what: str) -> None:
    """Refuse `what` on a backend that keeps no revisions (`Backend.has_revisions`)."""
    if not backend.has_revisions:
        raise UnsupportedOperationError(
            f"{type(backend).__name__} keeps no revisions, so it cannot take {what}; compare "
            "versions instead (expected_version, Version), or use a backend with revisions"
        )


class _UpdateStep:
    """One `update`'s read-modify-write step: current entry in, bytes to store out.

    The backend calls it with the current entry, again after each lost compare-and-set.
    """

    __slots__ = ("apply", "attempts", "codec", "default", "key", "result")

    def __init__(
        self, codec: Codec, key: str, apply: Callable[[Any], Any], default: object
    ) -> None:
        self.codec = codec
        self.key = key
        self.apply = apply
        self.default = default
        self.attempts = 0  # more than one: the compare-and-set lost a race and retried
        self.result: Any = None  # the value the last call encoded

    def __call__(self, entry: Entry | None) -> bytes:
        self.attempts += 1
        if entry is None:
            if self.default is _MISSING:
                raise NotFoundError(f"no state at key {self.key!r}")
            current = self.codec.copy(self.default)
        else:
            current = self.codec.decode(self.key, entry.value)
        new = self.apply(current)
        if inspect.isawaitable(new):
            if inspect.iscoroutine(new):
                new.close()
            raise InvalidArgumentError("update() functions must be synchronous")
        raw = self.codec.encode(self.key, new)
        self.result = new
        return raw


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
        self._codec = Codec.for_backend(self.config, self.backend)
        self._close_backend = close_backend
        self._is_open = False
        self._closed = False
        self._open_lock: anyio.Lock | None = None
        self._task_group: TaskGroup | None = None
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._pumps = CallbackPumps(
            open_backend=self._ensure_open,
            codec=self._codec,
            counters=self._counters,
            buffer=self.config.subscriber_buffer,
            backend=self.backend,
        )
        _otel.auto_instrument()  # once a tracer or meter provider is configured; else free

    def __repr__(self) -> str:
        return f"StateManager(backend={self.backend!r})"

    @property
    def serializer(self) -> Serializer:
        """How values become bytes (`StateConfig.format`, compression, size limits)."""
        return self._codec.serializer

    @serializer.setter
    def serializer(self, serializer: Serializer) -> None:
        self._codec.serializer = serializer

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
        if self._is_open and not self._pumps.pending and not self._closed:
            return self.backend
        return None

    async def _opened_backend(self) -> Backend:
        # Opened, and every callback subscribed before this call is live (so it sees the call).
        backend = await self._ensure_open()
        if self._pumps.pending:
            await self._pumps.wait_ready(within=_SUBSCRIBE_WAIT)
        return backend

    async def _ensure_open(self) -> Backend:
        if self._closed:
            raise BackendError("this StateManager is closed")
        if not self._is_open:
            if self._open_lock is None:
                self._open_lock = anyio.Lock()
            async with self._open_lock:
                if not self._is_open:
                    self._keep_history()
                    await self.backend.open()
                    self._is_open = True
        return self.backend

    def _keep_history(self) -> None:
        # `StateConfig.history`, handed to the backend before its first write.
        if not self.config.history:
            return
        try:
            self.backend.keep_history(HistoryRules(self.config.history))
        except UnsupportedOperationError:
            raise ConfigurationError(
                f"{type(self.backend).__name__} keeps no history: StateConfig(history=...) "
                "needs a backend that does (every built-in backend does)"
            ) from None

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
        await self._pumps.close(self.backend if self._close_backend else None, grace=_CLOSE_GRACE)

    # ---------------------------------------------------------------- reads

    @overload
    async def get(
        self, key: str, default: None = None, *, model: None = None, version: int | None = None
    ) -> Any: ...
    @overload
    async def get(
        self, key: str, default: D, *, model: None = None, version: int | None = None
    ) -> Any: ...
    @overload
    async def get(
        self, key: str, default: None = None, *, model: type[M], version: int | None = None
    ) -> M | None: ...
    @overload
    async def get(
        self, key: str, default: D, *, model: type[M], version: int | None = None
    ) -> M | D: ...

    async def get(
        self,
        key: str,
        default: object = None,
        *,
        model: type[BaseModel] | None = None,
        version: int | None = None,
    ) -> Any:
        """Return the value at `key`, or `default` if it is missing or expired.

        Args:
            key: The key.
            default: What to return when the key is missing.
            model: A pydantic model to validate the stored value as.
            version: Return the value the key held at this version instead, or `default` if
                that version is not retained (see `history`): only the current one is, unless
                `StateConfig.history` names the key.

        Raises:
            DecodeError: The stored bytes are corrupt or do not validate as `model`.
            InvalidArgumentError: `version` is not an int >= 1.
        """
        validate_key(key)
        if version is not None:
            entry = await self._get_version(key, version)
            return default if entry is None else self._codec.decode(key, entry.value, model)
        backend = self._ready_backend() or await self._opened_backend()
        entry = await backend.get(key)
        self._counters["reads"] += 1
        if entry is None:
            return default
        return self._codec.decode(key, entry.value, model)

    async def get_entry(
        self, key: str, *, model: type[BaseModel] | None = None, version: int | None = None
    ) -> StateEntry | None:
        """Return the value at `key` with its version, timestamps and time to live, or `None`.

        With `version=n`, return that version as it was written (its `updated_at` is when),
        or `None` if it is not retained (see `history`).
        """
        validate_key(key)
        if version is not None:
            found = await self._get_version(key, version)
        else:
            backend = await self._opened_backend()
            found = await backend.get(key)
            self._counters["reads"] += 1
        return None if found is None else self._codec.state_entry(found, model)

    async def _get_version(self, key: str, version: int) -> Entry | None:
        if type(version) is not int or version < 1:
            raise InvalidArgumentError(f"version must be an int >= 1, not {version!r}")
        backend = await self._opened_backend()
        self._counters["reads"] += 1
        return await backend.get_version(key, version)

    async def get_many(
        self, keys: Iterable[str], *, model: type[BaseModel] | None = None
    ) -> dict[str, Any]:
        """Return `{key: value}` for every key in `keys` that exists, in one backend call."""
        wanted = [validate_key(key) for key in keys]
        backend = await self._opened_backend()
        entries = await backend.get_many(wanted)
        self._counters["reads"] += len(wanted)
        decode = self._codec.decode
        return {
            key: decode(key, entry.value, model)
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

        Cost per backend: on Redis (and Redis Cluster) it reads the key index, O(log n + the
        keys under the pattern's literal prefix), never the rest of the database (on a cluster,
        a pattern without a complete `{tag}` in its literal prefix probes every slot's index:
        a fixed cost per slot; see the Redis backend's "Listings and the key index"). On the
        other backends, see their pages.
        """
        validate_pattern(pattern)
        backend = await self._opened_backend()
        keys: list[str] = []
        async for batch in backend.scan_batches(pattern):  # whole pages, each key once
            keys += batch
        keys.sort()
        return keys

    async def list_tags(self, prefix: str) -> list[str]:
        """Return the distinct hash tags of the present keys starting `<prefix>{`, sorted.

        A key's tag is its text between that `{` and the next `}`: `list_tags("agents:")` over
        `agents:{a1}:meta` and `agents:{a1}:checkpoints:7` is `["a1"]` (a key with no `}` after
        the `{` has none). `prefix` is literal text, not a glob.

        Cost: one seek per tag, O(tags x log n), however many keys each tag has, on the
        built-in backends (on Redis, in the key index; on a cluster, the slots its registry
        names). A third-party backend without `Backend.scan_tags` of its own reads every key
        under the prefix.
        """
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, not {type(prefix).__name__}")
        backend = await self._opened_backend()
        return await backend.scan_tags(prefix)

    async def usage(
        self,
        pattern: str = "*",
        *,
        batch_size: int = 500,
        max_time: timedelta | float | None = None,
        progress: Callable[[StateUsage], Awaitable[None] | None] | None = None,
    ) -> StateUsage:
        """Count the keys matching `pattern` and the bytes their values take, per namespace.

        Keys are listed (from the key index on Redis, never KEYS) and measured `batch_size` at a
        time without decoding a value: exact on memory and file, STRLEN on Redis. See
        `StateUsage` for what the bytes include.

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
        return as_ttl(ttl)

    async def save(
        self,
        key: str,
        value: object,
        *,
        ttl: timedelta | float | None = DEFAULT,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> int:
        """Store `value` at `key` and return its new version.

        Args:
            key: The key.
            value: A JSON-like value, datetime, date, UUID, bytes or pydantic model.
            ttl: Seconds or a timedelta until it expires; `None` for never; by default the
                configured `StateConfig.ttl`.
            expected_version: Write only if the key is at this version (0: only if missing).
            expected_revision: Write only if the key's current revision
                (`StateEntry.revision`) is this one (0: only if missing). Unlike a version, a
                revision read before the key was deleted or expired never matches its next life
                (see `docs/concepts/versions.md`). Not with `expected_version`.

        Raises:
            SerializationError: The value cannot be stored; nothing was written.
            ConflictError: `expected_version` or `expected_revision` did not match; nothing was
                written.
            InvalidArgumentError: Both were given.
            UnsupportedOperationError: `expected_revision` on a backend that keeps no revisions.
        """
        validate_key(key)
        if expected_version is not None or expected_revision is not None:
            check_expected(expected_version, expected_revision)
        life = self.config.ttl if ttl is DEFAULT else self._ttl(ttl)
        raw = self._codec.encode(key, value)
        backend = self._ready_backend() or await self._opened_backend()
        try:
            if expected_revision is None:
                change = await backend.set(key, raw, ttl=life, expected_version=expected_version)
            else:
                _require_revisions(backend, "expected_revision")
                change = await backend.set(key, raw, ttl=life, expected_revision=expected_revision)
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
        the batch is not a transaction. Values are encoded `_ENCODE_CHUNK` at a time with a
        yield to the event loop between chunks, so a batch of any size leaves other tasks
        running (a million keys used to hold the loop for seconds).
        """
        life = self._ttl(ttl)
        pairs = list(items.items())  # the mapping as it is now: it may change while we yield
        encode = self._codec.encode
        encoded: list[tuple[str, bytes]] = []
        for start in range(0, len(pairs), _ENCODE_CHUNK):
            if start:
                await anyio.lowlevel.checkpoint()
            encoded += [
                (validate_key(key), encode(key, value))
                for key, value in pairs[start : start + _ENCODE_CHUNK]
            ]
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
        step = _UpdateStep(self._codec, key, updater(key, change), default)
        life = self._ttl(ttl)
        backend = await self._opened_backend()
        try:
            await self._counted_write(
                backend.update(key, step, ttl=life, max_attempts=self.config.update_max_attempts)
            )
        finally:
            _otel.record_retry(self.backend, "update", step.attempts - 1)
        self._counters["updates"] += 1
        return step.result

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> bool:
        """Delete `key`; return whether it existed.

        `expected_version` or `expected_revision` (not both) make it conditional, as in `save`;
        a missing key with 0 expected is not a conflict (the call returns `False`).

        Raises:
            ConflictError: `expected_version` or `expected_revision` did not match; nothing was
                deleted.
            InvalidArgumentError: Both were given.
            UnsupportedOperationError: `expected_revision` on a backend that keeps no revisions.
        """
        validate_key(key)
        if expected_version is not None or expected_revision is not None:
            check_expected(expected_version, expected_revision)
        backend = self._ready_backend() or await self._opened_backend()
        try:
            if expected_revision is None:
                change = await backend.delete(key, expected_version=expected_version)
            else:
                _require_revisions(backend, "expected_revision")
                change = await backend.delete(key, expected_revision=expected_revision)
        except ConflictError:
            self._counters["conflicts"] += 1
            raise
        if change is None:
            return False
        self._counters["deletes"] += 1
        return True

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[txn.Op],
        orelse: Sequence[txn.Op] = (),
    ) -> txn.TransactResult:
        """Check `compare`, then run `then` (or `orelse`), as one atomic step; one round trip.

        The operations and what each returns are in `agenticstate.txn`. Every value is encoded
        and every operation checked before anything is sent: a bad one raises and changes
        nothing. Writes emit their changes to subscribers as `save` and `delete` do.

        Raises:
            InvalidArgumentError: An operation or compare is malformed, or (Redis Cluster) its
                keys do not share one hash slot.
            UnsupportedOperationError: The backend has no atomic `transact`, or a `Revision`
                compare on a backend that keeps no revisions.
            DecodeError: A `Get`'s value does not decode (or validate as its `model`). Values
                are decoded after the step: its writes have happened (the error's note says so).
        """
        checked = txn.check_compares(compare)
        then, orelse = txn.check_ops(then, "then"), txn.check_ops(orelse, "orelse")
        codec = self._codec
        puts: dict[int, BackendPut] = {}  # a Put in both branches is encoded once
        first = txn.to_backend(then, codec, self._ttl_or_configured, puts)
        second = txn.to_backend(orelse, codec, self._ttl_or_configured, puts) if orelse else []
        backend = self._ready_backend() or await self._opened_backend()
        if not backend.has_revisions and any(type(item) is Revision for item in checked):
            _require_revisions(backend, "a Revision compare")
        counters = self._counters
        try:  # `_counted_write`, inline: one coroutine less on the hot path
            done = await backend.transact(checked, first, second)
        except ConflictError:
            counters["conflicts"] += 1
            raise
        ops = then if done.succeeded else orelse
        results, revisions = txn.from_backend(ops, done.results, codec, counters)
        return txn.TransactResult(done.succeeded, results, revisions)

    def _ttl_or_configured(self, ttl: object) -> timedelta | None:
        return self.config.ttl if ttl is txn.CONFIGURED else self._ttl(ttl)

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
        if self._codec.encryption is None:
            raise ConfigurationError("reencrypt() needs StateConfig(encryption=...)")
        validate_pattern(pattern)
        backend = await self._opened_backend()
        return await reencrypt(backend, self._codec, pattern)

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

    # ---------------------------------------------------------------- history

    async def history(
        self, key: str, *, limit: int | None = None, model: type[BaseModel] | None = None
    ) -> list[StateEntry]:
        """Return the retained versions of `key`, newest first: the current one, then older.

        Keys that `StateConfig.history` names keep their last N versions; any other key has
        only its current one. A missing key has no history (`[]`): deleting a key, or its
        expiry, ends its history, and written again it starts over at version 1. Each entry is
        the key as that version left it: `updated_at` is when it was written, `expires_at` the
        expiry it was written with.

        <!-- snippet: setup=imports -->
        ```python
        state = StateManager(config=StateConfig(history={"agent:*": 20}))
        for status in ("idle", "running", "done"):
            await state.save("agent:1", {"status": status})
        for entry in await state.history("agent:1"):
            print(entry.version, entry.value)  # 3 {'status': 'done'}, then 2 ..., then 1 ...
        await state.aclose()
        ```

        Args:
            key: The key.
            limit: Return at most this many versions (the newest).
            model: A pydantic model to validate each value as.

        Raises:
            InvalidArgumentError: `limit` is not an int >= 0 or None.
            DecodeError: A stored value is corrupt or does not validate as `model`.
        """
        validate_key(key)
        check_limit(limit)
        backend = await self._opened_backend()
        entries = await backend.history(key, limit=limit)
        self._counters["reads"] += 1
        state_entry = self._codec.state_entry
        return [state_entry(entry, model) for entry in entries]

    async def revert(
        self, key: str, *, to_version: int, ttl: timedelta | float | None = DEFAULT
    ) -> int:
        """Write the value `key` held at `to_version` again, as a new version; return it.

        A normal write: it bumps the version, subscribers see it as a change, and the history
        keeps what it replaced. It is conditional on the current version it read (with the
        history, in one call): if another write lands in between, `revert` reads again and
        retries (up to `StateConfig.update_max_attempts` times, as `update` does), so it
        never overwrites a write it has not seen without reading the history again. Reverting
        to the current version writes the same value again as a new version.

        <!-- snippet: setup=imports -->
        ```python
        state = StateManager(config=StateConfig(history={"doc:*": 10}))
        await state.save("doc:1", "first draft")
        await state.save("doc:1", "a bad edit")
        print(await state.revert("doc:1", to_version=1))  # 3
        print(await state.get("doc:1"))  # first draft
        await state.aclose()
        ```

        Args:
            key: The key.
            to_version: The version whose value to write again; it must be retained.
            ttl: As for `save`: the written value's time to live (by default the configured
                `StateConfig.ttl`, not the old version's).

        Raises:
            NotFoundError: The key is missing, or `to_version` is not retained; nothing was
                written.
            InvalidArgumentError: `to_version` is not an int >= 1.
            ConflictError: Every attempt lost a race with another write.
        """
        validate_key(key)
        if type(to_version) is not int or to_version < 1:
            raise InvalidArgumentError(f"to_version must be an int >= 1, not {to_version!r}")
        life = self._ttl(ttl)
        backend = await self._opened_backend()
        attempts = self.config.update_max_attempts
        for attempt in range(attempts):
            versions = await backend.history(key)
            if not versions:
                raise NotFoundError(f"no state at key {key!r}")
            target = next((entry for entry in versions if entry.version == to_version), None)
            if target is None:
                raise NotFoundError(
                    f"version {to_version} of {key!r} is not retained (it is at version "
                    f"{versions[0].version}; StateConfig(history=...) keeps past versions)"
                )
            try:
                if backend.has_revisions:  # a key deleted and written again meanwhile: refused
                    change = await backend.set(
                        key, target.value, ttl=life, expected_revision=versions[0].revision
                    )
                else:
                    change = await backend.set(
                        key, target.value, ttl=life, expected_version=versions[0].version
                    )
            except ConflictError:
                await anyio.sleep(backoff(attempt))
                continue
            self._counters["saves"] += 1
            return change.version
        self._counters["conflicts"] += 1
        raise ConflictError(f"revert of {key!r} lost {attempts} races in a row; try again", key=key)

    async def feed_cursor(self) -> str | None:
        """Return the cursor of the newest change in the backend's feed (`None` if it has none).

        `changes(since=await state.feed_cursor())` then delivers every change committed after
        this call, however late it is entered. The cursor is the backend's, so a scope's is
        its manager's.
        """
        backend = await self._opened_backend()
        return await backend.feed_cursor()

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
        since: str | None = None,
        on_gap: OnGap = "raise",
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
        manager logs `subscription_reopened`, counts it in `stats().overflows` and subscribes
        again. With the backend's change feed on (the default), it resubscribes from the last
        change it delivered: nothing is missed, and `on_overflow` is not called. Without a feed
        (`StateConfig(feed=None)`), or if the feed no longer holds that change, the changes
        beyond the buffer are missed, and it then calls `on_overflow(pattern)` (sync or async).
        The new subscription is live before the handler runs, so a handler that re-reads the
        state it needs misses nothing: every later change follows it.

        With `since=cursor` (a `StateChange.cursor`, or `feed_cursor()`), the callback first
        receives the changes the feed retains after that cursor, then the live ones (see
        `changes`). If that cursor has expired: with `on_gap="raise"` the subscription ends
        and awaiting it (or `wait_live()`) raises `CursorExpiredError`; with
        `on_gap="resync"` the callback first receives `(key, None, current_value)` for every
        present key matching `pattern`, then the live changes.

        Under trio, enter the manager (`async with`) before subscribing callbacks.

        Returns:
            A `Subscription`: await it to wait until it is live.
        """
        validate_pattern(pattern)
        since = check_since(since)
        on_gap = check_on_gap(on_gap)
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, not {type(callback).__name__}")
        if self._closed:
            raise BackendError("this StateManager is closed")
        if on_overflow is not None and not callable(on_overflow):
            raise InvalidArgumentError("on_overflow must be callable")
        return self._pumps.subscribe(
            pattern, callback, on_overflow, self._task_group, since=since, on_gap=on_gap
        )

    def unsubscribe(self, pattern: str, callback: StateCallback) -> bool:
        """Stop calling `callback` for `pattern`; return whether it was subscribed.

        A call of the callback already running (an async callback that unsubscribes itself,
        say) runs to its end; no later change is delivered.

        Raises:
            InvalidPatternError: `pattern` is not a valid pattern (as `subscribe` refuses it).
        """
        validate_pattern(pattern)
        return self._pumps.unsubscribe(pattern, callback)

    def watch(
        self,
        pattern: str,
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
        max_buffer: int | None = None,
    ) -> Watch:
        """Return a `Watch`: an async iterator (and context manager) of `StateChange`s.

        Entered with `async with`, the watch is live on entry: it receives every change
        committed after that, by this manager or any other process. With `since=cursor` it
        first replays the retained changes after that cursor: see `changes`, which is this
        method with every key (`"*"`) as the default pattern.
        """
        validate_pattern(pattern)
        if max_buffer is None:
            max_buffer = self.config.subscriber_buffer
        elif type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        return Watch(
            self, pattern, max_buffer, since=check_since(since), on_gap=check_on_gap(on_gap)
        )

    def changes(
        self,
        pattern: str = "*",
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
        max_buffer: int | None = None,
    ) -> Watch:
        """Return a `Watch` of the changes to keys matching `pattern`, from a cursor if given.

        Every `StateChange` carries its `cursor`, its place in the backend's durable change
        feed. Store the cursor of the last change you handled; `changes(since=cursor)` later
        (in this process or another) first yields the changes the feed still retains after
        it that match `pattern`, in feed order, then follows live: none missed, none twice.
        `since=EARLIEST` replays everything retained. How much the feed keeps is
        `StateConfig.feed` (the last 10,000 changes by default).

        <!-- snippet: setup=state -->
        ```python
        await state.save("job:1", "queued")
        cursor = await state.feed_cursor()  # or a change's .cursor, stored earlier
        await state.save("job:1", "running")  # committed while nobody watched
        async with state.changes("job:*", since=cursor) as changes:
            async for change in changes:
                print(change.key, change.new_value, change.cursor is not None)  # job:1 running True
                break
        ```

        A cursor whose later changes the feed no longer holds has expired. With
        `on_gap="raise"` (the default), entering the watch raises `CursorExpiredError`: re-read
        the state you need and go on from `feed_cursor()`. With `on_gap="resync"`, the watch
        starts live and first yields one `ChangeOp.RESYNC` change per present key matching
        `pattern` (its current value; `old_value` and `cursor` are `None`), leaving out the live
        changes those values already include. A consumer applying the changes in order ends up
        with the current state either way.

        Args:
            pattern: A Redis glob, as for `list_keys`.
            since: A cursor (`StateChange.cursor`, `feed_cursor()`) or `EARLIEST`; `None`
                starts live.
            on_gap: What an expired cursor does: `"raise"` or `"resync"`.
            max_buffer: Changes buffered before the watch overflows (by default
                `StateConfig.subscriber_buffer`); after an overflow, resume with
                `since=watch.cursor`.

        Raises (on entering the watch):
            CursorExpiredError: `since` has expired and `on_gap="raise"`.
            InvalidArgumentError: `since` is not a cursor of this backend.
            UnsupportedOperationError: The backend keeps no change feed (`StateConfig(feed=None)`).
        """
        return self.watch(pattern, since=since, on_gap=on_gap, max_buffer=max_buffer)

    def stats(self) -> StateStats:
        """Return counters of saves, reads, updates, conflicts, events and callback errors."""
        return StateStats(
            backend=type(self.backend).__name__,
            subscriptions=len(self._pumps.running),
            **self._counters,
        )

    def view(self, pattern: str = "*", *, max_buffer: int | None = None) -> LocalView:
        """Return a `LocalView` of the keys matching `pattern`; enter it to load and follow them.

        Reads from the view cost no round trip, and `LocalView.update` is one conditional write
        when the view is current (see `agenticstate.LocalView`).
        """
        from agenticstate.view import LocalView  # here: view.py imports this module

        return LocalView(self, pattern, max_buffer=max_buffer)

    # ---------------------------------------------------------------- commits of a scope
    # (issue #23, point 4; the work is in `agenticstate.commits`, these methods delegate)

    async def _commit_store(self) -> CommitStore:
        from agenticstate.commits import CommitStore  # here: only commits need it

        backend = await self._opened_backend()
        store: CommitStore | None = getattr(self, "_commits", None)
        if store is None:
            store = CommitStore(
                backend,
                self._codec,
                retention=self.config.commit_retention,
                ttl=self.config.ttl,
            )
            self._commits = store
        return store

    async def commit(self, scope: str, *, message: str = "") -> CommitInfo:
        """Record a snapshot of every key under the prefix `scope` and return the commit.

        Unchanged values are stored once (by content hash); with a change feed the commit reads
        only what changed since the scope's previous commit, and the snapshot is exact at the
        commit's `cursor`. See `agenticstate.commits` for storage, consistency and retention
        (`StateConfig.commit_retention` commits per scope, plus pinned ones).

        <!-- snippet: setup=state -->
        ```python
        await state.save("agent:1:plan", ["search", "answer"])
        first = await state.commit("agent:1:", message="planned")
        await state.save("agent:1:plan", ["answer"])
        await state.rollback("agent:1:", first.id)
        print(await state.get("agent:1:plan"))  # ['search', 'answer']
        ```

        Args:
            scope: A key prefix (`"agent:1:"`); `""` is the whole namespace.
            message: Kept with the commit, shown by `log`.

        Raises:
            InvalidArgumentError: `scope` is not a valid key prefix, or lies under `_commits:`.
            ConflictError: Other processes committed the scope first, many times in a row.
        """
        return await (await self._commit_store()).commit(scope, message=message)

    async def log(self, scope: str, *, limit: int | None = None) -> list[CommitInfo]:
        """Return the retained commits of `scope`, newest first, at most `limit`."""
        return await (await self._commit_store()).log(scope, limit=limit)

    async def checkout(self, commit_id: str) -> Checkout:
        """Return a read-only view of a commit's snapshot (`keys()`, `get()`, `items()`).

        `commit_id` is the id or a unique prefix of at least 8 hex digits.

        Raises:
            NotFoundError: No retained commit has that id.
            InvalidArgumentError: It is not hex, shorter than 8 digits, or an ambiguous prefix.
        """
        return await (await self._commit_store()).checkout(commit_id)

    async def diff(self, a: str, b: str) -> CommitDiff:
        """Return the keys added, removed and changed from commit `a` to commit `b`.

        "Changed" compares stored bytes: with encryption, a value saved again is changed.
        """
        return await (await self._commit_store()).diff(a, b)

    async def rollback(self, scope: str, commit_id: str) -> int:
        """Make the keys under `scope` what they were at `commit_id`; return keys written.

        Keys the commit holds are written back (their exact stored bytes, with the configured
        `ttl`), keys it lacks are deleted, in one atomic `transact` conditional on every key's
        version as read (a lost race reads again). Where the backend cannot do that (Redis
        Cluster with the scope's keys in several slots) each key is written on its own, with
        `expected_version`: not atomic. The writes are normal changes: subscribers see them.

        Raises:
            NotFoundError: No retained commit has that id.
            InvalidArgumentError: The commit is of another scope.
            ConflictError: The scope kept changing under the rollback, many times in a row.
        """
        return await (await self._commit_store()).rollback(scope, commit_id)

    async def pin(self, commit_id: str) -> CommitInfo:
        """Keep a commit whatever the retention says (until `unpin`); return it."""
        return await (await self._commit_store()).pin(commit_id)

    async def unpin(self, commit_id: str) -> bool:
        """Let retention drop a pinned commit again; return whether it was pinned."""
        return await (await self._commit_store()).unpin(commit_id)
