"""`CheckpointSaver`: LangGraph checkpoints on any `StateManager`, with a guarded thread head.

Key layout (`p` is the saver's `prefix`, `{t}` the percent-encoded thread id in a Redis Cluster
hash tag, so a thread's keys share one slot; `ns`, `id`, `ch` and `v` are percent-encoded too):

| key                       | value                                                          |
|---------------------------|----------------------------------------------------------------|
| `p:{t}:head:ns`           | `{"id": latest checkpoint id}`: the thread head, moved atomically |
| `p:{t}:cp:ns:id`          | the checkpoint without its channel values, its metadata, parent |
| `p:{t}:b:ns:ch:v`         | one channel value at one version (LangGraph's serializer), whole, |
|                           | compressed, or a delta on the channel's previous value (`_blobs`) |
| `p:{t}:w:ns:id`           | the pending writes recorded against checkpoint `id`            |

A checkpoint record lists, for each channel stored as a delta, the versions its value is read
from (`chains`: the whole copy, then the deltas), so a read fetches them in the same call as the
others. Pruning keeps every value a kept checkpoint's chains name (`_used_blobs`).
"""

from __future__ import annotations

import heapq
import math
import random
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import anyio
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from agenticstate import txn
from agenticstate._log import get_logger
from agenticstate._retry import backoff
from agenticstate.exceptions import (
    ConfigurationError,
    ConflictError,
    DecodeError,
    InvalidArgumentError,
    UnsupportedOperationError,
)
from agenticstate.langgraph._blobs import (
    Tip,
    assemble,
    decode_full,
    encode_value,
    is_delta,
    tip_of,
)
from agenticstate.langgraph._common import (
    StaleCheckpointError,
    check_prefix,
    decode,
    encode,
    run_sync,
    unwrap_state,
)

if TYPE_CHECKING:
    from collections.abc import (
        AsyncIterator,
        Callable,
        Collection,
        Coroutine,
        Iterable,
        Iterator,
        Sequence,
    )

    from anyio.from_thread import BlockingPortal
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.serde.base import SerializerProtocol

    from agenticstate import sync
    from agenticstate._codec import StateEntry
    from agenticstate.backends import TxnCompare
    from agenticstate.manager import StateManager

T = TypeVar("T")

__all__ = ["HEAD_GUARD_KEY", "CheckpointRetention", "CheckpointSaver"]

_log = get_logger(__name__)

HEAD_GUARD_KEY = "__agenticstate_head__"
"""The `configurable` key that marks a config as "built on the thread head".

`aget_tuple` sets it to `True` when it returns a thread's latest checkpoint; LangGraph carries it
into every `aput` of that run, and `aput` then refuses to write unless the checkpoint it builds on
is still the head. A config that names its checkpoint and still carries the key (a snapshot kept
from `get_state`) is loaded with the key set to `"update"`: only an `update_state` on it stays
guarded, a run started from it (a replay) is a deliberate fork. Its name starts with `__`, so
LangGraph never copies it into metadata.
"""

_UPDATE_ONLY = "update"
"""`HEAD_GUARD_KEY` on an explicitly addressed snapshot config: guard `update_state` only."""

_PAGE = 64

_UNIQUE = re.compile(r"\d{32}\.[0-9.e+-]+")
"""A version `get_next_version` made (unique across forks): deltas are only stored between two."""

_READ_ATTEMPTS = 5
"""How many times a read starts over when a prune deletes what it is reading."""

_REMEMBERED = 1024
"""How many thread heads (and, separately, pending-write lists) a saver remembers for its steps."""

DELTA_CHAIN = 16
"""The default `delta_chain`: a channel value is read from at most this many stored values."""

COMPRESS_ABOVE = 1024
"""The default `compress_above`: stored channel values of this many bytes or more are zlib'd."""

_SWEEP_BATCH = 64
"""How many idle threads one TTL sweep looks at (the next sweep takes the rest)."""

_now = time.time
"""The clock of checkpoint ages and thread idleness (seconds since the epoch)."""


class _Seen(NamedTuple):
    """What a saver remembers of the checkpoint it last wrote or read on a thread and namespace."""

    checkpoint_id: str
    versions: dict[str, str]
    chains: dict[str, list[str]]
    tips: dict[str, Tip]


def _seconds(value: timedelta | float | None, name: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigurationError(f"{name} must be a positive duration, not {value!r}")
    try:
        as_float = float(seconds)
    except OverflowError:  # an int no float holds
        as_float = math.inf
    if not math.isfinite(as_float) or as_float <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite duration, not {value!r}")
    return as_float


@dataclass(frozen=True, slots=True)
class CheckpointRetention:
    """How long `CheckpointSaver` keeps checkpoints, applied as threads are written.

    After each `aput`, the thread and namespace written keeps its latest checkpoint (always), and
    of the others only those within every limit set: among the newest `keep_last`, and written
    less than `max_age` ago. A thread nobody wrote for `thread_ttl` is deleted whole by a sweep
    that runs as other threads are written. What a kept checkpoint needs (the values its delta
    chains start from, its pending writes) always stays.

    Attributes:
        keep_last: Checkpoints kept per thread and namespace, the latest included (at least 1).
        max_age: Checkpoints written longer ago than this are deleted (the latest one stays).
        thread_ttl: A thread with no checkpoint written for this long is deleted.

    Raises:
        ConfigurationError: No limit set, `keep_last` below 1, or a duration not positive.
    """

    keep_last: int | None = None
    max_age: timedelta | float | None = None
    thread_ttl: timedelta | float | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool)
            or not isinstance(self.keep_last, int)
            or self.keep_last < 1
        ):
            raise ConfigurationError(
                f"keep_last must be an int of at least 1, not {self.keep_last!r}"
            )
        _seconds(self.max_age, "max_age")
        _seconds(self.thread_ttl, "thread_ttl")
        if self.keep_last is None and self.max_age is None and self.thread_ttl is None:
            raise ConfigurationError("set keep_last, max_age or thread_ttl (or pass no retention)")

    @property
    def max_age_seconds(self) -> float | None:
        """`max_age` in seconds."""
        return _seconds(self.max_age, "max_age")

    @property
    def thread_ttl_seconds(self) -> float | None:
        """`thread_ttl` in seconds."""
        return _seconds(self.thread_ttl, "thread_ttl")


class CheckpointSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer over a `StateManager`, on any backend (memory, file, Redis, ...).

    Channel values go through LangGraph's serializer protocol (`JsonPlusSerializer` with its
    pickle fallback off, by default); the bytes it returns are stored as they are.

    Thread-head guarantee: a run that starts from a thread's latest checkpoint (the usual
    `graph.invoke(input, {"configurable": {"thread_id": ...}})`, a resume after `interrupt()`,
    `update_state` without a `checkpoint_id`, or on the snapshot `get_state` returned) writes each
    next checkpoint only if the one it builds on is still the thread's head; otherwise `aput`
    raises `StaleCheckpointError` and writes nothing. Two workers driving one thread therefore
    never fork it silently. A run started from an explicit `checkpoint_id` (replay, fork),
    including one from a snapshot `get_state` returned earlier, is a deliberate fork and is not
    refused; its checkpoints become the new head.

    Args:
        state: The state manager to keep checkpoints in (the caller opens and closes it), or
            an `agenticstate.sync.StateManager`, whose loop then runs the synchronous methods.
        prefix: The first segment of every key (letters, digits, `_`, `.`, `-`).
        serde: LangGraph serializer; defaults to `JsonPlusSerializer(pickle_fallback=False)`.
        portal: Where the synchronous methods (`put`, `get_tuple`, `list`, ...) run the async
            ones: a blocking portal to the loop that owns `state`. Without it they must be
            called from a worker thread of that loop.
        retention: Which checkpoints to keep and when to delete idle threads
            (`CheckpointRetention`); `None` keeps everything until `aprune` or a delete.
        delta_chain: A channel value that extends the channel's previous value (a list that
            grew by appends, such as `messages`) is stored as what it appends, and read from at
            most this many stored values: every `delta_chain`-th version is a whole copy. `1`
            stores every value whole.
        compress_above: Stored channel values of at least this many bytes are compressed with
            zlib (kept compressed only when smaller); `None` never compresses.

    Raises:
        ConfigurationError: A bad prefix, a serializer that falls back to pickle, a
            `delta_chain` below 1 or a negative `compress_above`.
    """

    def __init__(
        self,
        state: StateManager | sync.StateManager,
        *,
        prefix: str = "langgraph",
        serde: SerializerProtocol | None = None,
        portal: BlockingPortal | None = None,
        retention: CheckpointRetention | None = None,
        delta_chain: int = DELTA_CHAIN,
        compress_above: int | None = COMPRESS_ABOVE,
    ) -> None:
        if isinstance(delta_chain, bool) or not isinstance(delta_chain, int) or delta_chain < 1:
            raise ConfigurationError(
                f"delta_chain must be an int of at least 1, not {delta_chain!r}"
            )
        if compress_above is not None and (
            isinstance(compress_above, bool)
            or not isinstance(compress_above, int)
            or compress_above < 0
        ):
            raise ConfigurationError(
                f"compress_above must be a byte count (0 or more) or None, not {compress_above!r}"
            )
        if retention is not None and not isinstance(retention, CheckpointRetention):
            raise ConfigurationError(
                f"retention must be a CheckpointRetention or None, not {type(retention).__name__}"
            )
        if serde is None:
            serde = JsonPlusSerializer(pickle_fallback=False)
        inner: object = serde
        while inner is not None:  # a wrapper (EncryptedSerializer) keeps its own in `.serde`
            if getattr(inner, "pickle_fallback", False):
                raise ConfigurationError(
                    "the serializer falls back to pickle; agenticstate never unpickles stored bytes"
                )
            inner = getattr(inner, "serde", None)
        super().__init__(serde=serde)
        self.state, self._runner = unwrap_state(state)
        self.prefix = check_prefix(prefix)
        self.portal = portal
        self._steps = True  # the backend runs `transact` (until it says it does not)
        # What this saver last saw of a thread head, `(thread, ns) -> (checkpoint id, revision)`,
        # and of a pending-writes key, `key -> (revision, writes)`: a guarded `aput` (or an
        # `aput_writes`) compares on that revision and needs no read first. A revision names
        # one write of one life of a key, so a stale entry only costs a retry, never a wrong
        # write. Only kept on a backend with revisions (a version can come back after a delete).
        self._heads: dict[tuple[str, str], tuple[str, int]] = {}
        self._writes: dict[str, tuple[int, list[list[Any]]]] = {}
        self.retention = retention
        self.delta_chain = delta_chain
        self.compress_above = compress_above
        # The checkpoint this saver last wrote or read per thread and namespace, `(thread, ns)
        # -> _Seen`: the next `aput` on it stores each grown list as a delta against it, and
        # knows the chains of the values it shares with it without reading its record.
        self._tips: dict[tuple[str, str], _Seen] = {}
        # When this saver last marked a thread active in the TTL index, and last swept it.
        self._touched: dict[str, float] = {}
        self._swept = 0.0

    def _sync(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        return run_sync(self.portal, fn, *args, runner=self._runner)

    def __repr__(self) -> str:
        return f"CheckpointSaver(state={self.state!r}, prefix={self.prefix!r})"

    def _remember(self, cache: dict[Any, Any], slot: Any, value: Any) -> None:
        """Keep `value` in a bounded cache, dropping the least recently written entry."""
        cache.pop(slot, None)
        if len(cache) >= _REMEMBERED:
            del cache[next(iter(cache))]
        cache[slot] = value

    # ---------------------------------------------------------------- keys

    def _tag(self, thread_id: str) -> str:
        return f"{self.prefix}:{{{encode(str(thread_id))}}}"

    def _head_key(self, thread_id: str, ns: str) -> str:
        return f"{self._tag(thread_id)}:head:{encode(ns)}"

    def _cp_key(self, thread_id: str, ns: str, checkpoint_id: str) -> str:
        return f"{self._tag(thread_id)}:cp:{encode(ns)}:{encode(checkpoint_id)}"

    def _writes_key(self, thread_id: str, ns: str, checkpoint_id: str) -> str:
        return f"{self._tag(thread_id)}:w:{encode(ns)}:{encode(checkpoint_id)}"

    def _blob_key(self, thread_id: str, ns: str, channel: str, version: object) -> str:
        return f"{self._tag(thread_id)}:b:{encode(ns)}:{encode(channel)}:{encode(str(version))}"

    @staticmethod
    def _parse(key: str) -> tuple[str, str, str]:
        """Return `(thread_id, ns, checkpoint_id)` from a `cp` or `w` key."""
        _, tag, _, ns, checkpoint_id = key.split(":")
        return decode(tag[1:-1]), decode(ns), decode(checkpoint_id)

    async def _checkpoint_keys(
        self,
        thread_id: str | None,
        ns: str | None,
        keep: Callable[[str], bool] | None = None,
        limit: int | None = None,
    ) -> list[tuple[str, str, str, str]]:
        """Return `(checkpoint_id, thread_id, ns, key)` of matching checkpoints, newest first.

        `keep` tests a checkpoint id; `limit` keeps only the newest that many (a partial sort).
        """
        if thread_id is None:
            pattern = f"{self.prefix}:{{*}}:cp:*"
        elif ns is None:
            pattern = f"{self._tag(thread_id)}:cp:*"
        else:
            pattern = f"{self._tag(thread_id)}:cp:{encode(ns)}:*"
        found = []
        keys = await self.state.list_keys(pattern)
        if thread_id is not None:
            # One thread: each key is the pattern's prefix, then the namespace (unless the
            # pattern names it) and the id; only those are parsed.
            cut = len(pattern) - 1
            for key in keys:
                if ns is None:
                    namespace, _, rest = key[cut:].partition(":")
                    namespace, checkpoint_id = decode(namespace), decode(rest)
                else:
                    namespace, checkpoint_id = ns, decode(key[cut:])
                if keep is None or keep(checkpoint_id):
                    found.append((checkpoint_id, thread_id, namespace, key))
        else:
            for key in keys:
                thread, namespace, checkpoint_id = self._parse(key)
                if keep is None or keep(checkpoint_id):
                    found.append((checkpoint_id, thread, namespace, key))
        if limit is not None and limit < len(found):
            return heapq.nlargest(limit, found)  # keys are unique, so tuples never tie on them
        found.sort(reverse=True)
        return found

    # ---------------------------------------------------------------- reads

    def _config(self, thread_id: str, ns: str, checkpoint_id: str) -> RunnableConfig:
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }

    def _needed(
        self, thread_id: str, ns: str, checkpoint_id: str, record: dict[str, Any]
    ) -> list[str]:
        """The keys a checkpoint's tuple is built from: its channel values, then its writes."""
        versions: dict[str, str] = record["versions"]
        chains: dict[str, list[str]] = record.get("chains") or {}
        return [
            *(self._blob_key(thread_id, ns, ch, v) for ch, v in versions.items()),
            *(self._blob_key(thread_id, ns, ch, v) for ch, vs in chains.items() for v in vs),
            self._writes_key(thread_id, ns, checkpoint_id),
        ]

    def _value(
        self,
        thread_id: str,
        ns: str,
        channel: str,
        version: str,
        chain: Sequence[str],
        found: dict[str, Any],
    ) -> tuple[str, bytes, tuple[str, ...]] | None:
        """`(type, bytes, chain)` of a channel value from what `_needed` read (`None`: missing)."""
        stored = found.get(self._blob_key(thread_id, ns, channel, version))
        if stored is None:
            return None
        if not is_delta(stored):
            return (*decode_full(stored), ())
        if not chain:
            raise DecodeError(
                f"thread {thread_id!r} (namespace {ns!r}), channel {channel!r} at version "
                f"{version!r}: a delta whose checkpoint does not list its chain"
            )
        parts = [found.get(self._blob_key(thread_id, ns, channel, v)) for v in chain]
        kind, data = assemble(
            [*chain, version],
            [*parts, stored],
            f"thread {thread_id!r} (namespace {ns!r}), channel {channel!r} at version {version!r}",
        )
        return kind, data, tuple(chain)

    def _build(
        self,
        thread_id: str,
        ns: str,
        checkpoint_id: str,
        record: dict[str, Any],
        config: RunnableConfig,
        found: dict[str, Any],
        tips: dict[str, Tip] | None = None,
    ) -> CheckpointTuple:
        """The tuple of one checkpoint from what `_needed` read; fills `tips` if given."""
        values: dict[str, Any] = {}
        chains: dict[str, list[str]] = record.get("chains") or {}
        for channel, version in record["versions"].items():
            chain = chains.get(channel, ())
            blob = self._value(thread_id, ns, channel, version, chain, found)
            if blob is not None and blob[0] != "empty":
                values[channel] = self.serde.loads_typed(blob[:2])
                if tips is not None:
                    tip = tip_of(version, blob[2], blob[0], blob[1])
                    if tip is not None:
                        tips[channel] = tip
        writes = sorted(
            found.get(self._writes_key(thread_id, ns, checkpoint_id), []),
            key=lambda w: writes_sort_key(w[5], w[0], w[1]),
        )
        checkpoint = cast(
            "Checkpoint", self.serde.loads_typed((record["type"], record["checkpoint"]))
        )
        parent = record["parent"]
        return CheckpointTuple(
            config=config,
            checkpoint={**checkpoint, "channel_values": values},
            metadata=cast(
                "CheckpointMetadata",
                self.serde.loads_typed((record["metadata_type"], record["metadata"])),
            ),
            parent_config=self._config(thread_id, ns, parent) if parent else None,
            pending_writes=[(w[0], w[2], self.serde.loads_typed((w[3], w[4]))) for w in writes],
        )

    async def _tuple(
        self,
        thread_id: str,
        ns: str,
        checkpoint_id: str,
        record: dict[str, Any],
        config: RunnableConfig,
        *,
        remember: bool = True,
        found: dict[str, Any] | None = None,
    ) -> CheckpointTuple | None:
        """The tuple of a checkpoint whose record was read, or `None` if it is gone since.

        The values are read in a second call, so a prune may delete the checkpoint in between:
        a value missing makes the record be read again; gone, the checkpoint is absent; still
        there (a prune never deletes what a kept checkpoint reads), the values are read again.
        A checkpoint therefore reads exactly as it was put, or not at all.

        Raises:
            DecodeError: A value the record names stays missing while the record stays.
        """
        cp_key = self._cp_key(thread_id, ns, checkpoint_id)
        for _ in range(_READ_ATTEMPTS):
            needed = self._needed(thread_id, ns, checkpoint_id, record)
            if found is None:
                found = await self.state.get_many(needed)
            missing = [key for key in needed[:-1] if key not in found]  # writes may be none
            if not missing:
                tips: dict[str, Tip] = {}
                built = self._build(thread_id, ns, checkpoint_id, record, config, found, tips)
                if remember:
                    # The run that continues from this checkpoint writes its grown lists as
                    # deltas on these.
                    chains = record.get("chains") or {}
                    seen = _Seen(checkpoint_id, record["versions"], chains, tips)
                    self._remember(self._tips, (thread_id, ns), seen)
                return built
            again = await self.state.get(cp_key)
            if again is None:
                return None  # deleted (a prune) between the two reads
            record, found = again, None
        raise DecodeError(
            f"thread {thread_id!r} (namespace {ns!r}), checkpoint {checkpoint_id!r}: a value its "
            f"record names is missing ({missing[0]!r})"
        )

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Return the checkpoint `config` names, or the thread's latest one, or `None`.

        The latest checkpoint comes back with `HEAD_GUARD_KEY` in its config, so the run that
        continues from it is refused if another writer moves the head meanwhile. A checkpoint
        named by its id comes back with the guard narrowed to `update_state` (a config kept
        from `get_state` carries the key): a run started from it is a replay, never refused.
        """
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        if checkpoint_id:
            record = await self.state.get(self._cp_key(thread_id, ns, checkpoint_id))
            if record is None:
                return None
            if configurable.get(HEAD_GUARD_KEY):
                # LangGraph merges this config over the one it was given, so the value set
                # here (not the `True` a snapshot carried) is what every `aput` of the run sees.
                config = {
                    **config,
                    "configurable": {**configurable, HEAD_GUARD_KEY: _UPDATE_ONLY},
                }
            return await self._tuple(thread_id, ns, checkpoint_id, record, config)
        for _ in range(_READ_ATTEMPTS):
            head = await self.state.get_entry(self._head_key(thread_id, ns))
            if head is None:
                return None
            checkpoint_id = head.value["id"]
            record = await self.state.get(self._cp_key(thread_id, ns, checkpoint_id))
            if record is None:
                # Pruned since the head moved on (read the head again), or a head left naming
                # a deleted checkpoint (a delete that died part-way): repaired.
                await self._repair_head(thread_id, ns, head)
                continue
            self._remember_head(thread_id, ns, checkpoint_id, head.revision)
            latest = self._config(thread_id, ns, checkpoint_id)
            latest["configurable"][HEAD_GUARD_KEY] = True
            got = await self._tuple(thread_id, ns, checkpoint_id, record, latest)
            if got is not None:
                return got
        raise ConflictError(
            f"the head of thread {thread_id!r} (namespace {ns!r}) moved on during each of "
            f"{_READ_ATTEMPTS} reads",
            key=self._head_key(thread_id, ns),
        )

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002 (LangGraph's parameter name)
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Yield checkpoints newest first: of one thread (and namespace, if given), or of all.

        One scan of the matching checkpoint keys; with a `limit` and no `filter`, only the
        newest `limit` of them are sorted and read. Records and values are read a page at a
        time, never more than the page still to be returned.

        Args:
            config: `thread_id` (and optionally `checkpoint_ns`, `checkpoint_id`) to list; `None`
                lists every thread.
            filter: Metadata fields the checkpoints must have, compared for equality.
            before: Only checkpoints older than this config's `checkpoint_id`.
            limit: At most this many.
        """
        thread_id: str | None = None
        ns: str | None = None
        only: str | None = None
        if config is not None:
            configurable = config["configurable"]
            thread_id = str(configurable["thread_id"])
            ns = configurable.get("checkpoint_ns")
            only = get_checkpoint_id(config)
        before_id = get_checkpoint_id(before) if before is not None else None
        if limit is not None and limit <= 0:
            return

        def keep(checkpoint_id: str) -> bool:
            return (only is None or checkpoint_id == only) and (
                before_id is None or checkpoint_id < before_id
            )

        # Without a filter only the newest `limit` can be listed: sort just those. A checkpoint
        # deleted since the scan leaves a gap, filled by sorting the rest then (rarely).
        partial = not filter and limit is not None
        keys = await self._checkpoint_keys(thread_id, ns, keep, limit if partial else None)
        left = limit
        start = 0
        while start < len(keys):
            size = _PAGE if filter or left is None else min(_PAGE, left)
            page = keys[start : start + size]
            start += size
            records = await self.state.get_many([item[3] for item in page])
            chosen = []
            for checkpoint_id, thread, namespace, key in page:
                record = records.get(key)
                if record is None:
                    continue  # deleted since the scan
                if filter:
                    metadata = self.serde.loads_typed((record["metadata_type"], record["metadata"]))
                    if any(metadata.get(k) != v for k, v in filter.items()):
                        continue
                chosen.append((checkpoint_id, thread, namespace, record))
                if left is not None and len(chosen) == left:
                    break
            # One read for the whole page's channel values and writes.
            found = await self.state.get_many(
                [key for c, t, n, r in chosen for key in self._needed(t, n, c, r)]
            )
            for checkpoint_id, thread, namespace, record in chosen:
                got = await self._tuple(
                    thread,
                    namespace,
                    checkpoint_id,
                    record,
                    self._config(thread, namespace, checkpoint_id),
                    remember=False,
                    found=found,
                )
                if got is None:
                    continue  # deleted since its record was read
                yield got
                if left is not None:
                    left -= 1
                    if left == 0:
                        return
            if partial and start >= len(keys) and len(keys) == limit:
                # The partial sort fell short (deletions): continue past the last key read.
                last = keys[-1]
                keys = [
                    item for item in await self._checkpoint_keys(thread_id, ns, keep) if item < last
                ]
                start, partial = 0, False

    # ---------------------------------------------------------------- writes

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint and make it the thread's head.

        Raises:
            StaleCheckpointError: The config carries `HEAD_GUARD_KEY` (`True`, or `"update"`
                and this is an `update_state`) and the checkpoint it builds on is no longer the
                thread's head; nothing was written.
            InvalidArgumentError: An empty `thread_id`; nothing was written.

        The retention pass that follows a written checkpoint never fails the put: an error
        there is logged (`checkpoint_retention_failed`, at INFO) and the next put tries again.
        """
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        if not thread_id:
            raise InvalidArgumentError("thread_id must not be empty; nothing was written")
        ns = configurable.get("checkpoint_ns", "")
        parent = configurable.get("checkpoint_id")
        guard = configurable.get(HEAD_GUARD_KEY)
        # A snapshot's config, named by id: only update_state's write is checked (see aget_tuple).
        guarded = metadata.get("source") == guard if guard == _UPDATE_ONLY else bool(guard)
        body: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = body.pop("channel_values", {})
        versions = {ch: str(v) for ch, v in checkpoint["channel_versions"].items()}
        kind, data = self.serde.dumps_typed(body)
        full_metadata = get_checkpoint_metadata(config, metadata)
        meta_kind, meta_data = self.serde.dumps_typed(full_metadata)
        checkpoint_id = checkpoint["id"]
        cp_key = self._cp_key(thread_id, ns, checkpoint_id)
        record: dict[str, Any] = {
            "type": kind,
            "checkpoint": data,
            "metadata_type": meta_kind,
            "metadata": meta_data,
            "parent": parent,
            "run_id": full_metadata.get("run_id"),
            "versions": versions,
            "at": _now(),
        }
        # What the parent holds: each array channel's tip (a grown list is stored as a delta on
        # it), and the chains of the values this checkpoint shares with it.
        known = self._tips.get((thread_id, ns))
        bases: dict[str, Tip] = {}
        shared: dict[str, tuple[str, ...]] = {}
        unchanged = [ch for ch in versions if ch not in new_versions]
        unknown = unchanged
        if known is not None and parent is not None and known.checkpoint_id == parent:
            bases = known.tips
            same = [ch for ch in unchanged if known.versions.get(ch) == versions[ch]]
            shared = {ch: tuple(known.chains[ch]) for ch in same if ch in known.chains}
            unknown = [ch for ch in unchanged if ch not in same]
        if unknown:
            shared.update(await self._shared_chains(thread_id, ns, parent, versions, unknown))
        dumped: dict[str, tuple[str, bytes]] = {}

        def encode(
            bases: dict[str, Tip], rewrite: Collection[str]
        ) -> tuple[dict[str, object], list[str], _Seen]:
            """The keys to write, the keys they build on, what to remember once written."""
            blobs: dict[str, object] = {}
            refs: list[str] = []
            tips: dict[str, Tip] = {}
            chains: dict[str, list[str]] = {}
            written = {ch: str(v) for ch, v in new_versions.items()}
            written.update({ch: versions[ch] for ch in rewrite})
            for channel, version in written.items():
                if channel not in values:
                    blobs[self._blob_key(thread_id, ns, channel, version)] = ["empty", b""]
                    continue
                if channel not in dumped:
                    dumped[channel] = self.serde.dumps_typed(values[channel])
                base = bases.get(channel)
                if base is not None and not (
                    _UNIQUE.fullmatch(base.version) and _UNIQUE.fullmatch(version)
                ):
                    # A caller's own version may be reused by another branch, which overwrites
                    # its value: a delta on it could lose its base, and a delta stored at it
                    # would be read by records that do not list its chain (stored whole).
                    base = None
                stored, tip = encode_value(
                    version,
                    *dumped[channel],
                    base,
                    chain_limit=self.delta_chain,
                    compress_above=self.compress_above,
                )
                blobs[self._blob_key(thread_id, ns, channel, version)] = stored
                if tip is not None:
                    tips[channel] = tip
                    if tip.chain:
                        chains[channel] = list(tip.chain)
                        refs += [self._blob_key(thread_id, ns, channel, v) for v in tip.chain]
            for channel in unchanged:
                if channel in rewrite:
                    continue
                # Every stored value the record names must still be there when it is written.
                refs.append(self._blob_key(thread_id, ns, channel, versions[channel]))
                chain = shared.get(channel, ())
                if chain:
                    chains[channel] = list(chain)
                    refs += [self._blob_key(thread_id, ns, channel, v) for v in chain]
                tip = bases.get(channel)
                if tip is not None and tip.version == versions[channel]:
                    tips[channel] = tip
            blobs[cp_key] = {**record, "chains": chains} if chains else record
            return blobs, refs, _Seen(checkpoint_id, versions, chains, tips)

        if not self._steps:
            bases = {}
        blobs, refs, seen = encode(bases, ())

        def rebuild(missing: set[str]) -> tuple[dict[str, object], list[str], _Seen]:
            # A value this checkpoint builds on or names was deleted meanwhile (a prune, its
            # parent pruned): write whole copies instead, of the grown lists and of the
            # unchanged values that are gone or lost their chain.
            lost = [
                ch
                for ch in unchanged
                if self._blob_key(thread_id, ns, ch, versions[ch]) in missing
                or any(self._blob_key(thread_id, ns, ch, v) in missing for v in shared.get(ch, ()))
            ]
            return encode({}, lost)

        if self._steps:
            done = await self._put_step(
                thread_id, ns, parent, guarded, checkpoint_id, blobs, refs, seen, rebuild
            )
            if done:
                await self._after_put(thread_id, ns)
                return self._config(thread_id, ns, checkpoint_id)
            blobs, refs, seen = encode({}, ())  # no `transact` after all: no deltas either
        # A backend without `transact`: values and record, then the head (three calls).
        head_key = self._head_key(thread_id, ns)
        if guarded:
            # Refuse a stale write before writing anything (the common case of a lost race);
            # the compare-and-set below closes the window between this read and the write.
            head = await self.state.get(head_key)
            self._check_head(thread_id, ns, parent, head["id"] if head else None)
        await self.state.save_many(blobs, ttl=None)
        if not guarded:
            await self.state.save(head_key, {"id": checkpoint_id}, ttl=None)
            await self._after_put(thread_id, ns)
            return self._config(thread_id, ns, checkpoint_id)

        def move(current: dict[str, str] | None) -> dict[str, str]:
            # Runs atomically with the head's write (and again if it loses a race).
            self._check_head(thread_id, ns, parent, current["id"] if current else None)
            return {"id": checkpoint_id}

        try:
            await self.state.update(head_key, move, default=None, ttl=None)
        except StaleCheckpointError:
            # Another writer moved the head between our check and our write: withdraw the
            # checkpoint. Its channel values stay until the next prune or delete (a caller may
            # reuse version numbers, so another checkpoint may share them).
            await self.state.delete(cp_key)
            raise
        await self._after_put(thread_id, ns)
        return self._config(thread_id, ns, checkpoint_id)

    async def _shared_chains(
        self,
        thread_id: str,
        ns: str,
        parent: str | None,
        versions: dict[str, str],
        channels: list[str],
    ) -> dict[str, tuple[str, ...]]:
        """The delta chains of the values a checkpoint shares with its parent (not remembered).

        From the parent's record when it lists the same versions, else by reading the values
        themselves (a delta names the version it extends).
        """
        chains: dict[str, tuple[str, ...]] = {}
        todo = list(channels)
        if parent is not None:
            record = await self.state.get(self._cp_key(thread_id, ns, parent))
            if record is not None:
                listed: dict[str, list[str]] = record.get("chains") or {}
                same = [ch for ch in todo if record["versions"].get(ch) == versions[ch]]
                chains.update({ch: tuple(listed[ch]) for ch in same if ch in listed})
                todo = [ch for ch in todo if ch not in same]
        for channel in todo:
            chain: list[str] = []
            version = versions[channel]
            while True:
                stored = await self.state.get(self._blob_key(thread_id, ns, channel, version))
                if stored is None or not is_delta(stored):
                    break
                version = stored[5]
                chain.append(version)
                if len(chain) > self.delta_chain + 64:
                    raise DecodeError(
                        f"thread {thread_id!r} (namespace {ns!r}), channel {channel!r}: a delta "
                        "chain that does not end"
                    )
            if chain:
                chains[channel] = tuple(reversed(chain))
        return chains

    # ---------------------------------------------------------------- atomic steps

    async def _transact(
        self, compare: list[TxnCompare], then: list[txn.Op], orelse: list[txn.Op]
    ) -> txn.TransactResult | None:
        """`state.transact(...)`, or `None` if the backend has none (then never asked again)."""
        try:
            return await self.state.transact(compare, then, orelse)
        except UnsupportedOperationError:
            self._steps = False
            return None

    def _compare(self, key: str, entry: StateEntry | None) -> TxnCompare:
        """The compare that holds while `key` is still `entry` (missing: `None`)."""
        if entry is None:
            return txn.Version(key, 0)
        if entry.revision:
            return txn.Revision(key, entry.revision)
        return txn.Version(key, entry.version)  # a backend (or a write) without revisions

    def _remember_head(self, thread_id: str, ns: str, checkpoint_id: str, revision: int) -> None:
        if not revision:
            return  # a version is not enough: it comes back after a delete
        heads = self._heads
        slot = (thread_id, ns)
        heads.pop(slot, None)
        if len(heads) >= _REMEMBERED:
            del heads[next(iter(heads))]  # the least recently written
        heads[slot] = (checkpoint_id, revision)

    async def _put_step(
        self,
        thread_id: str,
        ns: str,
        parent: str | None,
        guarded: bool,
        checkpoint_id: str,
        blobs: dict[str, object],
        refs: list[str],
        seen: _Seen,
        rebuild: Callable[[set[str]], tuple[dict[str, object], list[str], _Seen]],
    ) -> bool:
        """Write a checkpoint's values, its record and the head move as one `transact`.

        Guarded, the step compares the head with the revision this saver last saw it at
        (remembered from `aget_tuple` or the last `aput`, else read now); a lost compare
        returns the head in the same step, and the step is retried on its new revision while
        it still names `parent`. The step also checks that the stored values its deltas build
        on (`refs`) are still there; if one was deleted meanwhile, `rebuild` makes whole copies
        and the step is tried again. Returns `False` if the backend has no `transact`.

        Raises:
            StaleCheckpointError: The head no longer names `parent`; nothing was written.
            ConflictError: The head was rewritten (still naming `parent`) on every attempt.
        """
        head_key = self._head_key(thread_id, ns)
        compare: TxnCompare | None = None
        if not guarded:
            compare = None
        elif parent is None:
            compare = txn.Version(head_key, 0)  # built on no checkpoint: the head is missing
        else:
            known = self._heads.get((thread_id, ns))
            if known is not None and known[0] == parent:
                compare = txn.Revision(head_key, known[1])
        attempts = self.state.config.update_max_attempts
        for attempt in range(attempts):
            if guarded and compare is None:
                # Refuse a stale write before building the step (the common lost race).
                entry = await self.state.get_entry(head_key)
                self._check_head(thread_id, ns, parent, entry.value["id"] if entry else None)
                compare = self._compare(head_key, entry)
            then: list[txn.Op] = [txn.Put(key, value, ttl=None) for key, value in blobs.items()]
            then.append(txn.Put(head_key, {"id": checkpoint_id}, ttl=None))
            compares: list[TxnCompare] = [txn.Exists(key) for key in refs]
            orelse: list[txn.Op] = [txn.Get(key) for key in refs]
            if compare is not None:
                compares.append(compare)
            done = await self._transact(compares, then, [*orelse, txn.Get(head_key)])
            if done is None:
                return False
            if done.succeeded:
                self._remember_head(thread_id, ns, checkpoint_id, done.revisions[-1])
                self._remember(self._tips, (thread_id, ns), seen)
                return True
            entry = done.results[-1]
            if guarded:
                self._heads.pop((thread_id, ns), None)
                self._check_head(thread_id, ns, parent, entry.value["id"] if entry else None)
                # The head still names `parent` (maybe written again meanwhile): retry on it.
                compare = self._compare(head_key, entry)
            missing = {key for key, got in zip(refs, done.results, strict=False) if got is None}
            if missing:
                self._tips.pop((thread_id, ns), None)
                blobs, refs, seen = rebuild(missing)
            elif attempt:
                await anyio.sleep(backoff(attempt))
        raise ConflictError(
            f"the head of thread {thread_id!r} (namespace {ns!r}) was rewritten during each "
            f"of {attempts} attempts to write checkpoint {checkpoint_id!r}; nothing was written",
            key=head_key,
        )

    @staticmethod
    def _check_head(thread_id: str, ns: str, parent: str | None, actual: str | None) -> None:
        if actual != parent:
            raise StaleCheckpointError(
                f"thread {thread_id!r} (namespace {ns!r}) moved from checkpoint {parent!r} to "
                f"{actual!r} before this write; nothing was written",
                thread_id=thread_id,
                checkpoint_ns=ns,
                expected_head=parent,
                actual_head=actual,
            )

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Record a task's writes against the checkpoint `config` names (atomically, idempotently).

        A regular write already recorded for the same task and index is kept; the special ones
        (error, interrupt, resume, scheduled) replace theirs, as in LangGraph's own savers.
        """
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        checkpoint_id = configurable["checkpoint_id"]
        new: list[list[Any]] = []
        for index, (channel, value) in enumerate(writes):
            kind, data = self.serde.dumps_typed(value)
            new.append(
                [task_id, WRITES_IDX_MAP.get(channel, index), channel, kind, data, task_path]
            )

        def merge(current: list[list[Any]]) -> list[list[Any]]:
            by_slot = {(w[0], w[1]): w for w in current}
            for write in new:
                slot = (write[0], write[1])
                if slot[1] >= 0 and slot in by_slot:
                    continue
                by_slot[slot] = write
            return list(by_slot.values())

        key = self._writes_key(thread_id, ns, checkpoint_id)
        if not (self._steps and await self._writes_step(key, merge)):
            await self.state.update(key, merge, default=[], ttl=None)
        policy = self.retention
        ttl = None if policy is None else policy.thread_ttl_seconds
        if ttl is not None:
            # Writes keep the thread in the TTL index too (a swept thread's slow task leaves
            # keys the next sweep then deletes).
            try:
                await self._touch(thread_id, ttl, sweep=False)
            except Exception as exc:  # noqa: BLE001 (the writes are stored: never fail them now)
                _log.info("checkpoint_retention_failed", error=type(exc).__name__)

    async def _writes_step(
        self, key: str, merge: Callable[[list[list[Any]]], list[list[Any]]]
    ) -> bool:
        """Merge writes into `key` as one `transact`, compared on what this saver last saw.

        The first try assumes the list this saver last wrote there (or none); a lost compare
        returns the current list in the same step, and the merge is retried on it. Returns
        `False` if the backend has no `transact`.

        Raises:
            ConflictError: Every attempt lost a race.
        """
        known = self._writes.pop(key, None)
        compare: TxnCompare = txn.Version(key, 0) if known is None else txn.Revision(key, known[0])
        current = [] if known is None else known[1]
        attempts = self.state.config.update_max_attempts
        for attempt in range(attempts):
            merged = merge(current)
            done = await self._transact([compare], [txn.Put(key, merged, ttl=None)], [txn.Get(key)])
            if done is None:
                return False
            if done.succeeded:
                if done.revisions[0]:
                    writes = self._writes
                    if len(writes) >= _REMEMBERED:
                        del writes[next(iter(writes))]
                    writes[key] = (done.revisions[0], merged)
                return True
            entry = done.results[0]
            current = [] if entry is None else entry.value
            compare = self._compare(key, entry)
            if attempt:  # the first miss is expected (another task's writes came first)
                await anyio.sleep(backoff(attempt))
        raise ConflictError(f"writes to {key!r} lost {attempts} races in a row; try again", key=key)

    # ---------------------------------------------------------------- deletes, copies, pruning

    async def _delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            await self.state.delete(key)

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, write and channel value of a thread."""
        thread_id = str(thread_id)
        await self._delete_keys(await self.state.list_keys(f"{self._tag(thread_id)}:*"))
        for slot in [slot for slot in self._tips if slot[0] == thread_id]:
            del self._tips[slot]
        if self.retention is not None and self.retention.thread_ttl is not None:
            self._touched.pop(thread_id, None)
            await self.state.index_remove(self._ttl_index(), [encode(thread_id)])

    def _used_blobs(self, thread_id: str, ns: str, records: Iterable[dict[str, Any]]) -> set[str]:
        """The stored values the given checkpoints are read from: their versions and chains."""
        used: set[str] = set()
        for record in records:
            for channel, version in record["versions"].items():
                used.add(self._blob_key(thread_id, ns, channel, version))
            for channel, chain in (record.get("chains") or {}).items():
                used.update(self._blob_key(thread_id, ns, channel, v) for v in chain)
        return used

    async def _prune_ns(
        self,
        thread_id: str,
        ns: str,
        choose: Callable[[list[tuple[str, str, str, str]], dict[str, Any], str | None], set[str]],
    ) -> int:
        """Delete the checkpoints `choose` names, their writes, and the values nothing kept reads.

        `choose(items, records, head id)` gets the namespace's checkpoints (newest first) and
        their records. The deletes are one `transact` that holds only while the thread head is
        the one read first: a checkpoint written meanwhile (which may build on a value about to
        go) makes the step fail, and it is worked out again. The head is never deleted. Returns
        how many checkpoints were deleted.

        Raises:
            ConflictError: The thread was written during every attempt; nothing was deleted.
        """
        head_key = self._head_key(thread_id, ns)
        attempts = self.state.config.update_max_attempts
        for attempt in range(attempts):
            head = await self.state.get_entry(head_key)
            head_id = head.value["id"] if head is not None else None
            items = await self._checkpoint_keys(thread_id, ns)
            records = await self.state.get_many([item[3] for item in items])
            doomed = choose(items, records, head_id) - {head_id}
            if not doomed:
                return 0
            used = self._used_blobs(
                thread_id,
                ns,
                (
                    records[item[3]]
                    for item in items
                    if item[0] not in doomed and item[3] in records
                ),
            )
            blobs = await self.state.list_keys(f"{self._tag(thread_id)}:b:{encode(ns)}:*")
            # Writes a slow task recorded against a checkpoint already deleted (older than the
            # head; a newer one may be a checkpoint still being written) go too.
            known = {item[0] for item in items}
            orphans = [
                key
                for key in await self.state.list_keys(f"{self._tag(thread_id)}:w:{encode(ns)}:*")
                if (checkpoint := self._parse(key)[2]) not in known
                and head_id is not None
                and checkpoint < head_id
            ]
            deletes = [
                *(item[3] for item in items if item[0] in doomed),
                *(self._writes_key(thread_id, ns, item[0]) for item in items if item[0] in doomed),
                *(key for key in blobs if key not in used),
                *orphans,
            ]
            done = await self._transact(
                [self._compare(head_key, head)], [txn.Delete(key) for key in deletes], []
            )
            if done is None:  # a backend without `transact`
                await self._delete_keys(deletes)
                return len(doomed)
            if done.succeeded:
                return len(doomed)
            if attempt:
                await anyio.sleep(backoff(attempt))
        raise ConflictError(
            f"thread {thread_id!r} (namespace {ns!r}) was written during each of {attempts} "
            "attempts to prune it; nothing was deleted",
            key=head_key,
        )

    # ---------------------------------------------------------------- retention

    def _ttl_index(self) -> str:
        return f"{self.prefix}:threads"

    async def _after_put(self, thread_id: str, ns: str) -> None:
        """Apply the retention policy to the thread and namespace just written."""
        policy = self.retention
        if policy is None:
            return
        try:
            if policy.keep_last is not None or policy.max_age is not None:
                await self._retain(thread_id, ns, policy)
            ttl = policy.thread_ttl_seconds
            if ttl is not None:
                await self._touch(thread_id, ttl)
        except ConflictError:
            # Another writer kept the thread busy: the checkpoint is written, and the next
            # `aput` applies the policy again.
            _log.debug("checkpoint_retention_deferred")
        except Exception as exc:  # noqa: BLE001 (the put is committed: never fail it now)
            # A store error, or a thread another client left unreadable: the checkpoint is
            # written, and the next `aput` applies the policy again.
            _log.info("checkpoint_retention_failed", error=type(exc).__name__)

    async def _retain(self, thread_id: str, ns: str, policy: CheckpointRetention) -> None:
        keep_last = policy.keep_last
        max_age = policy.max_age_seconds
        items = await self._checkpoint_keys(thread_id, ns)
        if keep_last is None or len(items) <= keep_last:
            if max_age is None or len(items) < 2:
                return
            at = await self._oldest_time(items[1:])
            if at is None or _now() - at <= max_age:
                return

        def choose(
            items: list[tuple[str, str, str, str]], records: dict[str, Any], head_id: str | None
        ) -> set[str]:
            now = _now()
            doomed = set()
            for rank, (checkpoint_id, _, _, key) in enumerate(items):
                if checkpoint_id == head_id:
                    continue
                if keep_last is not None and rank >= keep_last:
                    doomed.add(checkpoint_id)
                    continue
                at = records.get(key, {}).get("at")
                if max_age is not None and at is not None and now - at > max_age:
                    doomed.add(checkpoint_id)
            return doomed

        pruned = await self._prune_ns(thread_id, ns, choose)
        if pruned:
            _log.debug("checkpoint_retention_pruned", checkpoints=pruned)
            if ns == "":
                await self._drop_namespaces(thread_id)

    async def _drop_namespaces(self, thread_id: str) -> None:
        """Delete the thread's other namespaces whose head is older than every root checkpoint.

        A subgraph writes its checkpoints under a namespace of its own per invocation
        (`sub:<task id>`), whose head is written during the root step that invokes it: such a
        namespace whose head predates the oldest root checkpoint kept belongs to a step the
        retention dropped. A namespace without task ids (a `checkpointer=True` subgraph's
        history, kept across invocations) is never dropped. Each goes whole, in one `transact`
        that holds while its head is the one read (a write to it meanwhile keeps it).
        """
        left = await self._checkpoint_keys(thread_id, "")
        if not left:
            return
        oldest = left[-1][0]
        root = self._head_key(thread_id, "")
        tag = self._tag(thread_id)
        for head_key in await self.state.list_keys(f"{tag}:head:*"):
            if head_key == root:
                continue
            head = await self.state.get_entry(head_key)
            if head is None or not isinstance(head.value, dict):
                continue
            ns = head_key.rsplit(":", 1)[1]
            if ":" not in decode(ns) or str(head.value.get("id", "")) >= oldest:
                continue  # a subgraph's own history (`checkpointer=True`), or still current
            keys = [
                key
                for kind in ("cp", "w", "b")
                for key in await self.state.list_keys(f"{tag}:{kind}:{ns}:*")
            ]
            deletes: list[txn.Op] = [txn.Delete(key) for key in [*keys, head_key]]
            done = await self._transact([self._compare(head_key, head)], deletes, [])
            if done is None:  # a backend without `transact`
                await self._delete_keys([*keys, head_key])
            self._tips.pop((thread_id, decode(ns)), None)
            _log.debug("checkpoint_namespace_dropped")

    async def _oldest_time(self, items: list[tuple[str, str, str, str]]) -> float | None:
        """The write time of the oldest of `items` (newest first) that has one, or `None`.

        Reads the oldest record; records written before write times existed are older than
        any with one, so they are skipped a page at a time.
        """
        end = len(items)
        size = 1
        while end > 0:
            page = items[max(0, end - size) : end]
            records = await self.state.get_many([item[3] for item in page])
            for item in reversed(page):
                at = records.get(item[3], {}).get("at")
                if at is not None:
                    return float(at)
            end -= len(page)
            size = _PAGE
        return None

    async def _touch(self, thread_id: str, ttl: float, *, sweep: bool = True) -> None:
        """Mark the thread active in the TTL index (at most every `ttl / 8`), and sweep."""
        now = _now()
        last = self._touched.get(thread_id)
        if last is None or now - last >= ttl / 8:
            await self.state.index_add(self._ttl_index(), {encode(thread_id): now})
            self._remember(self._touched, thread_id, now)
        if sweep and now - self._swept >= ttl / 8:
            self._swept = now
            await self.asweep_idle_threads()

    async def _expire(self, thread_id: str, member: str, now: float, ttl: float) -> bool:
        """Delete an idle thread whole, unless it was written since; return whether it went.

        The thread's newest checkpoint's write time is checked first (another saver may have
        written it since the index said otherwise; the index is then corrected). The deletes
        are one `transact` that holds only while every head of the thread is the one read: a
        checkpoint written meanwhile keeps the thread, whole.
        """
        index = self._ttl_index()
        head_keys = await self.state.list_keys(f"{self._tag(thread_id)}:head:*")
        heads = {key: await self.state.get_entry(key) for key in head_keys}
        records = await self.state.get_many(
            [
                self._cp_key(thread_id, decode(key.rsplit(":", 1)[1]), entry.value["id"])
                for key, entry in heads.items()
                if entry is not None and isinstance(entry.value, dict) and "id" in entry.value
            ]
        )
        times = [at for at in (record.get("at") for record in records.values()) if at is not None]
        if times and now - max(times) <= ttl:
            await self.state.index_add(index, {member: max(times)})
            return False
        keys = await self.state.list_keys(f"{self._tag(thread_id)}:*")
        if any(":head:" in key and key not in heads for key in keys):
            return False  # a namespace begun meanwhile: the thread is active
        compares = [self._compare(key, entry) for key, entry in heads.items()]
        done = await self._transact(compares, [txn.Delete(key) for key in keys], [])
        if done is None:  # a backend without `transact`
            await self._delete_keys(keys)
        elif not done.succeeded:
            return False  # written meanwhile: the next sweep looks again
        for slot in [slot for slot in self._tips if slot[0] == thread_id]:
            del self._tips[slot]
        self._touched.pop(thread_id, None)
        if await self.state.list_keys(f"{self._tag(thread_id)}:*"):
            # Written after the listing (a new namespace, whose keys were not deleted): the
            # thread stays in the index, as written now.
            await self.state.index_add(index, {member: now})
        else:
            await self.state.index_remove(index, [member])
        return True

    async def asweep_idle_threads(self) -> int:
        """Delete the threads idle longer than the retention's `thread_ttl`; return how many.

        Runs by itself as threads are written (at most every `thread_ttl / 8` per saver);
        call it to sweep a store nobody writes. One read of the oldest entries of the TTL index
        (`prefix:threads`, a sorted index of threads by last write), then, for each thread past
        its TTL, a check of its newest checkpoint's write time and the thread's delete, one
        `transact` that a write to the thread meanwhile cancels: the cost is what expires.
        Without a `thread_ttl`, does nothing.
        """
        policy = self.retention
        ttl = None if policy is None else policy.thread_ttl_seconds
        if ttl is None:
            return 0
        index = self._ttl_index()
        deleted = 0
        now = _now()
        for member, score in await self.state.index_range(index, limit=_SWEEP_BATCH):
            if now - score <= ttl:
                break
            try:
                deleted += await self._expire(decode(member), member, now, ttl)
            except Exception as exc:  # noqa: BLE001 (one bad thread must not stop the sweep)
                _log.info("checkpoint_thread_expiry_failed", error=type(exc).__name__)
        if deleted:
            _log.debug("checkpoint_threads_expired", threads=deleted)
        return deleted

    async def _delete_checkpoints(self, doomed: list[tuple[str, str, str, str]]) -> None:
        """Delete checkpoints with their writes, fix the heads, and drop orphaned values.

        Per thread and namespace, one `transact` guarded on the head: the records, their
        writes, the values nothing left reads, and the head moved to the newest checkpoint left
        (or deleted). A process killed meanwhile leaves each namespace as it was or as it ends.

        Raises:
            ConflictError: A namespace was written during every attempt; it was left as it was.
        """
        by_ns: dict[tuple[str, str], set[str]] = {}
        for checkpoint_id, thread, ns, _ in doomed:
            by_ns.setdefault((thread, ns), set()).add(checkpoint_id)
        attempts = self.state.config.update_max_attempts
        for (thread, ns), ids in by_ns.items():
            head_key = self._head_key(thread, ns)
            self._heads.pop((thread, ns), None)
            self._tips.pop((thread, ns), None)
            for attempt in range(attempts):
                head = await self.state.get_entry(head_key)
                items = await self._checkpoint_keys(thread, ns)
                left = [item for item in items if item[0] not in ids]
                records = await self.state.get_many([item[3] for item in left])
                used = self._used_blobs(thread, ns, records.values())
                blobs = await self.state.list_keys(f"{self._tag(thread)}:b:{encode(ns)}:*")
                deletes = [
                    *(item[3] for item in items if item[0] in ids),
                    *(self._writes_key(thread, ns, item[0]) for item in items if item[0] in ids),
                    *(key for key in blobs if key not in used),
                ]
                then: list[txn.Op] = [txn.Delete(key) for key in deletes]
                if left:
                    then.append(txn.Put(head_key, {"id": left[0][0]}, ttl=None))
                else:
                    then.append(txn.Delete(head_key))
                done = await self._transact([self._compare(head_key, head)], then, [])
                if done is None:  # a backend without `transact`: key by key, then the head
                    await self._delete_keys(deletes)
                    await self._repair(thread, ns)
                    break
                if done.succeeded:
                    break
                if attempt:
                    await anyio.sleep(backoff(attempt))
            else:
                raise ConflictError(
                    f"thread {thread!r} (namespace {ns!r}) was written during each of "
                    f"{attempts} attempts to delete its checkpoints; nothing was deleted",
                    key=head_key,
                )

    async def _repair(self, thread_id: str, ns: str) -> None:
        """Point the head at the newest remaining checkpoint and delete unreferenced values."""
        left = await self._checkpoint_keys(thread_id, ns)
        head_key = self._head_key(thread_id, ns)
        if left:
            await self.state.save(head_key, {"id": left[0][0]}, ttl=None)
        else:
            await self.state.delete(head_key)
        records = await self.state.get_many([item[3] for item in left])
        used = self._used_blobs(thread_id, ns, records.values())
        blobs = await self.state.list_keys(f"{self._tag(thread_id)}:b:{encode(ns)}:*")
        await self._delete_keys([key for key in blobs if key not in used])

    async def _repair_head(self, thread_id: str, ns: str, head: StateEntry) -> None:
        """Point a head that names a deleted checkpoint at the newest one left (or drop it).

        One `transact` that holds only while the head is still `head` and its checkpoint still
        missing, so a head that merely moved on meanwhile is left alone.
        """
        head_key = self._head_key(thread_id, ns)
        left = await self._checkpoint_keys(thread_id, ns, limit=1)
        compares: list[TxnCompare] = [
            self._compare(head_key, head),
            txn.Version(self._cp_key(thread_id, ns, head.value["id"]), 0),
        ]
        then: list[txn.Op]
        if left:
            compares.append(txn.Exists(left[0][3]))
            then = [txn.Put(head_key, {"id": left[0][0]}, ttl=None)]
        else:
            then = [txn.Delete(head_key)]
        done = await self._transact(compares, then, [])
        if done is None:  # a backend without `transact`
            await self._repair(thread_id, ns)
        elif done.succeeded:
            self._heads.pop((thread_id, ns), None)
            _log.debug("checkpoint_head_repaired")

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) that the given runs created.

        Per thread and namespace one atomic step, guarded on the head: the checkpoints, their
        writes, the values nothing left reads, and the head moved to the newest one left.

        Raises:
            ConflictError: A namespace was written during every attempt; it was left as it was.
        """
        wanted = set(run_ids)
        if not wanted:
            return
        everything = await self._checkpoint_keys(None, None)
        doomed = []
        for start in range(0, len(everything), _PAGE):
            page = everything[start : start + _PAGE]
            records = await self.state.get_many([item[3] for item in page])
            doomed += [
                item
                for item in page
                if item[3] in records and records[item[3]].get("run_id") in wanted
            ]
        await self._delete_checkpoints(doomed)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, write and channel value of one thread to another."""
        source = self._tag(str(source_thread_id))
        target = self._tag(str(target_thread_id))
        keys = await self.state.list_keys(f"{source}:*")
        for start in range(0, len(keys), _PAGE):
            found = await self.state.get_many(keys[start : start + _PAGE])
            await self.state.save_many(
                {target + key[len(source) :]: value for key, value in found.items()}, ttl=None
            )

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: `"keep_latest"` keeps each namespace's head, `"delete"` removes all.

        `"keep_latest"` deletes, per namespace, every other checkpoint with its pending writes,
        and the stored values nothing kept is read from, in one atomic step that holds only
        while the head is unchanged (a write meanwhile makes it start over).

        Raises:
            InvalidArgumentError: An unknown strategy; nothing was changed.
            ConflictError: A thread was written during every attempt to prune it.
        """
        if strategy not in {"keep_latest", "delete"}:
            raise InvalidArgumentError(
                f"strategy must be 'keep_latest' or 'delete', not {strategy!r}"
            )
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.adelete_thread(thread_id)
                continue
            # Each namespace with a head keeps it (and what it is read from); one without a
            # head (none is ever left so) keeps everything.
            for key in await self.state.list_keys(f"{self._tag(str(thread_id))}:head:*"):
                await self._prune_ns(
                    str(thread_id),
                    decode(key.rsplit(":", 1)[1]),
                    lambda items, _records, head_id: {item[0] for item in items} - {head_id},
                )

    # ---------------------------------------------------------------- versions

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Return a version greater than `current`, unique across forks (as `InMemorySaver`)."""
        if current is None:
            number = 0
        elif isinstance(current, int):
            number = current
        else:
            number = int(str(current).split(".")[0])
        return f"{number + 1:032}.{random.random():016}"  # noqa: S311 (uniqueness, not secrecy)

    # ---------------------------------------------------------------- sync API

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Blocking `aget_tuple` (through `portal`)."""
        return self._sync(self.aget_tuple, config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002 (LangGraph's parameter name)
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Blocking `alist` (through `portal`); the results are read in one go."""

        async def collect() -> list[CheckpointTuple]:
            return [
                item async for item in self.alist(config, filter=filter, before=before, limit=limit)
            ]

        return iter(self._sync(collect))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Blocking `aput` (through `portal`)."""
        return self._sync(self.aput, config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Blocking `aput_writes` (through `portal`)."""
        self._sync(self.aput_writes, config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        """Blocking `adelete_thread` (through `portal`)."""
        self._sync(self.adelete_thread, thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Blocking `adelete_for_runs` (through `portal`)."""
        self._sync(self.adelete_for_runs, run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Blocking `acopy_thread` (through `portal`)."""
        self._sync(self.acopy_thread, source_thread_id, target_thread_id)

    def sweep_idle_threads(self) -> int:
        """Blocking `asweep_idle_threads` (through `portal`)."""
        return self._sync(self.asweep_idle_threads)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Blocking `aprune` (through `portal`)."""

        async def call() -> None:
            await self.aprune(thread_ids, strategy=strategy)

        self._sync(call)
