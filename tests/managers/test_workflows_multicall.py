"""Workflows on a backend without `transact`: every test of test_workflows.py, again.

A third-party backend may leave `Backend.transact` out (it raises `UnsupportedOperationError`);
the workflow manager then takes its multi-call paths (a checkpoint after its check, a delete of
the record then of the checkpoints, a rewind after the retiring). This module runs the whole
workflow suite over such a backend (the memory backend with `transact` taken away).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agenticstate import (
    StateConfig,
    StateManager,
    StepState,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
)
from agenticstate.backends import Backend, MemoryBackend
from tests.managers.test_workflows import *  # noqa: F403  # the suite, run again here

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from agenticstate.backends.base import TxnCompare, TxnOp, TxnResult


class NoTransactBackend(MemoryBackend):
    """The memory backend as a backend written before `transact` existed would be."""

    async def transact(
        self,
        compare: Sequence[TxnCompare],
        then: Sequence[TxnOp],
        orelse: Sequence[TxnOp] = (),
    ) -> TxnResult:
        return await Backend.transact(self, compare, then, orelse)


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    """Overrides the suite's backends: one without `transact`."""
    async with NoTransactBackend() as made:
        yield made


async def test_checkpoints_resume_and_delete_take_the_multi_call_path(backend: Backend) -> None:
    """Steps, automatic and manual checkpoints, a rewind and a delete work without transact."""
    state = StateManager(StateConfig(), backend=backend, close_backend=False)
    flows = WorkflowStateManager(state_manager=state, checkpoint_interval=2, max_checkpoints=2)
    await flows.create(WorkflowState(workflow_id="w"))
    for number in (1, 2, 3, 4):
        await flows.update_step("w", StepState(step_number=number))
    await flows.checkpoint(WorkflowCheckpoint(workflow_id="w", checkpoint_id="m", step=3))
    assert [c.checkpoint_id for c in await flows.list_checkpoints("w")] == ["auto-step-4", "m"]
    resumed = await flows.resume_from("w", "m")
    assert resumed.current_step == 3
    assert [c.checkpoint_id for c in await flows.list_checkpoints("w")] == ["m"]
    assert await flows.delete("w") is True
    assert await state.list_keys("workflows:*") == []
    assert flows._steps is False
