"""The queue on a backend without `transact`: every test of test_orchestration.py, again.

A third-party backend may leave `Backend.transact` out (it raises `UnsupportedOperationError`);
the queue then takes its multi-call path (reads, compare-and-sets and index calls one at a
time) for claims, completions, failures, heartbeats and status reads. This module runs the
whole orchestration suite over such a backend (the memory backend with `transact` taken away).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agenticstate import OrchestrationStateManager, StateConfig, StateManager, TeamState
from agenticstate.backends import Backend, MemoryBackend
from agenticstate.exceptions import UnsupportedOperationError
from tests.managers.test_orchestration import *  # noqa: F403  # the suite, run again here

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


async def test_the_backend_has_no_transact(backend: Backend) -> None:
    with pytest.raises(UnsupportedOperationError):
        await backend.transact([], [])


async def test_a_claim_and_completion_take_the_multi_call_path(backend: Backend) -> None:
    state = StateManager(StateConfig(), backend=backend, close_backend=False)
    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(TeamState(team_id="team"))
    await orch.enqueue_task("team", {"id": "t1"})
    claim = await orch.claim_task("team", "worker")
    assert claim is not None
    await orch.complete_task("team", "t1", {"ok": True}, lease_token=claim.lease_token)
    status = await orch.get_queue_status("team")
    assert [task.task_id for task in status.completed] == ["t1"]
    assert orch._queue._transact is False
    await state.aclose()
