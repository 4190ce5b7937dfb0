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

import random
from typing import TYPE_CHECKING, Any, TypeVar, cast

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

from agenticstate.exceptions import ConfigurationError, InvalidArgumentError
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
        self, thread_id: str | None, ns: str | None
    ) -> list[tuple[str, str, str, str]]:
        """Return `(checkpoint_id, thread_id, ns, key)` of matching checkpoints, newest first."""
        if thread_id is None:
            pattern = f"{self.prefix}:{{*}}:cp:*"
        elif ns is None:
            pattern = f"{self._tag(thread_id)}:cp:*"
        else:
            pattern = f"{self._tag(thread_id)}:cp:{encode(ns)}:*"
        found = []
        for key in await self.state.list_keys(pattern):
            thread, namespace, checkpoint_id = self._parse(key)
            found.append((checkpoint_id, thread, namespace, key))
        found.sort(key=lambda item: (item[0], item[1], item[2]), reverse=True)
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
        head = await self.state.get(self._head_key(thread_id, ns))
        if head is None:
            return None
        checkpoint_id = head["id"]
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
        keys = [
            item
            for item in await self._checkpoint_keys(thread_id, ns)
            if (only is None or item[0] == only) and (before_id is None or item[0] < before_id)
        ]
        if limit is not None and limit <= 0:
            return
        left = limit
        for start in range(0, len(keys), _PAGE):
            page = keys[start : start + _PAGE]
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
        head_key = self._head_key(thread_id, ns)
        if guarded:
            # Refuse a stale write before writing anything (the common case of a lost race);
            # the compare-and-set below closes the window between this read and the write.
            head = await self.state.get(head_key)
            self._check_head(thread_id, ns, parent, head["id"] if head else None)
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

        await self.state.update(
            self._writes_key(thread_id, ns, checkpoint_id), merge, default=[], ttl=None
        )

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
