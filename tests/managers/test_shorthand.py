"""The seed page's constructor shorthand: persistence="memory" | "file" | "redis"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agenticstate import (
    AgentSnapshot,
    AgentStateStore,
    ConfigurationError,
    FileBackend,
    KnowledgeStateManager,
    OrchestrationStateManager,
    RedisBackend,
    SpeechStateManager,
    StateManager,
    ToolStateManager,
    WorkflowState,
    WorkflowStateManager,
)
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from pathlib import Path

MANAGERS = [
    AgentStateStore,
    WorkflowStateManager,
    OrchestrationStateManager,
    KnowledgeStateManager,
    ToolStateManager,
    SpeechStateManager,
]


async def test_file_shorthand_persists_across_instances(tmp_path: Path) -> None:
    """persistence="file" with a base_path stores in that directory and survives a reopen."""
    async with WorkflowStateManager(persistence="file", base_path=tmp_path) as workflows:
        assert isinstance(workflows.state.backend, FileBackend)
        await workflows.create(WorkflowState(workflow_id="w", total_steps=3))
    assert (tmp_path / "state.json").exists()
    async with WorkflowStateManager(persistence="file", base_path=tmp_path) as workflows:
        assert await workflows.get("w") is not None


@pytest.mark.redis
async def test_redis_shorthand_uses_redis_url(redis_url: str) -> None:
    """persistence="redis" with redis_url= talks to that server."""
    prefix = unique_prefix()
    async with AgentStateStore(persistence="redis", redis_url=redis_url, key_prefix=prefix) as one:
        assert isinstance(one.state.backend, RedisBackend)
        await one.save_snapshot(AgentSnapshot(agent_id="a", snapshot_id="s"))
    async with AgentStateStore(persistence="redis", redis_url=redis_url, key_prefix=prefix) as two:
        assert [s.snapshot_id for s in await two.list_snapshots("a")] == ["s"]


@pytest.mark.parametrize("manager", MANAGERS)
async def test_every_manager_takes_either_form(manager: type, tmp_path: Path) -> None:
    """Each manager accepts state_manager= or the shorthand, and refuses both at once."""
    shared = StateManager()
    borrowed = manager(state_manager=shared)
    assert borrowed.state is shared
    await borrowed.aclose()
    assert await shared.get("nothing") is None  # a borrowed StateManager stays open
    own = manager(persistence="memory")
    assert own.state is not shared
    await own.aclose()
    with pytest.raises(ConfigurationError):
        manager(state_manager=shared, persistence="memory")
    with pytest.raises(ConfigurationError):
        manager(persistence="mongodb")
    await shared.aclose()
