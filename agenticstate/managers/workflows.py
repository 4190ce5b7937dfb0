"""Workflow execution state: a state machine, step progress, checkpoints, pause and resume.

```python
workflow_state = WorkflowStateManager(persistence="redis", checkpoint_interval=5)
await workflow_state.create(WorkflowState(workflow_id="research", total_steps=10))
async with workflow_state.step("research", 1, "collect") as step:   # waits while paused
    step.result = {"documents": 150}
await workflow_state.pause("research")          # from any process
await workflow_state.resume("research")
```

Every change is one atomic read-modify-write on the workflow's record, so step updates from
several processes never lose each other and an illegal move raises `InvalidTransitionError`
without changing anything.

A checkpoint belongs to one life of its workflow (a workflow deleted and created again under the
same id is a new life). Each write of a checkpoint is one step compared on the record's revision
(never its version, which starts over in a new life), so a write that read one life never lands
in another or outlives the delete. The delete removes the record and the checkpoints it listed
and writes a deletion marker in one step, deletes the checkpoints created before the marker
(those that came late), then removes the marker; `create` refuses to begin a new life while a
marker is there and finishes that delete first. So while a record is stored, every checkpoint
stored under its id is of its life. `resume_from` rewinds the record and retires the later
checkpoints in one step, compared on everything it read. On a backend without `transact` or
revisions, these take the older multi-call paths.

Key layout (the id sits in a `{...}` hash tag, so one workflow's keys share a Redis Cluster slot):
`workflows:{<workflow_id>}:state`, `workflows:{<workflow_id>}:checkpoints:<checkpoint_id>`, and,
while a delete is under way (or stopped half way), `workflows:{<workflow_id>}:deleting`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from contextlib import asynccontextmanager
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
    SerializationError,
    UnsupportedOperationError,
    WorkflowCancelledError,
)
from agenticstate.managers._base import (
    StateManagerBase,
    TaggedKeys,
    encode_error,
    jitter,
    mapping_argument,
    revise,
    sort_time,
    unstorable,
    utcnow,
)
from agenticstate.txn import Delete, Get, Put, Revision, Version

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from pathlib import Path

    from agenticstate import StateEntry
    from agenticstate.manager import StateManager
    from agenticstate.managers._base import Persistence
    from agenticstate.txn import Op, TransactResult

__all__ = [
    "StepState",
    "StepStatus",
    "WorkflowCheckpoint",
    "WorkflowState",
    "WorkflowStateManager",
    "WorkflowStatus",
    "WorkflowStep",
]


class WorkflowStatus(StrEnum):
    """Where a workflow is in its life."""

    PENDING = "pending"
    """Created, not started."""
    RUNNING = "running"
    """Steps are being executed."""
    PAUSED = "paused"
    """The runner waits at the next step boundary until resumed or cancelled."""
    COMPLETED = "completed"
    """Finished successfully (terminal)."""
    FAILED = "failed"
    """Stopped by an error; `resume_from` a checkpoint runs it again."""
    CANCELLED = "cancelled"
    """Stopped on request (terminal)."""


TRANSITIONS: dict[WorkflowStatus, frozenset[WorkflowStatus]] = {
    WorkflowStatus.PENDING: frozenset(
        {WorkflowStatus.RUNNING, WorkflowStatus.PAUSED, WorkflowStatus.CANCELLED}
    ),
    WorkflowStatus.RUNNING: frozenset(
        {
            WorkflowStatus.PAUSED,
            WorkflowStatus.COMPLETED,
            WorkflowStatus.FAILED,
            WorkflowStatus.CANCELLED,
        }
    ),
    WorkflowStatus.PAUSED: frozenset(
        {WorkflowStatus.RUNNING, WorkflowStatus.FAILED, WorkflowStatus.CANCELLED}
    ),
    WorkflowStatus.FAILED: frozenset({WorkflowStatus.RUNNING, WorkflowStatus.CANCELLED}),
    WorkflowStatus.COMPLETED: frozenset(),
    WorkflowStatus.CANCELLED: frozenset(),
}
"""The legal moves. FAILED -> RUNNING happens through `resume_from` (a retry)."""


class StepStatus(StrEnum):
    """The state of one step."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    """In flight when the workflow was cancelled, completed or failed: its result is refused."""


class StepState(BaseModel):
    """One step's outcome, as `update_step` records it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_number: int = Field(ge=1)
    """1-based position in the workflow."""
    name: str = ""
    status: StepStatus = StepStatus.COMPLETED
    result: Any = None
    duration_ms: float | None = None
    error: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None


class WorkflowState(BaseModel):
    """A workflow's execution state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workflow_id: str
    status: WorkflowStatus = WorkflowStatus.PENDING
    total_steps: int = Field(default=0, ge=0)
    current_step: int = Field(default=0, ge=0)
    """The highest step number completed (or skipped) so far."""
    context: dict[str, Any] = Field(default_factory=dict)
    """Data the steps share; restored by `resume_from`."""
    steps: dict[int, StepState] = Field(default_factory=dict)
    """Every step recorded, by step number."""
    name: str | None = None
    error: str | None = None
    cancel_reason: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def is_terminal(self) -> bool:
        """Whether no further move is possible."""
        return not TRANSITIONS[self.status]


class WorkflowCheckpoint(BaseModel):
    """A saved point a workflow can resume from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workflow_id: str
    checkpoint_id: str
    step: int = Field(ge=0)
    """The `current_step` to resume at."""
    state: Any = None
    """The workflow's state at that point (a `WorkflowState` dump when written automatically)."""
    context: dict[str, Any] = Field(default_factory=dict)
    """The context to restore."""
    timestamp: datetime = Field(default_factory=utcnow)
    automatic: bool = False
    """Whether `update_step` wrote it (every `checkpoint_interval` steps)."""


class WorkflowStep:
    """The handle `WorkflowStateManager.step()` yields: set `result` (and `context` changes)."""

    __slots__ = ("context_update", "name", "result", "step_number")

    def __init__(self, step_number: int, name: str) -> None:
        self.step_number = step_number
        self.name = name
        self.result: Any = None
        self.context_update: dict[str, Any] = {}


class _NoSteps(Exception):  # noqa: N818  # internal signal, never raised to callers
    """The backend has no `transact` or keeps no revisions: take the multi-call path."""


class WorkflowStateManager(StateManagerBase):
    """Track workflows: create, step, checkpoint, pause, resume, cancel, complete, fail.

    Args:
        state_manager: Where to store records (or use the shorthand below).
        persistence: `"memory"`, `"file"`, `"sqlite"`, `"redis"` or any registered backend
            name (the AgenticAI Framework shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        checkpoint_interval: `update_step` writes a checkpoint by itself every this many steps
            (0 turns that off).
        max_checkpoints: Keep at most this many checkpoints per workflow (the newest).
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
        checkpoint_interval: int = 5,
        max_checkpoints: int | None = None,
    ) -> None:
        if type(checkpoint_interval) is not int or checkpoint_interval < 0:
            raise InvalidArgumentError("checkpoint_interval must be an int >= 0")
        if max_checkpoints is not None and (
            type(max_checkpoints) is not int or max_checkpoints < 1
        ):
            raise InvalidArgumentError("max_checkpoints must be an int >= 1 or None")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.checkpoint_interval = checkpoint_interval
        self.max_checkpoints = max_checkpoints
        self._steps = True  # until the backend shows it has no `transact` or no revisions

    # keys: every key this manager writes is built here (the layout is in the module docstring)

    _keys = TaggedKeys("workflows", "workflow_id")

    @staticmethod
    def _key(workflow_id: str) -> str:
        return WorkflowStateManager._keys.key(workflow_id, "state")

    @staticmethod
    def _checkpoint_key(workflow_id: str, checkpoint_id: str) -> str:
        return WorkflowStateManager._keys.key(workflow_id, "checkpoints", checkpoint_id)

    @staticmethod
    def _checkpoint_pattern(workflow_id: str) -> str:
        return WorkflowStateManager._keys.glob(workflow_id, "checkpoints", "*")

    @staticmethod
    def _mark_key(workflow_id: str) -> str:
        return WorkflowStateManager._keys.key(workflow_id, "deleting")

    # one step compared on revisions

    async def _step(
        self, compare: Sequence[Revision], then: Sequence[Op], orelse: Sequence[Op] = ()
    ) -> TransactResult:
        """One `StateManager.transact` compared on revisions.

        Raises:
            _NoSteps: The backend has no `transact` or keeps no revisions (then never again).
        """
        if not self._steps or not self.state.backend.has_revisions:
            self._steps = False
            raise _NoSteps
        try:
            return await self.state.transact(compare, then, orelse)
        except UnsupportedOperationError:
            self._steps = False
            raise _NoSteps from None

    async def _snapshot(self, workflow_id: str) -> tuple[StateEntry | None, list[StateEntry]]:
        """The record's entry and every checkpoint's stored under the id, read in one step.

        Raises:
            _NoSteps: The backend cannot (then the caller takes the multi-call path).
        """
        keys = await self.state.list_keys(self._checkpoint_pattern(workflow_id))
        reads = [Get(self._key(workflow_id), model=WorkflowState)]
        reads += [Get(key, model=WorkflowCheckpoint) for key in keys]
        record, *found = (await self._step([], reads)).results
        return record, [entry for entry in found if entry is not None]

    # reads

    async def get(self, workflow_id: str) -> WorkflowState | None:
        """Return the workflow's state, or None."""
        return await self._load(self._key(workflow_id), WorkflowState)

    async def require(self, workflow_id: str) -> WorkflowState:
        """Return the workflow's state.

        Raises:
            NotFoundError: No such workflow.
        """
        state = await self.get(workflow_id)
        if state is None:
            raise NotFoundError(f"no workflow {workflow_id!r}")
        return state

    async def get_status(self, workflow_id: str) -> WorkflowStatus:
        """Return the workflow's status.

        Raises:
            NotFoundError: No such workflow.
        """
        return (await self.require(workflow_id)).status

    async def list_workflows(self) -> list[WorkflowState]:
        """Return every workflow, by id."""
        found = await self._load_many(self._keys.every("state"), WorkflowState)
        return sorted(found, key=lambda workflow: workflow.workflow_id)

    # the state machine

    async def create(self, state: WorkflowState) -> WorkflowState:
        """Store a new workflow.

        Raises:
            ConflictError: A workflow with this id exists already.
            SerializationError: Its context or metadata holds a value that cannot be stored
                (the path names it); nothing was written.
        """
        if not isinstance(state, WorkflowState):
            raise InvalidArgumentError("create takes a WorkflowState")
        self._check_record(state)
        workflow_id = state.workflow_id
        key, mark_key = self._key(workflow_id), self._mark_key(workflow_id)
        exists = ConflictError(f"workflow {workflow_id!r} exists already", key=key)
        try:
            for attempt in itertools.count():
                # A new life begins only once no record and no unfinished delete are there.
                done = await self._step(
                    [Revision(key, 0), Revision(mark_key, 0)],
                    [Put(key, state)],
                    [Get(key), Get(mark_key)],
                )
                if done.succeeded:
                    return state
                record, mark = done.results
                if record is not None:
                    raise exists
                if mark is not None:  # a delete under way or stopped half way: finish it
                    await self._finish_delete(workflow_id, mark.revision)
                else:
                    await anyio.sleep(jitter(attempt))  # it changed meanwhile: again
        except _NoSteps:
            pass
        try:
            await self.state.save(key, state, expected_version=0)
        except ConflictError:
            raise exists from None
        return state

    async def _change(
        self, workflow_id: str, fn: Callable[[WorkflowState], WorkflowState]
    ) -> WorkflowState:
        def apply(current: Any) -> Any:
            before = WorkflowState.model_validate(current)
            after = fn(before)
            return revise(after, updated_at=utcnow())

        try:
            value = await self.state.update(self._key(workflow_id), apply)
        except NotFoundError:
            raise NotFoundError(f"no workflow {workflow_id!r}") from None
        return WorkflowState.model_validate(value)

    @staticmethod
    def _move(state: WorkflowState, target: WorkflowStatus, **changes: Any) -> WorkflowState:
        if target not in TRANSITIONS[state.status]:
            raise InvalidTransitionError(
                f"workflow {state.workflow_id!r} cannot go from {state.status.value} "
                f"to {target.value}"
            )
        if target is WorkflowStatus.RUNNING and state.started_at is None:
            changes.setdefault("started_at", utcnow())
        if not TRANSITIONS[target]:
            changes.setdefault("finished_at", utcnow())
        return revise(state, **{"status": target, **changes})

    async def start(self, workflow_id: str) -> WorkflowState:
        """Move a pending workflow to running.

        Raises:
            InvalidTransitionError: The workflow is not pending (`resume` continues a paused
                one, `resume_from` a failed one).
        """

        def start(state: WorkflowState) -> WorkflowState:
            if state.status is not WorkflowStatus.PENDING:
                raise InvalidTransitionError(
                    f"workflow {workflow_id!r} cannot go from {state.status.value} to running: "
                    "start() begins a pending workflow (resume() continues a paused one, "
                    "resume_from() a failed one)"
                )
            return self._move(state, WorkflowStatus.RUNNING)

        return await self._change(workflow_id, start)

    async def pause(self, workflow_id: str) -> WorkflowState:
        """Ask the runner to stop at the next step boundary (any process may call this)."""
        return await self._change(workflow_id, lambda s: self._move(s, WorkflowStatus.PAUSED))

    async def resume(self, workflow_id: str) -> WorkflowState:
        """Let a paused workflow's runner continue."""

        def resume(state: WorkflowState) -> WorkflowState:
            if state.status is not WorkflowStatus.PAUSED:
                raise InvalidTransitionError(
                    f"workflow {workflow_id!r} is {state.status.value}, not paused"
                )
            return self._move(state, WorkflowStatus.RUNNING)

        return await self._change(workflow_id, resume)

    @staticmethod
    def _stop_in_flight(state: WorkflowState) -> dict[int, StepState]:
        """The steps with those still running marked cancelled (their results will be refused)."""
        now = utcnow()
        return {
            number: revise(step, status=StepStatus.CANCELLED, completed_at=now)
            if step.status is StepStatus.RUNNING
            else step
            for number, step in state.steps.items()
        }

    async def cancel(self, workflow_id: str, reason: str | None = None) -> WorkflowState:
        """Cancel the workflow; its runner gets `WorkflowCancelledError` at the next boundary.

        A step still running is marked `cancelled` in the same write: the workflow refuses its
        result (its runner gets `WorkflowCancelledError` when the step ends).
        """
        return await self._change(
            workflow_id,
            lambda s: self._move(
                s,
                WorkflowStatus.CANCELLED,
                cancel_reason=reason,
                steps=self._stop_in_flight(s),
            ),
        )

    async def complete(self, workflow_id: str, *, result: Any = None) -> WorkflowState:
        """Mark the workflow completed (optionally storing `result` in its context).

        A step still running is marked `cancelled`: a completed workflow refuses its result.
        A `result` that cannot be stored (alone, or in the workflow's record: the whole record
        is encoded before it is written) fails the running workflow instead (its `error` names
        the problem and where, `UnsupportedTypeError at $.context.result`; `resume_from` runs
        it again) and the error is raised.

        Raises:
            InvalidTransitionError: The workflow is not running (whatever `result` is; nothing
                changed).
            SerializationError: `result` cannot be stored; the workflow was failed.
        """
        problem: SerializationError | None = None
        try:
            self._check_value(result, "$.context.result")
        except SerializationError as exc:
            problem = exc
        refused: list[SerializationError] = []

        def complete(state: WorkflowState) -> WorkflowState:
            refused.clear()
            context = {**state.context, "result": result} if result is not None else state.context
            steps = self._stop_in_flight(state)
            # Refused (InvalidTransitionError, nothing changed) where complete is not legal.
            done = self._move(state, WorkflowStatus.COMPLETED, context=context, steps=steps)
            error = problem or encode_error(self.state, done, "$.context.result")
            if error is None:
                return done
            refused.append(error)
            return self._move(state, WorkflowStatus.FAILED, error=unstorable(error), steps=steps)

        after = await self._change(workflow_id, complete)
        if refused:
            raise refused[0]
        return after

    async def fail(self, workflow_id: str, error: str) -> WorkflowState:
        """Mark the workflow failed with an error description.

        A step still running is marked `cancelled`: a failed workflow refuses its result.
        """
        return await self._change(
            workflow_id,
            lambda s: self._move(
                s, WorkflowStatus.FAILED, error=error, steps=self._stop_in_flight(s)
            ),
        )

    async def update_step(self, workflow_id: str, step: StepState) -> WorkflowState:
        """Record a step's state.

        A pending workflow starts running. A completed or skipped step advances `current_step`
        to its number (never backwards). Every `checkpoint_interval` steps a checkpoint is written
        automatically, in the same atomic step as the step. Steps may be recorded while paused
        (one in flight when the pause came); not once the workflow is completed, failed or
        cancelled.

        A step whose data cannot be stored (its `result`, say) is recorded `failed` instead,
        with an `error` naming the problem and where (`UnsupportedTypeError at
        $.steps.1.result`), and the error is raised: a step never stays `running` for it.

        Raises:
            NotFoundError: No such workflow.
            InvalidTransitionError: The workflow is finished.
            SerializationError: The step's data cannot be stored; it was recorded failed.
        """
        if not isinstance(step, StepState):
            raise InvalidArgumentError("update_step takes a StepState")
        return await self._record_step(workflow_id, step)

    async def _record_step(
        self,
        workflow_id: str,
        step: StepState,
        *,
        in_flight: datetime | None = None,
        context: dict[str, Any] | None = None,
        fallback: bool = False,
    ) -> WorkflowState:
        """Record a step (see `update_step`), with `context` merged in the same write.

        `fallback`: this is the failed record of a step that could not be stored (raise, do
        not fall back again).

        With `in_flight` (the step's `started_at`), the step must still be the one recorded
        running then: a step that a rewind dropped (or another runner restarted) while it ran
        is refused with `InvalidTransitionError`, so it can neither advance `current_step` past
        steps that will run again nor write its context into the rewound one.
        """
        try:
            self._check_record(step, f"$.steps.{step.step_number}")
            if context:
                self._check_mapping(context, "$.context")
            return await self._write_step(workflow_id, step, in_flight=in_flight, context=context)
        except SerializationError as exc:
            if fallback:
                raise
            # Recorded failed (without the context), then raised: never left running.
            failed = revise(
                step,
                status=StepStatus.FAILED,
                result=None,
                error=unstorable(exc),
                completed_at=step.completed_at or utcnow(),
            )
            await self._record_step(workflow_id, failed, in_flight=in_flight, fallback=True)
            raise

    async def _write_step(
        self,
        workflow_id: str,
        step: StepState,
        *,
        in_flight: datetime | None,
        context: dict[str, Any] | None,
    ) -> WorkflowState:
        """Write a checked step (see `_record_step`); a record that would not fit raises.

        The automatic checkpoint a step makes due is written in the same step as the step,
        compared on the record's revision as read: it lands with the step, in the life of the
        workflow the step was recorded in, or not at all.
        """

        def record(state: WorkflowState) -> WorkflowState:
            if state.status is WorkflowStatus.PENDING:
                state = self._move(state, WorkflowStatus.RUNNING)
            elif state.status is WorkflowStatus.CANCELLED:
                raise WorkflowCancelledError(workflow_id, state.cancel_reason)
            elif state.status not in (WorkflowStatus.RUNNING, WorkflowStatus.PAUSED):
                raise InvalidTransitionError(
                    f"workflow {workflow_id!r} is {state.status.value}; no more steps"
                )
            if in_flight is not None:
                running = state.steps.get(step.step_number)
                if (
                    running is None
                    or running.status is not StepStatus.RUNNING
                    or running.started_at != in_flight
                ):
                    raise InvalidTransitionError(
                        f"step {step.step_number} of workflow {workflow_id!r} was dropped by a "
                        "rewind while it ran; its outcome is refused"
                    )
            current = state.current_step
            if step.status in (StepStatus.COMPLETED, StepStatus.SKIPPED):
                current = max(current, step.step_number)
            changes: dict[str, Any] = {
                "steps": {**state.steps, step.step_number: step},
                "current_step": current,
            }
            if context:
                changes["context"] = {**state.context, **context}
            after = revise(state, **changes)
            # The step may fit alone and not in the workflow's record with its other steps.
            if error := encode_error(self.state, after, f"$.steps.{step.step_number}"):
                raise error
            return after

        try:
            after, due, skipped = await self._write_step_with_checkpoint(workflow_id, record)
        except _NoSteps:
            return await self._write_step_then_checkpoint(workflow_id, record)
        if skipped is not None:
            self._checkpoint_skipped(workflow_id, after, skipped)
        if due is not None and skipped is None:
            await self._prune(workflow_id)
        return after

    def _due(self, before: WorkflowState, after: WorkflowState) -> WorkflowCheckpoint | None:
        """The automatic checkpoint a step moving `before` to `after` makes due, or None."""
        interval = self.checkpoint_interval
        if not interval or after.current_step // interval <= before.current_step // interval:
            return None
        return WorkflowCheckpoint(
            workflow_id=after.workflow_id,
            checkpoint_id=f"auto-step-{after.current_step}",
            step=after.current_step,
            state=after.model_dump(mode="json"),
            context=after.context,
            automatic=True,
        )

    def _checkpoint_skipped(
        self, workflow_id: str, after: WorkflowState, error: SerializationError
    ) -> None:
        # The step is recorded: raising would have a runner run it again. The checkpoint holds
        # the context twice (in `state` and `context`), so a workflow that fits may have a
        # checkpoint that does not: it is skipped, and said.
        self.log.warning(
            "checkpoint_skipped",
            workflow_id=workflow_id,
            step=after.current_step,
            error=unstorable(error),
        )

    async def _write_step_with_checkpoint(
        self, workflow_id: str, record: Callable[[WorkflowState], WorkflowState]
    ) -> tuple[WorkflowState, WorkflowCheckpoint | None, SerializationError | None]:
        """The step and its due checkpoint in one step compared on the record's revision.

        Returns the workflow written, the checkpoint made due (or None) and why it was not
        written (None: it was, or none was due).

        Raises:
            _NoSteps: The backend cannot (then `_write_step` takes the multi-call path).
        """
        if not self._steps or not self.state.backend.has_revisions:
            raise _NoSteps
        key = self._key(workflow_id)
        attempt = 0
        while True:
            entry = await self.state.get_entry(key, model=WorkflowState)
            if entry is None:
                raise NotFoundError(f"no workflow {workflow_id!r}")
            after = revise(record(entry.value), updated_at=utcnow())
            then: list[Op] = [Put(key, after)]
            due = self._due(entry.value, after)
            skipped: SerializationError | None = None
            if due is not None:
                try:
                    self._check_record(due)
                except SerializationError as exc:
                    skipped = exc
                else:  # each value may fit and the whole checkpoint not
                    skipped = encode_error(self.state, due, "$")
                if skipped is None:
                    then.append(Put(self._checkpoint_key(workflow_id, due.checkpoint_id), due))
            if (await self._step([Revision(key, entry.revision)], then)).succeeded:
                return after, due, skipped
            await anyio.sleep(jitter(attempt))  # it changed meanwhile: read it again
            attempt += 1

    async def _write_step_then_checkpoint(
        self, workflow_id: str, record: Callable[[WorkflowState], WorkflowState]
    ) -> WorkflowState:
        """`_write_step` on a backend without `transact` or revisions: two writes.

        The step, then its checkpoint (written unless the workflow finished meanwhile).
        """
        before_step: list[WorkflowState] = []

        def remember(state: WorkflowState) -> WorkflowState:
            before_step[:] = [state]
            return record(state)

        after = await self._change(workflow_id, remember)
        due = self._due(before_step[0], after)
        if due is not None:
            try:
                await self.checkpoint(due)
            except InvalidTransitionError:
                pass  # finished by another caller since the step was recorded: none is due
            except SerializationError as exc:
                self._checkpoint_skipped(workflow_id, after, exc)
        return after

    async def update_context(self, workflow_id: str, changes: dict[str, Any]) -> WorkflowState:
        """Merge `changes` into the workflow's context, atomically.

        Raises:
            NotFoundError: No such workflow.
            InvalidTransitionError: The workflow is completed or cancelled
                (`WorkflowCancelledError`); nothing changed.
            InvalidArgumentError: `changes` is not a mapping; nothing changed.
            SerializationError: A value in `changes` cannot be stored (the path names it,
                `$.context.<key>`); nothing changed.
        """
        mapping_argument(changes, "changes")
        self._check_mapping(changes, "$.context")

        def merge(state: WorkflowState) -> WorkflowState:
            self._refuse_finished(state, "its context cannot change")
            return revise(state, context={**state.context, **changes})

        return await self._change(workflow_id, merge)

    @staticmethod
    def _refuse_finished(state: WorkflowState, what: str) -> None:
        """Raise if the workflow is completed or cancelled: after those, nothing changes."""
        if state.status is WorkflowStatus.CANCELLED:
            raise WorkflowCancelledError(state.workflow_id, state.cancel_reason)
        if state.status is WorkflowStatus.COMPLETED:
            raise InvalidTransitionError(f"workflow {state.workflow_id!r} is completed; {what}")

    # checkpoints

    async def checkpoint(self, checkpoint: WorkflowCheckpoint) -> WorkflowCheckpoint:
        """Store a checkpoint (replacing one with the same id).

        The checkpoint is written only if the workflow is neither completed nor cancelled when
        it is written: one atomic step compared on the revision of the workflow's record as
        read, so a workflow deleted meanwhile (and perhaps created again under the id) refuses
        it, never keeps it.

        Raises:
            NotFoundError: No such workflow (or it was deleted while the call ran).
            InvalidTransitionError: The workflow is completed or cancelled
                (`WorkflowCancelledError`); nothing was written.
            SerializationError: Its state or context holds a value that cannot be stored (the
                path names it); nothing was written.
        """
        if not isinstance(checkpoint, WorkflowCheckpoint):
            raise InvalidArgumentError("checkpoint takes a WorkflowCheckpoint")
        self._check_record(checkpoint)
        await self._store_checkpoint(checkpoint)
        await self._prune(checkpoint.workflow_id)
        return checkpoint

    async def _store_checkpoint(self, checkpoint: WorkflowCheckpoint) -> None:
        """Write `checkpoint` if its workflow is not finished, in one step with that check."""
        workflow_id = checkpoint.workflow_id
        key = self._key(workflow_id)
        target = self._checkpoint_key(workflow_id, checkpoint.checkpoint_id)
        attempt = 0
        while True:
            entry = await self.state.get_entry(key, model=WorkflowState)
            if entry is None:
                raise NotFoundError(f"no workflow {workflow_id!r}")
            self._refuse_finished(entry.value, "no more checkpoints")
            # On the revision: a version read before a delete matches again in the next life.
            compare = (
                Revision(key, entry.revision)
                if self.state.backend.has_revisions
                else Version(key, entry.version)
            )
            try:
                done = await self.state.transact([compare], [Put(target, checkpoint)])
            except UnsupportedOperationError:
                # A backend without `transact`: the check above, then the write.
                await self.state.save(target, checkpoint)
                return
            if done.succeeded:
                return
            await anyio.sleep(jitter(attempt))  # the workflow changed meanwhile: look again
            attempt += 1

    async def _prune(self, workflow_id: str) -> None:
        """Keep the newest `max_checkpoints` checkpoints (each deleted as it was read)."""
        if self.max_checkpoints is None:
            return
        try:
            record, found = await self._snapshot(workflow_id)
        except _NoSteps:
            for pruned in (await self.list_checkpoints(workflow_id))[self.max_checkpoints :]:
                await self.state.delete(self._checkpoint_key(workflow_id, pruned.checkpoint_id))
            return
        if record is None:
            return  # deleted meanwhile: its delete erases them
        found.sort(key=lambda entry: self._line_order(entry.value), reverse=True)
        for old in found[self.max_checkpoints :]:
            # Written again since (a newer checkpoint under the id): it stays.
            with contextlib.suppress(ConflictError):
                await self.state.delete(old.key, expected_revision=old.revision)

    async def get_checkpoint(
        self, workflow_id: str, checkpoint_id: str
    ) -> WorkflowCheckpoint | None:
        """Return one checkpoint, or None (also once the workflow is deleted)."""
        key = self._checkpoint_key(workflow_id, checkpoint_id)
        try:
            record, entry = (
                await self._step(
                    [], [Get(self._key(workflow_id)), Get(key, model=WorkflowCheckpoint)]
                )
            ).results
        except _NoSteps:
            return await self._load(key, WorkflowCheckpoint)
        if record is None or entry is None:
            return None
        checkpoint: WorkflowCheckpoint = entry.value
        return checkpoint

    @staticmethod
    def _line_order(checkpoint: WorkflowCheckpoint) -> tuple[int, float, str]:
        # The place of a checkpoint on the line of steps: by step, then by when it was taken
        # (two checkpoints of one step), then by id (a total order, whatever the clocks say).
        return (checkpoint.step, sort_time(checkpoint.timestamp), checkpoint.checkpoint_id)

    async def list_checkpoints(self, workflow_id: str) -> list[WorkflowCheckpoint]:
        """Return the workflow's checkpoints, latest first (none once it is deleted).

        Latest means furthest along the line of steps: by step, then by time. Only checkpoints
        of the live line are stored: `resume_from` retires those after the point it rewinds to.
        The record and the checkpoints are read in one step: one `list_keys`, then one read.
        """
        try:
            record, entries = await self._snapshot(workflow_id)
        except _NoSteps:
            found = await self._load_many(self._checkpoint_pattern(workflow_id), WorkflowCheckpoint)
        else:
            found = [] if record is None else [entry.value for entry in entries]
        found.sort(key=self._line_order, reverse=True)
        return found

    async def get_latest_checkpoint(self, workflow_id: str) -> WorkflowCheckpoint | None:
        """Return the latest checkpoint of the live line (see `list_checkpoints`), or None."""
        found = await self.list_checkpoints(workflow_id)
        return found[0] if found else None

    async def resume_from(self, workflow_id: str, checkpoint_id: str = "latest") -> WorkflowState:
        """Restore the workflow's step and context from a checkpoint.

        Steps recorded after the checkpoint are dropped (they will run again). The checkpoints
        after it (further along the line of steps, see `list_checkpoints`) are retired, deleted
        in the same atomic step that rewinds the workflow: they belong to the line of steps
        this rewind abandons, so "latest" never jumps back onto it. That step is compared on
        the revisions of the record, the checkpoint and the retired checkpoints as read: a
        change to any of them meanwhile (a `complete`, say) has it read again and decide again,
        so a refused call changes nothing. A failed workflow becomes running again; a paused
        one stays paused.

        Raises:
            NotFoundError: No such workflow or checkpoint (a retired one is gone).
            InvalidTransitionError: The workflow is completed or cancelled; nothing changed.
        """
        key = self._key(workflow_id)
        attempt = 0
        while True:
            try:
                record, entries = await self._snapshot(workflow_id)
            except _NoSteps:
                return await self._resume_from_plain(workflow_id, checkpoint_id)
            if record is None:
                raise NotFoundError(f"no workflow {workflow_id!r}")
            entries.sort(key=lambda entry: self._line_order(entry.value), reverse=True)
            chosen = self._choose(entries, checkpoint_id)
            if chosen is None:
                raise NotFoundError(f"no checkpoint {checkpoint_id!r} for workflow {workflow_id!r}")
            checkpoint: WorkflowCheckpoint = chosen.value
            restored = revise(self._restore(record.value, checkpoint), updated_at=utcnow())
            point = self._line_order(checkpoint)
            retired = [e for e in entries if self._line_order(e.value) > point]
            done = await self._step(
                [
                    Revision(key, record.revision),
                    Revision(chosen.key, chosen.revision),
                    *(Revision(entry.key, entry.revision) for entry in retired),
                ],
                [Put(key, restored), *(Delete(entry.key) for entry in retired)],
            )
            if done.succeeded:
                if retired:
                    self.log.info(
                        "workflow_checkpoints_retired", workflow_id=workflow_id, count=len(retired)
                    )
                return restored
            await anyio.sleep(jitter(attempt))  # something it read changed: read it again
            attempt += 1

    @staticmethod
    def _choose(entries: list[StateEntry], checkpoint_id: str) -> StateEntry | None:
        """The entry of `checkpoint_id` ("latest": the first) among `entries`, latest first."""
        if checkpoint_id == "latest":
            return entries[0] if entries else None
        return next((e for e in entries if e.value.checkpoint_id == checkpoint_id), None)

    def _restore(self, state: WorkflowState, checkpoint: WorkflowCheckpoint) -> WorkflowState:
        """`state` rewound to `checkpoint` (refused on a completed or cancelled workflow)."""
        if state.status in (WorkflowStatus.COMPLETED, WorkflowStatus.CANCELLED):
            raise InvalidTransitionError(
                f"workflow {state.workflow_id!r} is {state.status.value}; it cannot resume"
            )
        if state.status is WorkflowStatus.FAILED:
            state = self._move(state, WorkflowStatus.RUNNING, error=None)
        kept = {n: s for n, s in state.steps.items() if n <= checkpoint.step}
        return revise(
            state, current_step=checkpoint.step, context=dict(checkpoint.context), steps=kept
        )

    async def _resume_from_plain(self, workflow_id: str, checkpoint_id: str) -> WorkflowState:
        """`resume_from` on a backend without `transact` or revisions: retire, then rewind."""
        found = await self.list_checkpoints(workflow_id)
        if checkpoint_id == "latest":
            checkpoint = found[0] if found else None
        else:
            checkpoint = next((c for c in found if c.checkpoint_id == checkpoint_id), None)
        if checkpoint is None:
            raise NotFoundError(f"no checkpoint {checkpoint_id!r} for workflow {workflow_id!r}")
        state = await self.require(workflow_id)
        if state.status in (WorkflowStatus.COMPLETED, WorkflowStatus.CANCELLED):
            raise InvalidTransitionError(
                f"workflow {workflow_id!r} is {state.status.value}; it cannot resume"
            )
        # Retire first: a crash between the two leaves the workflow where it was and the
        # abandoned checkpoints gone, so the next resume_from("latest") still rewinds here.
        point = self._line_order(checkpoint)
        for retired in found:
            if self._line_order(retired) > point:
                await self.state.delete(self._checkpoint_key(workflow_id, retired.checkpoint_id))
        return await self._change(workflow_id, lambda s: self._restore(s, checkpoint))

    # cooperative pause

    async def wait_if_paused(self, workflow_id: str) -> WorkflowState:
        """Return at once unless the workflow is paused; then wait until it is resumed.

        Waits on change events (no polling), so a pause or resume from any process that shares
        the backend is seen.

        Raises:
            WorkflowCancelledError: The workflow is (or gets) cancelled.
            NotFoundError: No such workflow.
        """
        state = await self.require(workflow_id)
        if state.status is not WorkflowStatus.PAUSED:
            return self._check_not_cancelled(state)
        self.log.info("workflow_waiting", workflow_id=workflow_id)
        async with self.state.watch(self._key(workflow_id)) as changes:
            # Re-read after subscribing: a resume between the first read and the subscription
            # would otherwise be missed.
            state = await self.require(workflow_id)
            while state.status is WorkflowStatus.PAUSED:
                change = await changes.__anext__()
                if change.new_value is None:
                    raise NotFoundError(f"workflow {workflow_id!r} was deleted")
                state = WorkflowState.model_validate(change.new_value)
        self.log.info("workflow_continuing", workflow_id=workflow_id, status=state.status.value)
        return self._check_not_cancelled(state)

    @staticmethod
    def _check_not_cancelled(state: WorkflowState) -> WorkflowState:
        if state.status is WorkflowStatus.CANCELLED:
            raise WorkflowCancelledError(state.workflow_id, state.cancel_reason)
        return state

    @asynccontextmanager
    async def step(
        self, workflow_id: str, step_number: int, name: str = ""
    ) -> AsyncIterator[WorkflowStep]:
        """Run one step: wait while paused, record it running, then completed or failed.

        <!-- snippet: setup=workflow_state,analyze check=step_completed -->
        ```python
        async with workflow_state.step("research_pipeline", 3, "analyze") as step:
            step.result = await analyze()
        ```

        On an exception the step is recorded failed (with the exception type) and the exception
        propagates; the workflow itself is not failed, so the caller decides. On success the
        result and `context_update` are recorded in one write.

        A step whose workflow stops while it runs (cancelled, completed or failed) is marked
        `cancelled` and its outcome refused; so is one that a rewind (`resume_from`) dropped
        while it ran.

        Raises:
            WorkflowCancelledError: The workflow was cancelled (before the step started, or
                while it ran).
            InvalidTransitionError: The workflow finished, or a rewind dropped the step, while
                it ran: its result was not recorded.
        """
        await self.wait_if_paused(workflow_id)
        handle = WorkflowStep(step_number, name)
        started = utcnow()
        clock = time.perf_counter()

        async def end(status: StepStatus, **outcome: Any) -> None:
            # Shielded: an outcome being recorded is never cut in half by a cancellation.
            with anyio.CancelScope(shield=True):
                await self._record_step(
                    workflow_id,
                    StepState(
                        step_number=step_number,
                        name=name,
                        status=status,
                        started_at=started,
                        completed_at=utcnow(),
                        duration_ms=(time.perf_counter() - clock) * 1000,
                        **outcome,
                    ),
                    in_flight=started,
                    context=handle.context_update if status is StepStatus.COMPLETED else None,
                )

        running = StepState(
            step_number=step_number, name=name, status=StepStatus.RUNNING, started_at=started
        )
        try:
            await self._record_step(workflow_id, running)
        except Exception:
            raise  # refused (cancelled, finished): nothing was recorded
        except BaseException as exc:
            # Cancelled while the start was being recorded: if it was, end it (else the
            # in-flight check finds no running step and nothing changes).
            with contextlib.suppress(InvalidTransitionError):
                await end(StepStatus.FAILED, error=type(exc).__name__)
            raise
        try:
            yield handle
        except BaseException as exc:
            with contextlib.suppress(InvalidTransitionError):
                await end(StepStatus.FAILED, error=type(exc).__name__)
            raise
        # The result and the context changes in one write: both land, or (cancelled, finished
        # or rewound meanwhile) neither does.
        await end(StepStatus.COMPLETED, result=handle.result)

    async def delete(self, workflow_id: str) -> bool:
        """Delete the workflow and its checkpoints; return whether it existed.

        One step compared on the record as read deletes the record and the checkpoints listed
        and writes a deletion marker (`workflows:{<id>}:deleting`): from then on every write
        of a checkpoint of this life is refused. Then the checkpoints created before the marker
        (one written between the listing and the step) are deleted, and the marker. A delete
        stopped half way leaves the marker: the next `delete` or `create` of the id finishes
        it, and reads show nothing of the workflow meanwhile. Costs two `list_keys`, one read
        and one write step, and one delete per checkpoint that came late.
        """
        key, mark_key = self._key(workflow_id), self._mark_key(workflow_id)
        pattern = self._checkpoint_pattern(workflow_id)
        try:
            attempt = 0
            while True:
                keys = await self.state.list_keys(pattern)
                reads = [Get(key), Get(mark_key), *(Get(k) for k in keys)]
                record, mark, *found = (await self._step([], reads)).results
                if record is None and mark is None and not keys:
                    return False  # nothing of it is stored
                done = await self._step(
                    [
                        Revision(key, 0 if record is None else record.revision),
                        Revision(mark_key, 0 if mark is None else mark.revision),
                    ],
                    [
                        Delete(key),
                        *(Delete(k) for k, entry in zip(keys, found, strict=True) if entry),
                        Put(mark_key, {"workflow_id": workflow_id}),
                    ],
                )
                if done.succeeded:
                    break
                await anyio.sleep(jitter(attempt))  # it changed meanwhile: read it again
                attempt += 1
        except _NoSteps:
            # The record first: a checkpoint write checks it, so none lands after the listing.
            existed = await self.state.delete(key)
            for checkpoint in await self._load_many(pattern, WorkflowCheckpoint):
                await self.state.delete(self._checkpoint_key(workflow_id, checkpoint.checkpoint_id))
            return existed
        await self._finish_delete(workflow_id, done.revisions[-1])
        if record is not None:
            self.log.debug("workflow_deleted", workflow_id=workflow_id)
        return record is not None

    async def _finish_delete(self, workflow_id: str, ended: int) -> None:
        """Finish a delete: the checkpoints created before revision `ended`, then the marker.

        `ended` is the revision of the deletion marker; a marker another delete wrote since is
        left alone. Each checkpoint is read, then deleted only as read (`expected_revision`): one a
        workflow created again since wrote (created after `ended`) is left alone.
        """
        keys = await self.state.list_keys(self._checkpoint_pattern(workflow_id))
        if keys:
            entries = (await self._step([], [Get(k) for k in keys])).results
            for key, entry in zip(keys, entries, strict=True):
                while entry is not None and entry.create_revision < ended:
                    try:
                        await self.state.delete(key, expected_revision=entry.revision)
                    except ConflictError:  # replaced meanwhile: look again
                        entry = await self.state.get_entry(key)
                    else:
                        break
        with contextlib.suppress(ConflictError):
            await self.state.delete(self._mark_key(workflow_id), expected_revision=ended)
