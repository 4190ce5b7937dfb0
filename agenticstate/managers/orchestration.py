"""Teams of agents and their task queue: atomic assignment, leases, retries, dead letters.

```python
orch_state = OrchestrationStateManager(persistence="redis", sync_interval=1.0)
await orch_state.create_team(TeamState(team_id="research_team", agents={...}))
await orch_state.enqueue_task(team_id="research_team", task={"id": "t1", "priority": "high"})
claim = await orch_state.claim_task("research_team", "researcher", lease=timedelta(seconds=30))
await orch_state.complete_task("research_team", claim.task_id, result={...},
                               lease_token=claim.lease_token)
```

The hot state is kept in small records, never in one team document rewritten on every change:
each agent and each task has its own record, and every change to one is an atomic
compare-and-set on its version. The task record is the single source of truth: a task is
assigned when the compare-and-set that moves it from pending to in progress succeeds, so two
workers (in any processes) can never hold it at once. Pending task ids are also kept in a sorted
index (a Redis sorted set) scored by priority and then enqueue order, so a worker reads the next
candidates in one call; the index is a hint, tidied when stale and restored by `reap_expired` if
a crash left a pending task out of it.

Key layout (the team id sits in a `{...}` hash tag, so one team lives in one Redis Cluster slot):

| Record | Key |
| --- | --- |
| team metadata | `teams:{<team_id>}:team` |
| `AgentCoordinationState` | `teams:{<team_id>}:agents:<agent_id>` |
| `TaskItem` | `teams:{<team_id>}:tasks:<task_id>` |
| pending index (sorted) | `teams:{<team_id>}:pending`, score = rank x 10^15 + sequence |
| enqueue sequence | `teams:{<team_id>}:sequence` |
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
)
from agenticstate.managers._base import (
    StateManagerBase,
    glob_part,
    key_part,
    utcnow,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agenticstate.manager import StateManager
    from agenticstate.managers._base import Persistence

__all__ = [
    "AgentCoordinationState",
    "AgentStatus",
    "OrchestrationStateManager",
    "TaskClaim",
    "TaskItem",
    "TaskPriority",
    "TaskQueueState",
    "TaskStatus",
    "TeamState",
]


class AgentStatus(StrEnum):
    """What an agent in a team is doing."""

    IDLE = "idle"
    """Free to take a task."""
    WORKING = "working"
    """Busy with a task."""
    BUSY = "busy"
    """Busy with something else."""
    OFFLINE = "offline"
    """Not available."""
    ERROR = "error"
    """Needs attention."""


class TaskPriority(StrEnum):
    """Queue order: high before normal before low, then first in, first out."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for high, 1 for normal, 2 for low."""
        return _RANKS[self]


_RANKS = {TaskPriority.HIGH: 0, TaskPriority.NORMAL: 1, TaskPriority.LOW: 2}


class TaskStatus(StrEnum):
    """Where a task is."""

    PENDING = "pending"
    """Waiting in the queue."""
    IN_PROGRESS = "in_progress"
    """Assigned to an agent (under a lease when claimed)."""
    COMPLETED = "completed"
    """Done (terminal)."""
    DEAD_LETTER = "dead_letter"
    """Failed more often than its retries allow (terminal)."""


class AgentCoordinationState(BaseModel):
    """One agent's place in a team."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    status: AgentStatus = AgentStatus.IDLE
    capabilities: list[str] = Field(default_factory=list)
    current_task: str | None = None
    updated_at: datetime = Field(default_factory=utcnow)
    metadata: dict[str, Any] = Field(default_factory=dict)


class TaskItem(BaseModel):
    """A task in a team's queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    type: str = "task"
    priority: TaskPriority = TaskPriority.NORMAL
    data: dict[str, Any] = Field(default_factory=dict)
    capability: str | None = None
    """Only agents with this capability may claim the task (None: anyone)."""
    status: TaskStatus = TaskStatus.PENDING
    sequence: int = 0
    """Enqueue order within the team."""
    assigned_to: str | None = None
    lease_token: str | None = None
    """Changes at every assignment; completions must present the current one."""
    lease_expires_at: datetime | None = None
    """When a claimed task goes back to pending unless its holder heartbeats."""
    attempts: int = 0
    """How often the task has been assigned."""
    failures: int = 0
    max_retries: int = 3
    """Failures allowed before the task moves to the dead-letter list."""
    result: Any = None
    error: str | None = None
    enqueued_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    completed_at: datetime | None = None


class TaskQueueState(BaseModel):
    """A team's tasks grouped by status (each list in queue order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pending: list[TaskItem] = Field(default_factory=list)
    in_progress: list[TaskItem] = Field(default_factory=list)
    completed: list[TaskItem] = Field(default_factory=list)
    dead_letter: list[TaskItem] = Field(default_factory=list)


class TeamState(BaseModel):
    """A team: its agents and its task queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    team_id: str
    agents: dict[str, AgentCoordinationState] = Field(default_factory=dict)
    task_queue: TaskQueueState = Field(default_factory=TaskQueueState)
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)


class _TeamRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    team_id: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)


class TaskClaim(BaseModel):
    """What a worker holds after `claim_task`: the task and its lease."""

    model_config = ConfigDict(frozen=True)

    team_id: str
    task: TaskItem
    lease_token: str
    lease_expires_at: datetime

    @property
    def task_id(self) -> str:
        """The claimed task's id."""
        return self.task.task_id


def _task_from(task: dict[str, Any] | TaskItem) -> TaskItem:
    if isinstance(task, TaskItem):
        return task
    if not isinstance(task, dict):
        raise InvalidArgumentError("a task is a dict (with an 'id') or a TaskItem")
    fields = dict(task)
    task_id = fields.pop("id", None) or fields.pop("task_id", None) or uuid4().hex
    known = set(TaskItem.model_fields) - {"task_id"}
    extra = {key: fields.pop(key) for key in list(fields) if key not in known}
    if extra:
        fields["data"] = {**fields.get("data", {}), **extra}
    try:
        return TaskItem(task_id=str(task_id), **fields)
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid task: {exc.error_count()} error(s): {exc}") from None


class OrchestrationStateManager(StateManagerBase):
    """Teams, agent status and a reliable task queue shared by any number of processes.

    Args:
        state_manager: Where to store records (or use the shorthand below).
        persistence: `"memory"`, `"file"` or `"redis"` (the seed page's shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        sync_interval: Seconds between the heartbeats and reaper passes that `default_lease`
            is sized against.
        default_lease: How long a claim lasts without a heartbeat (default: 30 x sync_interval).
        max_retries: Default failures a task may have before it is dead-lettered.
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
        sync_interval: float = 1.0,
        default_lease: timedelta | None = None,
        max_retries: int = 3,
    ) -> None:
        if not sync_interval > 0:
            raise InvalidArgumentError("sync_interval must be positive")
        if type(max_retries) is not int or max_retries < 0:
            raise InvalidArgumentError("max_retries must be an int >= 0")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.sync_interval = sync_interval
        self.default_lease = default_lease or timedelta(seconds=30 * sync_interval)
        self.max_retries = max_retries

    # keys

    @staticmethod
    def _base(team_id: str) -> str:
        return f"teams:{{{key_part(team_id, 'team_id')}}}"

    def _team_key(self, team_id: str) -> str:
        return f"{self._base(team_id)}:team"

    def _agent_key(self, team_id: str, agent_id: str) -> str:
        return f"{self._base(team_id)}:agents:{key_part(agent_id, 'agent_id')}"

    def _task_key(self, team_id: str, task_id: str) -> str:
        return f"{self._base(team_id)}:tasks:{key_part(task_id, 'task_id')}"

    def _pending(self, team_id: str) -> str:
        return f"{self._base(team_id)}:pending"

    @staticmethod
    def _order(task: TaskItem) -> dict[str, float]:
        # Priority first, then enqueue order: exact in a float up to 2**53.
        return {task.task_id: task.priority.rank * 1e15 + task.sequence}

    @staticmethod
    def _glob(team_id: str, kind: str) -> str:
        return f"teams:{{{glob_part(key_part(team_id, 'team_id'))}}}:{kind}:*"

    # teams and agents

    async def create_team(self, team: TeamState) -> TeamState:
        """Store a new team, its agents, and any tasks already in its queue.

        Raises:
            ConflictError: The team exists already.
        """
        if not isinstance(team, TeamState):
            raise InvalidArgumentError("create_team takes a TeamState")
        record = _TeamRecord(
            team_id=team.team_id, metadata=team.metadata, created_at=team.created_at
        )
        try:
            await self.state.save(self._team_key(team.team_id), record, expected_version=0)
        except ConflictError:
            raise ConflictError(f"team {team.team_id!r} exists already") from None
        for agent_id, agent in team.agents.items():
            if agent.agent_id != agent_id:
                raise InvalidArgumentError(f"agent key {agent_id!r} != agent_id {agent.agent_id!r}")
            await self.state.save(self._agent_key(team.team_id, agent_id), agent)
        queue = team.task_queue
        for task in queue.pending:
            await self.enqueue_task(team.team_id, task)
        # Tasks already under way or finished keep their status (and stay out of the queue).
        for status, tasks in (
            (TaskStatus.IN_PROGRESS, queue.in_progress),
            (TaskStatus.COMPLETED, queue.completed),
            (TaskStatus.DEAD_LETTER, queue.dead_letter),
        ):
            for task in tasks:
                await self.state.save(
                    self._task_key(team.team_id, task.task_id),
                    task.model_copy(update={"status": status}),
                    expected_version=0,
                )
        return await self.get_team(team.team_id)

    async def _require_team(self, team_id: str) -> _TeamRecord:
        record = await self._load(self._team_key(team_id), _TeamRecord)
        if record is None:
            raise NotFoundError(f"no team {team_id!r}")
        return record

    async def get_team(self, team_id: str) -> TeamState:
        """Return the team with its agents and its queue.

        Raises:
            NotFoundError: No such team.
        """
        record = await self._require_team(team_id)
        agents = await self._load_many(self._glob(team_id, "agents"), AgentCoordinationState)
        return TeamState(
            team_id=record.team_id,
            agents={agent.agent_id: agent for agent in agents},
            task_queue=await self.get_queue_status(team_id),
            metadata=record.metadata,
            created_at=record.created_at,
        )

    async def list_teams(self) -> list[str]:
        """Return the ids of every team, sorted."""
        keys = await self.state.list_keys("teams:{*}:team")
        return sorted(key[len("teams:{") : -len("}:team")] for key in keys)

    async def add_agent(self, team_id: str, agent: AgentCoordinationState) -> None:
        """Add an agent to a team.

        Raises:
            ConflictError: The team has an agent with this id already.
        """
        await self._require_team(team_id)
        try:
            await self.state.save(
                self._agent_key(team_id, agent.agent_id), agent, expected_version=0
            )
        except ConflictError:
            raise ConflictError(f"team {team_id!r} has agent {agent.agent_id!r} already") from None

    async def remove_agent(self, team_id: str, agent_id: str) -> bool:
        """Remove an agent from a team; return whether it was there."""
        return await self.state.delete(self._agent_key(team_id, agent_id))

    async def get_agent(self, team_id: str, agent_id: str) -> AgentCoordinationState:
        """Return one agent of a team.

        Raises:
            NotFoundError: No such agent in the team.
        """
        agent = await self._load(self._agent_key(team_id, agent_id), AgentCoordinationState)
        if agent is None:
            raise NotFoundError(f"team {team_id!r} has no agent {agent_id!r}")
        return agent

    async def update_agent_status(
        self,
        team_id: str,
        agent_id: str,
        status: AgentStatus | str,
        current_task: str | None = None,
    ) -> AgentCoordinationState:
        """Set an agent's status and current task, atomically.

        Raises:
            NotFoundError: No such agent in the team.
            InvalidArgumentError: Unknown status.
        """
        try:
            new_status = AgentStatus(status)
        except ValueError:
            raise InvalidArgumentError(f"unknown agent status {status!r}") from None

        def change(current: Any) -> Any:
            agent = AgentCoordinationState.model_validate(current)
            return agent.model_copy(
                update={"status": new_status, "current_task": current_task, "updated_at": utcnow()}
            )

        try:
            value = await self.state.update(self._agent_key(team_id, agent_id), change)
        except NotFoundError:
            raise NotFoundError(f"team {team_id!r} has no agent {agent_id!r}") from None
        return AgentCoordinationState.model_validate(value)

    async def get_available_agents(
        self, team_id: str, capability: str | None = None
    ) -> list[AgentCoordinationState]:
        """Return the idle agents of a team that have `capability` (any, if None), by id."""
        agents = await self._load_many(self._glob(team_id, "agents"), AgentCoordinationState)
        return sorted(
            (
                agent
                for agent in agents
                if agent.status is AgentStatus.IDLE
                and (capability is None or capability in agent.capabilities)
            ),
            key=lambda agent: agent.agent_id,
        )

    # the queue

    async def enqueue_task(self, team_id: str, task: dict[str, Any] | TaskItem) -> TaskItem:
        """Add a task to the team's queue (priority high/normal/low, then first in, first out).

        A dict takes the seed page's shape (`id`, `type`, `priority`, `data`; other keys go into
        `data`).

        Raises:
            ConflictError: A task with this id is in the team's queue already.
            NotFoundError: No such team.
        """
        item = _task_from(task)
        await self._require_team(team_id)
        sequence = await self.state.update(
            f"{self._base(team_id)}:sequence", lambda n: n + 1, default=0
        )
        item = item.model_copy(
            update={
                "sequence": sequence,
                "status": TaskStatus.PENDING,
                "max_retries": item.max_retries
                if "max_retries" in item.model_fields_set
                else self.max_retries,
            }
        )
        try:
            await self.state.save(self._task_key(team_id, item.task_id), item, expected_version=0)
        except ConflictError:
            raise ConflictError(f"task {item.task_id!r} is in team {team_id!r} already") from None
        await self.state.index_add(self._pending(team_id), self._order(item))
        return item

    async def get_task(self, team_id: str, task_id: str) -> TaskItem:
        """Return one task.

        Raises:
            NotFoundError: No such task in the team.
        """
        task = await self._load(self._task_key(team_id, task_id), TaskItem)
        if task is None:
            raise NotFoundError(f"team {team_id!r} has no task {task_id!r}")
        return task

    async def _change_task(
        self, team_id: str, task_id: str, fn: Callable[[TaskItem], TaskItem]
    ) -> TaskItem:
        def apply(current: Any) -> Any:
            return fn(TaskItem.model_validate(current)).model_copy(update={"updated_at": utcnow()})

        try:
            value = await self.state.update(self._task_key(team_id, task_id), apply)
        except NotFoundError:
            raise NotFoundError(f"team {team_id!r} has no task {task_id!r}") from None
        return TaskItem.model_validate(value)

    @staticmethod
    def _take(task: TaskItem, agent_id: str, lease: timedelta | None) -> TaskItem:
        if task.status is not TaskStatus.PENDING:
            raise ConflictError(
                f"task {task.task_id!r} is {task.status.value}"
                + (f" (held by {task.assigned_to!r})" if task.assigned_to else ""),
                key=task.task_id,
            )
        return task.model_copy(
            update={
                "status": TaskStatus.IN_PROGRESS,
                "assigned_to": agent_id,
                "lease_token": uuid4().hex,
                "lease_expires_at": utcnow() + lease if lease is not None else None,
                "attempts": task.attempts + 1,
            }
        )

    async def assign_task(self, team_id: str, task_id: str, agent_id: str) -> TaskItem:
        """Assign a pending task to an agent, atomically across processes (no lease).

        Raises:
            ConflictError: The task is not pending (another agent has it, or it is done).
            NotFoundError: No such task.
        """
        key_part(agent_id, "agent_id")
        task = await self._change_task(team_id, task_id, lambda t: self._take(t, agent_id, None))
        await self.state.index_remove(self._pending(team_id), [task.task_id])
        await self._set_agent_if_member(team_id, agent_id, AgentStatus.WORKING, task_id)
        return task

    async def claim_task(
        self,
        team_id: str,
        agent_id: str,
        *,
        capability: str | None = None,
        lease: timedelta | None = None,
    ) -> TaskClaim | None:
        """Take the next pending task for `agent_id`, under a lease.

        The next task is the highest-priority, oldest pending one the agent may take: tasks that
        need a capability go only to agents that have it (`capability=`, else the agent's
        capabilities in the team). The lease lasts `lease` (default `default_lease`);
        `heartbeat` extends it, and once it expires `reap_expired` puts the task back.

        Returns:
            The claim, or None when no task is available.
        """
        key_part(agent_id, "agent_id")
        lease = lease or self.default_lease
        capabilities: set[str] | None = None
        if capability is not None:
            capabilities = {capability}
        else:
            agent = await self._load(self._agent_key(team_id, agent_id), AgentCoordinationState)
            if agent is not None:
                capabilities = set(agent.capabilities)
        pending = self._pending(team_id)
        skipped: set[str] = set()
        contended = False
        page = 16
        while True:
            candidates = [
                (task_id, score)
                for task_id, score in await self.state.index_range(pending, limit=page)
                if task_id not in skipped
            ]
            if not candidates:
                return None
            while candidates:
                task_id, score = candidates[0]
                if contended:
                    # After losing a race, spread over the next few candidates of the same
                    # priority instead of all racing for the head again: every round some
                    # worker wins, so nobody livelocks, and priorities never invert.
                    rank = score // 1e15
                    window = [c for c in candidates[:4] if c[1] // 1e15 == rank]
                    task_id, score = random.choice(window)  # noqa: S311  # load spreading
                candidates.remove((task_id, score))
                key = self._task_key(team_id, task_id)
                entry = await self.state.get_entry(key, model=TaskItem)
                task: TaskItem | None = entry.value if entry is not None else None
                if entry is None or task is None or task.status is not TaskStatus.PENDING:
                    # A stale entry (the task was taken or finished): tidy it away.
                    await self.state.index_remove(pending, [task_id])
                    continue
                if (
                    task.capability is not None
                    and capabilities is not None
                    and task.capability not in capabilities
                ):
                    skipped.add(task_id)
                    continue
                taken = self._take(task, agent_id, lease).model_copy(
                    update={"updated_at": utcnow()}
                )
                try:
                    # Compare-and-set on the version just read: one round trip, and only one
                    # claimer can win it.
                    await self.state.save(key, taken, expected_version=entry.version)
                except ConflictError:
                    contended = True
                    continue  # another worker won this one
                await self.state.index_remove(pending, [task_id])
                await self._set_agent_if_member(team_id, agent_id, AgentStatus.WORKING, task_id)
                assert taken.lease_token is not None  # noqa: S101  # set by _take
                assert taken.lease_expires_at is not None  # noqa: S101
                return TaskClaim(
                    team_id=team_id,
                    task=taken,
                    lease_token=taken.lease_token,
                    lease_expires_at=taken.lease_expires_at,
                )
            page *= 2  # every candidate on this page was skipped or lost: look further

    @staticmethod
    def _check_holder(task: TaskItem, lease_token: str | None, agent_id: str | None) -> None:
        if task.status is not TaskStatus.IN_PROGRESS:
            raise ConflictError(f"task {task.task_id!r} is {task.status.value}", key=task.task_id)
        if lease_token is not None and lease_token != task.lease_token:
            raise ConflictError(
                f"task {task.task_id!r} is no longer held under this lease", key=task.task_id
            )
        if agent_id is not None and agent_id != task.assigned_to:
            raise ConflictError(
                f"task {task.task_id!r} is held by {task.assigned_to!r}, not {agent_id!r}",
                key=task.task_id,
            )

    async def heartbeat(
        self,
        team_id: str,
        task_id: str,
        lease_token: str,
        *,
        lease: timedelta | None = None,
    ) -> TaskItem:
        """Extend a claim's lease.

        Raises:
            ConflictError: The lease was lost (expired and reaped, or the task finished).
        """
        life = lease or self.default_lease

        def extend(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, None)
            return task.model_copy(update={"lease_expires_at": utcnow() + life})

        return await self._change_task(team_id, task_id, extend)

    async def complete_task(
        self,
        team_id: str,
        task_id: str,
        result: Any = None,
        *,
        lease_token: str | None = None,
        agent_id: str | None = None,
    ) -> TaskItem:
        """Mark an in-progress task completed with its result.

        Pass the claim's `lease_token` (or the `agent_id` it was assigned to): a completion by a
        holder whose lease expired and was handed on is refused.

        Raises:
            ConflictError: The task is not in progress, or is held under another lease.
        """

        def complete(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, agent_id)
            return task.model_copy(
                update={
                    "status": TaskStatus.COMPLETED,
                    "result": result,
                    "lease_expires_at": None,
                    "completed_at": utcnow(),
                }
            )

        task = await self._change_task(team_id, task_id, complete)
        if task.assigned_to is not None:
            await self._set_agent_if_member(team_id, task.assigned_to, AgentStatus.IDLE, None)
        return task

    async def fail_task(
        self,
        team_id: str,
        task_id: str,
        error: str,
        *,
        lease_token: str | None = None,
        agent_id: str | None = None,
    ) -> TaskItem:
        """Record a failure: the task is retried, or dead-lettered after `max_retries`.

        The task goes back to pending (keeping its place in the queue) until it has failed more
        than its `max_retries` times; then it moves to the dead-letter list.

        Raises:
            ConflictError: The task is not in progress, or is held under another lease.
        """

        def fail(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, agent_id)
            failures = task.failures + 1
            dead = failures > task.max_retries
            return task.model_copy(
                update={
                    "status": TaskStatus.DEAD_LETTER if dead else TaskStatus.PENDING,
                    "failures": failures,
                    "error": error,
                    "assigned_to": None,
                    "lease_token": None,
                    "lease_expires_at": None,
                }
            )

        before = await self.get_task(team_id, task_id)
        task = await self._change_task(team_id, task_id, fail)
        if task.status is TaskStatus.PENDING:
            await self.state.index_add(self._pending(team_id), self._order(task))
        if before.assigned_to is not None:
            await self._set_agent_if_member(team_id, before.assigned_to, AgentStatus.IDLE, None)
        self.log.info(
            "task_failed",
            team_id=team_id,
            task_id=task_id,
            dead_letter=task.status is TaskStatus.DEAD_LETTER,
        )
        return task

    async def reap_expired(self, team_id: str) -> list[str]:
        """Put tasks whose lease expired back to pending; restore lost index entries.

        A lease expires when its holder died (or stopped heartbeating).

        Run it every `sync_interval` or so from any process; concurrent reapers are safe.

        Returns:
            The ids of the tasks put back.
        """
        now = utcnow()
        tasks = await self._load_many(self._glob(team_id, "tasks"), TaskItem)
        indexed = {task_id for task_id, _ in await self.state.index_range(self._pending(team_id))}
        requeued: list[str] = []
        for task in tasks:
            if task.status is TaskStatus.PENDING and task.task_id not in indexed:
                await self.state.index_add(self._pending(team_id), self._order(task))
                continue
            expires = task.lease_expires_at
            if task.status is not TaskStatus.IN_PROGRESS or expires is None or expires > now:
                continue

            def release(current: TaskItem, token: str | None = task.lease_token) -> TaskItem:
                if current.status is not TaskStatus.IN_PROGRESS or current.lease_token != token:
                    raise InvalidTransitionError("lease renewed or task finished meanwhile")
                if current.lease_expires_at is not None and current.lease_expires_at > utcnow():
                    raise InvalidTransitionError("lease renewed meanwhile")
                return current.model_copy(
                    update={
                        "status": TaskStatus.PENDING,
                        "assigned_to": None,
                        "lease_token": None,
                        "lease_expires_at": None,
                    }
                )

            try:
                back = await self._change_task(team_id, task.task_id, release)
            except InvalidTransitionError:
                continue
            await self.state.index_add(self._pending(team_id), self._order(back))
            if task.assigned_to is not None:
                await self._set_agent_if_member(team_id, task.assigned_to, AgentStatus.IDLE, None)
            requeued.append(task.task_id)
            self.log.warning("lease_expired", team_id=team_id, task_id=task.task_id)
        return requeued

    async def get_queue_status(self, team_id: str) -> TaskQueueState:
        """Return the team's tasks grouped by status, each list in queue order."""
        tasks = await self._load_many(self._glob(team_id, "tasks"), TaskItem)
        tasks.sort(key=lambda task: (task.priority.rank, task.sequence))
        groups: dict[TaskStatus, list[TaskItem]] = {status: [] for status in TaskStatus}
        for task in tasks:
            groups[task.status].append(task)
        return TaskQueueState(
            pending=groups[TaskStatus.PENDING],
            in_progress=groups[TaskStatus.IN_PROGRESS],
            completed=groups[TaskStatus.COMPLETED],
            dead_letter=groups[TaskStatus.DEAD_LETTER],
        )

    async def _set_agent_if_member(
        self, team_id: str, agent_id: str, status: AgentStatus, current_task: str | None
    ) -> None:
        # Workers need not be registered team members; update them only when they are.
        try:
            await self.update_agent_status(team_id, agent_id, status, current_task)
        except NotFoundError:
            return
