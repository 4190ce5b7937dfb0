"""One open file store per path per process, shared by every opener (`SharedFileBackend`).

A file store has one owner process (its lock file). Within that process, every
`StateConfig(backend="file")`, every manager built with `persistence="file"` and every
`open_backend("file://...")` on the same snapshot path gets a `SharedFileBackend`: a lease on one
`FileBackend` that the leases count. The first lease to open opens the store; the last one to
close closes it (final snapshot, lock released). A lease that closes ends its own subscriptions
only, and its writes already acknowledged stay durable; the others go on. Another process still
gets `BackendError` naming the owner's pid.

The store is opened with the settings of the lease that opened it. A later lease must agree on
the ones that change what is on disk (`format`, `compression`, `durability`), or it gets a
`ConfigurationError`; `auto_save`, `save_interval` and the change feed's retention (`feed`) are
the first opener's. History rules are the store's: `keep_history` on any lease sets them for
every lease (the last call wins), as they are one writer's rules. A store is tied to
the event loop that opened it: a lease opened in another event loop (another thread, a second
`asyncio.run` while the first store is still open) gets `BackendError`, as another process would.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from agenticstate.backends.base import DEFAULT_MAX_BUFFER, DEFAULT_UPDATE_ATTEMPTS
from agenticstate.backends.file import FileBackend
from agenticstate.exceptions import BackendError, ConfigurationError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
    from datetime import timedelta

    from agenticstate.backends._fanout import ChangeStream
    from agenticstate.backends.base import (
        Change,
        Entry,
        HistoryRules,
        TxnCompare,
        TxnOp,
        TxnResult,
    )

__all__ = ["SharedFileBackend"]


class _Store:
    """One open `FileBackend` and how many leases hold it."""

    __slots__ = ("backend", "closed", "leases", "token")

    def __init__(self, backend: FileBackend) -> None:
        self.backend = backend
        self.leases = 0
        self.token: object = None  # the event loop it was opened in
        self.closed: anyio.Event | None = None  # set while the last lease closes it


_stores: dict[str, _Store] = {}
if hasattr(os, "register_at_fork"):
    # A forked child does not own its parent's open stores (the lock is the parent's): it opens
    # its own, and meets the parent's lock like any other process.
    os.register_at_fork(after_in_child=_stores.clear)


def _store_key(backend: FileBackend) -> str:
    return os.path.realpath(backend.snapshot_path)


class SharedFileBackend(FileBackend):
    """A `FileBackend` whose store is shared with every other opener of the same path here.

    Constructed like `FileBackend`; see the module docstring for what is shared.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store: _Store | None = None
        self._lease_closed = False
        self._streams: set[ChangeStream] = set()

    def __repr__(self) -> str:
        return f"FileBackend(base_path={str(self.base_path)!r}, format={self.format!r})"

    # leasing

    async def open(self) -> None:
        """Open the store, or join it if this process has it open already. Idempotent."""
        await self._backend()

    async def _backend(self) -> FileBackend:
        """The shared store, opened (joined) on first use."""
        store = self._store
        if store is not None:
            if self._lease_closed:
                raise BackendError("this FileBackend is closed")
            return store.backend
        if self._lease_closed:
            raise BackendError("this FileBackend is closed")
        key = _store_key(self)
        token = anyio.lowlevel.current_token()
        while True:
            store = _stores.get(key)
            if store is None:
                # A store of its own, built from this lease's settings (no file touched yet).
                store = _Store(self._twin())
                _stores[key] = store
                break
            if store.closed is None:
                break
            await store.closed.wait()  # the last lease is closing it: then open afresh
        self._check_compatible(store.backend)
        if self._keeps_history:
            store.backend.keep_history(self.history_rules)
        if store.token is not None and store.token != token:
            raise BackendError(
                f"the store {self.snapshot_path} is open in another event loop of this process "
                f"(pid {os.getpid()}); one event loop owns a store at a time"
            )
        store.leases += 1
        try:
            await store.backend.open()
        except BaseException:
            await self._release(store, key)
            raise
        store.token = token
        self._store = store
        self._local = store.backend._local  # what tools that look inside (the soak probe) read
        if self._lease_closed:  # closed while it was opening
            await self._release(store, key)
            raise BackendError("this FileBackend is closed")
        return store.backend

    def _twin(self) -> FileBackend:
        return FileBackend(
            base_path=self.base_path,
            format=self.format,
            compression=self.compression,
            key_prefix=self.key_prefix,
            durability=self.durability,
            auto_save=self.auto_save,
            save_interval=self.save_interval,
            file_name=self.snapshot_path.name,
            compact_bytes=self.compact_bytes,
            feed=self.feed,
            history=self.history_rules,
            create=self.create,
        )

    def _check_compatible(self, backend: FileBackend) -> None:
        for name in ("format", "compression", "durability"):
            mine, theirs = getattr(self, name), getattr(backend, name)
            if mine != theirs:
                raise ConfigurationError(
                    f"the store {self.snapshot_path} is already open in this process with "
                    f"{name}={theirs!r}; open it with the same {name}, not {mine!r}"
                )

    async def _release(self, store: _Store, key: str) -> None:
        store.leases -= 1
        if store.leases > 0:
            return
        store.closed = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                await store.backend.aclose()
        finally:
            if _stores.get(key) is store:
                del _stores[key]
            store.closed.set()

    async def aclose(self) -> None:
        """End this lease's subscriptions; the last lease closes the store. Idempotent."""
        if self._lease_closed:
            return
        self._lease_closed = True
        for stream in list(self._streams):
            # After what it has buffered, the subscription ends, as it would on a close.
            stream.end()  # the fan-out's own stream: ends after its buffer
        self._streams.clear()
        store, self._store = self._store, None
        if store is not None:
            await self._release(store, _store_key(self))

    # The Backend contract, on the shared store. The hot calls return the store's own coroutine
    # once the lease holds it, so a lease adds no await frame to a read or a write.

    async def _later(self, method: str, *args: Any, **kwargs: Any) -> Any:
        backend = await self._backend()
        return await getattr(backend, method)(*args, **kwargs)

    def get(self, key: str) -> Coroutine[Any, Any, Entry | None]:
        """See `Backend.get`."""
        store = self._store
        return store.backend.get(key) if store is not None else self._later("get", key)

    def get_many(self, keys: Sequence[str]) -> Coroutine[Any, Any, list[Entry | None]]:
        """See `Backend.get_many`."""
        store = self._store
        return store.backend.get_many(keys) if store is not None else self._later("get_many", keys)

    async def scan(self, pattern: str) -> AsyncIterator[str]:
        """See `Backend.scan`."""
        backend = await self._backend()
        async for key in backend.scan(pattern):
            yield key

    def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: timedelta | None = None,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Coroutine[Any, Any, Change]:
        """See `Backend.set`."""
        store = self._store
        if store is not None:
            return store.backend.set(
                key,
                value,
                ttl=ttl,
                expected_version=expected_version,
                expected_revision=expected_revision,
            )
        return self._later(
            "set",
            key,
            value,
            ttl=ttl,
            expected_version=expected_version,
            expected_revision=expected_revision,
        )

    async def set_many(
        self, items: Sequence[tuple[str, bytes]], *, ttl: timedelta | None = None
    ) -> list[Change]:
        """See `Backend.set_many`."""
        return await (await self._backend()).set_many(items, ttl=ttl)

    def delete(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        expected_revision: int | None = None,
    ) -> Coroutine[Any, Any, Change | None]:
        """See `Backend.delete`."""
        store = self._store
        if store is not None:
            return store.backend.delete(
                key, expected_version=expected_version, expected_revision=expected_revision
            )
        return self._later(
            "delete", key, expected_version=expected_version, expected_revision=expected_revision
        )

    def update(
        self,
        key: str,
        fn: Callable[[Entry | None], bytes],
        *,
        ttl: timedelta | None = None,
        max_attempts: int = DEFAULT_UPDATE_ATTEMPTS,
    ) -> Coroutine[Any, Any, Change]:
        """See `Backend.update`."""
        store = self._store
        if store is not None:
            return store.backend.update(key, fn, ttl=ttl, max_attempts=max_attempts)
        return self._later("update", key, fn, ttl=ttl, max_attempts=max_attempts)

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """See `Backend.transact`."""
        return await (await self._backend()).transact(compare, then, orelse)

    async def index_add(self, index: str, members: Mapping[str, float]) -> int:
        """See `Backend.index_add`."""
        return await (await self._backend()).index_add(index, members)

    async def index_remove(self, index: str, members: Sequence[str]) -> int:
        """See `Backend.index_remove`."""
        return await (await self._backend()).index_remove(index, members)

    async def index_range(self, index: str, *, limit: int | None = None) -> list[tuple[str, float]]:
        """See `Backend.index_range`."""
        return await (await self._backend()).index_range(index, limit=limit)

    def keep_history(self, rules: HistoryRules | Mapping[str, int]) -> None:
        """See `FileBackend.keep_history`: the rules of the shared store."""
        super().keep_history(rules)
        store = getattr(self, "_store", None)  # None while constructing
        if store is not None:
            store.backend.keep_history(self.history_rules)

    async def history(self, key: str, *, limit: int | None = None) -> list[Entry]:
        """See `Backend.history`."""
        return await (await self._backend()).history(key, limit=limit)

    async def get_version(self, key: str, version: int) -> Entry | None:
        """See `Backend.get_version`."""
        return await (await self._backend()).get_version(key, version)

    async def feed_cursor(self) -> str | None:
        """See `Backend.feed_cursor`: the shared store's feed."""
        return await (await self._backend()).feed_cursor()

    def changes(
        self, pattern: str, *, max_buffer: int = DEFAULT_MAX_BUFFER, since: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[ChangeStream]:
        """See `Backend.changes`; the subscription also ends when this lease closes."""
        return self._leased_changes(pattern, max_buffer, since)

    @asynccontextmanager
    async def _leased_changes(
        self, pattern: str, max_buffer: int, since: str | None
    ) -> AsyncIterator[ChangeStream]:
        backend = await self._backend()
        async with backend.changes(pattern, max_buffer=max_buffer, since=since) as stream:
            self._streams.add(stream)
            try:
                yield stream
            finally:
                self._streams.discard(stream)

    async def flush(self) -> None:
        """See `FileBackend.flush`: a snapshot of the shared store."""
        await (await self._backend()).flush()

    def stats(self) -> dict[str, int]:
        """The shared store's counters (see `FileBackend.stats`)."""
        store = self._store
        return store.backend.stats() if store is not None else super().stats()
