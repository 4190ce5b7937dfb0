"""Every manager's state machine against the table its documentation states.

Each manager page holds a table of what every call does in every status (`<!-- state-table:
NAME -->` before it). This test reads the tables from the docs and, on every backend, puts a
record in each status, makes each call, and checks the outcome the cell names:

- a status: the call returns and the record is in that status;
- `=`: the call returns and the status is unchanged;
- `✗`: the call raises the table's refusal error and nothing changed (every key of the record
  reads as before);
- `deleted`: the record is gone.

Every public method of a manager that changes a record with a status is either a row of its table
or listed in `NOT_IN_TABLES` with the reason, so a new transition cannot go unchecked.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentStateStore,
    ConflictError,
    IndexingProgress,
    IndexingStatus,
    InvalidTransitionError,
    KnowledgeStateManager,
    OrchestrationStateManager,
    RetryExhaustedError,
    SpeechStateManager,
    StepState,
    STTState,
    TaskItem,
    TaskStatus,
    TeamState,
    ToolExecution,
    ToolExecutionStatus,
    ToolStateManager,
    TTSState,
    VoiceConversationState,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager

DOCS = Path(__file__).resolve().parents[2] / "docs" / "managers"
MARK = re.compile(r"<!-- state-table: (\w+) -->")


def read_tables() -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """`{name: (statuses, {call: cells})}` from the manager pages."""
    tables: dict[str, tuple[list[str], dict[str, list[str]]]] = {}
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            found = MARK.search(line)
            if found is None:
                continue
            rows = []
            for row in lines[number + 1 :]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip().strip("|").split("|")])
            header, _, *body = rows
            tables[found.group(1)] = (
                header[1:],
                {cells[0].strip("`"): cells[1:] for cells in body},
            )
    return tables


TABLES = read_tables()


@dataclass
class Subject:
    """One record under test: how to reach it, read its status and all its keys."""

    obj: Any
    record_id: str
    status: Callable[[], Awaitable[str | None]]
    token: str | None = None


@dataclass
class Machine:
    """A manager's state machine: how to put a record in each status, and each call."""

    refusal: type[Exception]
    setup: Callable[[StateManager, str], Awaitable[Subject]]
    calls: dict[str, Callable[[Subject], Awaitable[Any]]]
    keys: Callable[[Subject], str]
    """A glob matching every key of the record (what must not change on a refusal)."""


# ------------------------------------------------------------------ workflows


async def _workflow(state: StateManager, status: str) -> Subject:
    workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=0)
    await workflows.create(WorkflowState(workflow_id="w", total_steps=3))
    await workflows.checkpoint(WorkflowCheckpoint(workflow_id="w", checkpoint_id="cp0", step=0))
    moves: dict[str, list[Callable[[], Awaitable[Any]]]] = {
        "pending": [],
        "running": [lambda: workflows.start("w")],
        "paused": [lambda: workflows.start("w"), lambda: workflows.pause("w")],
        "failed": [lambda: workflows.start("w"), lambda: workflows.fail("w", "e")],
        "completed": [lambda: workflows.start("w"), lambda: workflows.complete("w")],
        "cancelled": [lambda: workflows.cancel("w", "r")],
    }
    for move in moves[status]:
        await move()

    async def read() -> str | None:
        found = await workflows.get("w")
        return None if found is None else found.status.value

    return Subject(workflows, "w", read)


WORKFLOWS = Machine(
    refusal=InvalidTransitionError,
    setup=_workflow,
    calls={
        "start": lambda s: s.obj.start("w"),
        "pause": lambda s: s.obj.pause("w"),
        "resume": lambda s: s.obj.resume("w"),
        "cancel": lambda s: s.obj.cancel("w", "r"),
        "complete": lambda s: s.obj.complete("w"),
        "fail": lambda s: s.obj.fail("w", "e"),
        "update_step": lambda s: s.obj.update_step("w", StepState(step_number=1)),
        "update_context": lambda s: s.obj.update_context("w", {"k": 1}),
        "checkpoint": lambda s: s.obj.checkpoint(
            WorkflowCheckpoint(workflow_id="w", checkpoint_id="cp1", step=0)
        ),
        "resume_from": lambda s: s.obj.resume_from("w", "cp0"),
        "delete": lambda s: s.obj.delete("w"),
    },
    keys=lambda s: "workflows:*",
)


# ------------------------------------------------------------------ speech


async def _speech(state: StateManager, status: str) -> Subject:
    speech = SpeechStateManager(state_manager=state)
    session_id = await speech.create_session(session_id="v")
    moves = {
        "initializing": [],
        "active": ["active"],
        "paused": ["active", "paused"],
        "error": ["error"],
        "ended": ["ended"],
    }
    for target in moves[status]:
        await speech.update_session_status(session_id, target)

    async def read() -> str | None:
        found = await speech.get_session(session_id)
        return None if found is None else found.status.value

    return Subject(speech, session_id, read)


def _to(target: str) -> Callable[[Subject], Awaitable[Any]]:
    return lambda s: s.obj.update_session_status(s.record_id, target)


SPEECH = Machine(
    refusal=InvalidTransitionError,
    setup=_speech,
    calls={
        **{
            f"update_session_status({target})": _to(target)
            for target in ("initializing", "active", "paused", "error", "ended")
        },
        "end_session": lambda s: s.obj.end_session(s.record_id, "done"),
        "update_stt_state": lambda s: s.obj.update_stt_state(STTState(session_id=s.record_id)),
        "update_tts_state": lambda s: s.obj.update_tts_state(TTSState(session_id=s.record_id)),
        "update_conversation_state": lambda s: s.obj.update_conversation_state(
            VoiceConversationState(session_id=s.record_id)
        ),
        "append_turn": lambda s: s.obj.append_turn(s.record_id, "user", "hi"),
    },
    keys=lambda s: "speech:*",
)


# ------------------------------------------------------------------ tools


async def _execution(state: StateManager, status: str) -> Subject:
    tools = ToolStateManager(state_manager=state)
    start = ToolExecutionStatus.PENDING if status == "pending" else ToolExecutionStatus.RUNNING
    await tools.start_execution(ToolExecution(execution_id="e", tool_name="t", status=start))
    ends = {
        "completed": lambda: tools.complete_execution("e", 1),
        "failed": lambda: tools.fail_execution("e", "E"),
        "cancelled": lambda: tools.cancel_execution("e", "r"),
    }
    if status in ends:
        await ends[status]()

    async def read() -> str | None:
        found = await tools.get_execution("e")
        return None if found is None else found.status.value

    return Subject(tools, "e", read)


TOOLS = Machine(
    refusal=ConflictError,
    setup=_execution,
    calls={
        "complete_execution": lambda s: s.obj.complete_execution("e", 2),
        "fail_execution": lambda s: s.obj.fail_execution("e", "E2"),
        "cancel_execution": lambda s: s.obj.cancel_execution("e", "r2"),
    },
    # The statistics count finished executions: a refused call must not count either.
    keys=lambda s: "tools:*",
)


# ------------------------------------------------------------------ orchestration


async def _task(state: StateManager, status: str) -> Subject:
    # A dead-lettered task failed once with no retry left; the others have 3. "expired" is in
    # progress under a lease that ran out (1 µs: out by the time it is read) and that nobody
    # has taken back yet.
    orch = OrchestrationStateManager(
        state_manager=state, max_retries=0 if status == "dead_letter" else 3
    )
    await orch.create_team(TeamState(team_id="team"))
    await orch.enqueue_task("team", {"id": "x"})
    token: str | None = None
    if status != "pending":
        lease = timedelta(microseconds=1) if status == "expired" else None
        claim = await orch.claim_task("team", "worker", lease=lease)
        assert claim is not None
        token = claim.lease_token
    if status == "completed":
        await orch.complete_task("team", "x", {"ok": True}, lease_token=token)
    if status == "dead_letter":
        await orch.fail_task("team", "x", "E", lease_token=token)

    async def read() -> str | None:
        found = {t.task_id: t for t in await _tasks(orch)}
        if "x" not in found:
            return None
        task: TaskItem = found["x"]
        expires = task.lease_expires_at
        if task.status is TaskStatus.IN_PROGRESS and expires and expires <= datetime.now(UTC):
            return "expired"
        return task.status.value

    return Subject(orch, "x", read, token=token or "no-such-lease")


async def _tasks(orch: OrchestrationStateManager) -> list[Any]:
    queue = await orch.get_queue_status("team")
    return [*queue.pending, *queue.in_progress, *queue.completed, *queue.dead_letter]


ORCHESTRATION = Machine(
    refusal=ConflictError,
    setup=_task,
    calls={
        "assign_task": lambda s: s.obj.assign_task("team", "x", "other"),
        "claim_task": lambda s: s.obj.claim_task("team", "other"),
        "heartbeat": lambda s: s.obj.heartbeat("team", "x", s.token),
        "complete_task": lambda s: s.obj.complete_task("team", "x", 2, lease_token=s.token),
        "fail_task": lambda s: s.obj.fail_task("team", "x", "E2", lease_token=s.token),
        "release_task": lambda s: s.obj.release_task("team", "x", lease_token=s.token),
        "delete_task": lambda s: s.obj.delete_task("team", "x"),
    },
    keys=lambda s: "orchestration:*",
)


# ------------------------------------------------------------------ knowledge


async def _run(state: StateManager, status: str) -> Subject:
    kb = KnowledgeStateManager(state_manager=state)
    await kb.update_indexing_progress(
        IndexingProgress(knowledge_base_id="kb", status=IndexingStatus(status), total_documents=100)
    )

    async def read() -> str | None:
        found = await kb.get_indexing_progress("kb")
        return None if found is None else found.status.value

    return Subject(kb, "kb", read)


KNOWLEDGE = Machine(
    refusal=InvalidTransitionError,
    setup=_run,
    calls={"increment_progress": lambda s: s.obj.increment_progress("kb", processed=1)},
    keys=lambda s: "knowledge:*",
)


# ------------------------------------------------------------------ agents' recovery


class _Agent:
    id = "a"

    def restore_from_checkpoint(self, state: object) -> None:
        """Restore nothing: the recovery counts are what is checked."""


async def _recovery(state: StateManager, status: str) -> Subject:
    store = AgentStateStore(state_manager=state)
    await store.save_checkpoint(AgentCheckpoint(agent_id="a", state={"s": 1}))
    recovery = AgentRecoveryManager(store, max_recovery_attempts=2)
    recovery.register(_Agent())
    for _ in range({"fresh": 0, "attempted": 1, "exhausted": 2}[status]):
        await recovery.recover("a")

    async def read() -> str | None:
        record = await recovery.get_recovery_state("a")
        attempts = 0 if record is None else record.attempts
        return "fresh" if attempts == 0 else "attempted" if attempts < 2 else "exhausted"

    return Subject(recovery, "a", read)


RECOVERY = Machine(
    refusal=RetryExhaustedError,
    setup=_recovery,
    calls={
        "recover": lambda s: s.obj.recover("a"),
        "reset_attempts": lambda s: s.obj.reset_attempts("a"),
    },
    keys=lambda s: "agents:*",
)


MACHINES = {
    "workflows": WORKFLOWS,
    "speech": SPEECH,
    "tools": TOOLS,
    "orchestration": ORCHESTRATION,
    "knowledge": KNOWLEDGE,
    "recovery": RECOVERY,
}

NOT_IN_TABLES: dict[type, set[str]] = {
    # step() records with update_step after wait_if_paused; both are tested in test_workflows.py.
    # create makes the record.
    WorkflowStateManager: {"step", "wait_if_paused", "create"},
    SpeechStateManager: {"create_session"},
    # start_execution creates the record; cached_call and run_with_retries drive executions
    # through these very calls (tests/managers/test_tools.py); clear_history deletes finished
    # ones. The cache, the statistics and the retry schedules have no status.
    ToolStateManager: {
        "start_execution",
        "cached_call",
        "run_with_retries",
        "clear_history",
        "cache_result",
        "invalidate_cache",
        "reset_stats",
        "update_retry_state",
        "clear_retry_state",
    },
    # enqueue_task creates a task; reap_expired releases expired leases (test_orchestration.py);
    # run_worker moves tasks only through claim_task, heartbeat, complete_task, fail_task and
    # release_task (test_orchestration_worker.py); purge_finished and delete_team delete tasks
    # as delete_task does. An agent's status and a team's membership are set as given: any
    # value to any value.
    OrchestrationStateManager: {
        "enqueue_task",
        "reap_expired",
        "run_worker",
        "purge_finished",
        "create_team",
        "delete_team",
        "add_agent",
        "remove_agent",
        "update_agent_status",
    },
    # update_indexing_progress stores a run as given (it starts a new one); a source's sync
    # status is set as given; delete_knowledge_base deletes the run.
    KnowledgeStateManager: {
        "update_indexing_progress",
        "update_source_state",
        "remove_source",
        "delete_knowledge_base",
    },
    # run and guard drive recover and the reset through a job (test_agents.py).
    AgentRecoveryManager: {"run", "guard"},
}
"""Public calls of a manager with statuses that are not rows of its table, and why."""

STATEFUL = {
    WorkflowStateManager: "workflows",
    SpeechStateManager: "speech",
    ToolStateManager: "tools",
    OrchestrationStateManager: "orchestration",
    KnowledgeStateManager: "knowledge",
    AgentRecoveryManager: "recovery",
}
READS = re.compile(r"^(get_|get$|list_|require$|estimate$|aclose$)")


def test_every_call_that_moves_a_status_is_in_a_table() -> None:
    """Each public coroutine method of a manager with statuses (reads aside) is a row of the
    manager's documented table, or listed in NOT_IN_TABLES with its reason."""
    for manager, name in STATEFUL.items():
        rows = {row.split("(")[0] for row in TABLES[name][1]}
        for method, _ in inspect.getmembers(manager, inspect.iscoroutinefunction):
            if method.startswith("_") or READS.match(method):
                continue
            assert method in rows | NOT_IN_TABLES[manager], f"{manager.__name__}.{method}"


def test_the_tables_name_every_call_the_test_makes() -> None:
    """Every row of a documented table is a call this test knows how to make, and back."""
    assert set(TABLES) == set(MACHINES)
    for name, (_, rows) in TABLES.items():
        assert set(rows) == set(MACHINES[name].calls), name


async def _snapshot(state: StateManager, pattern: str) -> dict[str, Any]:
    keys = await state.list_keys(pattern)
    found = await state.get_many(keys)
    return {key: found.get(key) for key in keys}


@pytest.mark.parametrize("name", sorted(MACHINES))
async def test_every_call_in_every_status_does_what_the_table_says(
    state: StateManager, name: str
) -> None:
    """Every cell of the manager's documented state table holds, on this backend."""
    machine = MACHINES[name]
    statuses, rows = TABLES[name]
    wrong: list[str] = []
    for call, cells in rows.items():
        for status, cell in zip(statuses, cells, strict=True):
            for key in await state.list_keys("*"):
                await state.delete(key)
            subject = await machine.setup(state, status)
            assert await subject.status() == status, (call, status)
            before = await _snapshot(state, machine.keys(subject))
            outcome = "returned"
            try:
                await machine.calls[call](subject)
            except Exception as exc:  # noqa: BLE001  # the outcome is what is checked
                outcome = f"raised {type(exc).__name__}"
                refused = isinstance(exc, machine.refusal)
            after_status = await subject.status()
            after = await _snapshot(state, machine.keys(subject))
            where = f"{call} in {status}: {cell!r} expected, {outcome}, now {after_status!r}"
            if cell == "✗":
                if outcome == "returned" or not refused:
                    wrong.append(where)
                elif after != before:
                    changed = sorted(set(after) ^ set(before)) or "values"
                    wrong.append(f"{where}: the refusal changed {changed}")
            elif outcome != "returned":
                wrong.append(where)
            elif cell == "deleted":
                if after_status is not None:
                    wrong.append(where)
            elif after_status != (status if cell == "=" else cell):
                wrong.append(where)
    assert wrong == []
