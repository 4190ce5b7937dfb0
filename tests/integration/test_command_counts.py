"""How many commands each operation sends to a real Redis, counted by the server (issue #21).

Counted with tests/_commandstats.py (`INFO commandstats` deltas on every primary, with what a
Lua script runs inside itself told apart by MONITOR), on a plain server and on a 3-primary
cluster. `get` and `save` are one command, and so are a cache hit, a queue claim (when this
process's last completion read the queue's head, within two seconds), a completion and a speech
update to a live session: each one EVALSHA of `transact` (issue #21).

Every operation is run once before it is counted, so that connections are open and scripts
loaded (first-use costs are not what is counted).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

from agenticstate import (
    AgentCoordinationState,
    OrchestrationStateManager,
    RedisBackend,
    SpeechStateManager,
    StateConfig,
    StateManager,
    STTState,
    TeamState,
    ToolStateManager,
)
from tests._commandstats import command_counts, count_commands
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.redis

VALUE = {"status": "running", "progress": 0.5}


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """The URL of a plain redis-server and of a 3-primary cluster (the session's servers)."""
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    address: str = request.getfixturevalue(fixture)
    return address


@pytest.fixture
async def redis_state(url: str) -> AsyncIterator[StateManager]:
    """A StateManager on that server, in a fresh namespace (made as tests/conftest.py's)."""
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        manager = StateManager(StateConfig(), backend=backend, close_backend=False)
        try:
            yield manager
        finally:
            await manager.aclose()


async def test_the_helper_counts_nothing_for_an_empty_block(url: str) -> None:
    async with command_counts(url) as counts:
        pass
    assert counts.sent == {}
    assert counts.calls == {}


async def test_get_is_one_command(url: str, redis_state: StateManager) -> None:
    await redis_state.save("k", VALUE)
    await redis_state.get("k")
    counts = await count_commands(url, lambda: redis_state.get("k"))
    assert counts.sent == {"get": 1}, counts.describe()
    assert counts.calls == {"get": 1}


async def test_save_is_one_command(url: str, redis_state: StateManager) -> None:
    await redis_state.save("k", VALUE)
    counts = await count_commands(url, lambda: redis_state.save("k", VALUE))
    assert counts.sent == {"evalsha": 1}, counts.describe()
    # The server ran more: the script's own commands, which are not round trips.
    assert counts.calls["evalsha"] == 1
    # The value, the change feed's counter (issue #23) and the revision counter (issue #32).
    assert counts.calls["set"] == 3
    assert counts.calls["xadd"] == 1
    assert counts.calls["publish"] == 1


async def test_a_cache_hit_is_one_command(url: str, redis_state: StateManager) -> None:
    tools = ToolStateManager(state_manager=redis_state)

    async def search() -> dict[str, list[str]]:
        return {"results": ["a", "b"]}

    await tools.cached_call("search_web", {"query": "q"}, search)  # the miss: stored
    await tools.cached_call("search_web", {"query": "q"}, search)
    counts = await count_commands(
        url, lambda: tools.cached_call("search_web", {"query": "q"}, search)
    )
    assert counts.sent == {"evalsha": 1}, counts.describe()


async def _queue(redis_state: StateManager) -> OrchestrationStateManager:
    """A team whose member `worker` has done one task, with three more pending."""
    orch = OrchestrationStateManager(state_manager=redis_state)
    await orch.create_team(
        TeamState(team_id="team", agents={"worker": AgentCoordinationState(agent_id="worker")})
    )
    for n in range(4):
        await orch.enqueue_task("team", {"id": f"t{n}"})
    claim = await orch.claim_task("team", "worker")
    assert claim is not None
    await orch.complete_task("team", claim.task_id, {"ok": True}, lease_token=claim.lease_token)
    return orch


async def test_a_queue_claim_is_one_command(url: str, redis_state: StateManager) -> None:
    orch = await _queue(redis_state)
    async with command_counts(url) as counts:
        claim = await orch.claim_task("team", "worker")
    assert claim is not None
    assert counts.total == 1, counts.describe()


async def test_a_completion_is_one_command(url: str, redis_state: StateManager) -> None:
    orch = await _queue(redis_state)
    claim = await orch.claim_task("team", "worker")
    assert claim is not None
    async with command_counts(url) as counts:
        await orch.complete_task("team", claim.task_id, {"ok": True}, lease_token=claim.lease_token)
    assert counts.total == 1, counts.describe()


@pytest.mark.parametrize("session_ttl", [None, timedelta(minutes=5)])
async def test_a_speech_update_is_one_command(
    url: str, redis_state: StateManager, session_ttl: timedelta | None
) -> None:
    """Also with a session_ttl: the step reads the live marker's TTL, and no renewal is due."""
    speech = SpeechStateManager(state_manager=redis_state, session_ttl=session_ttl)
    session_id = await speech.create_session()
    await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="hel"))
    async with command_counts(url) as counts:
        await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="hello"))
    assert counts.sent == {"evalsha": 1}, counts.describe()
