"""The seed page's examples, as written (imports from agenticstate), on memory and Redis.

Names the page leaves undefined (`agent`, `results`, `current_state`, ...) are defined here with
the smallest stand-ins that make the page's code run.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.managers._base import Persistence

logger = logging.getLogger(__name__)


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def persistence(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Persistence:
    """The seed's `persistence=`; for Redis, AGENTICSTATE_REDIS_URL names the test server; SQLite
    writes its default ./state/state.db in a fresh directory."""
    if request.param == "sqlite":
        monkeypatch.chdir(tmp_path)
    if request.param == "redis":
        monkeypatch.setenv("AGENTICSTATE_REDIS_URL", request.getfixturevalue("redis_url"))
    value: Persistence = request.param
    return value


class _Memory:
    def export(self) -> dict[str, Any]:
        return {"facts": ["state matters"]}


class _Tools:
    def get_state(self) -> dict[str, Any]:
        return {"search_web": {"calls": 2}}


class StandInAgent:
    """The page's `agent`: memory, tools, history, id, run/resume and checkpoint restore."""

    def __init__(self) -> None:
        self.id = "researcher_01"
        self.memory = _Memory()
        self.tools = _Tools()
        self.conversation_history = [{"role": "user", "content": "hi"}]
        self.restored: dict[str, Any] | None = None
        self.failed_once = False

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        self.restored = state

    async def run(self, task: str) -> str:
        if not self.failed_once:
            self.failed_once = True
            raise RuntimeError("crashed")
        return task

    async def resume(self) -> str:
        assert self.restored is not None
        return f"resumed at {self.restored['current_task']}"


async def test_agent_state_store_sections(persistence: Persistence) -> None:
    """'Creating Agent Snapshots', 'Checkpointing' and 'Agent Recovery', as written."""
    from agenticstate import (
        AgentCheckpoint,
        AgentRecoveryManager,
        AgentSnapshot,
        AgentStateStore,
    )

    agent = StandInAgent()
    agent.id = f"researcher_01_{unique_prefix()[:-1]}"
    results = {"rows": 10}
    task = "analyze"

    agent_store = AgentStateStore(persistence=persistence, redis_url=None)

    snapshot = AgentSnapshot(
        agent_id=agent.id,
        timestamp=datetime.now(),  # noqa: DTZ005  # as the page writes it
        memory_state=agent.memory.export(),
        tool_state=agent.tools.get_state(),
        conversation_history=agent.conversation_history,
        metadata={
            "version": "1.0",
            "task_count": 42,
        },
    )
    await agent_store.save_snapshot(snapshot)
    snapshots = await agent_store.list_snapshots(agent.id)
    for snap in snapshots:
        logger.info(f"Snapshot: {snap.timestamp} - {snap.metadata}")
    assert snapshots == [snapshot]

    checkpoint = AgentCheckpoint(
        agent_id=agent.id,
        checkpoint_id="task_step_5",
        step=5,
        state={
            "current_task": "data_analysis",
            "intermediate_results": results,
            "tokens_used": 15000,
        },
        recoverable=True,
    )
    await agent_store.save_checkpoint(checkpoint)
    checkpoint = await agent_store.get_checkpoint(agent_id=agent.id, checkpoint_id="task_step_5")  # type: ignore[assignment]  # the page reuses the name
    if checkpoint:
        agent.restore_from_checkpoint(checkpoint.state)
    assert agent.restored is not None

    recovery_manager = AgentRecoveryManager(
        agent_store=agent_store,
        auto_recover=True,
        max_recovery_attempts=3,
    )
    recovery_manager.register(agent)
    result = None
    try:
        result = await agent.run(task)
    except Exception:  # noqa: BLE001  # as the page writes it
        recovered = await recovery_manager.recover(
            agent_id=agent.id,
            from_checkpoint="latest",
        )
        if recovered:
            logger.info("Agent recovered successfully")
            result = await agent.resume()
    assert result == "resumed at data_analysis"
    await agent_store.aclose()


async def test_workflow_sections(persistence: Persistence) -> None:
    """'Workflow State Tracking', 'Workflow Checkpointing' and 'Pause and Resume', as written."""
    from agenticstate import (
        StepState,
        WorkflowCheckpoint,
        WorkflowState,
        WorkflowStateManager,
        WorkflowStatus,
    )

    workflow_state = WorkflowStateManager(
        persistence=persistence,
        checkpoint_interval=5,
        key_prefix=unique_prefix(),
    )
    state = WorkflowState(
        workflow_id="research_pipeline",
        status=WorkflowStatus.PENDING,
        total_steps=10,
        current_step=0,
        context={},
    )
    await workflow_state.create(state)
    await workflow_state.update_step(
        workflow_id="research_pipeline",
        step=StepState(
            step_number=1,
            name="data_collection",
            status="completed",
            result={"documents": 150},
            duration_ms=5400,
        ),
    )
    current = await workflow_state.get("research_pipeline")
    assert current is not None
    logger.info(f"Progress: {current.current_step}/{current.total_steps}")
    assert (current.current_step, current.total_steps) == (1, 10)

    current_state = current
    workflow_context = {"topic": "AI trends"}
    checkpoint = WorkflowCheckpoint(
        workflow_id="research_pipeline",
        checkpoint_id="step_5_complete",
        step=5,
        state=current_state,
        context=workflow_context,
        timestamp=datetime.now(),  # noqa: DTZ005  # as the page writes it
    )
    await workflow_state.checkpoint(checkpoint)
    checkpoints = await workflow_state.list_checkpoints("research_pipeline")
    assert [c.checkpoint_id for c in checkpoints] == ["step_5_complete"]
    await workflow_state.resume_from(
        workflow_id="research_pipeline",
        checkpoint_id="step_5_complete",
    )

    await workflow_state.pause("research_pipeline")
    status = await workflow_state.get_status("research_pipeline")
    logger.info(f"Status: {status}")
    assert status is WorkflowStatus.PAUSED
    await workflow_state.resume("research_pipeline")
    await workflow_state.cancel(
        workflow_id="research_pipeline",
        reason="User requested cancellation",
    )
    assert await workflow_state.get_status("research_pipeline") is WorkflowStatus.CANCELLED
    await workflow_state.aclose()
