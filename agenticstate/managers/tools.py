"""Tool execution state: history, a result cache with single-flight, retries, statistics.

```python
tool_state = ToolStateManager(persistence="redis", cache_results=True, cache_ttl=3600)
await tool_state.start_execution(ToolExecution(execution_id="e1", tool_name="search_web", ...))
await tool_state.complete_execution(execution_id="e1", result={...}, duration_ms=1500)
result = await tool_state.cached_call("search_web", {"query": "AI news"}, search)
stats = await tool_state.get_tool_stats("search_web")
```

Key layout (the tool name sits in a `{...}` hash tag, so one tool's keys share a Redis Cluster
slot):

| Record | Key |
| --- | --- |
| `ToolExecution` | `tools:{<tool>}:executions:<execution_id>` |
| execution id -> tool | `tools:execution-ids:<execution_id>` |
| `ToolCacheEntry` | `tools:{<tool>}:cache:<parameters_hash>` |
| single-flight lock | `tools:{<tool>}:flight:<parameters_hash>` |
| `RetryState` | `tools:retries:<execution_id>` |
| statistics | `tools:{<tool>}:stats` |
| cache-hit counter | sorted index `tools:{<tool>}:counters`, member `cache_hits` |

A cache hit is one atomic step where the backend has `transact` (one command on Redis): the
cached entry is read and the hit counted in the tool's counters index together, and
`get_tool_stats` adds that counter to the statistics record's own `cache_hits` (which stores
written before the index, or backends without `transact`, count in).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import date, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID, uuid4

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agenticstate import _otel, txn
from agenticstate._checks import as_ttl, seconds
from agenticstate._retry import retry_delay
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    RetryExhaustedError,
    SerializationError,
    UnsupportedOperationError,
    UnsupportedTypeError,
)
from agenticstate.managers._base import (
    StateManagerBase,
    TaggedKeys,
    encode_error,
    key_part,
    mapping_argument,
    maybe_await,
    optional_count,
    revise,
    sort_time,
    unstorable,
    utcnow,
)

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.manager import StateManager
    from agenticstate.managers._base import Persistence

__all__ = [
    "RetryState",
    "ToolCacheEntry",
    "ToolExecution",
    "ToolExecutionStatus",
    "ToolStateManager",
    "ToolStats",
    "hash_parameters",
]

T = TypeVar("T")

DURATION_WINDOW = 512
"""Durations kept per tool for the p95 (the average covers every execution)."""

_HITS = "cache_hits"
"""The member of a tool's counters index that counts its cache hits."""


_TAG = "$"
"""Special types canonicalise to one-key dicts whose key is `$` then a letter (`$set`, `$dt`)."""


def _escape_key(key: str) -> str:
    # A user key starting with `$` gets one more: no user dict can then spell a type tag, and
    # the mapping stays one-to-one (`$x` -> `$$x`, `$$x` -> `$$$x`, `x` -> `x`).
    return _TAG + key if key.startswith(_TAG) else key


def _canonical(value: Any, path: str = "$") -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"parameter at {path} is not a finite number")
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(f"parameter keys must be str, found {key!r} at {path}")
            out[_escape_key(key)] = _canonical(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [_canonical(item, f"{path}[]") for item in value]
        return {"$set": sorted(items, key=lambda item: json.dumps(item, sort_keys=True))}
    if isinstance(value, datetime):
        return {"$dt": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, UUID):
        return {"$uuid": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump(mode="json"), path)
    raise UnsupportedTypeError(f"cannot hash a parameter of type {type(value).__name__}", path=path)


_FLAT = frozenset((str, int, bool, type(None)))


def _is_flat(parameters: Mapping[str, Any]) -> bool:
    """Whether `parameters` is its own canonical form (`_canonical` would return it as is).

    The common case: a flat dict of str keys (none starting with `$`) and str, int, bool or
    None values.
    """
    if type(parameters) is not dict:
        return False
    for key, value in parameters.items():
        if type(key) is not str or key.startswith(_TAG) or type(value) not in _FLAT:
            return False
    return True


def hash_parameters(parameters: Mapping[str, Any]) -> str:
    """Return the canonical SHA-256 hash of tool parameters (hex).

    Equal parameters hash equal however they were built: dict key order does not matter,
    integral floats hash like ints (`1.0` like `1`, as JSON would), tuples like lists, sets by
    their sorted members; nested values, datetimes, dates, UUIDs, bytes and pydantic models are
    handled. NaN and infinities are refused.

    Different parameters never share a canonical form: sets, datetimes, dates, UUIDs and bytes
    are written as tagged one-key dicts (`{"$set": [...]}`, `{"$dt": "..."}`), and a dict key
    of your own that starts with `$` is escaped with one more `$`, so no dict, however spelled,
    reads like a tagged value (`{"a": {1, 2}}` and `{"a": {"$set": [1, 2]}}` differ). A pydantic
    model hashes as its JSON dump (like the dict it dumps to).

    Raises:
        InvalidArgumentError: `parameters` is not a mapping, a key is not a str, or a number
            is not finite.
        UnsupportedTypeError: A value has a type that cannot be hashed canonically.
    """
    mapping_argument(parameters, "parameters")
    canonical = parameters if _is_flat(parameters) else _canonical(parameters)
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class ToolExecutionStatus(StrEnum):
    """Where a tool execution is."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_UNFINISHED = frozenset((ToolExecutionStatus.PENDING, ToolExecutionStatus.RUNNING))


def _first_problem(error: ValidationError) -> str:
    """What is wrong with an argument, named by its field (never its value)."""
    first = error.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}"


class ToolExecution(BaseModel):
    """One call of a tool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    execution_id: str = Field(default_factory=lambda: uuid4().hex)
    tool_name: str
    status: ToolExecutionStatus = ToolExecutionStatus.RUNNING
    started_at: datetime = Field(default_factory=utcnow)
    completed_at: datetime | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    result: Any = None
    error: str | None = None
    duration_ms: float | None = None
    cached: bool = False
    """Whether the result came from the cache."""


class ToolCacheEntry(BaseModel):
    """A cached tool result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_name: str
    parameters_hash: str
    """`hash_parameters(parameters)`; `get_cached_result` looks entries up by it."""
    result: Any = None
    created_at: datetime = Field(default_factory=utcnow)
    ttl: float | None = Field(default=None, gt=0)
    """Seconds to keep it (fractions too); None uses the manager's `cache_ttl`."""


class RetryState(BaseModel):
    """A failing execution's retry schedule.

    Timestamps the library computes here are naive local time, like `datetime.now()`, so the
    AgenticAI Framework's `retry.next_retry_at <= datetime.now()` works; ones you pass keep their
    tz-awareness.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    execution_id: str
    attempts: int = Field(default=0, ge=0)
    max_attempts: int = Field(default=3, ge=1)
    last_error: str | None = None
    next_retry_at: datetime | None = None
    backoff_factor: float = Field(default=2.0, ge=1.0)
    base_delay: float = Field(default=1.0, ge=0)
    """Seconds before the first retry."""
    max_delay: float = Field(default=300.0, ge=0)
    """The longest wait between attempts, in seconds."""
    tool_name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def exhausted(self) -> bool:
        """Whether every attempt has been used."""
        return self.attempts >= self.max_attempts


class ToolStats(BaseModel):
    """A tool's counters and rates."""

    model_config = ConfigDict(frozen=True)

    tool_name: str
    total_executions: int = 0
    successful_executions: int = 0
    failed_executions: int = 0
    cancelled_executions: int = 0
    """Executions cancelled while running (counted in `total_executions`, in no rate)."""
    cache_hits: int = 0
    cache_misses: int = 0
    total_duration_ms: float = 0.0
    recent_durations_ms: list[float] = Field(default_factory=list)
    """The last `DURATION_WINDOW` durations, for the p95."""
    last_execution_at: datetime | None = None

    @property
    def success_rate(self) -> float:
        """Successful executions / finished executions (0.0 when none)."""
        finished = self.successful_executions + self.failed_executions
        return self.successful_executions / finished if finished else 0.0

    @property
    def error_rate(self) -> float:
        """Failed executions / finished executions (0.0 when none)."""
        finished = self.successful_executions + self.failed_executions
        return self.failed_executions / finished if finished else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Cache hits / cache lookups (0.0 when none)."""
        lookups = self.cache_hits + self.cache_misses
        return self.cache_hits / lookups if lookups else 0.0

    @property
    def avg_duration_ms(self) -> float:
        """The mean duration of every finished execution with a duration."""
        timed = self.successful_executions + self.failed_executions
        return self.total_duration_ms / timed if timed else 0.0

    @property
    def p95_duration_ms(self) -> float:
        """The 95th percentile of the recent durations (nearest rank)."""
        if not self.recent_durations_ms:
            return 0.0
        ordered = sorted(self.recent_durations_ms)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _cache_ttl(ttl: object) -> float | None:
    """Check a cached result's TTL (seconds or a timedelta) before anything runs."""
    if ttl is None:
        return None
    try:
        life = as_ttl(ttl)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"cached_call: {exc}") from None
    assert life is not None  # noqa: S101  # only None maps to None
    return life.total_seconds()


def recorded(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters as an execution records them: their canonical form (see `hash_parameters`).

    The same as given for the common flat dict; a set, a datetime, bytes... become the tagged
    values they hash as (`{"$set": [...]}`), so what `cached_call` accepts can always be stored.
    """
    if _is_flat(parameters):
        return dict(parameters)
    canonical: dict[str, Any] = _canonical(parameters)
    return canonical


def _naive_now() -> datetime:
    return datetime.now()  # noqa: DTZ005  # see RetryState: the AgenticAI Framework API compares with naive now()


class _Flight:
    __slots__ = ("abandoned", "done", "error", "result")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: Any = None
        self.error: Exception | None = None
        self.abandoned = False
        """The runner was cancelled (or interrupted): its waiters look again themselves."""


class ToolStateManager(StateManagerBase):
    """Tool executions, a result cache, retry schedules and per-tool statistics.

    Args:
        state_manager: Where to store records (or use the shorthand below).
        persistence: `"memory"`, `"file"`, `"sqlite"`, `"redis"` or any registered backend
            name (the AgenticAI Framework shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        cache_results: Whether results are cached at all.
        cache_ttl: Seconds a cached result lives (unless its entry says otherwise).
        history_limit: Executions kept per tool (the oldest go first).
        flight_timeout: How long a single-flight lock outlives a holder that died, in seconds
            (a live holder renews it every third of this while its tool runs).
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
        cache_results: bool = True,
        cache_ttl: float = 3600,
        history_limit: int = 1000,
        flight_timeout: float = 60,
    ) -> None:
        cache_ttl = seconds(cache_ttl, "cache_ttl")
        flight_timeout = seconds(flight_timeout, "flight_timeout")
        if type(history_limit) is not int or history_limit < 1:
            raise InvalidArgumentError("history_limit must be an int >= 1")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.cache_results = cache_results
        self.cache_ttl = cache_ttl
        self.history_limit = history_limit
        self.flight_timeout = flight_timeout
        self._flights: dict[str, _Flight] = {}
        self._owner = uuid4().hex
        self._transact = True
        """Whether the backend has `transact`; False once it raised UnsupportedOperationError."""

    # keys: every key this manager writes is built here (the layout is in the module docstring)

    _keys = TaggedKeys("tools", "tool_name")

    def _execution_key(self, tool_name: str, execution_id: str) -> str:
        return self._keys.key(tool_name, "executions", key_part(execution_id, "execution_id"))

    def _executions_glob(self, tool_name: str) -> str:
        return self._keys.glob(tool_name, "executions", "*")

    @staticmethod
    def _index_key(execution_id: str) -> str:
        return f"tools:execution-ids:{key_part(execution_id, 'execution_id')}"

    def _cache_key(self, tool_name: str, parameters_hash: str) -> str:
        return self._keys.key(tool_name, "cache", key_part(parameters_hash, "parameters_hash"))

    def _flight_key(self, tool_name: str, parameters_hash: str) -> str:
        return self._keys.key(tool_name, "flight", parameters_hash)

    def _cache_and_flight_glob(self, tool_name: str, parameters_hash: str) -> str:
        # One subscription sees both the result arriving and the lock being released.
        return self._keys.glob(tool_name, "*", parameters_hash)

    def _stats_key(self, tool_name: str) -> str:
        return self._keys.key(tool_name, "stats")

    def _counters_index(self, tool_name: str) -> str:
        # A sorted index, not a key: never listed, and in the tool's hash tag like its cache.
        return self._keys.key(tool_name, "counters")

    @staticmethod
    def _retry_key(execution_id: str) -> str:
        return f"tools:retries:{key_part(execution_id, 'execution_id')}"

    # executions

    async def start_execution(self, execution: ToolExecution) -> ToolExecution:
        """Record that an execution started.

        Raises:
            ConflictError: An execution with this id exists already.
            SerializationError: Its parameters or result cannot be stored (the path names
                which); nothing was written.
        """
        if not isinstance(execution, ToolExecution):
            raise InvalidArgumentError("start_execution takes a ToolExecution")
        self._check_record(execution)
        key = self._execution_key(execution.tool_name, execution.execution_id)
        try:
            await self.state.save(
                self._index_key(execution.execution_id), execution.tool_name, expected_version=0
            )
        except ConflictError:
            raise ConflictError(f"execution {execution.execution_id!r} exists already") from None
        await self.state.save(key, execution)
        await self._prune_history(execution.tool_name)
        return execution

    async def get_execution(self, execution_id: str) -> ToolExecution | None:
        """Return one execution, or None."""
        tool_name = await self.state.get(self._index_key(execution_id))
        if tool_name is None:
            return None
        return await self._load(self._execution_key(tool_name, execution_id), ToolExecution)

    async def _finish(
        self, execution_id: str, changes: dict[str, Any], value_path: str | None = None
    ) -> ToolExecution:
        """Finish an execution with `changes`.

        With `value_path` (the change stores a result), an execution that cannot be stored with
        it (the result does not fit, with the parameters, in `max_value_size`) is failed
        instead, and the error is raised after.
        """
        tool_name = await self.state.get(self._index_key(execution_id))
        if tool_name is None:
            raise NotFoundError(f"no execution {execution_id!r}")
        before: list[ToolExecution] = []
        refused: list[SerializationError] = []

        def finish(current: Any) -> Any:
            execution = ToolExecution.model_validate(current)
            if execution.status not in (ToolExecutionStatus.RUNNING, ToolExecutionStatus.PENDING):
                raise ConflictError(
                    f"execution {execution_id!r} is {execution.status.value} already"
                )
            before[:] = [execution]
            duration = changes.get("duration_ms")
            if duration is None:
                elapsed = sort_time(utcnow()) - sort_time(execution.started_at)
                changes["duration_ms"] = max(0.0, elapsed * 1000)
            refused.clear()
            finished = revise(execution, **{**changes, "completed_at": utcnow()})
            if value_path is not None and (error := encode_error(self.state, finished, value_path)):
                refused.append(error)
                failed = {"status": ToolExecutionStatus.FAILED, "error": unstorable(error)}
                finished = revise(
                    execution, **{**changes, **failed, "result": None, "completed_at": utcnow()}
                )
            return finished

        try:
            value = await self.state.update(self._execution_key(tool_name, execution_id), finish)
        except NotFoundError:
            raise NotFoundError(f"no execution {execution_id!r}") from None
        execution = ToolExecution.model_validate(value)
        if execution.status is ToolExecutionStatus.CANCELLED:
            await self._count(tool_name, cancelled=True)
        else:
            await self._count(
                tool_name,
                ok=execution.status is ToolExecutionStatus.COMPLETED,
                duration_ms=execution.duration_ms,
            )
        if refused:
            raise refused[0]
        return execution

    async def complete_execution(
        self, execution_id: str, result: Any = None, duration_ms: float | None = None
    ) -> ToolExecution:
        """Record an execution's result (the duration is measured if not given).

        A result that cannot be stored ends the execution `failed` instead (its `error` names
        the problem and where: `UnsupportedTypeError at $.result`, counted as a failure in the
        statistics), and the error is raised: the execution never stays `running`. That
        includes a result that fits `max_value_size` alone but not in the execution record with
        its parameters (`TooLargeError at $.result`): the whole record is encoded before it is
        written.

        Raises:
            NotFoundError: No such execution.
            ConflictError: It finished already.
            SerializationError: The result cannot be stored; the execution was failed.
        """
        try:
            self._check_value(result, "$.result")
        except SerializationError as exc:
            await self.fail_execution(execution_id, unstorable(exc), duration_ms)
            raise
        return await self._finish(
            execution_id,
            {"status": ToolExecutionStatus.COMPLETED, "result": result, "duration_ms": duration_ms},
            "$.result",
        )

    async def fail_execution(
        self, execution_id: str, error: str, duration_ms: float | None = None
    ) -> ToolExecution:
        """Record that an execution failed.

        Raises:
            NotFoundError: No such execution.
            ConflictError: It finished already.
        """
        return await self._finish(
            execution_id,
            {"status": ToolExecutionStatus.FAILED, "error": error, "duration_ms": duration_ms},
        )

    async def cancel_execution(
        self, execution_id: str, reason: str | None = None, duration_ms: float | None = None
    ) -> ToolExecution:
        """Record that an execution was cancelled before it finished.

        It counts in the tool's `total_executions` and `cancelled_executions`, not in the
        success or error rates.

        Raises:
            NotFoundError: No such execution.
            ConflictError: It finished already.
        """
        return await self._finish(
            execution_id,
            {"status": ToolExecutionStatus.CANCELLED, "error": reason, "duration_ms": duration_ms},
        )

    async def get_execution_history(
        self, tool_name: str, limit: int | None = 100
    ) -> list[ToolExecution]:
        """Return a tool's executions, newest first.

        Raises:
            InvalidArgumentError: `limit` is not an int >= 0 or None.
        """
        optional_count(limit, "limit", minimum=0)
        found = await self._load_many(self._executions_glob(tool_name), ToolExecution)
        found.sort(key=lambda e: sort_time(e.started_at), reverse=True)
        return found[:limit] if limit is not None else found

    async def _prune_history(self, tool_name: str) -> None:
        keys = await self.state.list_keys(self._executions_glob(tool_name))
        # Prune in batches once the history is 10% over its limit, not on every start.
        if len(keys) <= self.history_limit + max(1, self.history_limit // 10):
            return
        history = await self.get_execution_history(tool_name, limit=None)
        for execution in history[self.history_limit :]:
            if execution.status in _UNFINISHED:
                continue  # still under way, however old: its caller will finish it
            await self.state.delete(self._execution_key(tool_name, execution.execution_id))
            await self.state.delete(self._index_key(execution.execution_id))

    async def clear_history(self, tool_name: str, *, include_running: bool = False) -> int:
        """Delete a tool's finished executions, with their execution-id entries.

        Any tool name may be given: one never used has no history, and 0 is returned. The
        statistics, cached results and retry schedules stay (`reset_stats`, `invalidate_cache`,
        `clear_retry_state`).

        Args:
            tool_name: The tool.
            include_running: Also delete executions still running or pending; their
                `complete_execution` / `fail_execution` then raise `NotFoundError`.

        Returns:
            How many executions were deleted.
        """
        deleted = 0
        for execution in await self._load_many(self._executions_glob(tool_name), ToolExecution):
            if not include_running and execution.status in (
                ToolExecutionStatus.RUNNING,
                ToolExecutionStatus.PENDING,
            ):
                continue
            # The id entry first: if this stops halfway, the execution is still found (and
            # deleted) by the next call, and no id entry is left pointing at nothing.
            await self.state.delete(self._index_key(execution.execution_id))
            deleted += await self.state.delete(
                self._execution_key(tool_name, execution.execution_id)
            )
        return deleted

    # statistics

    async def _count(
        self,
        tool_name: str,
        *,
        ok: bool | None = None,
        duration_ms: float | None = None,
        hit: bool | None = None,
        cancelled: bool = False,
    ) -> None:
        def count(current: Any) -> Any:
            stats = ToolStats.model_validate(current)
            changes: dict[str, Any] = {}
            if cancelled:
                changes["total_executions"] = stats.total_executions + 1
                changes["cancelled_executions"] = stats.cancelled_executions + 1
                changes["last_execution_at"] = utcnow()
            if ok is not None:
                changes["total_executions"] = stats.total_executions + 1
                field = "successful_executions" if ok else "failed_executions"
                changes[field] = getattr(stats, field) + 1
                changes["last_execution_at"] = utcnow()
                changes["total_duration_ms"] = stats.total_duration_ms + (duration_ms or 0.0)
                if duration_ms is not None:
                    recent = [*stats.recent_durations_ms, duration_ms]
                    changes["recent_durations_ms"] = recent[-DURATION_WINDOW:]
            if hit is not None:
                field = "cache_hits" if hit else "cache_misses"
                changes[field] = getattr(stats, field) + 1
            return revise(stats, **changes)

        await self.state.update(self._stats_key(tool_name), count, default={"tool_name": tool_name})
        if hit is not None:
            _otel.record_cache_lookup(self.state.backend, hit=hit)

    async def list_tools(self) -> list[str]:
        """Return the names of the tools with any stored record, sorted.

        A tool is listed while it has executions, cached results or statistics (retry
        schedules alone do not list it: they are kept by execution id).
        """
        return await self._keys.ids(self.state, "*")

    async def get_tool_stats(self, tool_name: str) -> ToolStats:
        """Return a tool's statistics (zeros for a tool never used).

        The record and the cache-hit counter are read in one atomic step where the backend has
        `transact`, so the figures are of one moment.
        """
        key = self._stats_key(tool_name)
        counters = self._counters_index(tool_name)
        done = await self._try_transact(
            [], [txn.Get(key, model=ToolStats), txn.IndexRange(counters)]
        )
        if done is not None:
            entry, counted = done.results
            stats = entry.value if entry is not None else None
        else:
            stats = await self._load(key, ToolStats)
            counted = await self.state.index_range(counters)
        stats = stats or ToolStats(tool_name=tool_name)
        hits = int(dict(counted).get(_HITS, 0))
        if hits:
            stats = revise(stats, cache_hits=stats.cache_hits + hits)
        return stats

    async def reset_stats(self, tool_name: str) -> bool:
        """Delete a tool's statistics; return whether it had any.

        `get_tool_stats` returns zeros until the tool's next execution or cache lookup starts
        counting again. Any tool name may be given: one never used has nothing to reset.
        """
        key = self._stats_key(tool_name)
        counters = self._counters_index(tool_name)
        done = await self._try_transact([], [txn.Delete(key), txn.IndexRemove(counters, [_HITS])])
        if done is not None:
            deleted, removed = done.results
        else:
            deleted = await self.state.delete(key)
            removed = await self.state.index_remove(counters, [_HITS])
        return bool(deleted or removed)

    async def _try_transact(
        self,
        compare: list[txn.Version | txn.Exists],
        then: list[txn.Op],
    ) -> txn.TransactResult | None:
        """`state.transact(compare, then)`, or None if the backend has none (asked only once)."""
        if not self._transact:
            return None
        try:
            return await self.state.transact(compare, then)
        except UnsupportedOperationError:
            self._transact = False
            return None

    async def _count_hit(self, tool_name: str) -> None:
        """Count a cache hit: one index increment (or a statistics update without `transact`)."""
        counters = self._counters_index(tool_name)
        if await self._try_transact([], [txn.IndexIncr(counters, _HITS, 1)]) is None:
            await self._count(tool_name, hit=True)
            return
        _otel.record_cache_lookup(self.state.backend, hit=True)

    async def _lookup_counted(self, tool_name: str, digest: str) -> ToolCacheEntry | None:
        """Look a result up and count a hit if it is there: one atomic step with `transact`."""
        key = self._cache_key(tool_name, digest)
        counters = self._counters_index(tool_name)
        done = await self._try_transact(
            [txn.Exists(key)],
            [txn.Get(key, model=ToolCacheEntry), txn.IndexIncr(counters, _HITS, 1)],
        )
        if done is None:
            cached = await self._lookup(tool_name, digest)
            if cached is not None:
                await self._count(tool_name, hit=True)
            return cached
        if not done.succeeded:
            return None
        _otel.record_cache_lookup(self.state.backend, hit=True)
        found: ToolCacheEntry = done.results[0].value
        return found

    # the cache

    async def cache_result(self, entry: ToolCacheEntry) -> ToolCacheEntry | None:
        """Store a result in the cache (no-op, returning None, when caching is off)."""
        if not isinstance(entry, ToolCacheEntry):
            raise InvalidArgumentError("cache_result takes a ToolCacheEntry")
        if not self.cache_results:
            return None
        self._check_record(entry)
        ttl = entry.ttl if entry.ttl is not None else self.cache_ttl
        await self.state.save(
            self._cache_key(entry.tool_name, entry.parameters_hash), entry, ttl=ttl
        )
        return entry

    async def get_cached_result(
        self, tool_name: str, parameters: Mapping[str, Any]
    ) -> ToolCacheEntry | None:
        """Return the cached entry for these parameters, or None (counted as a hit or a miss)."""
        if not self.cache_results:
            return None
        entry = await self._lookup_counted(tool_name, hash_parameters(parameters))
        if entry is None:
            await self._count(tool_name, hit=False)
        return entry

    async def _lookup(self, tool_name: str, digest: str) -> ToolCacheEntry | None:
        return await self._load(self._cache_key(tool_name, digest), ToolCacheEntry)

    async def invalidate_cache(
        self, tool_name: str, parameters: Mapping[str, Any] | None = None
    ) -> int:
        """Drop one cached result (for `parameters`) or all of a tool's; return how many."""
        if parameters is not None:
            return int(
                await self.state.delete(self._cache_key(tool_name, hash_parameters(parameters)))
            )
        dropped = 0
        for key in await self.state.list_keys(self._keys.glob(tool_name, "cache", "*")):
            dropped += await self.state.delete(key)
        return dropped

    async def cached_call(
        self,
        tool_name: str,
        parameters: Mapping[str, Any],
        fn: Callable[[], Awaitable[T]],
        *,
        ttl: float | timedelta | None = None,
    ) -> T:
        """Return the cached result, or run `fn()` once and cache what it returns.

        Each call counts once in the statistics: a cache hit when it is served from the cache or
        by another caller's run, a miss when it runs the tool.

        Single-flight: concurrent identical calls (same tool, same parameter hash) run `fn` once;
        the others wait for its result. In one process they wait on an event; across processes
        they take a lock key with compare-and-set and the others watch the cache key and the
        lock for the result. Each run is recorded as an execution; waiters count as cache hits.

        When the run does not produce a result, its waiters learn of it at once:

        - `fn` raised: the callers waiting in this process get the same exception; callers in
          other processes see the lock released without a result, and one of them runs `fn`
          itself (then the next, if that one fails too).
        - the caller running `fn` was cancelled: its execution is recorded `cancelled`, and one
          of its waiters (in this process or another) runs `fn` instead. No waiter inherits
          another task's cancellation.
        - its process died: its lock expires after `flight_timeout`, then another caller runs it.

        A live caller running `fn` renews its lock every third of `flight_timeout`, so `fn` may
        run for as long as it needs and still runs once: `flight_timeout` bounds only how long
        the lock of a caller that died outlives it. `fn` must not block the event loop (run
        blocking work in a thread): a blocked loop cannot renew.

        Args:
            tool_name: The tool.
            parameters: Its parameters (hashed canonically, see `hash_parameters`).
            fn: Runs the tool.
            ttl: Seconds (fractions too) or a timedelta to keep the result; None uses
                `cache_ttl`. Checked before anything runs.

        Raises:
            InvalidArgumentError: `ttl` is not a positive number of seconds or timedelta.
            Exception: Whatever `fn` raised (also in the callers waiting in this process).
        """
        mapping_argument(parameters, "parameters")
        life = _cache_ttl(ttl)
        digest = hash_parameters(parameters)
        if not self.cache_results:
            return await self._execute(tool_name, parameters, fn)
        flight_id = f"{tool_name}\x00{digest}"
        while True:
            # Each call counts once: a hit if served from the cache or another caller's run, a
            # miss if it runs the tool itself.
            cached = await self._lookup_counted(tool_name, digest)
            if cached is not None:
                return cached.result  # type: ignore[no-any-return]
            flight = self._flights.get(flight_id)
            if flight is None:
                break
            await flight.done.wait()
            if flight.abandoned:
                continue  # its runner was cancelled: look again, and run it if nobody has
            if flight.error is not None:
                raise flight.error
            await self._count_hit(tool_name)
            return flight.result  # type: ignore[no-any-return]
        flight = self._flights[flight_id] = _Flight()
        try:
            flight.result = await self._fly(tool_name, parameters, digest, fn, life)
        except Exception as exc:
            flight.error = exc
            raise
        except BaseException:
            # Cancellation belongs to this task alone: the waiters must not inherit it.
            flight.abandoned = True
            raise
        finally:
            del self._flights[flight_id]
            flight.done.set()
        return flight.result  # type: ignore[no-any-return]

    async def _fly(
        self,
        tool_name: str,
        parameters: Mapping[str, Any],
        digest: str,
        fn: Callable[[], Awaitable[T]],
        ttl: float | None,
    ) -> T:
        lock = self._flight_key(tool_name, digest)
        cache = self._cache_key(tool_name, digest)
        both = self._cache_and_flight_glob(tool_name, digest)
        while True:
            async with self.state.watch(both) as changes:
                try:
                    held = await self._take_lock(lock)
                except ConflictError:
                    # Another process is computing it: wait for its result to be cached, or for
                    # its lock to be released without one (its fn raised or it was cancelled)
                    # or to run out (it died); then try again ourselves.
                    entry = await self._lookup_counted(tool_name, digest)
                    if entry is not None:
                        return entry.result  # type: ignore[no-any-return]
                    self.log.debug("tool_call_waiting", tool=tool_name)
                    with anyio.move_on_after(self.flight_timeout):
                        async for change in changes:
                            if change.key == cache and change.new_value is not None:
                                await self._count_hit(tool_name)
                                return ToolCacheEntry.model_validate(change.new_value).result  # type: ignore[no-any-return]
                            if change.key == lock and change.new_value is None:
                                break
                    continue
            token = [held]
            try:
                # Look once more now that the lock is ours: a holder caches its result before it
                # releases the lock, so a result cached after our first lookup (or a release seen
                # before the result) is found here and the tool never runs twice.
                entry = await self._lookup_counted(tool_name, digest)
                if entry is not None:
                    return entry.result  # type: ignore[no-any-return]
                await self._count(tool_name, hit=False)
                failure: Exception | None = None
                async with anyio.create_task_group() as renewals:
                    # A live holder keeps its lock however long `fn` runs: `flight_timeout`
                    # bounds only how long a dead holder's lock outlives it.
                    renewals.start_soon(self._keep_lock, tool_name, lock, token)
                    try:
                        result = await self._execute(tool_name, parameters, fn)
                        await self.cache_result(
                            ToolCacheEntry(
                                tool_name=tool_name, parameters_hash=digest, result=result, ttl=ttl
                            )
                        )
                    except Exception as exc:  # noqa: BLE001  # raised below, as it is
                        # Out of the task group first: it would wrap the error in a group.
                        failure = exc
                    finally:
                        renewals.cancel_scope.cancel()
                if failure is not None:
                    raise failure
                return result
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(ConflictError):
                    # Only our own lock: if it ran out and another caller took it, it is theirs.
                    await self.state.delete(lock, **token[0])

    async def _take_lock(self, lock: str) -> dict[str, int]:
        """Take the single-flight lock `lock`; return the condition that releases it.

        The condition names the lock's revision where the backend keeps revisions (a lock
        that ran out and was taken by another caller is at version 1 again, never at the same
        revision), else its version.

        Raises:
            ConflictError: Another caller holds it.
        """
        if self.state.backend.has_revisions:
            try:
                done = await self.state.transact(
                    [txn.Revision(lock, 0)], [txn.Put(lock, self._owner, ttl=self.flight_timeout)]
                )
            except UnsupportedOperationError:
                pass
            else:
                if not done.succeeded:
                    raise ConflictError(f"the single-flight lock {lock!r} is held", key=lock)
                return {"expected_revision": done.revisions[0]}
        version = await self.state.save(
            lock, self._owner, ttl=self.flight_timeout, expected_version=0
        )
        return {"expected_version": version}

    async def _keep_lock(self, tool_name: str, lock: str, token: list[dict[str, int]]) -> None:
        """Renew a held single-flight lock every third of `flight_timeout` until cancelled.

        `token[0]` is the condition the lock is held under (its revision, or its version where
        the backend keeps no revisions), replaced at each renewal (the release needs the
        latest). A renewal that finds the lock no longer ours (it lapsed, then another caller
        took it: this process stalled for over `flight_timeout`) stops renewing; that caller
        may then run the tool too.
        """
        while True:
            await anyio.sleep(self.flight_timeout / 3)  # the renewal period, not a wait on state
            try:
                token[0] = await self._renew_lock(lock, token[0])
            except ConflictError:
                self.log.warning("tool_call_lock_lost", tool=tool_name)
                return
            except Exception as exc:  # noqa: BLE001  # the next period tries again
                # A failed renewal (the store unreachable) must not stop the tool's run.
                self.log.warning(
                    "tool_call_lock_renewal_failed", tool=tool_name, error=type(exc).__name__
                )

    async def _renew_lock(self, lock: str, held: dict[str, int]) -> dict[str, int]:
        """Extend the lock held under `held` by `flight_timeout`; return its new condition.

        Raises:
            ConflictError: The lock is no longer held under `held`.
        """
        if "expected_revision" in held:
            done = await self.state.transact(
                [txn.Revision(lock, held["expected_revision"])],
                [txn.Put(lock, self._owner, ttl=self.flight_timeout)],
            )
            if not done.succeeded:
                raise ConflictError(f"the single-flight lock {lock!r} is no longer ours", key=lock)
            return {"expected_revision": done.revisions[0]}
        version = await self.state.save(lock, self._owner, ttl=self.flight_timeout, **held)
        return {"expected_version": version}

    async def _execute(
        self, tool_name: str, parameters: Mapping[str, Any], fn: Callable[[], Awaitable[T]]
    ) -> T:
        """Run `fn()` as a recorded execution: it ends completed, failed or cancelled.

        Recording the outcome is shielded from cancellation, and a cancellation that arrives
        while the start is being recorded cancels the record, so no execution is ever left
        `running` by a cancelled caller.
        """
        execution = ToolExecution(tool_name=tool_name, parameters=recorded(parameters))
        execution_id = execution.execution_id
        clock = time.perf_counter()

        def elapsed_ms() -> float:
            return (time.perf_counter() - clock) * 1000

        try:
            await self.start_execution(execution)
        except Exception:
            raise
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._cancel_started(execution_id, type(exc).__name__, elapsed_ms())
            raise
        try:
            # A plain function that returned has succeeded: its value is the result.
            result: T = await maybe_await(fn())
        except Exception as exc:
            with anyio.CancelScope(shield=True):
                await self.fail_execution(execution_id, type(exc).__name__, elapsed_ms())
            raise
        except BaseException as exc:
            # Cancelled (or interrupted): record it as such, even inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await self.cancel_execution(execution_id, type(exc).__name__, elapsed_ms())
            raise
        with anyio.CancelScope(shield=True):
            await self.complete_execution(execution_id, result, elapsed_ms())
        return result

    async def _cancel_started(self, execution_id: str, reason: str, duration_ms: float) -> None:
        """End an execution whose start was being recorded when its caller was cancelled."""
        try:
            await self.cancel_execution(execution_id, reason, duration_ms)
        except NotFoundError:
            # Cancelled between the id entry and the record: drop the entry left pointing at
            # nothing.
            await self.state.delete(self._index_key(execution_id))

    # retries

    async def update_retry_state(self, retry: RetryState) -> RetryState:
        """Store a retry schedule (replacing the one for the same execution)."""
        if not isinstance(retry, RetryState):
            raise InvalidArgumentError("update_retry_state takes a RetryState")
        self._check_record(retry)
        await self.state.save(self._retry_key(retry.execution_id), retry)
        _otel.record_retry(self.state.backend, "tool")
        return retry

    async def get_retry_state(self, execution_id: str) -> RetryState | None:
        """Return an execution's retry schedule, or None."""
        return await self._load(self._retry_key(execution_id), RetryState)

    async def clear_retry_state(self, execution_id: str) -> bool:
        """Forget an execution's retry schedule; return whether there was one."""
        return await self.state.delete(self._retry_key(execution_id))

    async def get_pending_retries(
        self, *, due_only: bool = True, now: datetime | None = None
    ) -> list[RetryState]:
        """Return retry schedules with attempts left, ordered by `next_retry_at`.

        Args:
            due_only: Only those whose `next_retry_at` has come (naive and aware timestamps are
                compared as instants).
            now: The moment to compare with (default: now).
        """
        moment = sort_time(now) if now is not None else time.time()
        found = await self._load_many("tools:retries:*", RetryState)
        pending = [
            retry
            for retry in found
            if not retry.exhausted
            and (
                not due_only
                or retry.next_retry_at is None
                or sort_time(retry.next_retry_at) <= moment
            )
        ]
        return sorted(
            pending,
            key=lambda r: sort_time(r.next_retry_at) if r.next_retry_at is not None else 0.0,
        )

    @staticmethod
    def next_delay(retry: RetryState, *, jitter: bool = True) -> float:
        """Return the wait, in seconds, before the next attempt after `retry.attempts` failures.

        Exponential: `base_delay * backoff_factor ** (attempts - 1)`, capped at `max_delay`, with
        "equal jitter" (a uniform draw between half and all of it) so retrying callers spread out.
        """
        delay = retry_delay(
            retry.attempts - 1,
            base=retry.base_delay,
            cap=retry.max_delay,
            factor=retry.backoff_factor,
        )
        if jitter:
            delay = random.uniform(delay / 2, delay)  # noqa: S311  # jitter, not crypto
        return delay

    async def run_with_retries(
        self,
        execution_id: str,
        tool_name: str,
        parameters: Mapping[str, Any],
        fn: Callable[[], Awaitable[T]],
        *,
        max_attempts: int = 3,
        backoff_factor: float = 2.0,
        base_delay: float = 1.0,
        max_delay: float = 300.0,
        jitter: bool = True,
    ) -> T:
        """Run `fn()` until it succeeds, waiting with exponential backoff between attempts.

        The schedule is stored under `execution_id` after every failure, so a restarted process
        calling this again continues it: it waits for the stored `next_retry_at` and counts the
        attempts already made. Success clears the schedule; each attempt is recorded as an
        execution of the tool.

        Raises:
            InvalidArgumentError: `base_delay` or `max_delay` is not a number of seconds >= 0,
                or a parameter cannot be hashed (see `hash_parameters`).
            RetryExhaustedError: Every attempt failed (from the last exception).
            SerializationError: The tool's result cannot be stored: its execution is recorded
                failed and no attempt follows (the schedule is cleared).
        """
        base_delay = seconds(base_delay, "base_delay", zero=True)
        max_delay = seconds(max_delay, "max_delay", zero=True)
        mapping_argument(parameters, "parameters")
        if type(max_attempts) is not int:
            raise InvalidArgumentError(f"max_attempts must be an int >= 1, not {max_attempts!r}")
        if isinstance(backoff_factor, bool) or not isinstance(backoff_factor, int | float):
            raise InvalidArgumentError(
                f"backoff_factor must be a number >= 1, not {backoff_factor!r}"
            )
        try:  # checked before anything runs, even when a stored schedule is resumed
            fresh = RetryState(
                execution_id=execution_id,
                max_attempts=max_attempts,
                backoff_factor=backoff_factor,
                base_delay=base_delay,
                max_delay=max_delay,
                tool_name=tool_name,
                parameters=recorded(parameters),
            )
        except ValidationError as exc:
            raise InvalidArgumentError(_first_problem(exc)) from None
        retry = await self.get_retry_state(execution_id) or fresh
        while True:
            if retry.exhausted:
                raise RetryExhaustedError(
                    f"execution {execution_id!r} failed {retry.attempts} times: {retry.last_error}"
                )
            if retry.next_retry_at is not None:
                wait = sort_time(retry.next_retry_at) - time.time()
                if wait > 0:
                    await anyio.sleep(wait)  # the backoff itself
            try:
                result = await self._execute(tool_name, parameters, fn)
            except SerializationError:
                # The tool ran but its result cannot be stored: not a failure to retry. The
                # execution is recorded failed; the schedule ends with it.
                await self.clear_retry_state(execution_id)
                raise
            except Exception as exc:
                attempts = retry.attempts + 1
                retry = revise(retry, attempts=attempts, last_error=type(exc).__name__)
                delay = self.next_delay(retry, jitter=jitter)
                retry = revise(retry, next_retry_at=_naive_now() + timedelta(seconds=delay))
                await self.update_retry_state(retry)
                self.log.warning(
                    "tool_retry_scheduled",
                    tool=tool_name,
                    execution_id=execution_id,
                    attempt=attempts,
                    delay=round(delay, 3),
                )
                if retry.exhausted:
                    raise RetryExhaustedError(
                        f"execution {execution_id!r} failed {attempts} times"
                    ) from exc
                continue
            await self.clear_retry_state(execution_id)
            return result
