"""A team's task queue: atomic claims under leases, retries, dead letters and its indexes.

`OrchestrationStateManager` keeps teams and their agents and delegates every queue call to the
`TaskQueue` here. The queue reaches the team's agents only through the three callables it is
given (is there such a team; what can this agent do; this agent took or let go of a task), so
it never reads or writes an agent record itself.

The task record is the single source of truth; the three sorted indexes (pending, in progress,
finished) are hints that are restored when found wrong. The module docstring of
`agenticstate.managers.orchestration` describes the indexes and the key layout, which
`TeamKeys` below builds.
"""

from __future__ import annotations

import copy
import math
import random
import time
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agenticstate import _otel
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
    UnsupportedOperationError,
)
from agenticstate.managers._base import (
    TaggedKeys,
    conditional,
    encode_error,
    key_part,
    load,
    load_many,
    read_entries,
    revise,
    sort_time,
    utcnow,
)
from agenticstate.txn import (
    CONFIGURED,
    Delete,
    Exists,
    Get,
    IndexAdd,
    IndexRange,
    IndexRemove,
    Put,
    Revision,
    TransactResult,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from agenticstate.manager import StateEntry, StateManager
    from agenticstate.txn import Op

__all__ = [
    "TaskClaim",
    "TaskItem",
    "TaskPriority",
    "TaskQueue",
    "TaskQueueState",
    "TaskStatus",
    "TeamKeys",
]


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

_NO_LEASE = 1e15
"""The in-progress index score of a task assigned without a lease: never due."""


_UNLEASED = "-"
"""The token part of the in-progress entry of a task that has no lease token."""


_REPAIR_EVERY = 60
"""`sync_interval`s between two checks of a team's task records against its indexes."""

_KNOWN_MAX = 4096
"""Records (tasks and agents) whose last revision this process knows, at most (oldest go)."""

_HEADS = 2
"""Pending tasks after the one a claim took whose records the next claim reads with the index."""

_AGENT_RETRIES = 3
"""Single-step attempts redone because only the agent's record changed meanwhile."""


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


_FINISHED = frozenset({TaskStatus.COMPLETED, TaskStatus.DEAD_LETTER})


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


_Snapshot = tuple[
    list[tuple[str, float]],
    dict[str, "StateEntry | None"],
    list["Revision"],
    list[tuple[str, float]],
]
"""A team's pending index head, the records of some of its tasks, the compares on the keys
whose revisions tell that nothing was added to the index since, and the first entry of the
in-progress index (the claim whose lease the index says runs out first), read at once (see
`TaskQueue._candidates`)."""

_SNAPSHOT_LIFE = 2.0
"""Seconds a claim may use a snapshot of the pending index (it only saves a read: past this,
the next claim reads the index again)."""

_PAGE = 16
"""Pending entries a claim reads first."""


class _Mispredicted(Exception):  # noqa: N818  # internal signal, never raised to callers
    """A failure's outcome (retry or dead letter) differed from the one its TTL was chosen for."""


def _own(value: Any) -> Any:
    """A deep copy of a record (or of a value), so that no caller shares it with the queue."""
    if isinstance(value, BaseModel):
        return value.model_copy(deep=True)
    return copy.deepcopy(value)


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


class TeamKeys(TaggedKeys):
    """Every key of a team: its record, agents, tasks, indexes and enqueue sequence.

    The team id sits in a `{...}` hash tag, so one team lives in one Redis Cluster slot.
    """

    def __init__(self) -> None:
        super().__init__("teams", "team_id")

    def team(self, team_id: str) -> str:
        """The team record: `teams:{<team_id>}:team`."""
        return self.key(team_id, "team")

    def agent(self, team_id: str, agent_id: str) -> str:
        """An agent of the team: `teams:{<team_id>}:agents:<agent_id>`."""
        return self.key(team_id, "agents", key_part(agent_id, "agent_id"))

    def task(self, team_id: str, task_id: str) -> str:
        """A task of the team: `teams:{<team_id>}:tasks:<task_id>`."""
        return self.key(team_id, "tasks", key_part(task_id, "task_id"))

    def pending(self, team_id: str) -> str:
        """The pending index: `teams:{<team_id>}:pending`."""
        return self.key(team_id, "pending")

    def in_progress(self, team_id: str) -> str:
        """The in-progress index: `teams:{<team_id>}:in-progress`."""
        return self.key(team_id, "in-progress")

    def finished(self, team_id: str) -> str:
        """The finished index: `teams:{<team_id>}:finished`."""
        return self.key(team_id, "finished")

    def sequence(self, team_id: str) -> str:
        """The enqueue counter: `teams:{<team_id>}:sequence`."""
        return self.key(team_id, "sequence")

    def added(self, team_id: str) -> str:
        """Written with (or after) every addition to the pending index: `teams:{<team_id>}:added`.

        Its revision tells a worker that nothing was added to the pending index since it last
        read it (only claims removed entries).
        """
        return self.key(team_id, "added")

    def lease(self, team_id: str, task_id: str, lease_token: str) -> str:
        """Present while a claim holds its task: `teams:{<team_id>}:leases:<task_id>:<token>`.

        A single step on a task compares it present as well as the task's revision. The
        revision alone already refuses a step of an earlier life of the task (deleted and
        enqueued anew under the same id); the marker also ends a claim the moment its task is
        reaped, deleted or finished, since those delete it.
        """
        return self.key(team_id, "leases", key_part(task_id, "task_id"), lease_token)

    def records(self, team_id: str, kind: str) -> str:
        """A glob over the team's `agents` or `tasks` records."""
        return self.glob(team_id, kind, "*")

    @staticmethod
    def member(task_id: str, lease_token: str | None) -> str:
        """A claim's in-progress index entry: `<task_id>:<lease_token>`."""
        # One in-progress entry per claim, so that no writer ever moves or removes another's.
        return f"{task_id}:{lease_token or _UNLEASED}"

    @staticmethod
    def claim_of(member: str) -> tuple[str, str | None]:
        """The task id and lease token of an in-progress index entry."""
        task_id, _, token = member.rpartition(":")
        return task_id, token if token != _UNLEASED else None


class TaskQueue:
    """The task queue of every team of one `OrchestrationStateManager`.

    Args:
        state: Where the tasks and indexes are.
        log: The manager's logger.
        keys: The teams' key layout.
        require_team: Raises `NotFoundError` unless the team exists.
        capabilities: The capabilities an agent has in a team (none if not a member).
        agent_took: Called when an agent took a task (sets it working, if a member).
        agent_freed: Called when an agent let go of its task (sets it idle, if a member).
        agent_change: An agent's record as it is after taking a task (its id) or letting go
            of one (`None`), from its record before: for the single-step writes below.
        sync_interval, default_lease, max_retries, finished_task_ttl: As the manager's.

    Single steps: where the backend has `transact` (every built-in one), an enqueue's store, a
    claim's take, a completion, a failure and a heartbeat are each one atomic
    `StateManager.transact` (one round trip on Redis) that moves the task and its index entries
    and sets its holder's record, compared on the revisions of the task and the agent record
    this process last wrote or read (`Revision` compares: a revision never comes round again,
    so a step of a claim on an earlier life of a task, deleted and enqueued anew under the same
    id, is refused where a version would match), and on the claim's lease marker
    (`TeamKeys.lease`). The queue remembers those revisions (`_known`, at most `_KNOWN_MAX`
    records); when one is unknown or stale, the step fails its compare, reads them back in the
    same round trip, and the call falls back to the multi-call path (a read, then a
    compare-and-set), which checks the lease token in the record itself and gives the exact
    errors. A completion or failure step also reads the head of the pending index for the next
    claim (see `_candidates`). A backend without `transact` or without revisions always takes
    the multi-call path. docs/managers/orchestration.md describes it all.
    """

    def __init__(
        self,
        state: StateManager,
        log: Any,
        keys: TeamKeys,
        *,
        require_team: Callable[[str], Awaitable[object]],
        capabilities: Callable[[str, str], Awaitable[set[str]]],
        agent_took: Callable[[str, str, str], Awaitable[None]],
        agent_freed: Callable[[str, str], Awaitable[None]],
        agent_change: Callable[[Any, str | None], Any],
        sync_interval: float,
        default_lease: timedelta,
        max_retries: int,
        finished_task_ttl: timedelta | None,
    ) -> None:
        self.state = state
        self.log = log
        self.keys = keys
        self._require_team = require_team
        self._capabilities = capabilities
        self._agent_took = agent_took
        self._agent_freed = agent_freed
        self._agent_change = agent_change
        self.sync_interval = sync_interval
        self.default_lease = default_lease
        self.max_retries = max_retries
        self.finished_task_ttl = finished_task_ttl
        self._checked: dict[str, float] = {}  # team id -> when its indexes were last checked
        self._finishes = 0  # tasks finished here: every 32nd tidies the index
        # key -> (revision, record) this process last wrote or read: 0 and None for missing.
        self._known: dict[str, tuple[int, Any]] = {}
        # False once the backend said it has no transact (or no revisions to compare).
        self._transact = True
        self._heads: dict[str, list[str]] = {}  # team id -> likely head of its pending index
        # team id -> the pending index as this process's last step read it, with the records
        # of its likely head, and the compares that hold while nothing was added to it since.
        self._snapshots: dict[str, tuple[float, _Snapshot]] = {}  # with when it was read

    # single steps

    def _remember(self, key: str, revision: int, value: Any) -> None:
        """Keep a copy of `value` as the record at `revision`.

        A copy, so that what a call hands back (a claim's task) stays the caller's to change.
        """
        self._known.pop(key, None)
        self._known[key] = (revision, _own(value))
        if len(self._known) > _KNOWN_MAX:
            del self._known[next(iter(self._known))]

    def _forget(self, key: str) -> None:
        self._known.pop(key, None)

    async def _step(
        self, compare: Sequence[Revision | Exists], then: Sequence[Op], orelse: Sequence[Op] = ()
    ) -> TransactResult | None:
        """One `StateManager.transact`; `None` (then never again) if the backend cannot.

        It cannot when it has no `transact`, or keeps no revisions to compare.
        """
        if not self._transact:
            return None
        try:
            return await self.state.transact(compare, then, orelse)
        except UnsupportedOperationError:
            self._transact = False
            return None

    def _agent_step(
        self, team_id: str, agent_id: str | None, task_id: str | None
    ) -> tuple[list[Revision], list[Op], list[Op]] | None:
        """The compare, write and read-back of setting an agent's record in a single step.

        `None` if this process does not know the record's revision (then it is set apart, by
        `_set_agent`). A known non-member is compared as missing and left alone.
        """
        if agent_id is None:
            return [], [], []
        key = self.keys.agent(team_id, agent_id)
        known = self._known.get(key)
        if known is None:
            return None
        revision, record = known[0], _own(known[1])
        if revision == 0:
            return [Revision(key, 0)], [], [Get(key)]
        change = self._agent_change(record, task_id)
        return [Revision(key, revision)], [Put(key, change)], [Get(key)]

    def _learn_agent(
        self, team_id: str, agent_id: str | None, ops: Sequence[Op], done: TransactResult
    ) -> None:
        """Remember the agent record a single step wrote or read back (the last op on it)."""
        if agent_id is None:
            return
        key = self.keys.agent(team_id, agent_id)
        for op, result, revision in zip(ops, done.results, done.revisions, strict=True):
            # This manager's own operations: exact types (index operations have no key).
            if type(op) is Put and op.key == key:
                self._remember(key, revision, op.value)
            elif type(op) is Get and op.key == key:
                self._remember(
                    key, *((0, None) if result is None else (result.revision, result.value))
                )

    async def _set_agent(self, team_id: str, agent_id: str, task_id: str | None) -> None:
        """Set an agent's record apart from the task's step (working on `task_id`, or idle)."""
        key = self.keys.agent(team_id, agent_id)
        if self._transact:
            # A read and a compare-and-set, so that the next steps know the record's revision.
            entry = await self.state.get_entry(key)
            if entry is None:
                self._remember(key, 0, None)
                return
            record = self._agent_change(entry.value, task_id)
            done = await self._step([Revision(key, entry.revision)], [Put(key, record)])
            if done is not None and done.succeeded:
                self._remember(key, done.revisions[0], record)
                return
            self._forget(key)  # it changed meanwhile: set it by the multi-call path below
        if task_id is not None:
            await self._agent_took(team_id, agent_id, task_id)
        else:
            await self._agent_freed(team_id, agent_id)

    # records and scores

    @staticmethod
    def _lease_score(task: TaskItem) -> float:
        expires = task.lease_expires_at
        return sort_time(expires) if expires is not None else _NO_LEASE

    @staticmethod
    def _finished_score(task: TaskItem) -> float:
        return sort_time(task.completed_at or task.updated_at)

    def _finished_ttl(self, finished: bool) -> dict[str, Any]:
        # Without finished_task_ttl, writes keep the store's default TTL, as every other write.
        if finished and self.finished_task_ttl is not None:
            return {"ttl": self.finished_task_ttl}
        return {}

    @staticmethod
    def _order(task: TaskItem) -> dict[str, float]:
        # Priority first, then enqueue order: exact in a float up to 2**53.
        return {task.task_id: task.priority.rank * 1e15 + task.sequence}

    def forget(self, team_id: str) -> None:
        """Drop what this queue remembers of a deleted team."""
        self._checked.pop(team_id, None)
        self._heads.pop(team_id, None)
        self._snapshots.pop(team_id, None)
        prefix = self.keys.key(team_id, "")
        for key in [key for key in self._known if key.startswith(prefix)]:
            del self._known[key]

    async def restore(self, team_id: str, task: TaskItem) -> None:
        """Store a task already under way or finished, with its index entry.

        For the queue of a new team given to `create_team`: the task keeps its status and
        stays out of pending.

        Raises:
            ConflictError: The team has a task with this id already.
        """
        await self.state.save(
            self.keys.task(team_id, task.task_id),
            task,
            expected_version=0,
            **self._finished_ttl(task.status in _FINISHED),
        )
        if task.status is TaskStatus.IN_PROGRESS:
            member = self.keys.member(task.task_id, task.lease_token)
            await self.state.index_add(
                self.keys.in_progress(team_id), {member: self._lease_score(task)}
            )
        else:
            await self.state.index_add(
                self.keys.finished(team_id), {task.task_id: self._finished_score(task)}
            )

    # the queue

    async def enqueue_task(self, team_id: str, task: dict[str, Any] | TaskItem) -> TaskItem:
        """Add a task to the team's queue (priority high/normal/low, then first in, first out).

        See `OrchestrationStateManager.enqueue_task`.
        """
        item = _task_from(task)
        await self._require_team(team_id)
        sequence = await self.state.update(self.keys.sequence(team_id), lambda n: n + 1, default=0)
        item = revise(
            item,
            sequence=sequence,
            status=TaskStatus.PENDING,
            max_retries=item.max_retries
            if "max_retries" in item.model_fields_set
            else self.max_retries,
        )
        key = self.keys.task(team_id, item.task_id)
        # Stored, indexed and announced (for claims reading snapshots) in one step.
        done = await self._step(
            [Revision(key, 0)],
            [
                Put(key, item),
                IndexAdd(self.keys.pending(team_id), self._order(item)),
                Put(self.keys.added(team_id), item.task_id, ttl=None),
            ],
        )
        if done is not None and not done.succeeded:
            raise ConflictError(f"task {item.task_id!r} is in team {team_id!r} already")
        if done is None:
            try:
                await self.state.save(key, item, expected_version=0)
            except ConflictError:
                raise ConflictError(
                    f"task {item.task_id!r} is in team {team_id!r} already"
                ) from None
            await self.state.index_add(self.keys.pending(team_id), self._order(item))
        else:
            self._remember(key, done.revisions[0], item)
        return item

    async def get_task(self, team_id: str, task_id: str) -> TaskItem:
        """Return one task (see `OrchestrationStateManager.get_task`)."""
        task = await load(self.state, self.keys.task(team_id, task_id), TaskItem)
        if task is None:
            raise NotFoundError(f"team {team_id!r} has no task {task_id!r}")
        return task

    async def _change_task(
        self,
        team_id: str,
        task_id: str,
        fn: Callable[[TaskItem], TaskItem],
        *,
        finished: bool = False,
    ) -> tuple[TaskItem, TaskItem]:
        """Change a task atomically; return it as it was just before the change, and after."""
        before: list[TaskItem] = []

        def apply(current: Any) -> Any:
            task = TaskItem.model_validate(current)
            before[:] = [task]  # the last run is the one that committed
            return revise(fn(task), updated_at=utcnow())

        key = self.keys.task(team_id, task_id)
        self._forget(key)  # its next revision is not learned here
        try:
            value = await self.state.update(key, apply, **self._finished_ttl(finished))
        except NotFoundError:
            raise NotFoundError(f"team {team_id!r} has no task {task_id!r}") from None
        return before[0], TaskItem.model_validate(value)

    @staticmethod
    def _take(
        task: TaskItem, agent_id: str, lease_token: str, lease_expires_at: datetime | None
    ) -> TaskItem:
        if task.status is not TaskStatus.PENDING:
            raise ConflictError(
                f"task {task.task_id!r} is {task.status.value}"
                + (f" (held by {task.assigned_to!r})" if task.assigned_to else ""),
                key=task.task_id,
            )
        return revise(
            task,
            status=TaskStatus.IN_PROGRESS,
            assigned_to=agent_id,
            lease_token=lease_token,
            lease_expires_at=lease_expires_at,
            attempts=task.attempts + 1,
        )

    async def assign_task(self, team_id: str, task_id: str, agent_id: str) -> TaskItem:
        """Assign a pending task to an agent, atomically across processes (no lease).

        See `OrchestrationStateManager.assign_task`.
        """
        key_part(agent_id, "agent_id")
        self.keys.task(team_id, task_id)  # check the ids before indexing anything
        token = uuid4().hex
        in_progress = self.keys.in_progress(team_id)
        member = self.keys.member(task_id, token)
        # Indexed before the task is taken, so that no assigned task is ever missing from it.
        await self.state.index_add(in_progress, {member: _NO_LEASE})
        try:
            _, task = await self._change_task(
                team_id, task_id, lambda t: self._take(t, agent_id, token, None)
            )
        except (ConflictError, NotFoundError):
            await self.state.index_remove(in_progress, [member])
            raise
        await self.state.index_remove(self.keys.pending(team_id), [task.task_id])
        await self._set_agent(team_id, agent_id, task_id)
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

        See `OrchestrationStateManager.claim_task`.
        """
        key_part(agent_id, "agent_id")
        lease = lease or self.default_lease
        capabilities: set[str] | None = None  # the agent's, read at the first task needing one
        pending = self.keys.pending(team_id)
        in_progress = self.keys.in_progress(team_id)
        skipped: set[str] = set()
        contended = False
        reclaimed = False
        page = _PAGE
        while True:
            ranked, read, guard, earliest = await self._candidates(team_id, page)
            if not reclaimed and earliest and earliest[0][1] <= sort_time(utcnow()):
                # A claim whose lease ran out, by the index (a heartbeat may have extended it
                # since): put such tasks back to pending, then read the index again so that
                # they are taken in queue order. Once per call, so a claim never loops here.
                reclaimed = True
                if await self._reclaim(team_id, limit=_PAGE):
                    continue
            candidates = [(task_id, score) for task_id, score in ranked if task_id not in skipped]
            if not candidates:
                if guard:
                    continue  # the snapshot may be behind: read the index itself
                return None
            stale = False
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
                key = self.keys.task(team_id, task_id)
                if task_id in read:
                    entry = read.pop(task_id)  # read with the index, in the same step
                else:
                    entry = await self.state.get_entry(key, model=TaskItem)
                task: TaskItem | None = entry.value if entry is not None else None
                if entry is None or task is None or task.status is not TaskStatus.PENDING:
                    # A stale entry (the task was taken or finished): tidy it away, unless the
                    # task changed since (it may be pending again, and indexed again).
                    revision = 0 if entry is None else entry.revision
                    tidied = await self._step(
                        [Revision(key, revision)], [IndexRemove(pending, [task_id])]
                    )
                    if tidied is None:
                        await self.state.index_remove(pending, [task_id])
                    continue
                if task.capability is not None:
                    if capability is not None and task.capability != capability:
                        skipped.add(task_id)  # narrowed away: no need to read the agent
                        continue
                    if capabilities is None:
                        capabilities = await self._capabilities(team_id, agent_id)
                    if task.capability not in capabilities:
                        skipped.add(task_id)
                        continue
                now = utcnow()
                taken = revise(self._take(task, agent_id, uuid4().hex, now + lease), updated_at=now)
                assert taken.lease_token is not None  # noqa: S101  # set by _take
                assert taken.lease_expires_at is not None  # noqa: S101
                member = self.keys.member(task_id, taken.lease_token)
                won = await self._take_step(
                    team_id, agent_id, key, entry.revision, taken, member, guard, lease
                )
                if won == "stale":
                    stale = True  # a task was added to pending since the snapshot
                    break
                if won == "lost":
                    contended = True
                    continue  # another worker won this one
                if won == "taken":
                    # The next candidates of this page: read with the index by the next claim.
                    self._heads[team_id] = [c for c, _ in candidates[:_HEADS]]
                    return TaskClaim(
                        team_id=team_id,
                        task=_own(taken),
                        lease_token=taken.lease_token,
                        lease_expires_at=taken.lease_expires_at,
                    )
                # The claim is indexed before the task is taken, so that a worker dying between
                # the two leaves a stale entry (tidied by the reaper), never an unreapable task.
                await self.state.index_add(in_progress, {member: self._lease_score(taken)})
                try:
                    # Compare-and-set on what was just read: one round trip, and only one
                    # claimer can win it.
                    await self.state.save(key, taken, **conditional(self.state, entry))
                except ConflictError:
                    await self.state.index_remove(in_progress, [member])
                    contended = True
                    continue  # another worker won this one
                await self.state.index_remove(pending, [task_id])
                await self._set_agent(team_id, agent_id, task_id)
                return TaskClaim(
                    team_id=team_id,
                    task=_own(taken),
                    lease_token=taken.lease_token,
                    lease_expires_at=taken.lease_expires_at,
                )
            if stale or guard:
                continue  # read the index itself, from the start
            page *= 2  # every candidate on this page was skipped or lost: look further

    async def _candidates(self, team_id: str, page: int) -> _Snapshot:
        """Read the pending index's head, its likely records, a guard and the first claim.

        The first read of a claim uses the snapshot that this process's last completion or
        failure of a task of the team took in its own step, if there is one. Its guard compares
        the revision of `TeamKeys.added` as that step read it, so a take compared on it fails if
        a task was added to pending since (then the claim reads the index again). Else one step
        reads the index's first `page` entries and the records of the tasks that followed the
        last task this process claimed (the likely head now), with no guard. Either way the
        records are those of the same instant as the index, and only records of tasks in the
        returned head are returned. The first entry of the in-progress index (lowest lease
        expiry) comes from the same read: a claim checks it against its own clock to learn
        whether a lease may have run out (see `_reclaim`), at no extra round trip.
        """
        kept = self._snapshots.pop(team_id, None)
        if kept is not None and page == _PAGE and time.monotonic() - kept[0] < _SNAPSHOT_LIFE:
            return kept[1]
        pending = self.keys.pending(team_id)
        in_progress = self.keys.in_progress(team_id)
        guesses = self._heads.pop(team_id, [])
        if self._transact:
            keys = [self.keys.task(team_id, task_id) for task_id in guesses]
            done = await self._step(
                [],
                [
                    IndexRange(pending, limit=page),
                    IndexRange(in_progress, limit=1),
                    *[Get(key, model=TaskItem) for key in keys],
                ],
            )
            if done is not None:
                ranked, earliest, *entries = done.results
                return ranked, self._head_entries(ranked, guesses, entries), [], earliest
        return (
            await self.state.index_range(pending, limit=page),
            {},
            [],
            await self.state.index_range(in_progress, limit=1),
        )

    @staticmethod
    def _head_entries(
        ranked: list[tuple[str, float]], ids: list[str], entries: Sequence[StateEntry | None]
    ) -> dict[str, StateEntry | None]:
        head = {task_id for task_id, _ in ranked}
        return {
            task_id: entry for task_id, entry in zip(ids, entries, strict=True) if task_id in head
        }

    def _snapshot_ops(self, team_id: str) -> tuple[list[Op], list[str]]:
        """The reads a completion or failure step ends with, for the next claim's snapshot.

        Returns them and the ids of the tasks whose records they read.
        """
        guesses = self._heads.pop(team_id, [])
        return [
            IndexRange(self.keys.pending(team_id), limit=_PAGE),
            IndexRange(self.keys.in_progress(team_id), limit=1),
            Get(self.keys.added(team_id)),
            *[Get(self.keys.task(team_id, task_id), model=TaskItem) for task_id in guesses],
        ], guesses

    def _keep_snapshot(self, team_id: str, guesses: list[str], results: Sequence[Any]) -> None:
        """Keep what the `_snapshot_ops` at the end of a step read, for the next claim."""
        ranked, earliest, added, *entries = results
        guard = [Revision(self.keys.added(team_id), 0 if added is None else added.revision)]
        snapshot = (ranked, self._head_entries(ranked, guesses, entries), guard, earliest)
        self._snapshots[team_id] = (time.monotonic(), snapshot)

    async def _take_step(
        self,
        team_id: str,
        agent_id: str,
        key: str,
        revision: int,
        taken: TaskItem,
        member: str,
        guard: list[Revision],
        lease: timedelta,
    ) -> Literal["taken", "lost", "stale", "none"]:
        """Take a task read at `revision` in a single step, compared also on `guard`.

        Returns "taken", "lost" (the task changed), "stale" (a guard's key changed: a task was
        added to pending since the snapshot), or "none" (the backend has no `transact`).
        Indexed and taken at once, the claim leaves no stale index entry behind even when its
        worker dies right after.
        """
        task_id = taken.task_id
        for _ in range(_AGENT_RETRIES):
            agent = self._agent_step(team_id, agent_id, task_id)
            compare, agent_then, agent_back = agent or ([], [], [])
            assert taken.lease_token is not None  # noqa: S101  # a claim always has one
            then: list[Op] = [
                Put(key, taken),
                Put(self.keys.lease(team_id, task_id, taken.lease_token), task_id, ttl=2 * lease),
                IndexAdd(self.keys.in_progress(team_id), {member: self._lease_score(taken)}),
                IndexRemove(self.keys.pending(team_id), [task_id]),
                *agent_then,
            ]
            orelse: list[Op] = [
                Get(key, model=TaskItem),
                *agent_back,
                *[Get(check.key) for check in guard],
            ]
            done = await self._step([Revision(key, revision), *guard, *compare], then, orelse)
            if done is None:
                return "none"
            if done.succeeded:
                self._remember(key, done.revisions[0], taken)
                self._learn_agent(team_id, agent_id, then, done)
                if agent is None:
                    await self._set_agent(team_id, agent_id, task_id)
                return "taken"
            self._learn_agent(team_id, agent_id, orelse, done)
            current = done.results[0]
            if current is None or current.revision != revision:
                self._forget(key)
                return "lost"  # the task changed: another worker took it (or it went)
            now = done.results[len(done.results) - len(guard) :]
            if any(
                (0 if entry is None else entry.revision) != check.revision
                for check, entry in zip(guard, now, strict=True)
            ):
                return "stale"
        return "lost"

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
        """Extend a claim's lease (see `OrchestrationStateManager.heartbeat`)."""
        life = lease or self.default_lease

        def extend(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, None)
            return revise(task, lease_expires_at=utcnow() + life)

        # The in-progress index keeps the older expiry: when it comes due, the reaper finds the
        # lease extended and moves the entry (one index write per lease, not per heartbeat).
        known = self._held(team_id, task_id, lease_token, None)
        if known is not None:
            revision, held = known
            key = self.keys.task(team_id, task_id)
            extended = revise(extend(held), updated_at=utcnow())
            held_key = self.keys.lease(team_id, task_id, lease_token)
            done = await self._step(
                [Revision(key, revision), Exists(held_key)],
                [Put(key, extended), Put(held_key, task_id, ttl=2 * life)],
            )
            if done is not None and done.succeeded:
                self._remember(key, done.revisions[0], extended)
                return extended
        _, task = await self._change_task(team_id, task_id, extend)
        return task

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

        See `OrchestrationStateManager.complete_task`.
        """

        def complete(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, agent_id)
            done = revise(
                task,
                status=TaskStatus.COMPLETED,
                result=result,
                lease_expires_at=None,
                completed_at=utcnow(),
            )
            # The result may fit alone and not with the task's data: nothing is written then.
            if error := encode_error(self.state, done, "$.result"):
                raise error
            return done

        known = self._held(team_id, task_id, lease_token, agent_id)
        if known is not None:
            revision, held = known
            done = await self._finish_step(team_id, revision, held, complete(held))
            if done is not None:
                return done
        before, task = await self._change_task(team_id, task_id, complete, finished=True)
        await self._finish(team_id, before, task)
        return task

    def _held(
        self, team_id: str, task_id: str, lease_token: str | None, agent_id: str | None
    ) -> tuple[int, TaskItem] | None:
        """The revision and record of a task this process knows to be in progress as given."""
        if not self._transact:
            return None
        known = self._known.get(self.keys.task(team_id, task_id))
        if known is None or not isinstance(known[1], TaskItem):
            return None
        revision, task = known[0], _own(known[1])
        if task.lease_token is None:
            return None
        try:
            self._check_holder(task, lease_token, agent_id)
        except ConflictError:
            return None  # maybe stale: the multi-call path reads it and says exactly why
        return revision, task

    async def _finish_step(
        self, team_id: str, revision: int, before: TaskItem, after: TaskItem
    ) -> TaskItem | None:
        """Move a task out of in-progress in a single step, compared on the known `revision`.

        Writes the task, adds its next index entry, removes its claim's, and sets its holder
        idle (in the same step when this process knows the holder's record). Returns the task
        as written, or `None` when the compare failed or the backend has no `transact`: then
        the multi-call path takes over.
        """
        key = self.keys.task(team_id, before.task_id)
        task = revise(after, updated_at=utcnow())
        finished = task.status in _FINISHED
        if finished:
            entry: IndexAdd = IndexAdd(
                self.keys.finished(team_id), {task.task_id: self._finished_score(task)}
            )
        else:
            entry = IndexAdd(self.keys.pending(team_id), self._order(task))
        ttl = self.finished_task_ttl if finished and self.finished_task_ttl is not None else None
        member = self.keys.member(before.task_id, before.lease_token)
        assert before.lease_token is not None  # noqa: S101  # see _held
        held_key = self.keys.lease(team_id, before.task_id, before.lease_token)
        holder = before.assigned_to
        # Back to pending: say so, for the claims that read the index before (see _candidates).
        added: list[Op] = (
            [] if finished else [Put(self.keys.added(team_id), task.task_id, ttl=None)]
        )
        for _ in range(_AGENT_RETRIES):
            agent = self._agent_step(team_id, holder, None)
            compare, agent_then, agent_back = agent or ([], [], [])
            reads, guesses = self._snapshot_ops(team_id)
            then: list[Op] = [
                Put(key, task, ttl=CONFIGURED if ttl is None else ttl),
                entry,
                *added,
                IndexRemove(self.keys.in_progress(team_id), [member]),
                Delete(held_key),
                *agent_then,
                *reads,
            ]
            orelse: list[Op] = [Get(key, model=TaskItem), Get(held_key), *agent_back]
            done = await self._step(
                [Revision(key, revision), Exists(held_key), *compare], then, orelse
            )
            if done is None:
                return None
            if done.succeeded:
                self._remember(key, done.revisions[0], task)
                self._learn_agent(team_id, holder, then, done)
                self._keep_snapshot(team_id, guesses, done.results[len(then) - len(reads) :])
                if agent is None and holder is not None:
                    await self._set_agent(team_id, holder, None)
                await self._finished_one(team_id, task)
                return task
            self._learn_agent(team_id, holder, orelse, done)
            current = done.results[0]
            if current is None or current.revision != revision or done.results[1] is None:
                self._forget(key)
                return None
        return None

    async def _finish(self, team_id: str, before: TaskItem, task: TaskItem) -> None:
        """Move a task that just left in-progress to its next index; set its holder idle."""
        member = self.keys.member(before.task_id, before.lease_token)
        if before.lease_token is not None:  # the claim is over, as in the single step
            await self.state.delete(self.keys.lease(team_id, before.task_id, before.lease_token))
        # The new index entry goes in before the old one goes, so a reader of the indexes
        # (get_queue_status) never finds the task in neither.
        if task.status is TaskStatus.PENDING:
            await self.state.index_add(self.keys.pending(team_id), self._order(task))
            await self._added(team_id, task.task_id)
        else:
            await self.state.index_add(
                self.keys.finished(team_id), {task.task_id: self._finished_score(task)}
            )
        await self.state.index_remove(self.keys.in_progress(team_id), [member])
        if before.assigned_to is not None:
            await self._set_agent(team_id, before.assigned_to, None)
        await self._finished_one(team_id, task)

    async def _added(self, team_id: str, task_id: str) -> None:
        """Say that a task was added to pending (after it was indexed): see `_candidates`."""
        if self._transact:  # only a backend with transact has claims that read snapshots
            await self.state.save(self.keys.added(team_id), task_id, ttl=None)

    async def _finished_one(self, team_id: str, task: TaskItem) -> None:
        """Count a task that just left in-progress; tidy the finished index every 32nd."""
        if task.status in _FINISHED:
            self._finishes += 1
            if self.finished_task_ttl is not None and self._finishes % 32 == 0:
                # Expired tasks leave their index entries behind: tidy them as tasks finish, so
                # the index stays bounded even where nobody runs reap_expired.
                await self._tidy_finished(team_id)

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

        See `OrchestrationStateManager.fail_task`.
        """
        # The TTL is chosen before the write: expect a retry, and redo the write in the rare
        # case that it turns out to be the dead letter (only when the two TTLs differ).
        expect_dead = False
        predicting = self.finished_task_ttl is not None

        def fail(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, agent_id)
            failures = task.failures + 1
            dead = failures > task.max_retries
            if predicting and dead is not expect_dead:
                raise _Mispredicted
            return revise(
                task,
                status=TaskStatus.DEAD_LETTER if dead else TaskStatus.PENDING,
                failures=failures,
                error=error,
                assigned_to=None,
                lease_token=None,
                lease_expires_at=None,
            )

        task: TaskItem | None = None
        known = self._held(team_id, task_id, lease_token, agent_id)
        if known is not None:
            revision, held = known
            expect_dead = held.failures + 1 > held.max_retries
            task = await self._finish_step(team_id, revision, held, fail(held))
        while task is None:
            try:
                before, task = await self._change_task(team_id, task_id, fail, finished=expect_dead)
            except _Mispredicted:
                expect_dead = not expect_dead
                continue
            await self._finish(team_id, before, task)
        self.log.info(
            "task_failed",
            team_id=team_id,
            task_id=task_id,
            dead_letter=task.status is TaskStatus.DEAD_LETTER,
        )
        if task.status is TaskStatus.PENDING:
            _otel.record_retry(self.state.backend, "task")
        return task

    async def release_task(
        self,
        team_id: str,
        task_id: str,
        *,
        lease_token: str | None = None,
        agent_id: str | None = None,
    ) -> TaskItem:
        """Give an in-progress task back to pending, counting no failure.

        See `OrchestrationStateManager.release_task`.
        """

        def release(task: TaskItem) -> TaskItem:
            self._check_holder(task, lease_token, agent_id)
            return self._released(task)

        task: TaskItem | None = None
        known = self._held(team_id, task_id, lease_token, agent_id)
        if known is not None:
            revision, held = known
            task = await self._finish_step(team_id, revision, held, release(held))
        if task is None:
            before, task = await self._change_task(team_id, task_id, release)
            await self._finish(team_id, before, task)
        self.log.info("task_released", team_id=team_id, task_id=task_id)
        return task

    async def delete_task(self, team_id: str, task_id: str) -> TaskItem:
        """Delete a task in any status, with its index entries; return it as it was.

        See `OrchestrationStateManager.delete_task`.
        """
        key = self.keys.task(team_id, task_id)
        self._forget(key)
        while True:
            entry = await self.state.get_entry(key, model=TaskItem)
            if entry is None:
                raise NotFoundError(f"team {team_id!r} has no task {task_id!r}")
            try:
                await self.state.delete(key, **conditional(self.state, entry))
            except ConflictError:
                continue  # it changed meanwhile: delete what it is now
            break
        task: TaskItem = entry.value
        if task.lease_token is not None:  # its holder's single steps must fail from now on
            await self.state.delete(self.keys.lease(team_id, task_id, task.lease_token))
        await self.state.index_remove(self.keys.pending(team_id), [task_id])
        await self.state.index_remove(self.keys.finished(team_id), [task_id])
        if task.status is TaskStatus.IN_PROGRESS:
            await self.state.index_remove(
                self.keys.in_progress(team_id), [self.keys.member(task_id, task.lease_token)]
            )
            if task.assigned_to is not None:
                await self._set_agent(team_id, task.assigned_to, None)
        return task

    async def purge_finished(self, team_id: str, *, older_than: timedelta | None = None) -> int:
        """Delete the team's completed and dead-lettered tasks, oldest first.

        See `OrchestrationStateManager.purge_finished`.
        """
        if older_than is not None and (
            not isinstance(older_than, timedelta) or older_than < timedelta(0)
        ):
            raise InvalidArgumentError(f"older_than must be a timedelta >= 0, not {older_than!r}")
        await self._require_team(team_id)
        cutoff = sort_time(utcnow() - older_than) if older_than is not None else math.inf
        finished = self.keys.finished(team_id)
        purged = 0
        while entries := await self._due(finished, cutoff, limit=256):
            keys = [self.keys.task(team_id, task_id) for task_id, _ in entries]
            found = await read_entries(self.state, keys, model=TaskItem)
            done: list[str] = []
            for (task_id, _), key, entry in zip(entries, keys, found, strict=True):
                self._forget(key)
                if entry is not None and entry.value.status in _FINISHED:
                    # Finished is terminal, but the task may be deleted and a new one enqueued
                    # under its id since the read: delete only the record read (its revision).
                    try:
                        purged += await self.state.delete(key, **conditional(self.state, entry))
                    except ConflictError:
                        now = await self.state.get_entry(key, model=TaskItem)
                        if now is not None and now.value.status in _FINISHED:
                            continue  # a new life finished too: its own score says when it goes
                done.append(task_id)
            await self.state.index_remove(finished, done)
        if purged:
            self.log.info("finished_tasks_purged", team_id=team_id, count=purged)
        return purged

    async def _due(
        self, index: str, cutoff: float, *, limit: int | None = None
    ) -> list[tuple[str, float]]:
        """The entries of `index` scored at most `cutoff`, lowest first (at most `limit`)."""
        page = 64 if limit is None else min(64, limit)
        while True:
            entries = await self.state.index_range(index, limit=page)
            due = [(member, score) for member, score in entries if score <= cutoff]
            if len(due) < len(entries) or len(entries) < page:
                return due
            if limit is not None and page >= limit:
                return due
            page = page * 2 if limit is None else min(page * 2, limit)

    async def _tidy_finished(self, team_id: str) -> None:
        """Drop the finished-index entries of tasks that have expired (`finished_task_ttl`)."""
        if self.finished_task_ttl is None:
            return
        cutoff = sort_time(utcnow() - self.finished_task_ttl)
        entries = await self._due(self.keys.finished(team_id), cutoff, limit=256)
        if not entries:
            return
        keys = [self.keys.task(team_id, task_id) for task_id, _ in entries]
        found = await self.state.get_many(keys, model=TaskItem)
        gone = [
            task_id for (task_id, _), key in zip(entries, keys, strict=True) if key not in found
        ]
        if gone:
            await self.state.index_remove(self.keys.finished(team_id), gone)

    async def reap_expired(self, team_id: str) -> list[str]:
        """Put tasks whose lease expired back to pending; restore lost index entries.

        See `OrchestrationStateManager.reap_expired`.
        """
        await self._check_indexes(team_id)
        requeued = await self._reclaim(team_id)
        await self._tidy_finished(team_id)
        return requeued

    async def _reclaim(self, team_id: str, *, limit: int | None = None) -> list[str]:
        """Put the tasks whose lease ran out back to pending; return their ids.

        Reads the in-progress entries that are due by their score (at most `limit`) and their
        task records at once, then, for each: a stale entry (its claim is over) is removed, an
        entry whose lease a heartbeat extended is moved to the new expiry, and a task whose
        lease did run out goes back to pending in one atomic step compared on the revision read
        (`_release`). Claims call it on their way (`claim_task`), `reap_expired` for the rest.
        """
        now = utcnow()
        in_progress = self.keys.in_progress(team_id)
        due = await self._due(in_progress, sort_time(now), limit=limit)
        requeued: list[str] = []
        if due:
            claims = [(member, *self.keys.claim_of(member)) for member, _ in due]
            keys = list(dict.fromkeys(self.keys.task(team_id, task_id) for _, task_id, _ in claims))
            found = await self._entries(keys)
            stale: list[str] = []
            moved: dict[str, float] = {}
            for member, task_id, token in claims:
                entry = found.get(self.keys.task(team_id, task_id))
                task: TaskItem | None = None if entry is None else entry[1]
                if task is None or task.status is not TaskStatus.IN_PROGRESS:
                    stale.append(member)  # finished, failed, reaped or deleted meanwhile
                elif task.lease_token != token:
                    stale.append(member)  # a claim that lost its race or was handed on
                elif task.lease_expires_at is None:
                    moved[member] = _NO_LEASE
                elif sort_time(task.lease_expires_at) > sort_time(now):
                    moved[member] = self._lease_score(task)  # heartbeats extended it
                elif await self._release(team_id, task, 0 if entry is None else entry[0]):
                    stale.append(member)
                    requeued.append(task_id)
            if stale:
                await self.state.index_remove(in_progress, stale)
            if moved:
                await self.state.index_add(in_progress, moved)
        _otel.record_lease_expiries(self.state.backend, team_id, len(requeued))
        return requeued

    async def _entries(self, keys: list[str]) -> dict[str, tuple[int, TaskItem]]:
        """The revision and record of each task of `keys` that exists, read at once.

        The revision is 0 where the backend has no `transact` (then `_release` takes the
        multi-call path).
        """
        done = await self._step([], [Get(key, model=TaskItem) for key in keys])
        if done is not None:
            return {
                key: (entry.revision, entry.value)
                for key, entry in zip(keys, done.results, strict=True)
                if entry is not None
            }
        found = await self.state.get_many(keys, model=TaskItem)
        return {key: (0, task) for key, task in found.items()}

    @staticmethod
    def _released(task: TaskItem) -> TaskItem:
        """A task in progress, back to pending with no holder (its counts unchanged)."""
        return revise(
            task,
            status=TaskStatus.PENDING,
            assigned_to=None,
            lease_token=None,
            lease_expires_at=None,
        )

    async def _release(self, team_id: str, task: TaskItem, revision: int) -> bool:
        """Put a task whose lease ran out back to pending; False if it changed meanwhile.

        One atomic step compared on the `revision` the task was read at: the task goes back to
        pending, its pending entry and the `added` marker are written, and its claim's entry
        and lease marker removed (its holder's single steps fail from then on). Without
        `transact` (or a revision), a compare-and-set of the record and then the index writes.
        """
        token = task.lease_token
        key = self.keys.task(team_id, task.task_id)
        member = self.keys.member(task.task_id, token)
        back = revise(self._released(task), updated_at=utcnow())
        done = None
        if revision:
            done = await self._step(
                [Revision(key, revision)],
                [
                    Put(key, back),
                    IndexAdd(self.keys.pending(team_id), self._order(back)),
                    Put(self.keys.added(team_id), back.task_id, ttl=None),
                    IndexRemove(self.keys.in_progress(team_id), [member]),
                    *(
                        [Delete(self.keys.lease(team_id, task.task_id, token))]
                        if token is not None
                        else []
                    ),
                ],
            )
            if done is not None and not done.succeeded:
                self._forget(key)
                return False  # renewed, finished, or taken back by another claim meanwhile
            if done is not None:
                self._remember(key, done.revisions[0], back)
        if done is None and not await self._release_apart(team_id, task):
            return False
        if task.assigned_to is not None:
            await self._set_agent(team_id, task.assigned_to, None)
        self.log.warning("lease_expired", team_id=team_id, task_id=task.task_id)
        return True

    async def _release_apart(self, team_id: str, task: TaskItem) -> bool:
        """`_release` by the multi-call path; False if the task changed meanwhile."""
        token = task.lease_token

        def release(current: TaskItem) -> TaskItem:
            if current.status is not TaskStatus.IN_PROGRESS or current.lease_token != token:
                raise InvalidTransitionError("lease renewed or task finished meanwhile")
            expires = current.lease_expires_at
            if expires is not None and sort_time(expires) > time.time():
                raise InvalidTransitionError("lease renewed meanwhile")
            return self._released(current)

        try:
            _, back = await self._change_task(team_id, task.task_id, release)
        except (InvalidTransitionError, NotFoundError):
            return False
        if token is not None:  # the claim is over: its holder's single steps fail from now on
            await self.state.delete(self.keys.lease(team_id, task.task_id, token))
        await self.state.index_add(self.keys.pending(team_id), self._order(back))
        await self._added(team_id, back.task_id)
        return True

    async def _check_indexes(self, team_id: str) -> None:
        """Check the team's task records against its indexes, when that is due."""
        now = time.monotonic()
        last = self._checked.get(team_id)
        if last is not None and now - last < _REPAIR_EVERY * self.sync_interval:
            return
        self._checked[team_id] = now
        pending, in_progress, finished = (
            self.keys.pending(team_id),
            self.keys.in_progress(team_id),
            self.keys.finished(team_id),
        )
        # The indexes are read before the records: an entry whose task is missing from the
        # records read afterwards was stale already.
        queued = {task_id for task_id, _ in await self.state.index_range(pending)}
        claims = dict(await self.state.index_range(in_progress))
        done = {task_id for task_id, _ in await self.state.index_range(finished)}
        tasks = {
            task.task_id: task
            for task in await load_many(self.state, self.keys.records(team_id, "tasks"), TaskItem)
        }
        add_pending: dict[str, float] = {}
        add_claims: dict[str, float] = {}
        add_done: dict[str, float] = {}
        for task in tasks.values():
            if task.status is TaskStatus.PENDING and task.task_id not in queued:
                add_pending.update(self._order(task))
            elif task.status is TaskStatus.IN_PROGRESS:
                member = self.keys.member(task.task_id, task.lease_token)
                if member not in claims:
                    add_claims[member] = self._lease_score(task)
            elif task.status in _FINISHED and task.task_id not in done:
                add_done[task.task_id] = self._finished_score(task)
        # Finished entries whose task expired or was deleted, and claims without a lease that
        # are not their task's current one (claims with a lease are tidied when they come due).
        gone = [t for t in done if t not in tasks or tasks[t].status not in _FINISHED]
        unleased = [
            member
            for member, score in claims.items()
            if score >= _NO_LEASE
            and (
                (current := tasks.get(self.keys.claim_of(member)[0])) is None
                or current.status is not TaskStatus.IN_PROGRESS
                or self.keys.member(current.task_id, current.lease_token) != member
            )
        ]
        for index, adds in (
            (pending, add_pending),
            (in_progress, add_claims),
            (finished, add_done),
        ):
            if adds:
                await self.state.index_add(index, adds)
        if add_pending:
            await self._added(team_id, next(iter(add_pending)))
        if gone:
            await self.state.index_remove(finished, gone)
        if unleased:
            await self.state.index_remove(in_progress, unleased)
        if add_pending or add_claims or add_done:
            self.log.info(
                "task_indexes_restored",
                team_id=team_id,
                pending=len(add_pending),
                in_progress=len(add_claims),
                finished=len(add_done),
            )

    async def _indexed(
        self, team_id: str, *, include_finished: bool
    ) -> tuple[list[str], list[str]]:
        """The ids in the pending and in-progress indexes, and in the finished one.

        Read in one atomic step where the backend has `transact`, so that a task moving
        between two indexes meanwhile is in exactly one of them.
        """
        indexes = [self.keys.pending(team_id), self.keys.in_progress(team_id)]
        if include_finished:
            indexes.append(self.keys.finished(team_id))
        done = await self._step([], [IndexRange(index) for index in indexes])
        if done is not None:
            pending, claims, *rest = done.results
            finished = rest[0] if rest else []
            ids = [task_id for task_id, _ in pending]
            ids += [self.keys.claim_of(member)[0] for member, _ in claims]
            return list(dict.fromkeys(ids)), [task_id for task_id, _ in finished]
        ids = [task_id for task_id, _ in await self.state.index_range(indexes[0])]
        ids += [
            self.keys.claim_of(member)[0] for member, _ in await self.state.index_range(indexes[1])
        ]
        finished_ids: list[str] = []
        if include_finished:
            finished_ids = [task_id for task_id, _ in await self.state.index_range(indexes[2])]
        # A task sent back from in-progress to pending after the first read of pending was
        # read in neither: read pending again (entries are added before the old ones go).
        ids += [task_id for task_id, _ in await self.state.index_range(indexes[0])]
        return list(dict.fromkeys(ids)), finished_ids

    async def get_queue_status(
        self, team_id: str, *, include_finished: bool = True
    ) -> TaskQueueState:
        """Return the team's tasks grouped by status, each list in queue order.

        See `OrchestrationStateManager.get_queue_status`.
        """
        await self._check_indexes(team_id)
        ids, finished_ids = await self._indexed(team_id, include_finished=include_finished)
        keys = {task_id: self.keys.task(team_id, task_id) for task_id in [*ids, *finished_ids]}
        found = await self.state.get_many(list(keys.values()), model=TaskItem) if keys else {}
        # Grouped by each record's own status: the indexes are only hints.
        tasks = [
            task for task in found.values() if include_finished or task.status not in _FINISHED
        ]
        tasks.sort(key=lambda task: (task.priority.rank, task.sequence))
        groups: dict[TaskStatus, list[TaskItem]] = {status: [] for status in TaskStatus}
        for task in tasks:
            groups[task.status].append(task)
        gone = [task_id for task_id in finished_ids if keys[task_id] not in found]
        if gone:  # expired (finished_task_ttl) or deleted
            await self.state.index_remove(self.keys.finished(team_id), gone)
        _otel.record_queue_depth(
            self.state.backend, team_id, {status.value: len(groups[status]) for status in groups}
        )
        return TaskQueueState(
            pending=groups[TaskStatus.PENDING],
            in_progress=groups[TaskStatus.IN_PROGRESS],
            completed=groups[TaskStatus.COMPLETED],
            dead_letter=groups[TaskStatus.DEAD_LETTER],
        )
