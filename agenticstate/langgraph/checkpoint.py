"""`CheckpointSaver`: LangGraph checkpoints on any `StateManager`, with a guarded thread head.

Key layout (`p` is the saver's `prefix`, `{t}` the percent-encoded thread id in a Redis Cluster
hash tag, so a thread's keys share one slot; `ns`, `id`, `ch` and `v` are percent-encoded too):

| key                       | value                                                          |
|---------------------------|----------------------------------------------------------------|
| `p:{t}:head:ns`           | `{"id": latest checkpoint id}`: the thread head, moved atomically |
| `p:{t}:cp:ns:id`          | the checkpoint without its channel values, its metadata, parent |
| `p:{t}:b:ns:ch:v`         | one channel value at one version (LangGraph's serializer)      |
| `p:{t}:w:ns:id`           | the pending writes recorded against checkpoint `id`            |
"""

from __future__ import annotations

import heapq
import random
from typing import TYPE_CHECKING, Any, TypeVar, cast

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
from agenticstate._retry import backoff
from agenticstate.exceptions import (
    ConfigurationError,
    ConflictError,
    InvalidArgumentError,
    UnsupportedOperationError,
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
    from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence

    from anyio.from_thread import BlockingPortal
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.serde.base import SerializerProtocol

    from agenticstate import sync
    from agenticstate._codec import StateEntry
    from agenticstate.backends import TxnCompare
    from agenticstate.manager import StateManager

T = TypeVar("T")

__all__ = ["HEAD_GUARD_KEY", "CheckpointSaver"]

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

_REMEMBERED = 1024
"""How many thread heads (and, separately, pending-write lists) a saver remembers for its steps."""


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

    Raises:
        ConfigurationError: A bad prefix, or a serializer that falls back to pickle.
    """

    def __init__(
        self,
        state: StateManager | sync.StateManager,
        *,
        prefix: str = "langgraph",
        serde: SerializerProtocol | None = None,
        portal: BlockingPortal | None = None,
    ) -> None:
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

    def _sync(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        return run_sync(self.portal, fn, *args, runner=self._runner)

    def __repr__(self) -> str:
        return f"CheckpointSaver(state={self.state!r}, prefix={self.prefix!r})"

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
        return [
            *(self._blob_key(thread_id, ns, ch, v) for ch, v in versions.items()),
            self._writes_key(thread_id, ns, checkpoint_id),
        ]

    def _build(
        self,
        thread_id: str,
        ns: str,
        checkpoint_id: str,
        record: dict[str, Any],
        config: RunnableConfig,
        found: dict[str, Any],
    ) -> CheckpointTuple:
        values: dict[str, Any] = {}
        for channel, version in record["versions"].items():
            blob = found.get(self._blob_key(thread_id, ns, channel, version))
            if blob is not None and blob[0] != "empty":
                values[channel] = self.serde.loads_typed((blob[0], blob[1]))
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
    ) -> CheckpointTuple:
        found = await self.state.get_many(self._needed(thread_id, ns, checkpoint_id, record))
        return self._build(thread_id, ns, checkpoint_id, record, config, found)

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
        head = await self.state.get_entry(self._head_key(thread_id, ns))
        if head is None:
            return None
        checkpoint_id = head.value["id"]
        self._remember_head(thread_id, ns, checkpoint_id, head.revision)
        record = await self.state.get(self._cp_key(thread_id, ns, checkpoint_id))
        if record is None:
            return None
        latest = self._config(thread_id, ns, checkpoint_id)
        latest["configurable"][HEAD_GUARD_KEY] = True
        return await self._tuple(thread_id, ns, checkpoint_id, record, latest)

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
                yield self._build(
                    thread,
                    namespace,
                    checkpoint_id,
                    record,
                    self._config(thread, namespace, checkpoint_id),
                    found,
                )
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
        """
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        parent = configurable.get("checkpoint_id")
        guard = configurable.get(HEAD_GUARD_KEY)
        # A snapshot's config, named by id: only update_state's write is checked (see aget_tuple).
        guarded = metadata.get("source") == guard if guard == _UPDATE_ONLY else bool(guard)
        body: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = body.pop("channel_values", {})
        blobs: dict[str, object] = {}
        for channel, version in new_versions.items():
            kind, data = (
                self.serde.dumps_typed(values[channel]) if channel in values else ("empty", b"")
            )
            blobs[self._blob_key(thread_id, ns, channel, version)] = [kind, data]
        kind, data = self.serde.dumps_typed(body)
        full_metadata = get_checkpoint_metadata(config, metadata)
        meta_kind, meta_data = self.serde.dumps_typed(full_metadata)
        checkpoint_id = checkpoint["id"]
        cp_key = self._cp_key(thread_id, ns, checkpoint_id)
        blobs[cp_key] = {
            "type": kind,
            "checkpoint": data,
            "metadata_type": meta_kind,
            "metadata": meta_data,
            "parent": parent,
            "run_id": full_metadata.get("run_id"),
            "versions": {ch: str(v) for ch, v in checkpoint["channel_versions"].items()},
        }
        if self._steps and await self._put_step(
            thread_id, ns, parent, guarded, checkpoint_id, blobs
        ):
            return self._config(thread_id, ns, checkpoint_id)
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
        return self._config(thread_id, ns, checkpoint_id)

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
    ) -> bool:
        """Write a checkpoint's values, its record and the head move as one `transact`.

        Guarded, the step compares the head with the revision this saver last saw it at
        (remembered from `aget_tuple` or the last `aput`, else read now); a lost compare
        returns the head in the same step, and the step is retried on its new revision while
        it still names `parent`. Returns `False` if the backend has no `transact`.

        Raises:
            StaleCheckpointError: The head no longer names `parent`; nothing was written.
            ConflictError: The head was rewritten (still naming `parent`) on every attempt.
        """
        head_key = self._head_key(thread_id, ns)
        then: list[txn.Op] = [txn.Put(key, value, ttl=None) for key, value in blobs.items()]
        then.append(txn.Put(head_key, {"id": checkpoint_id}, ttl=None))
        if not guarded:
            done = await self._transact([], then, [])
            if done is None:
                return False
            self._remember_head(thread_id, ns, checkpoint_id, done.revisions[-1])
            return True
        compare: TxnCompare | None = None
        if parent is None:
            compare = txn.Version(head_key, 0)  # built on no checkpoint: the head is missing
        else:
            known = self._heads.get((thread_id, ns))
            if known is not None and known[0] == parent:
                compare = txn.Revision(head_key, known[1])
        attempts = self.state.config.update_max_attempts
        for attempt in range(attempts):
            if compare is None:
                # Refuse a stale write before building the step (the common lost race).
                entry = await self.state.get_entry(head_key)
                self._check_head(thread_id, ns, parent, entry.value["id"] if entry else None)
                compare = self._compare(head_key, entry)
            done = await self._transact([compare], then, [txn.Get(head_key)])
            if done is None:
                return False
            if done.succeeded:
                self._remember_head(thread_id, ns, checkpoint_id, done.revisions[-1])
                return True
            self._heads.pop((thread_id, ns), None)
            entry = done.results[0]
            self._check_head(thread_id, ns, parent, entry.value["id"] if entry else None)
            # The head still names `parent` but was written again meanwhile: retry on it.
            compare = self._compare(head_key, entry)
            if attempt:
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
        if self._steps and await self._writes_step(key, merge):
            return
        await self.state.update(key, merge, default=[], ttl=None)

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
        await self._delete_keys(await self.state.list_keys(f"{self._tag(str(thread_id))}:*"))

    async def _delete_checkpoints(self, doomed: list[tuple[str, str, str, str]]) -> None:
        """Delete checkpoints with their writes, fix the heads, and drop orphaned values."""
        touched: set[tuple[str, str]] = set()
        for checkpoint_id, thread, ns, key in doomed:
            await self.state.delete(key)
            await self.state.delete(self._writes_key(thread, ns, checkpoint_id))
            touched.add((thread, ns))
        for thread, ns in touched:
            await self._repair(thread, ns)

    async def _repair(self, thread_id: str, ns: str) -> None:
        """Point the head at the newest remaining checkpoint and delete unreferenced values."""
        left = await self._checkpoint_keys(thread_id, ns)
        head_key = self._head_key(thread_id, ns)
        if left:
            await self.state.save(head_key, {"id": left[0][0]}, ttl=None)
        else:
            await self.state.delete(head_key)
        records = await self.state.get_many([item[3] for item in left])
        used = {
            self._blob_key(thread_id, ns, ch, v)
            for record in records.values()
            for ch, v in record["versions"].items()
        }
        blobs = await self.state.list_keys(f"{self._tag(thread_id)}:b:{encode(ns)}:*")
        await self._delete_keys([key for key in blobs if key not in used])

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) that the given runs created."""
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

        Raises:
            InvalidArgumentError: An unknown strategy; nothing was changed.
        """
        if strategy not in {"keep_latest", "delete"}:
            raise InvalidArgumentError(
                f"strategy must be 'keep_latest' or 'delete', not {strategy!r}"
            )
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.adelete_thread(thread_id)
                continue
            heads = {}
            for key in await self.state.list_keys(f"{self._tag(str(thread_id))}:head:*"):
                head = await self.state.get(key)
                if head is not None:
                    heads[decode(key.rsplit(":", 1)[1])] = head["id"]
            doomed = [
                item
                for item in await self._checkpoint_keys(str(thread_id), None)
                if heads.get(item[2], item[0]) != item[0]
            ]
            await self._delete_checkpoints(doomed)

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

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Blocking `aprune` (through `portal`)."""

        async def call() -> None:
            await self.aprune(thread_ids, strategy=strategy)

        self._sync(call)
