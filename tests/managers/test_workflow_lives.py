"""A workflow's calls racing each other, and a delete and create of the same id, at every point.

A workflow deleted and created again under its id is a new life: nothing of the old one (its
checkpoints above all) may reach it. Each test sweeps every storage call of one call (the
victim, `_interleave.at_call`) and runs another process's call (the intruder) just before it.
Every call but `step()` is one atomic step as far as its callers can tell, so whatever point
the intruder came in at, the outcome (what each call returned or raised, the workflow, its
checkpoints and every key stored under its id) must be that of the two calls run one after the
other, in one order or the other. Those two sequential runs (on a memory store) are checked in
turn against the state table of docs/managers/workflows.md. A delete killed at any point leaves
nothing a reader or a new life of the id can see, and the next delete erases it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import (
    InvalidTransitionError,
    NotFoundError,
    StateConfig,
    StateManager,
    StepState,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
)
from agenticstate.backends import MemoryBackend
from tests.managers._interleave import Crash, at_call, points
from tests.managers.test_state_tables import TABLES

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

W = "w"
KEY = "workflows:{w}:state"


def _manager(state: StateManager) -> WorkflowStateManager:
    return WorkflowStateManager(state_manager=state, checkpoint_interval=2)


async def _setup(flows: WorkflowStateManager, status: str) -> None:
    """`w` with steps 1-4 done, checkpoints auto-step-2, m3 and auto-step-4, in `status`."""
    await flows.create(WorkflowState(workflow_id=W, total_steps=8, context={"life": 1}))
    for number in (1, 2, 3):
        await flows.update_step(W, StepState(step_number=number))
    await flows.checkpoint(
        WorkflowCheckpoint(workflow_id=W, checkpoint_id="m3", step=3, context={"at": "m3"})
    )
    await flows.update_step(W, StepState(step_number=4))
    await flows.update_context(W, {"after": 4})
    if status == "paused":
        await flows.pause(W)
    elif status == "failed":
        await flows.fail(W, "boom")


async def _again(flows: WorkflowStateManager, *, completed: bool = False) -> str:
    """Delete `w` and create it again (then complete it), written up to the version the old
    life had (so a compare on the version alone would not see the difference), with no
    checkpoint."""
    entry = await flows.state.get_entry(KEY)
    version = 0 if entry is None else entry.version
    await flows.delete(W)
    await flows.create(WorkflowState(workflow_id=W, total_steps=8, context={"life": 2}))
    await flows.start(W)
    for n in range(max(0, version - 2 - completed)):
        await flows.update_context(W, {"n": n})
    if completed:
        await flows.complete(W)
    return "again"


CALLS: dict[str, Callable[[WorkflowStateManager], Awaitable[Any]]] = {
    "start": lambda f: f.start(W),
    "pause": lambda f: f.pause(W),
    "resume": lambda f: f.resume(W),
    "cancel": lambda f: f.cancel(W, "stop"),
    "complete": lambda f: f.complete(W, result="done"),
    "fail": lambda f: f.fail(W, "late"),
    # Step 6 makes auto-step-6 due (every 2 steps), written with it.
    "update_step": lambda f: f.update_step(W, StepState(step_number=6)),
    "update_context": lambda f: f.update_context(W, {"k": "v"}),
    "checkpoint": lambda f: f.checkpoint(
        WorkflowCheckpoint(workflow_id=W, checkpoint_id="manual", step=5, context={"at": "m5"})
    ),
    "resume_from": lambda f: f.resume_from(W, "auto-step-2"),
    "resume_from(latest)": lambda f: f.resume_from(W),
    "delete": lambda f: f.delete(W),
    "list_checkpoints": lambda f: f.list_checkpoints(W),
    "get_checkpoint": lambda f: f.get_checkpoint(W, "m3"),
    "get_latest_checkpoint": lambda f: f.get_latest_checkpoint(W),
}
"""Every public call of a workflow but `create`, `step` and the waits (see the module doc)."""

INTRUDERS: dict[str, Callable[[WorkflowStateManager], Awaitable[Any]]] = {
    "delete+create": _again,
    "delete+create+complete": functools.partial(_again, completed=True),
    **{
        name: CALLS[name]
        for name in (
            "pause",
            "resume",
            "cancel",
            "complete",
            "fail",
            "update_context",
            "checkpoint",
            "resume_from",
            "delete",
        )
    },
    # Another step, and another checkpoint taken by hand, by the other process.
    "update_step(5)": lambda f: f.update_step(W, StepState(step_number=5)),
    "checkpoint(m1)": lambda f: f.checkpoint(
        WorkflowCheckpoint(workflow_id=W, checkpoint_id="m1", step=1, context={"at": "m1"})
    ),
}


def _shape(value: Any) -> Any:
    """What a call returned or raised, without its times."""
    if isinstance(value, BaseException):
        return type(value).__name__
    if isinstance(value, WorkflowState):
        steps = tuple(sorted((n, s.status.value) for n, s in value.steps.items()))
        return (
            value.status.value,
            value.current_step,
            tuple(sorted(value.context.items())),
            steps,
            value.error,
        )
    if isinstance(value, WorkflowCheckpoint):
        return (value.checkpoint_id, value.step, tuple(sorted(value.context.items())))
    if isinstance(value, list):
        return [_shape(item) for item in value]
    return value


async def _observe(flows: WorkflowStateManager) -> Any:
    """The workflow, its checkpoints (latest first) and every key under its id."""
    return (
        _shape(await flows.get(W)),
        _shape(await flows.list_checkpoints(W)),
        sorted(await flows.state.list_keys("workflows:{w}:*")),
    )


async def _attempt(call: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return _shape(await call())
    except Exception as exc:  # noqa: BLE001  # an outcome, compared
        return _shape(exc)


_ORDERS: dict[tuple[str, str, str], list[Any]] = {}


async def _orders(status: str, victim: str, intruder: str) -> list[Any]:
    """The outcomes of the two calls run one after the other, either way (memory store)."""
    found = _ORDERS.get((status, victim, intruder))
    if found is not None:
        return found
    found = []
    for first_victim in (True, False):
        state = StateManager(StateConfig(), backend=MemoryBackend())
        flows, other = _manager(state), _manager(state)
        await _setup(flows, status)
        before = await flows.get_status(W)
        if first_victim:
            mine = await _attempt(functools.partial(CALLS[victim], flows))
            after_victim = await flows.get(W)
            theirs = await _attempt(functools.partial(INTRUDERS[intruder], other))
            _check_table(victim, before.value, mine, after_victim)
        else:
            theirs = await _attempt(functools.partial(INTRUDERS[intruder], other))
            between = await flows.get(W)
            mine = await _attempt(functools.partial(CALLS[victim], flows))
            if between is not None:
                _check_table(victim, between.status.value, mine, await flows.get(W))
        found.append((mine, theirs, await _observe(flows)))
        await state.aclose()
    _ORDERS[(status, victim, intruder)] = found
    return found


def _check_table(call: str, status: str, outcome: Any, after: WorkflowState | None) -> None:
    """`call` made in `status` did what docs/managers/workflows.md's table says."""
    statuses, rows = TABLES["workflows"]
    row = rows.get(call.split("(")[0])
    if row is None:
        return  # a read, not in the table
    if call.startswith("resume_from") and outcome == "NotFoundError":
        return  # no such checkpoint in this life (the table's rows have one)
    cell = row[statuses.index(status)]
    if cell == "✗":
        assert outcome in ("InvalidTransitionError", "WorkflowCancelledError"), (call, status)
    elif cell == "deleted":
        assert after is None, (call, status)
    else:
        assert not isinstance(outcome, str), (call, status, outcome)
        assert after is not None
        assert after.status.value == (status if cell == "=" else cell), (call, status)


async def _sweep(state: StateManager, status: str, victim: str, intruder: str) -> list[str]:
    """Run `victim` with `intruder` just before each of its storage calls in turn, on a fresh
    `w` each time; return every point whose outcome is neither sequential order's."""
    orders = await _orders(status, victim, intruder)
    problems: list[str] = []
    flows, other = _manager(state), _manager(state)  # two processes
    at = 0
    while True:
        await _setup(flows, status)
        theirs: list[Any] = []

        async def intrude(theirs: list[Any] = theirs) -> None:
            theirs.append(await _attempt(functools.partial(INTRUDERS[intruder], other)))

        made, mine = await at_call(state, functools.partial(CALLS[victim], flows), at, intrude)
        if not theirs:  # past the victim's last call: the intruder runs after it
            theirs.append(await _attempt(functools.partial(INTRUDERS[intruder], other)))
        outcome = (_shape(mine), theirs[0], await _observe(flows))
        if outcome not in orders:
            problems.append(f"{victim} with {intruder} before its call {at}: {outcome}")
        await flows.delete(W)
        assert await state.list_keys("workflows:*") == []
        if at >= made:
            return problems
        at += 1


STATUSES = ("running", "paused", "failed")


@pytest.mark.slow
@pytest.mark.parametrize("victim", sorted(CALLS))
async def test_every_call_is_atomic_against_every_other_and_a_new_life(
    state: StateManager, victim: str
) -> None:
    """Every workflow call, with another process's call (or a delete and create of the id)
    before any of its storage calls, in a running, paused or failed workflow: the outcome is
    that of the two run one after the other, and those follow the state table."""
    problems: list[str] = []
    for intruder in sorted(INTRUDERS):
        for status in STATUSES if intruder.startswith("delete+") else ("running",):
            problems += await _sweep(state, status, victim, intruder)
    assert problems == []


# The red-team cases, one by one (each failed before checkpoints kept to one life).


async def test_a_checkpoint_written_while_delete_runs_never_reaches_the_next_life(
    state: StateManager,
) -> None:
    """A runner's checkpoint() before any storage call of delete(): after delete, a workflow
    created again under the id lists no checkpoint and has none to resume from, and nothing of
    the old life is stored."""
    flows, runner = _manager(state), _manager(state)
    await _setup(flows, "running")
    total = await points(state, lambda: flows.delete(W))
    await flows.delete(W)
    problems = []
    for at in range(total + 1):
        await _setup(flows, "running")

        async def late() -> None:
            with contextlib.suppress(NotFoundError):  # refused: fine
                await runner.checkpoint(
                    WorkflowCheckpoint(workflow_id=W, checkpoint_id="late", step=7)
                )

        _, deleted = await at_call(state, lambda: flows.delete(W), at, late)
        assert deleted is True
        await flows.create(WorkflowState(workflow_id=W, context={"life": 2}))
        if left := await flows.list_checkpoints(W):
            problems.append(f"at call {at}: the new life lists {[c.checkpoint_id for c in left]}")
        with pytest.raises(NotFoundError):
            await flows.resume_from(W)
        if (keys := await state.list_keys("workflows:*")) != ["workflows:{w}:state"]:
            problems.append(f"at call {at}: {keys} are stored")
        await flows.delete(W)
    assert problems == []


async def test_a_checkpoint_read_in_one_life_is_never_written_in_the_next(
    state: StateManager,
) -> None:
    """The workflow deleted, created again and completed at the version checkpoint() read,
    before any storage call of checkpoint(): the checkpoint is refused, none is stored."""
    flows, other = _manager(state), _manager(state)
    victim = functools.partial(
        flows.checkpoint, WorkflowCheckpoint(workflow_id=W, checkpoint_id="cp", step=0)
    )

    async def again_completed() -> None:
        version = (await state.get_entry(KEY) or _never()).version
        await other.delete(W)
        await other.create(WorkflowState(workflow_id=W))
        await other.start(W)
        for _ in range(version - 3):
            await other.update_context(W, {})
        await other.complete(W)  # the version checkpoint() read, again
        assert (await state.get_entry(KEY) or _never()).version == version

    await _setup(flows, "running")
    total = await points(state, victim)
    await flows.delete(W)
    for at in range(total):
        await _setup(flows, "running")
        _, outcome = await at_call(state, victim, at, again_completed)
        assert isinstance(outcome, InvalidTransitionError), (at, outcome)
        assert await flows.list_checkpoints(W) == []
        assert await state.list_keys("workflows:{w}:checkpoints:*") == []
        await flows.delete(W)


def _never() -> Any:
    raise AssertionError("the workflow is there")


async def test_a_refused_rewind_retires_nothing(state: StateManager) -> None:
    """complete() before any storage call of resume_from(): either the rewind happened first
    (then the later checkpoints are retired) or it is refused and every checkpoint is kept."""
    flows, other = _manager(state), _manager(state)
    await _setup(flows, "running")
    total = await points(state, lambda: flows.resume_from(W, "auto-step-2"))
    await flows.delete(W)
    for at in range(total):
        await _setup(flows, "running")

        async def complete() -> None:
            await other.complete(W)

        _, outcome = await at_call(state, lambda: flows.resume_from(W, "auto-step-2"), at, complete)
        left = [c.checkpoint_id for c in await flows.list_checkpoints(W)]
        if isinstance(outcome, InvalidTransitionError):
            assert left == ["auto-step-4", "m3", "auto-step-2"], at
        else:
            assert isinstance(outcome, WorkflowState), (at, outcome)
            assert left == ["auto-step-2"], at
        assert (await flows.get_status(W)).value == "completed"
        await flows.delete(W)


async def test_an_automatic_checkpoint_lands_with_its_step_or_not_at_all(
    state: StateManager,
) -> None:
    """A delete and create of the id before any storage call of update_step(): the step's
    automatic checkpoint is written in its own life with it, never in the new one."""
    flows, other = _manager(state), _manager(state)
    for at in range(4):
        await _setup(flows, "running")

        async def again() -> None:
            await _again(other)

        _, outcome = await at_call(
            state, lambda: flows.update_step(W, StepState(step_number=6)), at, again
        )
        workflow = await flows.require(W)
        ids = [c.checkpoint_id for c in await flows.list_checkpoints(W)]
        if workflow.context.get("life") == 2 and 6 not in workflow.steps:
            assert ids == [], at
        else:
            assert isinstance(outcome, WorkflowState), (at, outcome)
            assert ids[0] == "auto-step-6", at
        await flows.delete(W)


@pytest.mark.parametrize("then_create", [False, True])
async def test_a_delete_killed_at_any_point_leaves_nothing_to_see(
    state: StateManager, then_create: bool
) -> None:
    """delete() killed before any of its storage calls: the workflow is either whole or shows
    no record and no checkpoint; a workflow created again under the id shows none of the old
    one's checkpoints; and the next delete leaves no key of the id."""
    flows = _manager(state)
    await _setup(flows, "running")
    total = await points(state, lambda: flows.delete(W))
    for at in range(total):
        await _setup(flows, "running")
        with pytest.raises(Crash):
            await at_call(state, lambda: flows.delete(W), at, crash=True)
        after = _manager(state)  # a process started afterwards
        if await after.get(W) is None:
            assert await after.list_checkpoints(W) == []
            assert await after.get_checkpoint(W, "m3") is None
        else:
            assert len(await after.list_checkpoints(W)) == 3
        if then_create:
            with contextlib.suppress(Exception):
                await after.create(WorkflowState(workflow_id=W, context={"life": 2}))
            if (await after.require(W)).context == {"life": 2}:
                assert await after.list_checkpoints(W) == [], at
                assert await state.list_keys("workflows:*") == ["workflows:{w}:state"], at
        await after.delete(W)
        assert await state.list_keys("workflows:*") == [], at


async def test_reads_show_nothing_of_a_deleted_workflow(state: StateManager) -> None:
    """Checkpoints left under an id with no workflow (a delete stopped half way, an older
    release's leftovers) are not listed, and delete erases them."""
    flows = _manager(state)
    await state.save(
        "workflows:{w}:checkpoints:old",
        WorkflowCheckpoint(workflow_id=W, checkpoint_id="old", step=1),
    )
    assert await flows.list_checkpoints(W) == []
    assert await flows.get_latest_checkpoint(W) is None
    assert await flows.delete(W) is False
    assert await state.list_keys("workflows:*") == []
