"""LocalView: the keys matching a pattern, kept in memory and fresh by a subscription.

```python
async with state.view("agent:*") as view:           # subscribe, then load every matching key
    view.get("agent:1")                              # no round trip
    await view.update("agent:1", {"status": "busy"}) # one conditional write
```

Built on public API only: the change feed of the manager's backend (what `StateManager.watch`
wraps, here without decoding the changes the view skips), and the manager's `list_keys`,
`get_entry` and `save(..., expected_revision=...)`. How it stays exact:

- **Open.** The feed is entered first (live: every change committed from then on will arrive),
  then every matching key is read, then the buffered changes are applied. A change never moves a
  key backwards: one whose revision is not newer than the view's is skipped. Revisions never
  repeat, so a key deleted or expired and written again (its versions starting over at 1) is
  always taken, whether or not the view knew its expiry. (On a backend without revisions, and
  for an own write until its change arrives with its revision, versions decide.)
- **Writes are conditional.** `update` computes the new value from the cached value and writes it
  with `expected_revision` set to the cached revision (`expected_version` on a backend without
  revisions): one round trip when the view is current. If
  another writer got in first, the write is refused (`ConflictError`), the key is read fresh (one
  round trip) and the update retried. A stale view can cost a retry; it can never cause a lost
  update.
- **Own writes.** After a successful write, the view stores the written value at once, unless the
  feed or a fresh read has meanwhile shown something at or past that write (then the feed's order
  wins, and the write's own change arrives with it).
- **Fresh reads** (after a conflict, or to learn an expiry) are stored only if no change to that
  key arrived while the read was in flight, so a slow reply never overwrites newer news.
- **Gaps.** If the subscription overflows (the view fell more than `max_buffer` changes behind),
  the view subscribes again and reloads every matching key. If the backend reports a resync (a
  Redis reconnect, SQLite changes trimmed by retention), the view applies what it re-sent and
  then re-reads every matching key while following the feed, since a resync may not name them
  all (a delete of a key it never delivered).
- **Expiry** emits no change on any backend, so the view tracks each key's expiry: known from
  reads and from its own writes, and learned by a background read for a key another writer
  changed (writes state their TTL). An expired key reads as missing.
"""

from __future__ import annotations

import inspect
from itertools import islice
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict

from agenticstate._checks import as_ttl
from agenticstate._glob import compile_glob
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._log import get_logger
from agenticstate._merge import updater
from agenticstate._retry import backoff, retry_delay
from agenticstate._tasks import spawn_service
from agenticstate.backends.base import ChangeOp, utcnow
from agenticstate.encryption import ENCRYPTED_HEADER
from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
    SubscriptionClosedError,
)
from agenticstate.manager import DEFAULT

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from datetime import datetime, timedelta
    from types import TracebackType

    from agenticstate.backends.base import Change
    from agenticstate.manager import StateEntry, StateManager

__all__ = ["LocalView", "ViewEntry"]

log = get_logger(__name__)

_MISSING: Any = object()
_ENCRYPTED = bytes((ENCRYPTED_HEADER,))
_READ_BATCH = 64  # keys read at once while loading or learning expiries


class ViewEntry(BaseModel):
    """A key's value and version, as a `LocalView` holds it.

    Attributes:
        key: The key.
        value: The value (the caller's own copy).
        version: The version the view last saw.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    value: Any
    version: int


class _Cached:
    """One key in the view: the encoded value (decoded per read: callers never share it)."""

    __slots__ = ("expires_at", "expiry_known", "raw", "revision", "version")

    def __init__(
        self,
        raw: bytes,
        version: int,
        expires_at: datetime | None,
        *,
        expiry_known: bool,
        revision: int = 0,
    ) -> None:
        self.raw = raw
        self.version = version
        self.revision = revision  # 0: not known (no revisions, or an own write in flight)
        self.expires_at = expires_at
        self.expiry_known = expiry_known

    def is_older_than(self, change: Change) -> bool:
        """Whether `change` came after this state of the key (by revision where both have one)."""
        if change.revision and self.revision:
            return change.revision > self.revision
        if change.op is ChangeOp.DELETE:  # a delete carries the version it deleted
            return self.version <= change.version
        return change.version > self.version

    def is_expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now


class _Window:
    """A write or read of one key in flight: `passed` once something newer may have been seen.

    `version` is the version an own write will create (`None` for a read). A change older than
    that (a set with a lower version) does not pass a write: it was committed before it.
    """

    __slots__ = ("passed", "version")

    def __init__(self, version: int | None) -> None:
        self.version = version
        self.passed = False


def _life(ttl: object, default: timedelta | None) -> timedelta | None:
    """The TTL `save(ttl=ttl)` applies; `None` for none, or for a TTL save will refuse."""
    if ttl is DEFAULT:
        return default
    try:
        return as_ttl(ttl)
    except ValueError:
        return None  # save raises InvalidArgumentError before anything is stored


class LocalView:
    """The keys matching a pattern, held in memory and kept fresh by a subscription.

    Reads (`get`, `entry`, `keys`, `len`, `in`) cost no round trip. `update` sends one
    conditional write when the view is current, and reads the key only after a conflict. The
    view costs memory for every matching key's encoded value and one subscription; a write by
    another process costs it one background read too (to learn the key's expiry).

    <!-- snippet: setup=state -->
    ```python
    await state.save("agent:1", {"status": "idle", "runs": 0})
    async with state.view("agent:*") as view:
        print(view.get("agent:1"))                                  # {'status': 'idle', 'runs': 0}
        await view.update("agent:1", lambda a: {**a, "runs": a["runs"] + 1})  # one write
        print(view.entry("agent:1").version)                        # 2
    ```

    Reads show what the subscription has delivered: a write by another process appears when
    its change arrives (after its commit, usually well under a millisecond on one machine).
    `update` never writes over a change it has not seen: each write is conditional on the
    version it was computed from.

    Args:
        state: The manager to read, write and subscribe through.
        pattern: A Redis glob, as for `StateManager.list_keys`.
        max_buffer: Changes the subscription buffers before it overflows (then the view
            reloads); by default `StateConfig.subscriber_buffer`.

    Enter it with `async with` (or call `open()` and later `aclose()`). `StateManager.view`
    builds one.
    """

    def __init__(self, state: StateManager, pattern: str, *, max_buffer: int | None = None) -> None:
        validate_pattern(pattern)
        if max_buffer is None:
            max_buffer = state.config.subscriber_buffer
        elif type(max_buffer) is not int or max_buffer < 1:
            raise InvalidArgumentError(f"max_buffer must be an int >= 1, not {max_buffer!r}")
        self._state = state
        self._pattern = pattern
        self._matcher = compile_glob(pattern)
        self._max_buffer = max_buffer
        self._serializer = state.serializer
        self._encryption = state.config.encryption
        self._entries: dict[str, _Cached] = {}
        self._windows: dict[str, list[_Window]] = {}
        self._unknown_expiry: dict[str, None] = {}  # keys to read for their expiry, in order
        self._changed: anyio.Event | None = None  # set on the next change (for wait_until)
        # Made by open(), on the event loop (a view may be built outside one).
        self._probe_wake: anyio.Event
        self._ready: anyio.Event
        self._done: anyio.Event
        self._scope: anyio.CancelScope
        self._task: object = None
        self._error: BaseException | None = None
        self._is_open = False
        self._is_live = False
        self._closed = False
        self._reloads = 0
        self._reconcile_wanted = False

    def __repr__(self) -> str:
        state = "live" if self._is_live else "closed" if self._closed else "not live"
        return f"LocalView({self._pattern!r}, {len(self._entries)} keys, {state})"

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> Self:
        """Subscribe, load every matching key, and follow changes from then on; return self.

        Raises:
            BackendError: The first subscription or load failed (nothing keeps running).
        """
        if self._is_open or self._closed:
            raise InvalidArgumentError("a LocalView opens once")
        self._is_open = True
        self._probe_wake = anyio.Event()
        self._ready = anyio.Event()
        self._done = anyio.Event()
        self._scope = anyio.CancelScope()
        # A task of its own, not a task group of the caller's: the view outlives this call
        # (and the blocking API enters and exits it in different tasks).
        self._task = spawn_service(self._run, name=f"agenticstate:view:{self._pattern}")
        try:
            await self._ready.wait()
        except BaseException:  # cancelled while loading: stop the task, leave nothing running
            self._closed = True
            self._scope.cancel()
            raise
        if self._error is not None:
            self._closed = True
            raise self._error
        return self

    async def aclose(self) -> None:
        """Stop following changes. Reads and updates raise `SubscriptionClosedError` after."""
        self._closed = True
        self._is_live = False
        if self._task is not None:
            self._scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._done.wait()
        self._entries.clear()
        self._wake()

    @property
    def pattern(self) -> str:
        """The pattern the view follows."""
        return self._pattern

    @property
    def is_live(self) -> bool:
        """Whether the view is subscribed and loaded (false while it reloads after a gap)."""
        return self._is_live and not self._closed

    @property
    def reloads(self) -> int:
        """How many times the view re-read every key after a gap (an overflow or a resync)."""
        return self._reloads

    # ---------------------------------------------------------------- reads (no round trip)

    def get(self, key: str, default: Any = None, *, model: type[BaseModel] | None = None) -> Any:
        """Return the value at `key` as the view holds it, or `default` if missing or expired.

        Args:
            key: The key.
            default: What to return when the key is missing.
            model: A pydantic model to validate the value as.

        Raises:
            InvalidArgumentError: The key is outside the view's pattern (the view cannot know
                it: read it with `StateManager.get`).
        """
        cached = self._cached(self._inside(key))
        if cached is None:
            return default
        if model is not None:
            return self._serializer.load_model(cached.raw, model, key=key)
        return self._serializer.loads(cached.raw)

    def entry(self, key: str) -> ViewEntry | None:
        """Return the value at `key` with the version the view holds, or `None`.

        Raises:
            InvalidArgumentError: The key is outside the view's pattern.
        """
        cached = self._cached(self._inside(key))
        if cached is None:
            return None
        return ViewEntry(key=key, value=self._serializer.loads(cached.raw), version=cached.version)

    def keys(self) -> list[str]:
        """Return the keys the view holds (present and not expired), sorted."""
        self._check_open()
        now = utcnow()
        expired = [key for key, cached in self._entries.items() if cached.is_expired(now)]
        for key in expired:  # gone from the store: forget them (a later write brings them back)
            del self._entries[key]
        return sorted(self._entries)

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._matcher.match(key) and self._cached(key) is not None

    async def wait_until(self, predicate: Callable[[LocalView], bool]) -> None:
        """Wait until `predicate(view)` holds, checking it after each change the view applies.

        Bound the wait with `anyio.fail_after`. Raises `SubscriptionClosedError` if the view
        closes first.
        """
        while not predicate(self):
            self._check_open()
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _inside(self, key: str) -> str:
        if not self._matcher.match(validate_key(key)):
            raise InvalidArgumentError(f"key {key!r} is outside the view of {self._pattern!r}")
        return key

    def _check_open(self) -> None:
        if self._closed or not self._is_open:
            state = "closed" if self._closed else "not open (enter it with `async with`)"
            raise SubscriptionClosedError("closed", f"the view of {self._pattern!r} is {state}")

    def _cached(self, key: str) -> _Cached | None:
        self._check_open()
        cached = self._entries.get(key)
        if cached is None:
            return None
        expires_at = cached.expires_at
        if expires_at is not None and expires_at <= utcnow():
            return None
        return cached

    # ---------------------------------------------------------------- update

    async def update(
        self,
        key: str,
        change: Mapping[str, Any] | Callable[[Any], Any],
        *,
        default: object = _MISSING,
        ttl: timedelta | float | None = DEFAULT,
    ) -> Any:
        """Change the value at `key` with one conditional write; return the new value.

        The same semantics as `StateManager.update` (a dict deep-merges, a function maps the
        old value to the new one; it may run more than once and gets its own copy), computed
        from the view's value and written with `expected_version` set to the view's version. If
        another writer got in first, the key is read fresh and the update retried. The
        manager's `stats()` counts each write as a save, and each refused one as a conflict.

        Args:
            key: The key; it must match the view's pattern.
            change: A partial dict to merge, or a function from the old value to the new one.
            default: The current value to assume when the key is missing; without it, a
                missing key raises `NotFoundError`.
            ttl: As for `StateManager.save`.

        Raises:
            NotFoundError: The key is missing and no `default` was given.
            MergeError: A dict was given but the value is not a dict.
            ConflictError: The update lost `StateConfig.update_max_attempts` races in a row.
            InvalidArgumentError: The key is outside the view's pattern.
        """
        self._inside(key)
        apply = updater(key, change)
        serializer = self._serializer
        attempts = self._state.config.update_max_attempts
        conflicts = 0
        # What a read found, once one was needed: the bytes, version and revision.
        fresh: tuple[bytes | None, int, int] | None = None
        by_revision = self._state.backend.has_revisions
        while True:
            if fresh is None:
                cached = self._cached(key)
                raw, version, revision = (
                    (None, 0, 0)
                    if cached is None
                    else (cached.raw, cached.version, cached.revision)
                )
            else:
                self._check_open()
                raw, version, revision = fresh
            try:
                if raw is not None:
                    current = serializer.loads(raw)
                elif default is _MISSING:
                    raise NotFoundError(f"no state at key {key!r}")
                else:
                    current = serializer.loads(serializer.dumps(default))
                new = apply(current)
            except Exception:
                if fresh is not None:
                    raise
                # Computed from the view's copy: confirm on the stored value before failing
                # (a key the view has not yet seen created, a value it has not yet seen change).
                fresh = await self._read_fresh(key)
                continue
            if inspect.isawaitable(new):
                if inspect.iscoroutine(new):
                    new.close()
                raise InvalidArgumentError("update() functions must be synchronous")
            window = self._open_window(key, version + 1)
            life = _life(ttl, self._state.config.ttl)
            # Measured from before the write: the view hides the key no later than the store.
            started = None if life is None else utcnow()
            try:
                if by_revision and (revision or not version):
                    await self._state.save(key, new, ttl=ttl, expected_revision=revision)
                else:  # no revisions, or an own write's not known yet: on the version
                    await self._state.save(key, new, ttl=ttl, expected_version=version)
            except ConflictError:
                self._close_window(key, window)
                conflicts += 1
                if conflicts >= attempts:
                    raise ConflictError(
                        f"update of {key!r} lost {attempts} races in a row; try again", key=key
                    ) from None
                await anyio.sleep(backoff(conflicts - 1))
                fresh = await self._read_fresh(key)
                continue
            except BaseException:
                self._close_window(key, window)
                raise
            self._close_window(key, window)
            current_entry = self._entries.get(key)
            if not window.passed and (current_entry is None or current_entry.version <= version):
                expires_at = None if started is None or life is None else started + life
                self._store(
                    key,
                    _Cached(serializer.dumps(new), version + 1, expires_at, expiry_known=True),
                    window,
                )
            return new

    # ---------------------------------------------------------------- keeping fresh

    def _open_window(self, key: str, version: int | None) -> _Window:
        window = _Window(version)
        self._windows.setdefault(key, []).append(window)
        return window

    def _close_window(self, key: str, window: _Window) -> None:
        windows = self._windows.get(key)
        if windows is not None:
            windows.remove(window)
            if not windows:
                del self._windows[key]

    def _store(self, key: str, cached: _Cached | None, source: _Window | None = None) -> None:
        """Put what a read or own write found, and pass what else is in flight for `key`.

        An own write still in flight is passed only by something at or past the version it
        will create: an older state (or none) was read before that write committed, or the
        feed has yet to deliver what came after it (and will, moving the key forward again).
        """
        version = 0 if cached is None else cached.version
        for window in self._windows.get(key, ()):
            if window is not source and (window.version is None or version >= window.version):
                window.passed = True
        if cached is None:
            self._entries.pop(key, None)
        else:
            self._entries[key] = cached
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _apply(self, change: Change) -> None:
        """Apply one change from the feed (commit order for its key), never going backwards.

        Changes arrive as the backend's bytes: one the view skips (its own write, already
        stored) is never decoded, and one it keeps is stored as it came, decoded per read.
        """
        key = change.key
        # A resync change carries the key's current value (or none: gone) like a set (a delete).
        is_set = change.new is not None and change.op is not ChangeOp.DELETE
        for window in self._windows.get(key, ()):
            # Only a set older than an own write leaves it current; anything else may be newer.
            if not (is_set and window.version is not None and change.version < window.version):
                window.passed = True
        current = self._entries.get(key)
        if current is not None and current.is_expired(utcnow()):
            # Gone from the store, so versions start again at 1: older is not stale here.
            del self._entries[key]
            current = None
        if (
            current is not None
            and is_set
            and not current.revision
            and change.version == current.version
            and change.revision
        ):
            current.revision = change.revision  # an own write's change: its revision, at last
            return
        if not is_set:
            if current is not None and current.is_older_than(change):
                del self._entries[key]
                self._wake()
            return
        if current is not None and not current.is_older_than(change):
            return
        raw = self._plaintext(key, change.new)
        if raw is None:
            self._entries.pop(key, None)
        else:
            # Another writer's change: its TTL is unknown until read (expiry emits no change).
            self._entries[key] = _Cached(
                raw, change.version, None, expiry_known=False, revision=change.revision
            )
            self._want_expiry(key)
        self._wake()

    def _plaintext(self, key: str, raw: bytes | None) -> bytes | None:
        """The serialized value in a change (decrypted), or `None` if this view cannot read it."""
        if raw is None:  # a set always carries its bytes; never trust a backend blindly
            return None
        encryption = self._encryption
        try:
            if encryption is not None:
                return encryption.decrypt(self._state.backend.key_prefix, key, raw)
        except SerializationError as exc:
            log.warning("view_value_undecodable", key=key, error=type(exc).__name__)
            return None
        if raw[:1] == _ENCRYPTED:  # encrypted, and this manager has no keys: as get() would
            log.warning("view_value_undecodable", key=key, error="DecryptionError")
            return None
        return raw

    def _want_expiry(self, key: str) -> None:
        self._unknown_expiry[key] = None
        self._probe_wake.set()

    def _from_entry(self, entry: StateEntry) -> _Cached:
        raw = self._serializer.dumps(entry.value)
        return _Cached(
            raw, entry.version, entry.expires_at, expiry_known=True, revision=entry.revision
        )

    async def _read_fresh(self, key: str) -> tuple[bytes | None, int, int]:
        """Read `key` (one round trip); store it unless a newer change arrived meanwhile."""
        window = self._open_window(key, None)
        try:
            entry = await self._state.get_entry(key)
        finally:
            self._close_window(key, window)
        cached = None if entry is None else self._from_entry(entry)
        if not window.passed:
            self._store(key, cached)
        elif key in self._entries and not self._entries[key].expiry_known:
            self._want_expiry(key)
        return (None, 0, 0) if cached is None else (cached.raw, cached.version, cached.revision)

    async def _read_entries(self, keys: list[str]) -> list[StateEntry | None]:
        found: list[StateEntry | None] = [None] * len(keys)
        failed: list[BackendError] = []

        async def read(index: int, key: str) -> None:
            try:
                found[index] = await self._state.get_entry(key)
            except SerializationError as exc:  # unreadable: left out of the view, and said so
                log.warning("view_value_undecodable", key=key, error=type(exc).__name__)
            except BackendError as exc:
                failed.append(exc)

        for start in range(0, len(keys), _READ_BATCH):
            async with anyio.create_task_group() as group:
                for index in range(start, min(start + _READ_BATCH, len(keys))):
                    group.start_soon(read, index, keys[index])
            if failed:
                raise failed[0]
        return found

    async def _reload(self) -> None:
        """Read every matching key (the subscription is already live)."""
        keys = await self._state.list_keys(self._pattern)
        entries = await self._read_entries(keys)
        loaded = {
            key: self._from_entry(entry)
            for key, entry in zip(keys, entries, strict=True)
            if entry is not None
        }
        for windows in self._windows.values():
            for window in windows:
                window.passed = True
        self._entries = loaded
        self._unknown_expiry.clear()
        self._reconcile_wanted = False
        self._wake()

    async def _run(self) -> None:
        try:
            with self._scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._learn_expiries)
                    try:
                        await self._follow()
                    except Exception as exc:  # noqa: BLE001  # a service task must never raise
                        if not self._ready.is_set():
                            self._error = exc  # open() raises it
                        else:
                            log.error(
                                "view_failed", pattern=self._pattern, error=type(exc).__name__
                            )
                    group.cancel_scope.cancel()
        finally:
            self._closed = True
            self._is_live = False
            self._ready.set()
            self._done.set()
            self._wake()

    async def _follow(self) -> None:
        """Subscribe, load, apply changes; after a gap, again. Return when the manager closes."""
        failures = 0
        while True:
            try:
                await self._state.open()
                # The backend's own feed (what `watch` wraps), live on entry: its changes carry
                # bytes, so the view decodes only what it keeps.
                changes = self._state.backend.changes(self._pattern, max_buffer=self._max_buffer)
                async with changes as feed:
                    await self._reload()
                    failures = 0
                    self._is_live = True
                    self._ready.set()
                    while True:
                        try:
                            change = await feed.__anext__()
                        except StopAsyncIteration:
                            return  # the backend closed
                        self._apply(change)
                        if change.op is ChangeOp.RESYNC:
                            # The backend lost changes (a reconnect, trimmed history) and re-sent
                            # what it knows of; that may not name every key the view holds
                            # (a delete of a key it never delivered). Re-read them all, once the
                            # burst is over, while following the feed.
                            self._want_reconcile()
            except SubscriptionClosedError as exc:
                if exc.reason != "overflow":
                    return
            except BackendError as exc:
                if not self._ready.is_set():
                    raise
                failures += 1
                log.warning(
                    "view_subscription_failed",
                    pattern=self._pattern,
                    error=type(exc).__name__,
                    attempt=failures,
                )
                self._is_live = False
                await anyio.sleep(retry_delay(failures, base=0.05, cap=5.0))
                continue
            self._is_live = False
            self._reloads += 1
            log.warning("view_reloading", pattern=self._pattern, reason="overflow")

    def _want_reconcile(self) -> None:
        self._reconcile_wanted = True
        self._probe_wake.set()

    async def _learn(self, key: str) -> bool:
        """Read `key` fresh in the background; return False (and queue it again) on failure."""
        try:
            await self._read_fresh(key)
        except AgenticStateError as exc:
            log.warning("view_read_failed", key=key, error=type(exc).__name__)
            cached = self._entries.get(key)
            if cached is not None and not cached.expiry_known:
                self._unknown_expiry[key] = None
            return False
        return True

    async def _read_each(self, keys: list[str]) -> bool:
        """Read `keys` fresh, `_READ_BATCH` at a time; return whether every read worked."""
        done: list[bool] = []

        async def learn(key: str) -> None:
            done.append(await self._learn(key))

        for start in range(0, len(keys), _READ_BATCH):
            async with anyio.create_task_group() as group:
                for key in keys[start : start + _READ_BATCH]:
                    group.start_soon(learn, key)
        return all(done)

    async def _reconcile(self) -> bool:
        """Re-read every matching key while the feed goes on: a resync may not name them all.

        Each read is stored only if no change to its key arrived meanwhile (see `_read_fresh`);
        a held key no longer listed is dropped unless a change to it arrived during the listing.
        """
        self._reconcile_wanted = False
        held = [(key, self._open_window(key, None)) for key in list(self._entries)]
        try:
            listed = await self._state.list_keys(self._pattern)
        except AgenticStateError as exc:
            log.warning("view_read_failed", pattern=self._pattern, error=type(exc).__name__)
            self._reconcile_wanted = True
            return False
        finally:
            for key, window in held:
                self._close_window(key, window)
        present = set(listed)
        for key, window in held:
            if key not in present and not window.passed:
                self._store(key, None)
        self._reloads += 1
        log.warning("view_reloading", pattern=self._pattern, reason="resync")
        return await self._read_each(listed)

    async def _learn_expiries(self) -> None:
        """Re-read every key after a resync, and read changed keys for their expiry, in batches.

        Runs beside the feed. A key another writer changed is read for its expiry (and value).
        """
        while True:
            await self._probe_wake.wait()
            self._probe_wake = anyio.Event()
            await anyio.lowlevel.checkpoint()  # let a burst of changes (a resync) arrive first
            while self._reconcile_wanted or self._unknown_expiry:
                if self._reconcile_wanted:
                    worked = await self._reconcile()
                else:
                    batch = list(islice(self._unknown_expiry, _READ_BATCH))
                    for key in batch:
                        del self._unknown_expiry[key]
                    worked = await self._read_each(batch)
                if not worked:  # the backend is failing: do not spin on it
                    await anyio.sleep(0.1)
