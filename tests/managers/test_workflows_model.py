"""Workflow rewinds and resumes against a model of the live line of steps (hypothesis).

The model is a list of the live line's checkpoints and the workflow's current step, context and
steps. Generated programs run steps, take manual checkpoints, fail, and rewind (to "latest", to
a live checkpoint, to one a rewind retired, or under a step still running) in any order; after
every operation the stored workflow and its checkpoints must be what the model says. Every step
writes a context that names its operation, so a resume that lands on an abandoned line shows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import (
    InvalidTransitionError,
    NotFoundError,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

INTERVAL = 3

Op = tuple[str, int]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 4)),  # run this many next steps
        st.tuples(st.just("checkpoint"), st.just(0)),
        st.tuples(st.just("fail"), st.just(0)),
        st.tuples(st.just("resume_latest"), st.just(0)),
        st.tuples(st.just("resume_live"), st.integers(0, 20)),  # index into the live line
        st.tuples(st.just("resume_retired"), st.integers(0, 20)),
        st.tuples(st.just("rewind_in_flight"), st.integers(0, 20)),  # under a running step
    ),
    max_size=25,
)


@dataclass
class Checkpoint:
    checkpoint_id: str
    step: int
    context: dict[str, Any]


@dataclass
class Model:
    """The live line: where the workflow is, and its checkpoints in line order."""

    current: int = 0
    context: dict[str, Any] = field(default_factory=dict)
    live: list[Checkpoint] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    failed: bool = False

    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        # Same id: the new one replaces the old (a store write under the same key).
        self.live = [c for c in self.live if c.checkpoint_id != checkpoint.checkpoint_id]
        self.live.append(checkpoint)
        self.live.sort(key=lambda c: c.step)  # stable: equal steps stay in creation order

    def rewind(self, target: Checkpoint) -> None:
        index = self.live.index(target)
        dropped = self.live[index + 1 :]
        self.retired += [c.checkpoint_id for c in dropped]
        self.live = self.live[: index + 1]
        self.current, self.context, self.failed = target.step, dict(target.context), False


async def _run(workflows: WorkflowStateManager, workflow_id: str, ops: list[Op]) -> None:
    await workflows.create(WorkflowState(workflow_id=workflow_id, total_steps=1000))
    await workflows.start(workflow_id)
    model = Model()
    manual = itertools.count()
    for number, (kind, arg) in enumerate(ops):
        if kind == "step" and not model.failed:
            for _ in range(arg):
                step = model.current + 1
                async with workflows.step(workflow_id, step) as handle:
                    handle.context_update = {"last": step, "op": number}
                model.current = step
                model.context = {**model.context, "last": step, "op": number}
                if step % INTERVAL == 0:
                    model.add_checkpoint(Checkpoint(f"auto-step-{step}", step, model.context))
        elif kind == "checkpoint":
            checkpoint_id = f"manual-{next(manual)}"
            await workflows.checkpoint(
                WorkflowCheckpoint(
                    workflow_id=workflow_id,
                    checkpoint_id=checkpoint_id,
                    step=model.current,
                    context=model.context,
                )
            )
            model.add_checkpoint(Checkpoint(checkpoint_id, model.current, dict(model.context)))
        elif kind == "fail" and not model.failed:
            await workflows.fail(workflow_id, f"op {number}")
            model.failed = True
        elif kind == "resume_latest" and model.live:
            await workflows.resume_from(workflow_id)
            model.rewind(model.live[-1])
        elif kind == "resume_live" and model.live:
            target = model.live[arg % len(model.live)]
            await workflows.resume_from(workflow_id, target.checkpoint_id)
            model.rewind(target)
        elif kind == "rewind_in_flight" and model.live and not model.failed:
            target = model.live[arg % len(model.live)]

            async def interrupted(target: Checkpoint = target, number: int = number) -> None:
                async with workflows.step(workflow_id, model.current + 1) as handle:
                    await workflows.resume_from(workflow_id, target.checkpoint_id)
                    handle.context_update = {"op": number, "abandoned": True}

            with pytest.raises(InvalidTransitionError, match="rewind"):
                await interrupted()
            model.rewind(target)
        elif kind == "resume_retired":
            gone = [c for c in model.retired if c not in {c.checkpoint_id for c in model.live}]
            if gone:
                with pytest.raises(NotFoundError):
                    await workflows.resume_from(workflow_id, gone[arg % len(gone)])
        await _check(workflows, workflow_id, model)


async def _check(workflows: WorkflowStateManager, workflow_id: str, model: Model) -> None:
    state = await workflows.require(workflow_id)
    assert state.current_step == model.current
    assert state.context == model.context
    assert sorted(state.steps) == list(range(1, model.current + 1))
    expected = WorkflowStatus.FAILED if model.failed else WorkflowStatus.RUNNING
    assert state.status is expected
    stored = await workflows.list_checkpoints(workflow_id)
    assert [c.checkpoint_id for c in stored] == [c.checkpoint_id for c in reversed(model.live)]
    assert [c.context for c in stored] == [c.context for c in reversed(model.live)]


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_rewinds_and_resumes_follow_the_live_line(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Any program of steps, checkpoints, failures and rewinds matches the live-line model."""
    ids = itertools.count()
    with open_state(backend_name, request, tmp_path) as (portal, state):
        workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=INTERVAL)

        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(ops=OPS)
        def check(ops: list[Op]) -> None:
            portal.call(_run, workflows, f"wf-{next(ids)}", ops)

        check()
