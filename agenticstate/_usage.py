"""State size: how many keys match a pattern and how many bytes their values take.

`StateManager.usage()` lists the keys (the key index on Redis, never KEYS) and reads their sizes in
batches through `Backend.value_sizes` (one MGET-shaped call per batch: the memory and file
backends measure the stored bytes exactly, Redis pipelines STRLEN). It never decodes a value.
The change feed's size comes from `Backend.feed_size`, once.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from agenticstate._checks import duration
from agenticstate.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from datetime import timedelta

    from agenticstate.backends.base import Backend

__all__ = ["FeedUsage", "NamespaceUsage", "StateUsage", "measure_usage", "namespace_of"]

DEFAULT_BATCH = 500


class NamespaceUsage(BaseModel):
    """Keys and stored bytes under one top-level namespace."""

    model_config = ConfigDict(frozen=True)

    keys: int = 0
    """Keys counted."""
    bytes: int = 0
    """Stored bytes of their values."""


class FeedUsage(BaseModel):
    """What the store's change feed holds (`StateUsage.feed`), whatever the pattern."""

    model_config = ConfigDict(frozen=True)

    changes: int = 0
    """Changes retained."""
    bytes: int = 0
    """What they hold: keys, headers, values carried inline and the old values of overwritten
    and deleted keys; a value still in the store is held by reference and not counted.
    `FeedRetention.max_bytes` bounds it."""


class StateUsage(BaseModel):
    """How much state matches a pattern, as `StateManager.usage` returns it.

    `bytes` counts each value as stored: after serialization, compression and encryption. It
    leaves out per-key metadata (the version and timestamps), the key names and the backend's
    own overhead (Redis' per-key memory, the file backend's log), which depend on the backend.
    """

    model_config = ConfigDict(frozen=True)

    pattern: str
    """The glob that was measured."""
    keys: int = 0
    """Keys counted."""
    bytes: int = 0
    """Stored bytes of their values."""
    namespaces: dict[str, NamespaceUsage] = Field(default_factory=dict)
    """Per top-level namespace: the key's first `:`-separated segment (`agent` for
    `agent:a1:status`); keys without a `:` count under `""`."""
    complete: bool = True
    """False when `max_time` stopped the scan early (the figures are then a lower bound),
    and in the running totals passed to a progress callback."""
    elapsed: float = 0.0
    """Seconds the measurement took."""
    feed: FeedUsage | None = None
    """The change feed this store writes (per backend: see `Backend.feed_size`), or `None`
    when it keeps none."""


def namespace_of(key: str) -> str:
    """Return the top-level namespace of a key: its first `:`-separated segment, or `""`."""
    head, colon, _ = key.partition(":")
    return head if colon else ""


async def measure_usage(
    backend: Backend,
    pattern: str,
    *,
    batch_size: int = DEFAULT_BATCH,
    max_time: timedelta | float | None = None,
    progress: Callable[[StateUsage], Awaitable[None] | None] | None = None,
) -> StateUsage:
    """Scan `pattern` on `backend` and add up the stored sizes of the values, batch by batch."""
    if type(batch_size) is not int or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an int >= 1, not {batch_size!r}")
    checked = duration(max_time, "max_time", seconds=True)
    limit = checked.total_seconds() if checked is not None else None
    if progress is not None and not callable(progress):
        raise InvalidArgumentError("progress must be callable")
    started = time.monotonic()
    totals: dict[str, list[int]] = {}
    complete = True
    size = await backend.feed_size()
    feed = None if size is None else FeedUsage(changes=size.changes, bytes=size.bytes)

    def snapshot(*, done: bool) -> StateUsage:
        return StateUsage(
            pattern=pattern,
            keys=sum(keys for keys, _ in totals.values()),
            bytes=sum(size for _, size in totals.values()),
            namespaces={
                name: NamespaceUsage(keys=keys, bytes=size)
                for name, (keys, size) in sorted(totals.items())
            },
            complete=done,
            elapsed=time.monotonic() - started,
            feed=feed,
        )

    async def measure(batch: list[str]) -> None:
        for key, size in zip(batch, await backend.value_sizes(batch), strict=True):
            if size is None:
                continue  # deleted or expired since the scan saw it
            counts = totals.setdefault(namespace_of(key), [0, 0])
            counts[0] += 1
            counts[1] += size
        if progress is not None:
            outcome = progress(snapshot(done=False))
            if inspect.isawaitable(outcome):
                await outcome

    batch: list[str] = []
    keys = backend.scan(pattern)
    try:
        async for key in keys:
            batch.append(key)
            # Checked per key, not per batch, so a slow scan stops on time too.
            late = limit is not None and time.monotonic() - started >= limit
            if len(batch) >= batch_size or late:
                await measure(batch)
                batch = []
            if late:
                complete = False
                break
    finally:
        close = getattr(keys, "aclose", None)  # an async generator left early: close it now
        if close is not None:
            await close()
    if batch and complete:
        await measure(batch)
    return snapshot(done=complete)
