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
workers (in any processes) can never hold it at once.

Three sorted indexes (Redis sorted sets) keep the queue's reads off a scan of every task: pending
task ids scored by priority and then enqueue order, so a worker reads the next candidates in one
call; claims in progress (`<task_id>:<lease_token>`) scored by lease expiry, so a claim (which reads
its first entry with the pending head) and `reap_expired` read only the claims that are due and take
back the tasks whose lease ran out; and finished (completed or dead-lettered) task ids scored by
when they finished, so `purge_finished` reads the oldest first. The indexes are hints: a claim's
entry is added before the compare-and-set that takes the task, stale entries are tidied when found,
and a periodic check of every task record against the indexes (the first `reap_expired` or
`get_queue_status` of a team in a process, then at most every 60 `sync_interval`s) restores what a
crash left out.

This module keeps the teams and their agents; the queue (claims, leases, retries, dead letters
and the indexes) is a `TaskQueue` in `managers/_task_queue.py`, to which the manager delegates
every queue call, and `TeamKeys` there builds every key below.

Key layout (the team id sits in a `{...}` hash tag, so one team lives in one Redis Cluster slot):

| Record | Key |
| --- | --- |
| team metadata | `teams:{<team_id>}:team` |
| `AgentCoordinationState` | `teams:{<team_id>}:agents:<agent_id>` |
| `TaskItem` | `teams:{<team_id>}:tasks:<task_id>` |
| pending index (sorted) | `teams:{<team_id>}:pending`, score = rank x 10^15 + sequence |
| in-progress index (sorted) | `teams:{<team_id>}:in-progress`, score = lease expiry |
| finished index (sorted) | `teams:{<team_id>}:finished`, score = when the task finished |
| enqueue sequence | `teams:{<team_id>}:sequence` |
| marker written with each addition to pending | `teams:{<team_id>}:added` |
| a claim's lease marker (present while it holds) | `teams:{<team_id>}:leases:<task_id>:<token>` |
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agenticstate._checks import duration, seconds
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
)
from agenticstate.managers._base import StateManagerBase, key_part, revise, unstorable, utcnow
from agenticstate.managers._task_queue import (
    TaskClaim,
    TaskItem,
    TaskPriority,
    TaskQueue,
    TaskQueueState,
    TaskStatus,
    TeamKeys,
    _task_from,
)
from agenticstate.managers._worker import Worker

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


class AgentCoordinationState(BaseModel):
    """One agent's place in a team."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    status: AgentStatus = AgentStatus.IDLE
    capabilities: list[str] = Field(default_factory=list)
    current_task: str | None = None
    updated_at: datetime = Field(default_factory=utcnow)
    metadata: dict[str, Any] = Field(default_factory=dict)


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


def _check_max_retries(value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError("max_retries must be an int >= 0")


class OrchestrationStateManager(StateManagerBase):
    """Teams, agent status and a reliable task queue shared by any number of processes.

    Args:
        state_manager: Where to store records (or use the shorthand below).
        persistence: `"memory"`, `"file"`, `"sqlite"`, `"redis"` or any registered backend
            name (the AgenticAI Framework shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        sync_interval: Seconds between a worker's heartbeats and between an idle worker's
            claims (`run_worker`); `default_lease` is sized against it.
        default_lease: How long a claim lasts without a heartbeat (default: 30 x sync_interval).
        max_retries: Default failures a task may have before it is dead-lettered.
        finished_task_ttl: How long a completed or dead-lettered task is kept: its record gets
            this time to live when it finishes (None: the store's default TTL, usually never).
            `purge_finished` and `delete_task` remove finished tasks before that.
    """

    _keys = TeamKeys()
    """Every key of a team, built in one place (the layout is in the module docstring)."""

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
        finished_task_ttl: timedelta | None = None,
    ) -> None:
        sync_interval = seconds(sync_interval, "sync_interval")
        default_lease = duration(default_lease, "default_lease")
        finished_task_ttl = duration(finished_task_ttl, "finished_task_ttl")
        _check_max_retries(max_retries)
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self._queue = TaskQueue(
            self.state,
            self.log,
            self._keys,
            require_team=self._require_team,
            capabilities=self._capabilities,
            agent_took=self._agent_took,
            agent_freed=self._agent_freed,
            agent_change=self._agent_change,
            sync_interval=sync_interval,
            default_lease=default_lease or timedelta(seconds=30 * sync_interval),
            max_retries=max_retries,
            finished_task_ttl=finished_task_ttl,
        )

    # the queue's settings, kept by the queue

    @property
    def sync_interval(self) -> float:
        """Seconds between heartbeats and idle claims (`default_lease` is sized against it)."""
        return self._queue.sync_interval

    @sync_interval.setter
    def sync_interval(self, value: float) -> None:
        self._queue.sync_interval = seconds(value, "sync_interval")

    @property
    def default_lease(self) -> timedelta:
        """How long a claim lasts without a heartbeat."""
        return self._queue.default_lease

    @default_lease.setter
    def default_lease(self, value: timedelta) -> None:
        self._queue.default_lease = duration(value, "default_lease", optional=False)

    @property
    def max_retries(self) -> int:
        """Default failures a task may have before it is dead-lettered."""
        return self._queue.max_retries

    @max_retries.setter
    def max_retries(self, value: int) -> None:
        _check_max_retries(value)
        self._queue.max_retries = value

    @property
    def finished_task_ttl(self) -> timedelta | None:
        """How long a completed or dead-lettered task is kept (None: the store's default)."""
        return self._queue.finished_task_ttl

    @finished_task_ttl.setter
    def finished_task_ttl(self, value: timedelta | None) -> None:
        self._queue.finished_task_ttl = duration(value, "finished_task_ttl")

    # teams and agents

    async def create_team(self, team: TeamState) -> TeamState:
        """Store a new team, its agents, and any tasks already in its queue.

        Raises:
            ConflictError: The team exists already.
            InvalidArgumentError: An agent is stored under a key other than its `agent_id`, an
                agent or task id cannot be part of a key, or a task id is in the queue twice;
                nothing was written.
            SerializationError: A value in it (metadata, a task's data) cannot be stored (the
                path names it); nothing was written.
        """
        if not isinstance(team, TeamState):
            raise InvalidArgumentError("create_team takes a TeamState")
        self._check_record(team)
        self._check_new_team(team)
        record = _TeamRecord(
            team_id=team.team_id, metadata=team.metadata, created_at=team.created_at
        )
        try:
            await self.state.save(self._keys.team(team.team_id), record, expected_version=0)
        except ConflictError:
            raise ConflictError(f"team {team.team_id!r} exists already") from None
        for agent_id, agent in team.agents.items():
            await self.state.save(self._keys.agent(team.team_id, agent_id), agent)
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
                await self._queue.restore(team.team_id, revise(task, status=status))
        return await self.get_team(team.team_id)

    def _check_new_team(self, team: TeamState) -> None:
        """Refuse, before anything is written, a team whose agents or tasks cannot be stored.

        Raises:
            InvalidArgumentError: An agent stored under a key other than its `agent_id`, an id
                that cannot be part of a key, or a task id twice in the queue.
        """
        for agent_id, agent in team.agents.items():
            if agent.agent_id != agent_id:
                raise InvalidArgumentError(f"agent key {agent_id!r} != agent_id {agent.agent_id!r}")
            self._keys.agent(team.team_id, agent_id)
        queue = team.task_queue
        seen: set[str] = set()
        for task in (*queue.pending, *queue.in_progress, *queue.completed, *queue.dead_letter):
            self._keys.task(team.team_id, task.task_id)
            if task.task_id in seen:
                raise InvalidArgumentError(f"task {task.task_id!r} is twice in the team's queue")
            seen.add(task.task_id)

    async def _require_team(self, team_id: str) -> _TeamRecord:
        record = await self._load(self._keys.team(team_id), _TeamRecord)
        if record is None:
            raise NotFoundError(f"no team {team_id!r}")
        return record

    async def get_team(self, team_id: str) -> TeamState:
        """Return the team with its agents and its queue.

        Raises:
            NotFoundError: No such team.
        """
        record = await self._require_team(team_id)
        agents = await self._load_many(
            self._keys.records(team_id, "agents"), AgentCoordinationState
        )
        return TeamState(
            team_id=record.team_id,
            agents={agent.agent_id: agent for agent in agents},
            task_queue=await self.get_queue_status(team_id),
            metadata=record.metadata,
            created_at=record.created_at,
        )

    async def list_teams(self) -> list[str]:
        """Return the ids of every team, sorted."""
        return await self._keys.ids(self.state, "team")

    async def add_agent(self, team_id: str, agent: AgentCoordinationState) -> None:
        """Add an agent to a team.

        Raises:
            ConflictError: The team has an agent with this id already.
            SerializationError: Its metadata cannot be stored; nothing was written.
        """
        self._check_record(agent)
        await self._require_team(team_id)
        try:
            await self.state.save(
                self._keys.agent(team_id, agent.agent_id), agent, expected_version=0
            )
        except ConflictError:
            raise ConflictError(f"team {team_id!r} has agent {agent.agent_id!r} already") from None

    async def remove_agent(self, team_id: str, agent_id: str) -> bool:
        """Remove an agent from a team; return whether it was there."""
        return await self.state.delete(self._keys.agent(team_id, agent_id))

    async def delete_team(self, team_id: str) -> int:
        """Delete a team: its record, agents, tasks (in any status), sequence and indexes.

        The team record goes first, so `enqueue_task` refuses new tasks from then on. Stop the
        team's workers before: a claim or completion in flight fails with `NotFoundError` or
        `ConflictError`, and an enqueue that had already passed its check may leave its task
        behind; calling `delete_team` again removes it (it also finishes a deletion that was
        interrupted, when the team record is gone already).

        Returns:
            How many records (team, agents, tasks, sequence) were deleted.

        Raises:
            NotFoundError: No such team (and nothing of one left).
        """
        deleted = int(await self.state.delete(self._keys.team(team_id)))
        # The queue's own markers (see TeamKeys.added and .lease) are not records.
        marker, leases = self._keys.added(team_id), self._keys.key(team_id, "leases", "")
        for key in await self.state.list_keys(self._keys.glob(team_id, "*")):
            gone = await self.state.delete(key)
            deleted += gone and key != marker and not key.startswith(leases)
        entries = 0
        keys = self._keys
        for index in (keys.pending(team_id), keys.in_progress(team_id), keys.finished(team_id)):
            members = [member for member, _ in await self.state.index_range(index)]
            if members:
                entries += await self.state.index_remove(index, members)
        self._queue.forget(team_id)
        if not deleted and not entries:
            raise NotFoundError(f"no team {team_id!r}")
        self.log.info("team_deleted", team_id=team_id, records=deleted)
        return deleted

    async def get_agent(self, team_id: str, agent_id: str) -> AgentCoordinationState:
        """Return one agent of a team.

        Raises:
            NotFoundError: No such agent in the team.
        """
        agent = await self._load(self._keys.agent(team_id, agent_id), AgentCoordinationState)
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
            return revise(agent, status=new_status, current_task=current_task, updated_at=utcnow())

        try:
            value = await self.state.update(self._keys.agent(team_id, agent_id), change)
        except NotFoundError:
            raise NotFoundError(f"team {team_id!r} has no agent {agent_id!r}") from None
        return AgentCoordinationState.model_validate(value)

    async def get_available_agents(
        self, team_id: str, capability: str | None = None
    ) -> list[AgentCoordinationState]:
        """Return the idle agents of a team that have `capability` (any, if None), by id."""
        agents = await self._load_many(
            self._keys.records(team_id, "agents"), AgentCoordinationState
        )
        return sorted(
            (
                agent
                for agent in agents
                if agent.status is AgentStatus.IDLE
                and (capability is None or capability in agent.capabilities)
            ),
            key=lambda agent: agent.agent_id,
        )

    async def _capabilities(self, team_id: str, agent_id: str) -> set[str]:
        """The agent's capabilities in the team; none for an agent that is not in it."""
        agent = await self._load(self._keys.agent(team_id, agent_id), AgentCoordinationState)
        return set(agent.capabilities) if agent is not None else set()

    async def _agent_took(self, team_id: str, agent_id: str, task_id: str) -> None:
        await self._set_agent_if_member(team_id, agent_id, AgentStatus.WORKING, task_id)

    async def _agent_freed(self, team_id: str, agent_id: str) -> None:
        await self._set_agent_if_member(team_id, agent_id, AgentStatus.IDLE, None)

    @staticmethod
    def _agent_change(current: Any, task_id: str | None) -> AgentCoordinationState:
        """An agent's record after taking `task_id` (working), or letting go of one (idle)."""
        agent = AgentCoordinationState.model_validate(current)
        return revise(
            agent,
            status=AgentStatus.WORKING if task_id is not None else AgentStatus.IDLE,
            current_task=task_id,
            updated_at=utcnow(),
        )

    async def _set_agent_if_member(
        self, team_id: str, agent_id: str, status: AgentStatus, current_task: str | None
    ) -> None:
        # Workers need not be registered team members; update them only when they are.
        try:
            await self.update_agent_status(team_id, agent_id, status, current_task)
        except NotFoundError:
            return

    # the queue: delegated to the TaskQueue

    async def enqueue_task(self, team_id: str, task: dict[str, Any] | TaskItem) -> TaskItem:
        """Add a task to the team's queue (priority high/normal/low, then first in, first out).

        A dict takes the AgenticAI Framework state-management API's shape (`id`, `type`,
        `priority`, `data`; other keys go into `data`).

        Raises:
            ConflictError: A task with this id is in the team's queue already.
            NotFoundError: No such team.
            SerializationError: Its data cannot be stored (the path names where,
                `$.data.<key>`); nothing was written.
        """
        self._check_record(_task_from(task))
        return await self._queue.enqueue_task(team_id, task)

    async def get_task(self, team_id: str, task_id: str) -> TaskItem:
        """Return one task.

        Raises:
            NotFoundError: No such task in the team.
        """
        return await self._queue.get_task(team_id, task_id)

    async def assign_task(self, team_id: str, task_id: str, agent_id: str) -> TaskItem:
        """Assign a pending task to an agent, atomically across processes (no lease).

        This is a coordinator's decision: unlike `claim_task`, it does not check the task's
        `capability` against the agent's.

        Raises:
            ConflictError: The task is not pending (another agent has it, or it is done).
            NotFoundError: No such task.
        """
        return await self._queue.assign_task(team_id, task_id, agent_id)

    async def claim_task(
        self,
        team_id: str,
        agent_id: str,
        *,
        capability: str | None = None,
        lease: timedelta | None = None,
    ) -> TaskClaim | None:
        """Take the next pending task for `agent_id`, under a lease.

        The next task is the highest-priority, oldest pending one the agent may take. A task
        that needs a capability goes only to an agent of the team that has it (its
        `capabilities` in the team's record); an agent that is not in the team has no
        capabilities, so it may take only tasks that need none. `capability=` narrows the claim
        further: tasks that need another capability are passed over (tasks that need none
        still come). The lease lasts `lease` (default `default_lease`); `heartbeat` extends it.
        Once it has run out, the task is claimable again: a claim that finds a lease run out
        (the in-progress index, read with the pending one, tells it) puts such tasks back to
        pending, each in one atomic step, before it picks the next task in queue order; no
        reaper needs to run.

        The agent's record is read only when a candidate task needs a capability.

        Returns:
            The claim, or None when no task is available.
        """
        lease = duration(lease, "lease")
        return await self._queue.claim_task(team_id, agent_id, capability=capability, lease=lease)

    async def heartbeat(
        self,
        team_id: str,
        task_id: str,
        lease_token: str,
        *,
        lease: timedelta | None = None,
    ) -> TaskItem:
        """Extend a claim's lease.

        A lease that ran out is extended too, as long as nobody took the task back meanwhile (a
        claim, `reap_expired`); once one did, the claim is over.

        Raises:
            ConflictError: The lease was lost (it ran out and the task was taken back, or the
                task finished).
        """
        lease = duration(lease, "lease")
        return await self._queue.heartbeat(team_id, task_id, lease_token, lease=lease)

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
        holder whose lease expired and was handed on is refused. With `finished_task_ttl`, the
        completed task expires after it.

        A `result` that cannot be stored fails the task instead, as `fail_task` does (it is
        retried, or dead-lettered after `max_retries`; its `error` names the problem and where,
        `UnsupportedTypeError at $.result`), and the error is raised.

        Raises:
            ConflictError: The task is not in progress, or is held under another lease.
            SerializationError: `result` cannot be stored; the task was failed.
        """
        try:
            self._check_value(result, "$.result")
            # The task's record is encoded whole before it is written: a result that fits
            # alone may not fit with the task's data.
            return await self._queue.complete_task(
                team_id, task_id, result, lease_token=lease_token, agent_id=agent_id
            )
        except SerializationError as exc:
            await self._queue.fail_task(
                team_id, task_id, unstorable(exc), lease_token=lease_token, agent_id=agent_id
            )
            raise

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
        than its `max_retries` times; then it moves to the dead-letter list (and, with
        `finished_task_ttl`, expires after it).

        Raises:
            ConflictError: The task is not in progress, or is held under another lease.
        """
        return await self._queue.fail_task(
            team_id, task_id, error, lease_token=lease_token, agent_id=agent_id
        )

    async def release_task(
        self,
        team_id: str,
        task_id: str,
        *,
        lease_token: str | None = None,
        agent_id: str | None = None,
    ) -> TaskItem:
        """Give an in-progress task back to pending, counting no failure.

        For a worker that stops before it finishes its task (`run_worker` does this when it is
        cancelled): the task goes back to its place in the queue for the next claim, at once
        rather than when its lease runs out. Its `attempts` keep counting the claim; its
        `failures` do not change.

        Raises:
            ConflictError: The task is not in progress, or is held under another lease.
            NotFoundError: No such task.
        """
        return await self._queue.release_task(
            team_id, task_id, lease_token=lease_token, agent_id=agent_id
        )

    async def run_worker(
        self,
        team_id: str,
        agent_id: str,
        handler: Callable[[TaskItem], Any],
        *,
        capability: str | None = None,
        lease: timedelta | None = None,
        heartbeat_interval: timedelta | float | None = None,
        poll_interval: timedelta | float | None = None,
        stop: anyio.Event | None = None,
        until_empty: bool = False,
        max_tasks: int | None = None,
    ) -> int:
        """Claim the team's tasks one at a time and run `handler` on each, until stopped.

        For each task the worker claims (as `claim_task(team_id, agent_id, capability=...,
        lease=...)`), it calls `handler(task)` while a heartbeat renews the lease every
        `heartbeat_interval`, so a task may run longer than its lease; then:

        - the handler returned: the task is completed with the return value as its result;
        - the handler raised an exception: the task is failed with `"<ExceptionType>: <message>"`
          (`fail_task`: retried until it has failed more than `max_retries` times, then
          dead-lettered) and the worker goes on;
        - a heartbeat found the lease lost (the worker stalled past its lease and another
          worker took the task, or the task was deleted): the handler is cancelled and its
          outcome dropped.

        A coroutine function runs on the event loop; a plain function runs in a worker thread
        (so blocking work does not stop the heartbeats; it cannot be interrupted, so a lost
        lease only drops its outcome). When the queue has nothing for this agent, the worker
        waits `poll_interval` and claims again. A worker that dies (SIGKILL, a lost host) stops
        heartbeating; once its lease runs out, the next `claim_task` of any worker puts the task
        back and it is done again, with no reaper to run.

        Stopping: set `stop` (an `anyio.Event`), and the worker finishes the task in hand, then
        returns (graceful); cancel the enclosing scope, and the worker cancels the handler and
        gives its task back (`release_task`) before the cancellation goes on. `until_empty`
        returns when a claim finds nothing; `max_tasks` after that many tasks.

        Args:
            team_id: The team whose queue to work.
            agent_id: Who claims (a team member's capabilities apply, as in `claim_task`).
            handler: Called with each claimed `TaskItem`; its return value is the result
                (something `complete_task` can store).
            capability: As `claim_task`'s.
            lease: Each claim's lease (default `default_lease`).
            heartbeat_interval: Seconds (or a timedelta) between heartbeats (default: the
                smaller of `sync_interval` and a third of the lease). Shorter than the lease,
                or `InvalidArgumentError`: a lease that runs out between beats is taken back.
            poll_interval: Seconds (or a timedelta) an idle worker waits before it claims again
                (default `sync_interval`).
            stop: Set it to stop the worker once its current task is done.
            until_empty: Return as soon as a claim finds no task.
            max_tasks: Return after handling this many tasks.

        Returns:
            How many tasks the handler ran (completed, failed or lost).
        """
        lease = duration(lease, "lease") or self.default_lease
        beat = duration(heartbeat_interval, "heartbeat_interval", seconds=True)
        poll = duration(poll_interval, "poll_interval", seconds=True)
        if max_tasks is not None and (type(max_tasks) is not int or max_tasks < 1):
            raise InvalidArgumentError(f"max_tasks must be an int >= 1 or None, not {max_tasks!r}")
        if not callable(handler):
            raise InvalidArgumentError("handler must be callable: it is called with each task")
        if stop is not None and not isinstance(stop, anyio.Event):
            raise InvalidArgumentError("stop must be an anyio.Event or None")
        interval = timedelta(seconds=self.sync_interval)
        worker = Worker(
            self,
            team_id,
            key_part(agent_id, "agent_id"),
            handler,
            capability=capability,
            lease=lease,
            heartbeat_interval=beat or min(interval, lease / 3),
            poll_interval=poll or interval,
            stop=stop,
            until_empty=until_empty,
            max_tasks=max_tasks,
            log=self.log,
        )
        return await worker.run()

    async def delete_task(self, team_id: str, task_id: str) -> TaskItem:
        """Delete a task in any status, with its index entries; return it as it was.

        Deleting a task in progress takes it from its holder: the holder's `heartbeat`,
        `complete_task` or `fail_task` then raise `NotFoundError`, and the holder, if a member
        of the team, is set idle.

        Raises:
            NotFoundError: No such task in the team.
        """
        return await self._queue.delete_task(team_id, task_id)

    async def purge_finished(self, team_id: str, *, older_than: timedelta | None = None) -> int:
        """Delete the team's completed and dead-lettered tasks, oldest first.

        Args:
            team_id: The team.
            older_than: Only tasks that finished at least this long ago (None: all of them).

        Returns:
            How many tasks were deleted.

        Raises:
            NotFoundError: No such team.
        """
        older_than = duration(older_than, "older_than", zero=True)
        return await self._queue.purge_finished(team_id, older_than=older_than)

    async def reap_expired(self, team_id: str) -> list[str]:
        """Put tasks whose lease expired back to pending; restore lost index entries.

        A lease expires when its holder died (or stopped heartbeating). Only the claims that are
        due are read (the in-progress index is scored by lease expiry), so the cost does not
        grow with the tasks pending or finished. The first call for a team in a process, and
        then one every 60 `sync_interval`s, also checks every task record of the team against
        the indexes and restores what a crash left out of them.

        Claims reap on their way (see `claim_task`), so a queue with workers needs no reaper;
        run it where no worker claims for a while yet the tasks should show as pending again
        (a dashboard, `get_queue_status`). Concurrent reapers are safe.

        Returns:
            The ids of the tasks put back.
        """
        return await self._queue.reap_expired(team_id)

    async def get_queue_status(
        self, team_id: str, *, include_finished: bool = True
    ) -> TaskQueueState:
        """Return the team's tasks grouped by status, each list in queue order.

        The tasks are read through the indexes, not by scanning the store.

        Args:
            team_id: The team.
            include_finished: Whether to read the completed and dead-lettered tasks too; without
                them the cost depends only on the tasks pending and in progress.
        """
        return await self._queue.get_queue_status(team_id, include_finished=include_finished)
