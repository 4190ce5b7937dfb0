"""ScopedState: the `StateManager` API relative to a key prefix.

```python
user = state.scope("session:u1:")
await user.save("cart", ["milk"])           # writes session:u1:cart
await user.get("cart")                      # ["milk"]
await user.list_keys()                      # ["cart"]: keys come back relative
await user.get_all()                        # {"cart": ["milk"]}, one batch read
await user.clear()                          # deletes every key under session:u1:, returns 1
```

A scope is a view, not a copy: it holds no state of its own, writes go straight to the manager,
and two scopes over one prefix see the same keys. Patterns are relative too, and the prefix is
escaped, so a prefix holding glob characters (`*`, `[`) matches only itself. Nothing outside
the prefix is reachable from a scope: keys are joined to the prefix, never resolved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, overload

from agenticstate._checks import wrong_object
from agenticstate._keys import escape_glob, validate_key, validate_pattern
from agenticstate.exceptions import (
    ConfigurationError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidPatternError,
)
from agenticstate.manager import DEFAULT, StateManager

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Mapping
    from datetime import timedelta
    from types import TracebackType

    from pydantic import BaseModel

    from agenticstate.commits import CommitInfo
    from agenticstate.events import OnGap, StateChange
    from agenticstate.manager import (
        OverflowCallback,
        StateCallback,
        StateEntry,
        Subscription,
        Watch,
    )

__all__ = ["ScopedState"]

M = TypeVar("M", bound="BaseModel")
D = TypeVar("D")

_MISSING: Any = object()


class ScopedState:
    """A view of a `StateManager` where every key is relative to `prefix`.

    Build it with `StateManager.scope(prefix)`. Agno's agent-state calls map one to one:
    `get` → `get`, `set` → `save`, `has` → `exists`, `delete` → `delete`,
    `update` → `update`, `clear` → `clear`, `get_all` → `get_all`.

    Args:
        state: The manager the scope reads and writes through.
        prefix: Put before every key; usually ends with a separator such as `:`.
    """

    def __init__(self, state: StateManager, prefix: str) -> None:
        if not isinstance(state, StateManager):
            raise ConfigurationError(
                wrong_object(
                    state,
                    parameter="state",
                    expected="agenticstate.StateManager",
                    owner="ScopedState",
                )
            )
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgumentError(f"prefix must be a non-empty str, not {prefix!r}")
        try:
            validate_key(prefix + "x")
        except InvalidKeyError as exc:
            raise InvalidArgumentError(f"invalid scope prefix {prefix!r}: {exc}") from None
        self.state = state
        self.prefix = prefix
        self._glob = escape_glob(prefix)

    def __repr__(self) -> str:
        return f"ScopedState({self.prefix!r}, state={self.state!r})"

    # ---------------------------------------------------------------- keys

    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise InvalidKeyError(f"key must be a non-empty str, not {key!r}")
        return validate_key(self.prefix + key)

    def _pattern(self, pattern: str) -> str:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidPatternError(f"pattern must be a non-empty str, not {pattern!r}")
        return validate_pattern(self._glob + pattern)

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) :]

    def scope(self, prefix: str) -> ScopedState:
        """Return a narrower scope: this prefix followed by `prefix`."""
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgumentError(f"prefix must be a non-empty str, not {prefix!r}")
        return ScopedState(self.state, self.prefix + prefix)

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
        """Return the value at `key` in the scope, or `default` (see `StateManager.get`)."""
        return await self.state.get(self._key(key), default, model=model, version=version)

    async def get_entry(
        self, key: str, *, model: type[BaseModel] | None = None, version: int | None = None
    ) -> StateEntry | None:
        """Return the value with its metadata, or `None`; the entry's `key` is relative."""
        entry = await self.state.get_entry(self._key(key), model=model, version=version)
        if entry is None:
            return None
        return entry.model_copy(update={"key": key})

    async def get_many(
        self, keys: Iterable[str], *, model: type[BaseModel] | None = None
    ) -> dict[str, Any]:
        """Return `{key: value}` for the keys that exist, in one backend call."""
        wanted = {self._key(key): key for key in keys}
        found = await self.state.get_many(wanted, model=model)
        return {wanted[full]: value for full, value in found.items()}

    async def exists(self, key: str) -> bool:
        """Return whether `key` is present in the scope (Agno's `has`)."""
        return await self.state.exists(self._key(key))

    async def list_keys(self, pattern: str = "*") -> list[str]:
        """Return the scope's keys matching the relative glob `pattern`, relative and sorted."""
        return [self._relative(key) for key in await self.state.list_keys(self._pattern(pattern))]

    async def get_all(self, *, model: type[BaseModel] | None = None) -> dict[str, Any]:
        """Return every key of the scope with its value, read in one batch (`get_many`).

        A key that expires or is deleted between the listing and the read is left out.
        """
        keys = await self.state.list_keys(self._pattern("*"))
        if not keys:
            return {}
        found = await self.state.get_many(keys, model=model)
        return {self._relative(key): found[key] for key in keys if key in found}

    # ---------------------------------------------------------------- writes

    async def save(
        self,
        key: str,
        value: object,
        *,
        ttl: timedelta | float | None = DEFAULT,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> int:
        """Store `value` at `key` in the scope; return its new version (Agno's `set`)."""
        return await self.state.save(
            self._key(key),
            value,
            ttl=ttl,
            expected_version=expected_version,
            expected_revision=expected_revision,
        )

    async def save_many(
        self, items: Mapping[str, object], *, ttl: timedelta | float | None = DEFAULT
    ) -> dict[str, int]:
        """Store several values in one backend call; return `{key: new_version}` (relative)."""
        full = {self._key(key): value for key, value in items.items()}
        versions = await self.state.save_many(full, ttl=ttl)
        return {self._relative(key): version for key, version in versions.items()}

    async def update(
        self,
        key: str,
        change: Mapping[str, Any] | Callable[[Any], Any],
        *,
        default: object = _MISSING,
        ttl: timedelta | float | None = DEFAULT,
    ) -> Any:
        """Merge a dict into, or apply a function to, the value at `key`, atomically."""
        if default is _MISSING:
            return await self.state.update(self._key(key), change, ttl=ttl)
        return await self.state.update(self._key(key), change, default=default, ttl=ttl)

    async def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> bool:
        """Delete `key` in the scope; return whether it existed."""
        return await self.state.delete(
            self._key(key), expected_version=expected_version, expected_revision=expected_revision
        )

    async def clear(self) -> int:
        """Delete every key in the scope; return how many were deleted.

        Keys written while `clear` runs may survive it. Sorted indexes are not keys and stay.
        """
        deleted = 0
        for key in await self.state.list_keys(self._pattern("*")):
            deleted += await self.state.delete(key)
        return deleted

    # ---------------------------------------------------------------- history

    async def history(
        self, key: str, *, limit: int | None = None, model: type[BaseModel] | None = None
    ) -> list[StateEntry]:
        """Return the retained versions of `key`, newest first; keys are relative.

        See `StateManager.history`: `StateConfig.history` patterns name full keys (the
        scope's prefix included).
        """
        entries = await self.state.history(self._key(key), limit=limit, model=model)
        return [entry.model_copy(update={"key": key}) for entry in entries]

    async def revert(
        self, key: str, *, to_version: int, ttl: timedelta | float | None = DEFAULT
    ) -> int:
        """Write the value `key` held at `to_version` again; see `StateManager.revert`."""
        return await self.state.revert(self._key(key), to_version=to_version, ttl=ttl)

    async def feed_cursor(self) -> str | None:
        """Return the backend's feed cursor (a scope's cursors are its manager's)."""
        return await self.state.feed_cursor()

    # ---------------------------------------------------------------- sorted indexes

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """Add members with scores to the scope's sorted index `index`."""
        return await self.state.index_add(self._key(index), members)

    async def index_remove(self, index: str, members: Iterable[str]) -> int:
        """Remove members from the scope's sorted index `index`."""
        return await self.state.index_remove(self._key(index), members)

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """Return up to `limit` members of the scope's index, lowest score first."""
        return await self.state.index_range(self._key(index), limit=limit)

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
        """Call `callback(key, old, new)` with relative keys for changes matching `pattern`.

        Everything else is `StateManager.subscribe`'s: the same checks and errors, the
        subscription handle it returns (await it, or `wait_live()`, to know it is live; an
        expired `since=` cursor raises `CursorExpiredError` there), subscribing the same
        callback to the same pattern again returns the first handle, and a subscription that
        ended (its cursor expired, or it was unsubscribed) can be made again. The handle's
        `pattern` is the full one (with the prefix), as is what `on_overflow` receives. Two
        scopes over one prefix share their subscriptions: either may unsubscribe a callback.
        """
        full = self._pattern(pattern)
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, not {type(callback).__name__}")
        relative = _Relative(callback, len(self.prefix))
        return self.state.subscribe(
            full, relative, on_overflow=on_overflow, since=since, on_gap=on_gap
        )

    def unsubscribe(self, pattern: str, callback: StateCallback) -> bool:
        """Stop calling `callback` for `pattern`; return whether it was subscribed."""
        full = self._pattern(pattern)
        return self.state.unsubscribe(full, _Relative(callback, len(self.prefix)))

    def watch(
        self,
        pattern: str,
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
        max_buffer: int | None = None,
    ) -> ScopedWatch:
        """Return a `Watch` of the scope's changes; their keys are relative.

        `since` and `on_gap` are as for `StateManager.changes`.
        """
        watch = self.state.watch(
            self._pattern(pattern), since=since, on_gap=on_gap, max_buffer=max_buffer
        )
        return ScopedWatch(watch, self)

    def changes(
        self,
        pattern: str = "*",
        *,
        since: str | None = None,
        on_gap: OnGap = "raise",
        max_buffer: int | None = None,
    ) -> ScopedWatch:
        """Return a `Watch` of the scope's changes from a cursor; see `StateManager.changes`.

        Keys are relative, and so is `pattern`; the cursors are the manager's feed's.
        """
        return self.watch(pattern, since=since, on_gap=on_gap, max_buffer=max_buffer)

    # ---------------------------------------------------------------- commits of the scope

    async def commit(self, *, message: str = "") -> CommitInfo:
        """Commit every key of the scope: `StateManager.commit(prefix, message=)`."""
        return await self.state.commit(self.prefix, message=message)

    async def log(self, *, limit: int | None = None) -> list[CommitInfo]:
        """The scope's retained commits, newest first: `StateManager.log(prefix)`."""
        return await self.state.log(self.prefix, limit=limit)

    async def rollback(self, commit_id: str) -> int:
        """Put the scope back as it was at `commit_id`: `StateManager.rollback(prefix, id)`."""
        return await self.state.rollback(self.prefix, commit_id)


class _Relative:
    """A scope's callback: called with the key relative to the scope.

    Equal to every other one wrapping the same callback for a prefix of the same length (the
    manager keys its subscriptions by pattern and callback, and the pattern holds the prefix),
    so subscribing again finds the running subscription and `unsubscribe` stops it, from any
    scope over the prefix.
    """

    def __init__(self, callback: StateCallback, cut: int) -> None:
        self.callback = callback
        self.cut = cut
        # What the manager's log lines name a callback by.
        self.__qualname__ = getattr(callback, "__qualname__", type(callback).__name__)

    def __call__(self, key: str, old: Any, new: Any) -> Any:
        return self.callback(key[self.cut :], old, new)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Relative):
            return NotImplemented
        return self.cut == other.cut and self.callback == other.callback

    def __hash__(self) -> int:
        return hash((self.cut, self.callback))


class ScopedWatch:
    """A `Watch` whose changes carry keys relative to a scope."""

    def __init__(self, watch: Watch, scope: ScopedState) -> None:
        self._watch = watch
        self._cut = len(scope.prefix)

    @property
    def cursor(self) -> str | None:
        """The cursor of the last change yielded (at first, `since`): resume from it."""
        return self._watch.cursor

    async def __aenter__(self) -> ScopedWatch:
        await self._watch.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        await self._watch.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Unsubscribe."""
        await self._watch.aclose()

    def __aiter__(self) -> AsyncIterator[StateChange]:
        return self

    async def __anext__(self) -> StateChange:
        change = await self._watch.__anext__()
        return change.model_copy(update={"key": change.key[self._cut :]})
