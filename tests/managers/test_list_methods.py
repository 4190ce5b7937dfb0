"""The managers' list methods on every backend: what the CLI's `inspect` and the inspector read.

Each manager lists the ids it has records for from its own key layout (nobody else parses its
keys), sorted, and only its own records: a namespace shared with the other managers lists
nothing of theirs.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from agenticstate.managers import (
    AgentSnapshot,
    AgentStateStore,
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SessionManager,
    SourceState,
    SpeechStateManager,
    TeamState,
    ToolExecution,
    ToolStateManager,
    WorkflowState,
    WorkflowStateManager,
)

if TYPE_CHECKING:
    from agenticstate import StateManager


async def _fill(state: StateManager) -> None:
    """Records of every manager in one namespace, ids given out of order."""
    agents = AgentStateStore(state_manager=state)
    for agent_id in ("writer", "critic"):
        await agents.save_snapshot(AgentSnapshot(agent_id=agent_id, snapshot_id="s1"))
    workflows = WorkflowStateManager(state_manager=state)
    for workflow_id in ("run-b", "run-a"):
        await workflows.create(WorkflowState(workflow_id=workflow_id, total_steps=2))
    orch = OrchestrationStateManager(state_manager=state)
    for team_id in ("crew", "band"):
        await orch.create_team(TeamState(team_id=team_id))
    await orch.enqueue_task("crew", {"id": "t1"})
    kb = KnowledgeStateManager(state_manager=state)
    await kb.update_indexing_progress(IndexingProgress(knowledge_base_id="notes"))
    await kb.update_source_state(SourceState(source_id="s1", knowledge_base_id="docs"))
    tools = ToolStateManager(state_manager=state)
    await tools.start_execution(
        ToolExecution(execution_id="e1", tool_name="search_web", started_at=datetime.now())  # noqa: DTZ005
    )
    await tools.cached_call("calculator", {"x": 1}, _one)
    sessions = SessionManager(state_manager=state)
    await sessions.create_session("ann", session_id="chat-2")
    await sessions.create_session("bob", session_id="chat-1", name="support")
    await sessions.add_message("chat-1", "user", "hello")
    speech = SpeechStateManager(state_manager=state)
    await speech.create_session(session_id="voice-b")
    await speech.create_session(session_id="voice-a")
    await speech.end_session("voice-a")


async def _one() -> int:
    return 1


async def test_every_manager_lists_its_own_ids(state: StateManager) -> None:
    """list_agents, list_workflows, list_teams, list_knowledge_bases, list_tools and the two
    session managers' list_session_ids: sorted, and nothing of another manager's."""
    await _fill(state)
    assert await AgentStateStore(state_manager=state).list_agents() == ["critic", "writer"]
    workflows = await WorkflowStateManager(state_manager=state).list_workflows()
    assert [w.workflow_id for w in workflows] == ["run-a", "run-b"]
    assert await OrchestrationStateManager(state_manager=state).list_teams() == ["band", "crew"]
    kb = KnowledgeStateManager(state_manager=state)
    assert await kb.list_knowledge_bases() == ["docs", "notes"]
    assert await ToolStateManager(state_manager=state).list_tools() == ["calculator", "search_web"]
    sessions = SessionManager(state_manager=state)
    assert await sessions.list_session_ids() == ["chat-1", "chat-2"]
    assert await sessions.list_session_ids(limit=1) == ["chat-1"]
    speech = SpeechStateManager(state_manager=state)
    assert await speech.list_session_ids() == ["voice-a", "voice-b"]  # the ended one too


async def test_an_empty_store_lists_nothing(state: StateManager) -> None:
    """Every list method on an empty store: an empty list, no error."""
    assert await AgentStateStore(state_manager=state).list_agents() == []
    assert await WorkflowStateManager(state_manager=state).list_workflows() == []
    assert await OrchestrationStateManager(state_manager=state).list_teams() == []
    assert await KnowledgeStateManager(state_manager=state).list_knowledge_bases() == []
    assert await ToolStateManager(state_manager=state).list_tools() == []
    assert await SessionManager(state_manager=state).list_session_ids() == []
    assert await SessionManager(state_manager=state).get_sessions([]) == []
    assert await SpeechStateManager(state_manager=state).list_session_ids() == []


async def test_get_sessions_reads_what_exists_in_the_order_given(state: StateManager) -> None:
    """get_sessions skips ids without a session and keeps the order of the ids it was given."""
    await _fill(state)
    sessions = SessionManager(state_manager=state)
    found = await sessions.get_sessions(["chat-2", "nope", "chat-1"])
    assert [(s.session_id, s.user_id, s.message_count) for s in found] == [
        ("chat-2", "ann", 0),
        ("chat-1", "bob", 1),
    ]


async def test_deleted_records_leave_the_lists(state: StateManager) -> None:
    """A deleted agent, team or session is no longer listed, nor a tool without records."""
    await _fill(state)
    await AgentStateStore(state_manager=state).delete_agent("critic")
    assert await AgentStateStore(state_manager=state).list_agents() == ["writer"]
    await OrchestrationStateManager(state_manager=state).delete_team("crew")
    assert await OrchestrationStateManager(state_manager=state).list_teams() == ["band"]
    tools = ToolStateManager(state_manager=state)
    await tools.invalidate_cache("calculator")
    await tools.reset_stats("calculator")
    await tools.clear_history("calculator")
    assert await tools.list_tools() == ["search_web"]
    sessions = SessionManager(state_manager=state)
    await sessions.delete_session("chat-1")
    assert await sessions.list_session_ids() == ["chat-2"]
