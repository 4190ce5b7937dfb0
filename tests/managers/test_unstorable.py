"""A value that cannot be stored, given to any manager method that takes user data.

Every such call checks what it will write before it changes anything: it raises the
`SerializationError` the core raises for that value (a set, NaN, a dict with an int key, an
object, a value over `max_value_size`), naming the place in the record (`$.steps.1.result`), and
leaves its records either unchanged or in the documented end state: a transition that would have
finished a record (a result, a completed step) finishes it failed, never leaves it running.

The methods are found by introspection (a parameter typed `Any`, a JSON value, or a record with
such a field); each is a row of `TABLE` (how to call it, the path, what the records look like
after) or in `ELSEWHERE` with the reason.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel

import agenticstate.managers as managers
from agenticstate import (
    AgentCheckpoint,
    AgentCoordinationState,
    AgentSnapshot,
    AgentStateStore,
    InvalidNumberError,
    KnowledgeStateManager,
    NonStringKeyError,
    OrchestrationStateManager,
    RetryState,
    SessionManager,
    SourceState,
    SpeechStateManager,
    StateConfig,
    StateManager,
    StepState,
    TeamState,
    TooLargeError,
    ToolCacheEntry,
    ToolExecution,
    ToolStateManager,
    UnsupportedTypeError,
    VoiceConversationState,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.managers._base import StateManagerBase

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agenticstate.exceptions import SerializationError

MAX = 4096
"""`max_value_size` of the stores here: the oversized value is over it."""


class _Opaque:
    """An object the store does not know."""

    def __repr__(self) -> str:
        return "Opaque()"


BAD: dict[str, tuple[Callable[[], Any], type[SerializationError]]] = {
    "set": (lambda: {1, 2}, UnsupportedTypeError),
    "nan": (lambda: math.nan, InvalidNumberError),
    "int-key": (lambda: {1: "a"}, NonStringKeyError),
    "object": (lambda: _Opaque(), UnsupportedTypeError),
    "oversized": (lambda: "x" * (MAX + 1), TooLargeError),
}


@dataclass
class Ctx:
    """A fresh store, and the managers over it."""

    state: StateManager
    tools: ToolStateManager
    workflows: WorkflowStateManager
    orch: OrchestrationStateManager
    kb: KnowledgeStateManager
    agents: AgentStateStore
    sessions: SessionManager
    speech: SpeechStateManager
    ran: list[str]


After = "Callable[[Ctx, dict[str, Any]], Awaitable[str | None]]"


@dataclass
class Row:
    """How to call a method with the bad value, where it is, and what must hold after."""

    setup: Callable[[Ctx], Awaitable[None]]
    call: Callable[[Ctx, Any], Awaitable[Any]]
    path: str
    after: Callable[[Ctx, dict[str, Any]], Awaitable[str | None]] | None = None
    """None: every key is as before the call; else a check returning what is wrong, or None."""


async def _nothing(ctx: Ctx) -> None:
    """No records needed first."""


async def _running_execution(ctx: Ctx) -> None:
    await ctx.tools.start_execution(ToolExecution(execution_id="e", tool_name="t"))


async def _execution_failed(ctx: Ctx, before: dict[str, Any]) -> str | None:
    history = await ctx.tools.get_execution_history("t")
    stats = await ctx.tools.get_tool_stats("t")
    if [e.status.value for e in history] != ["failed"]:
        return f"executions: {[e.status.value for e in history]}"
    if not (history[0].error or "").endswith(" at $.result"):
        return f"error: {history[0].error!r}"
    if (stats.failed_executions, stats.successful_executions) != (1, 0):
        return f"stats: {stats}"
    if await ctx.state.list_keys("tools:{t}:cache:*") or await ctx.state.list_keys(
        "tools:{t}:flight:*"
    ):
        return "a cached result or a flight lock was left"
    return None


async def _returns(ctx: Ctx, value: Any) -> Any:
    ctx.ran.append("tool")
    return value


async def _cached(ctx: Ctx, bad: Any) -> Any:
    return await ctx.tools.cached_call("t", {"q": 1}, lambda: _returns(ctx, bad))


async def _retried(ctx: Ctx, bad: Any) -> Any:
    return await ctx.tools.run_with_retries("r", "t", {"q": 1}, lambda: _returns(ctx, bad))


async def _ran_once_and_failed(ctx: Ctx, before: dict[str, Any]) -> str | None:
    if ctx.ran != ["tool"]:
        return f"the tool ran {len(ctx.ran)} times"
    if await ctx.tools.get_retry_state("r") is not None:
        return "a retry schedule was left"
    return await _execution_failed(ctx, before)


async def _workflow(ctx: Ctx) -> None:
    await ctx.workflows.create(WorkflowState(workflow_id="w", total_steps=3))
    await ctx.workflows.start("w")


async def _step_failed(ctx: Ctx, before: dict[str, Any]) -> str | None:
    workflow = await ctx.workflows.require("w")
    step = workflow.steps.get(1)
    if (
        step is None
        or step.status.value != "failed"
        or not (step.error or "").startswith(
            (
                "UnsupportedTypeError at $.",
                "InvalidNumberError at $.",
                "NonStringKeyError at $.",
                "TooLargeError at $.",
            )
        )
    ):
        return f"step 1: {step!r}"
    if workflow.context or workflow.status is not WorkflowStatus.RUNNING:
        return f"workflow: {workflow.status.value}, context {workflow.context}"
    return None


async def _stepped(ctx: Ctx, bad: Any, part: str) -> None:
    async with ctx.workflows.step("w", 1, "s") as step:
        if part == "result":
            step.result = bad
        else:
            step.context_update = {"k": bad}


async def _workflow_failed(ctx: Ctx, before: dict[str, Any]) -> str | None:
    workflow = await ctx.workflows.require("w")
    if workflow.status is not WorkflowStatus.FAILED or "result" in workflow.context:
        return f"workflow: {workflow.status.value}, context {workflow.context}"
    if not (workflow.error or "").endswith(" at $.context.result"):
        return f"error: {workflow.error!r}"
    return None


async def _team(ctx: Ctx) -> None:
    await ctx.orch.create_team(TeamState(team_id="t"))


async def _claimed(ctx: Ctx) -> None:
    await _team(ctx)
    await ctx.orch.enqueue_task("t", {"id": "x"})
    claim = await ctx.orch.claim_task("t", "a")
    assert claim is not None
    ctx.ran.append(claim.lease_token)


async def _task_failed(ctx: Ctx, before: dict[str, Any]) -> str | None:
    task = await ctx.orch.get_task("t", "x")
    if task.status.value != "pending" or task.failures != 1:
        return f"task: {task.status.value}, {task.failures} failures"
    if not (task.error or "").endswith(" at $.result"):
        return f"error: {task.error!r}"
    return None


async def _session(ctx: Ctx) -> None:
    await ctx.sessions.create_session("u", session_id="s")


async def _voice(ctx: Ctx) -> None:
    await ctx.speech.create_session(session_id="v")


TABLE: dict[str, Row] = {
    "ToolStateManager.start_execution": Row(
        _nothing,
        lambda c, v: c.tools.start_execution(
            ToolExecution(execution_id="e", tool_name="t", parameters={"k": v})
        ),
        "$.parameters.k",
    ),
    "ToolStateManager.complete_execution": Row(
        _running_execution,
        lambda c, v: c.tools.complete_execution("e", v),
        "$.result",
        _execution_failed,
    ),
    "ToolStateManager.cache_result": Row(
        _nothing,
        lambda c, v: c.tools.cache_result(
            ToolCacheEntry(tool_name="t", parameters_hash="h", result=v)
        ),
        "$.result",
    ),
    "ToolStateManager.update_retry_state": Row(
        _nothing,
        lambda c, v: c.tools.update_retry_state(RetryState(execution_id="e", parameters={"k": v})),
        "$.parameters.k",
    ),
    "ToolStateManager.cached_call": Row(_nothing, _cached, "$.result", _ran_once_and_failed),
    "ToolStateManager.run_with_retries": Row(_nothing, _retried, "$.result", _ran_once_and_failed),
    "WorkflowStateManager.create": Row(
        _nothing,
        lambda c, v: c.workflows.create(WorkflowState(workflow_id="w", context={"k": v})),
        "$.context.k",
    ),
    "WorkflowStateManager.update_step": Row(
        _workflow,
        lambda c, v: c.workflows.update_step("w", StepState(step_number=1, result=v)),
        "$.steps.1.result",
        _step_failed,
    ),
    "WorkflowStateManager.step(result)": Row(
        _workflow, lambda c, v: _stepped(c, v, "result"), "$.steps.1.result", _step_failed
    ),
    "WorkflowStateManager.step(context_update)": Row(
        _workflow, lambda c, v: _stepped(c, v, "context"), "$.context.k", _step_failed
    ),
    "WorkflowStateManager.update_context": Row(
        _workflow, lambda c, v: c.workflows.update_context("w", {"k": v}), "$.context.k"
    ),
    "WorkflowStateManager.complete": Row(
        _workflow,
        lambda c, v: c.workflows.complete("w", result=v),
        "$.context.result",
        _workflow_failed,
    ),
    "WorkflowStateManager.checkpoint": Row(
        _workflow,
        lambda c, v: c.workflows.checkpoint(
            WorkflowCheckpoint(workflow_id="w", checkpoint_id="c", step=0, context={"k": v})
        ),
        "$.context.k",
    ),
    "OrchestrationStateManager.create_team": Row(
        _nothing,
        lambda c, v: c.orch.create_team(TeamState(team_id="t", metadata={"k": v})),
        "$.metadata.k",
    ),
    "OrchestrationStateManager.add_agent": Row(
        _team,
        lambda c, v: c.orch.add_agent("t", AgentCoordinationState(agent_id="a", metadata={"k": v})),
        "$.metadata.k",
    ),
    "OrchestrationStateManager.enqueue_task": Row(
        _team, lambda c, v: c.orch.enqueue_task("t", {"id": "x", "data": {"k": v}}), "$.data.k"
    ),
    "OrchestrationStateManager.complete_task": Row(
        _claimed,
        lambda c, v: c.orch.complete_task("t", "x", v, lease_token=c.ran[0]),
        "$.result",
        _task_failed,
    ),
    "KnowledgeStateManager.update_source_state": Row(
        _nothing,
        lambda c, v: c.kb.update_source_state(
            SourceState(source_id="s", knowledge_base_id="kb", metadata={"k": v})
        ),
        "$.metadata.k",
    ),
    "AgentStateStore.save_snapshot": Row(
        _nothing,
        lambda c, v: c.agents.save_snapshot(
            AgentSnapshot(agent_id="a", snapshot_id="s", metadata={"k": v})
        ),
        "$.metadata.k",
    ),
    "AgentStateStore.save_checkpoint": Row(
        _nothing,
        lambda c, v: c.agents.save_checkpoint(AgentCheckpoint(agent_id="a", state={"k": v})),
        "$.state.k",
    ),
    "SessionManager.create_session": Row(
        _nothing, lambda c, v: c.sessions.create_session("u", state={"k": v}), "$.k"
    ),
    "SessionManager.update_state": Row(
        _session, lambda c, v: c.sessions.update_state("s", {"k": v}), "$.k"
    ),
    "SessionManager.set_state": Row(
        _session, lambda c, v: c.sessions.set_state("s", {"k": v}), "$.k"
    ),
    "SessionManager.add_message(content)": Row(
        _session, lambda c, v: c.sessions.add_message("s", "user", v), "$.content"
    ),
    "SessionManager.add_message(metadata)": Row(
        _session, lambda c, v: c.sessions.add_message("s", "user", "hi", k=v), "$.metadata.k"
    ),
    "SpeechStateManager.create_session": Row(
        _nothing, lambda c, v: c.speech.create_session(config={"k": v}), "$.config.k"
    ),
    "SpeechStateManager.update_conversation_state": Row(
        _voice,
        lambda c, v: c.speech.update_conversation_state(
            VoiceConversationState(session_id="v", transcript=[{"k": v}])
        ),
        "$.transcript[0].k",
    ),
    "SpeechStateManager.append_turn": Row(
        _voice, lambda c, v: c.speech.append_turn("v", "user", "hi", k=v), "$.transcript[0].k"
    ),
}

ELSEWHERE = {
    # Parameters are hashed, not stored as given: hash_parameters' rules apply (a set is a
    # parameter; NaN and int keys raise InvalidArgumentError), tested in test_tools.py.
    "ToolStateManager.get_cached_result",
    "ToolStateManager.invalidate_cache",
    # The agent object is not stored: only its checkpoints are (save_checkpoint above).
    "AgentRecoveryManager.run",
    "AgentRecoveryManager.guard",
    "AgentRecoveryManager.register",
    # Computes a delay from a schedule; stores nothing.
    "ToolStateManager.next_delay",
    # The handler's result is completed through complete_task (a row above); a result that
    # cannot be stored fails the task and the worker goes on: test_orchestration_worker.py,
    # test_an_unstorable_result_fails_the_task.
    "OrchestrationStateManager.run_worker",
}


def _free_form(annotation: object, seen: set[type]) -> bool:
    if annotation is Any or "JsonValue" in str(annotation):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return False
        seen.add(annotation)
        return any(_free_form(f.annotation, seen) for f in annotation.model_fields.values())
    return any(_free_form(arg, seen) for arg in typing.get_args(annotation))


def _takes_user_data() -> set[str]:
    """`Class.method` of every manager method with a parameter holding free-form values."""
    found = set()
    for name in managers.__all__:
        kind = getattr(managers, name)
        if not isinstance(kind, type) or kind is StateManagerBase:
            continue
        if not (issubclass(kind, StateManagerBase) or name == "AgentRecoveryManager"):
            continue
        for method, member in inspect.getmembers(kind, inspect.isfunction):
            if method.startswith("_"):
                continue
            # Names imported for annotations only (AsyncIterator) are looked up there too.
            names = {**vars(collections.abc), **vars(inspect.getmodule(member))}
            hints = typing.get_type_hints(member, names)
            if any(_free_form(a, set()) for p, a in hints.items() if p != "return"):
                found.add(f"{name}.{method}")
    return found


def test_every_method_taking_user_data_is_in_the_table() -> None:
    """Introspection finds no manager method taking free-form data without a row here."""
    rows = {name.split("(")[0] for name in TABLE} | ELSEWHERE
    # Methods whose data comes back from a callable are rows too (cached_call's result).
    assert sorted(_takes_user_data() - rows) == []


async def _snapshot(state: StateManager) -> dict[str, Any]:
    keys = await state.list_keys("*")
    found = await state.get_many(keys)
    return {key: found.get(key) for key in keys}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("name", sorted(TABLE))
async def test_an_unstorable_value_fails_the_call_with_its_path_and_a_documented_state(
    name: str, bad: str
) -> None:
    """The call raises the core's error for the value, with the value's place in the record in
    the message, and the records are unchanged or in the documented end state (failed)."""
    make, error = BAD[bad]
    row = TABLE[name]
    async with StateManager(StateConfig(max_value_size=MAX)) as state:
        ctx = Ctx(
            state,
            ToolStateManager(state_manager=state),
            WorkflowStateManager(state_manager=state, checkpoint_interval=0),
            OrchestrationStateManager(state_manager=state),
            KnowledgeStateManager(state_manager=state),
            AgentStateStore(state_manager=state),
            SessionManager(state_manager=state),
            SpeechStateManager(state_manager=state),
            [],
        )
        await row.setup(ctx)
        before = await _snapshot(state)
        with pytest.raises(error) as caught:
            await row.call(ctx, make())
        assert caught.value.path == row.path
        assert f" at {row.path}" in str(caught.value)
        if row.after is None:
            assert await _snapshot(state) == before
        else:
            assert await row.after(ctx, before) is None
