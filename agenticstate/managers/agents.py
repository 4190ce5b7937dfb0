"""Agent snapshots, checkpoints and recovery.

```python
agent_store = AgentStateStore(persistence="redis", redis_url="redis://localhost:6379")
await agent_store.save_snapshot(AgentSnapshot(agent_id="researcher_01", memory_state={...}))
await agent_store.save_checkpoint(AgentCheckpoint(agent_id="researcher_01", checkpoint_id="s5",
                                                  step=5, state={...}))
recovery = AgentRecoveryManager(agent_store=agent_store, max_recovery_attempts=3)
recovery.register(agent)
await recovery.recover(agent_id="researcher_01", from_checkpoint="latest")
```

Key layout (the agent id sits in a `{...}` hash tag, so one agent's keys share a Redis Cluster
slot): `agents:{<agent_id>}:snapshots:<snapshot_id>`, `agents:{<agent_id>}:checkpoints:<id>`,
`agents:{<agent_id>}:recovery`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, runtime_checkable
from uuid import uuid4

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agenticstate._checks import duration, positive_timedelta, wrong_object
from agenticstate.exceptions import (
    ConfigurationError,
    InvalidArgumentError,
    NotFoundError,
    RetryExhaustedError,
)
from agenticstate.managers._base import (
    StateManagerBase,
    TaggedKeys,
    maybe_await,
    optional_count,
    revise,
    sort_time,
    utcnow,
)

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.manager import StateManager
    from agenticstate.managers._base import Persistence

__all__ = [
    "AgentCheckpoint",
    "AgentRecoveryManager",
    "AgentSnapshot",
    "AgentStateStore",
    "RecoverableAgent",
    "RecoveryEvent",
    "RecoveryHook",
    "RecoveryRecord",
]

T = TypeVar("T")
P = ParamSpec("P")


def _new_id() -> str:
    return uuid4().hex


class AgentSnapshot(BaseModel):
    """A picture of an agent's whole state at one moment.

    Timestamps keep the tz-awareness they were given (`datetime.now()` stays naive); generated
    ones are aware UTC.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    """The agent."""
    timestamp: datetime = Field(default_factory=utcnow)
    """When the snapshot was taken."""
    snapshot_id: str = Field(default_factory=_new_id)
    """Unique per agent; generated when not given."""
    step: int | None = None
    """The agent's step counter, when it has one (breaks ties between equal timestamps)."""
    memory_state: Any = None
    """What the agent's memory exported."""
    tool_state: Any = None
    """The state of the agent's tools."""
    conversation_history: list[Any] = Field(default_factory=list)
    """The conversation so far."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything else worth keeping."""


class AgentCheckpoint(BaseModel):
    """A point a long-running agent task can resume from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    """The agent."""
    checkpoint_id: str = Field(default_factory=_new_id)
    """Unique per agent; generated when not given."""
    step: int = 0
    """The task step the checkpoint was taken at."""
    state: dict[str, Any] = Field(default_factory=dict)
    """What `restore_from_checkpoint(state)` receives."""
    recoverable: bool = True
    """Whether recovery may use this checkpoint."""
    timestamp: datetime = Field(default_factory=utcnow)
    """When the checkpoint was taken."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything else worth keeping."""


class RecoveryRecord(BaseModel):
    """An agent's recovery attempts, kept in the store so a restarted process sees them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    attempts: int = 0
    """Recovery attempts since the agent last ran successfully (or was reset)."""
    last_attempt_at: datetime | None = None
    last_checkpoint_id: str | None = None
    """The checkpoint the last attempt used."""
    last_error: str | None = None
    """The exception type of the last failed attempt (never its message: it may hold data)."""
    recovered_at: datetime | None = None
    """When the last successful recovery finished."""


class RecoveryEvent(BaseModel):
    """What recovery hooks receive."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    agent_id: str
    attempt: int
    """1 for the first attempt since the agent last ran successfully."""
    checkpoint: AgentCheckpoint | None = None
    """The checkpoint being restored (None if none was found)."""
    error: BaseException | None = None
    """For the failed hook: why recovery failed."""


RecoveryHook = Callable[[RecoveryEvent], "Awaitable[None] | None"]
"""A recovery hook: `hook(event)`, sync or async."""


@runtime_checkable
class RecoverableAgent(Protocol):
    """What `AgentRecoveryManager.register` needs: an id and a way to restore state.

    The id is read from `agent.id`, else `agent.agent_id`. `restore_from_checkpoint` may be sync
    or async.
    """

    def restore_from_checkpoint(self, state: dict[str, Any]) -> Any:
        """Load `state` (an `AgentCheckpoint.state`) into the agent."""


class AgentStateStore(StateManagerBase):
    """Snapshots and checkpoints per agent, listed newest first, with retention.

    Args:
        state_manager: Where to store records (see `StateManagerBase` for the shorthand).
        persistence: `"memory"`, `"file"`, `"sqlite"`, `"redis"` or any registered backend
            name (the AgenticAI Framework shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        max_snapshots: Keep at most this many snapshots per agent (the newest).
        max_checkpoints: Keep at most this many checkpoints per agent (the newest).
        max_age: Drop snapshots and checkpoints older than this (they also get it as their TTL).
            An agent's recovery record gets it as its TTL too, renewed by every recovery
            attempt and `reset_attempts`.
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
        max_snapshots: int | None = None,
        max_checkpoints: int | None = None,
        max_age: timedelta | None = None,
    ) -> None:
        for name, limit in (("max_snapshots", max_snapshots), ("max_checkpoints", max_checkpoints)):
            if limit is not None and (type(limit) is not int or limit < 1):
                raise InvalidArgumentError(f"{name} must be an int >= 1 or None, not {limit!r}")
        positive_timedelta(max_age, "max_age")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.max_snapshots = max_snapshots
        self.max_checkpoints = max_checkpoints
        self.max_age = max_age

    # keys: every key this manager writes is built here (the layout is in the module docstring)

    _keys = TaggedKeys("agents", "agent_id")

    @staticmethod
    def _key(agent_id: str, kind: str, item_id: str) -> str:
        return AgentStateStore._keys.key(agent_id, kind, item_id)

    @staticmethod
    def _pattern(agent_id: str, kind: str) -> str:
        return AgentStateStore._keys.glob(agent_id, kind, "*")

    @staticmethod
    def _recovery_key(agent_id: str) -> str:
        return AgentStateStore._keys.key(agent_id, "recovery")

    def _recovery_ttl(self) -> dict[str, Any]:
        # Without max_age the record keeps the store's default TTL, as it always did.
        return {"ttl": self.max_age} if self.max_age is not None else {}

    # snapshots

    async def save_snapshot(self, snapshot: AgentSnapshot) -> AgentSnapshot:
        """Store a snapshot (replacing one with the same id) and apply retention."""
        if not isinstance(snapshot, AgentSnapshot):
            raise InvalidArgumentError("save_snapshot takes an AgentSnapshot")
        self._check_record(snapshot)
        key = self._key(snapshot.agent_id, "snapshots", snapshot.snapshot_id)
        await self.state.save(key, snapshot, ttl=self.max_age)
        await self._prune(snapshot.agent_id, "snapshots", AgentSnapshot, self.max_snapshots)
        return snapshot

    async def get_snapshot(self, agent_id: str, snapshot_id: str) -> AgentSnapshot | None:
        """Return one snapshot, or None."""
        return await self._load(self._key(agent_id, "snapshots", snapshot_id), AgentSnapshot)

    async def list_snapshots(self, agent_id: str, limit: int | None = None) -> list[AgentSnapshot]:
        """Return the agent's snapshots, newest first (by time, then step).

        Raises:
            InvalidArgumentError: `limit` is not an int >= 0 or None.
        """
        optional_count(limit, "limit", minimum=0)
        found = await self._load_many(self._pattern(agent_id, "snapshots"), AgentSnapshot)
        found.sort(key=lambda s: (sort_time(s.timestamp), s.step or 0), reverse=True)
        return found[:limit] if limit is not None else found

    async def get_latest_snapshot(self, agent_id: str) -> AgentSnapshot | None:
        """Return the newest snapshot, or None."""
        snapshots = await self.list_snapshots(agent_id, limit=1)
        return snapshots[0] if snapshots else None

    async def delete_snapshot(self, agent_id: str, snapshot_id: str) -> bool:
        """Delete one snapshot; return whether it existed."""
        return await self.state.delete(self._key(agent_id, "snapshots", snapshot_id))

    # checkpoints

    async def save_checkpoint(self, checkpoint: AgentCheckpoint) -> AgentCheckpoint:
        """Store a checkpoint (replacing one with the same id) and apply retention."""
        if not isinstance(checkpoint, AgentCheckpoint):
            raise InvalidArgumentError("save_checkpoint takes an AgentCheckpoint")
        self._check_record(checkpoint)
        key = self._key(checkpoint.agent_id, "checkpoints", checkpoint.checkpoint_id)
        await self.state.save(key, checkpoint, ttl=self.max_age)
        await self._prune(checkpoint.agent_id, "checkpoints", AgentCheckpoint, self.max_checkpoints)
        return checkpoint

    async def get_checkpoint(self, agent_id: str, checkpoint_id: str) -> AgentCheckpoint | None:
        """Return one checkpoint, or None."""
        return await self._load(self._key(agent_id, "checkpoints", checkpoint_id), AgentCheckpoint)

    async def list_checkpoints(
        self, agent_id: str, limit: int | None = None, *, recoverable_only: bool = False
    ) -> list[AgentCheckpoint]:
        """Return the agent's checkpoints, newest first (by time, then step).

        Raises:
            InvalidArgumentError: `limit` is not an int >= 0 or None.
        """
        optional_count(limit, "limit", minimum=0)
        found = await self._load_many(self._pattern(agent_id, "checkpoints"), AgentCheckpoint)
        if recoverable_only:
            found = [checkpoint for checkpoint in found if checkpoint.recoverable]
        found.sort(key=lambda c: (sort_time(c.timestamp), c.step), reverse=True)
        return found[:limit] if limit is not None else found

    async def get_latest_checkpoint(
        self, agent_id: str, *, recoverable_only: bool = True
    ) -> AgentCheckpoint | None:
        """Return the newest (recoverable) checkpoint, or None."""
        found = await self.list_checkpoints(agent_id, 1, recoverable_only=recoverable_only)
        return found[0] if found else None

    async def delete_checkpoint(self, agent_id: str, checkpoint_id: str) -> bool:
        """Delete one checkpoint; return whether it existed."""
        return await self.state.delete(self._key(agent_id, "checkpoints", checkpoint_id))

    async def list_agents(self) -> list[str]:
        """Return the ids of agents with any stored state, sorted."""
        return await self._keys.ids(self.state, "*")

    async def delete_agent(self, agent_id: str) -> int:
        """Delete every snapshot, checkpoint and recovery record of an agent; return how many."""
        deleted = 0
        for key in await self.state.list_keys(self._keys.glob(agent_id, "*")):
            deleted += await self.state.delete(key)
        return deleted

    async def _prune(
        self,
        agent_id: str,
        kind: str,
        model: type[AgentSnapshot] | type[AgentCheckpoint],
        keep: int | None,
    ) -> None:
        if keep is None and self.max_age is None:
            return
        items: list[Any] = await self._load_many(self._pattern(agent_id, kind), model)
        items.sort(key=lambda item: (sort_time(item.timestamp), item.step or 0), reverse=True)
        doomed = items[keep:] if keep is not None else []
        if self.max_age is not None:
            oldest = sort_time(utcnow() - self.max_age)
            doomed += [item for item in items[:keep] if sort_time(item.timestamp) < oldest]
        for item in doomed:
            item_id = item.snapshot_id if kind == "snapshots" else item.checkpoint_id
            await self.state.delete(self._key(agent_id, kind, item_id))
        if doomed:
            self.log.debug("retention_pruned", agent_id=agent_id, kind=kind, count=len(doomed))


def _agent_id(agent: object) -> str:
    for attribute in ("id", "agent_id"):
        value = getattr(agent, attribute, None)
        if isinstance(value, str) and value:
            return value
    raise InvalidArgumentError("an agent needs a str `id` (or `agent_id`) to be registered")


class AgentRecoveryManager:
    """Restore agents from their checkpoints, counting attempts in the store.

    Args:
        agent_store: Where checkpoints and recovery records live.
        auto_recover: Whether `run()` / `guard()` recover and retry a failed job.
        max_recovery_attempts: Attempts allowed since the agent last ran successfully; the next
            one raises `RetryExhaustedError`. Attempts are stored, so a restarted process sees
            the earlier ones.
        retry_delay: How long `run()` waits after a recovery before running the job again.
    """

    def __init__(
        self,
        agent_store: AgentStateStore,
        auto_recover: bool = True,
        max_recovery_attempts: int = 3,
        *,
        retry_delay: timedelta = timedelta(0),
    ) -> None:
        if not isinstance(agent_store, AgentStateStore):
            raise ConfigurationError(
                wrong_object(
                    agent_store,
                    parameter="agent_store",
                    expected="agenticstate.AgentStateStore",
                    owner="AgentRecoveryManager",
                )
            )
        if type(max_recovery_attempts) is not int or max_recovery_attempts < 1:
            raise InvalidArgumentError("max_recovery_attempts must be an int >= 1")
        self.agent_store = agent_store
        self.auto_recover = auto_recover
        self.max_recovery_attempts = max_recovery_attempts
        self.retry_delay = duration(retry_delay, "retry_delay", zero=True, optional=False)
        self._agents: dict[str, Any] = {}
        self._before: list[RecoveryHook] = []
        self._after: list[RecoveryHook] = []
        self._failed: list[RecoveryHook] = []
        self._log = agent_store.log.bind(component="recovery")
        self.hook_failures = 0
        """How many times a recovery hook raised (each is logged as `recovery_hook_failed`)."""

    def register(self, agent: Any) -> None:
        """Make `agent` recoverable by its id (`agent.id`, else `agent.agent_id`)."""
        if not callable(getattr(agent, "restore_from_checkpoint", None)):
            raise InvalidArgumentError("a recoverable agent needs restore_from_checkpoint(state)")
        self._agents[_agent_id(agent)] = agent

    def unregister(self, agent_id: str) -> bool:
        """Forget an agent; return whether it was registered."""
        return self._agents.pop(agent_id, None) is not None

    def on_before_recovery(self, hook: RecoveryHook) -> RecoveryHook:
        """Run `hook(event)` before each restore (usable as a decorator).

        Hooks observe recoveries; they never change one. A hook that raises (before, after or
        failed) is logged (`recovery_hook_failed`, a warning) and counted in `hook_failures`;
        the recovery goes on as if it had returned, and so does `run()`'s retry loop.
        """
        self._before.append(hook)
        return hook

    def on_after_recovery(self, hook: RecoveryHook) -> RecoveryHook:
        """Run `hook(event)` after each successful restore (usable as a decorator)."""
        self._after.append(hook)
        return hook

    def on_recovery_failed(self, hook: RecoveryHook) -> RecoveryHook:
        """Run `hook(event)` when a recovery attempt fails (usable as a decorator)."""
        self._failed.append(hook)
        return hook

    async def get_recovery_state(self, agent_id: str) -> RecoveryRecord | None:
        """Return the stored attempt count and outcome, or None if never recovered."""
        key = AgentStateStore._recovery_key(agent_id)
        return await self.agent_store._load(key, RecoveryRecord)

    async def reset_attempts(self, agent_id: str) -> None:
        """Start counting attempts from zero again (after the agent ran successfully).

        With the store's `max_age`, this renews the recovery record's TTL like an attempt does.
        """
        store = self.agent_store
        await store.state.update(
            AgentStateStore._recovery_key(agent_id),
            {"attempts": 0},
            default={"agent_id": agent_id},
            **store._recovery_ttl(),
        )

    async def recover(self, agent_id: str, from_checkpoint: str = "latest") -> bool:
        """Restore an agent from a checkpoint through its `restore_from_checkpoint`.

        Args:
            agent_id: A registered agent.
            from_checkpoint: `"latest"` (the newest recoverable checkpoint) or a checkpoint id.

        Returns:
            True if the agent was restored; False if there was no usable checkpoint or the
            restore raised (then the failed hooks run). A hook that raises changes neither
            (see `on_before_recovery`).

        Raises:
            NotFoundError: The agent is not registered.
            RetryExhaustedError: `max_recovery_attempts` attempts were made already.
        """
        agent = self._agents.get(agent_id)
        if agent is None:
            raise NotFoundError(f"agent {agent_id!r} is not registered for recovery")
        attempt = await self._count_attempt(agent_id)
        checkpoint: AgentCheckpoint | None = None
        try:
            if from_checkpoint == "latest":
                checkpoint = await self.agent_store.get_latest_checkpoint(agent_id)
            else:
                checkpoint = await self.agent_store.get_checkpoint(agent_id, from_checkpoint)
            if checkpoint is None:
                raise NotFoundError(
                    f"no recoverable checkpoint {from_checkpoint!r} for {agent_id!r}"
                )
            if not checkpoint.recoverable:
                raise InvalidArgumentError(
                    f"checkpoint {checkpoint.checkpoint_id!r} is not recoverable"
                )
            event = RecoveryEvent(agent_id=agent_id, attempt=attempt, checkpoint=checkpoint)
            await self._run_hooks("before", self._before, event)
            await maybe_await(agent.restore_from_checkpoint(dict(checkpoint.state)))
        except Exception as exc:  # noqa: BLE001  # every failure is reported through hooks
            await self._record(agent_id, checkpoint, error=exc)
            self._log.warning(
                "recovery_failed", agent_id=agent_id, attempt=attempt, error=type(exc).__name__
            )
            failed = RecoveryEvent(
                agent_id=agent_id, attempt=attempt, checkpoint=checkpoint, error=exc
            )
            await self._run_hooks("failed", self._failed, failed)
            return False
        await self._record(agent_id, checkpoint, error=None)
        self._log.info(
            "agent_recovered",
            agent_id=agent_id,
            attempt=attempt,
            checkpoint=checkpoint.checkpoint_id,
        )
        await self._run_hooks("after", self._after, event)
        return True

    async def _run_hooks(self, phase: str, hooks: list[RecoveryHook], event: RecoveryEvent) -> None:
        """Run every hook of a phase; one that raises is logged and counted, never propagated."""
        for hook in hooks:
            try:
                await maybe_await(hook(event))
            except Exception as exc:  # noqa: BLE001  # a hook observes: it cannot fail a recovery
                self.hook_failures += 1
                self._log.warning(
                    "recovery_hook_failed",
                    agent_id=event.agent_id,
                    attempt=event.attempt,
                    phase=phase,
                    hook=getattr(hook, "__qualname__", type(hook).__name__),
                    error=type(exc).__name__,
                )

    async def _count_attempt(self, agent_id: str) -> int:
        limit = self.max_recovery_attempts

        def count(current: dict[str, Any]) -> dict[str, Any]:
            record = RecoveryRecord.model_validate(current)
            if record.attempts >= limit:
                raise RetryExhaustedError(
                    f"agent {agent_id!r} used all {limit} recovery attempts; "
                    "reset_attempts() to allow more"
                )
            return revise(
                record, attempts=record.attempts + 1, last_attempt_at=utcnow()
            ).model_dump(mode="json")

        store = self.agent_store
        stored = await store.state.update(
            AgentStateStore._recovery_key(agent_id),
            count,
            default={"agent_id": agent_id},
            **store._recovery_ttl(),
        )
        return int(stored["attempts"])

    async def _record(
        self, agent_id: str, checkpoint: AgentCheckpoint | None, *, error: BaseException | None
    ) -> None:
        change: dict[str, Any] = {
            "last_checkpoint_id": checkpoint.checkpoint_id if checkpoint else None,
            "last_error": type(error).__name__ if error else None,
        }
        if error is None:
            change["recovered_at"] = utcnow().isoformat()
        store = self.agent_store
        await store.state.update(
            AgentStateStore._recovery_key(agent_id),
            change,
            default={"agent_id": agent_id},
            **store._recovery_ttl(),
        )

    async def run(self, agent: Any, job: Callable[[], Awaitable[T]]) -> T:
        """Run `job()`; when it raises, recover the agent and run it again.

        This is the guard for long-running jobs: each failure costs one recovery attempt, and
        once `max_recovery_attempts` are used the next failure raises `RetryExhaustedError`
        (from the job's exception). A job that succeeds resets the count. With
        `auto_recover=False` the job's exception propagates at once.

        Raises:
            RetryExhaustedError: Recovery attempts ran out.
        """
        agent_id = _agent_id(agent)
        if agent_id not in self._agents:
            self.register(agent)
        while True:
            try:
                # A plain function that returned has succeeded: its value is the result.
                result: T = await maybe_await(job())
            except Exception as exc:
                if not self.auto_recover:
                    raise
                self._log.warning("guarded_job_failed", agent_id=agent_id, error=type(exc).__name__)
                try:
                    recovered = await self.recover(agent_id)
                except RetryExhaustedError as exhausted:
                    raise exhausted from exc
                if not recovered:
                    record = await self.get_recovery_state(agent_id)
                    if record is not None and record.attempts >= self.max_recovery_attempts:
                        raise RetryExhaustedError(
                            f"agent {agent_id!r} could not be recovered"
                        ) from exc
                if self.retry_delay > timedelta(0):
                    await anyio.sleep(self.retry_delay.total_seconds())
                continue
            record = await self.get_recovery_state(agent_id)
            if record is not None and record.attempts:
                await self.reset_attempts(agent_id)
            return result

    def guard(self, agent: Any) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
        """Decorate an async function so that it runs under `run(agent, ...)`.

        <!-- snippet: setup=recovery_manager -->
        ```python
        @recovery_manager.guard(agent)
        async def research(topic: str) -> str:
            return f"notes on {topic}"

        await research("agent memory")
        ```
        """

        def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            @functools.wraps(fn)
            async def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
                return await self.run(agent, lambda: fn(*args, **kwargs))

            return guarded

        return decorate
