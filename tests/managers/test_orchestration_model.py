"""Claims against a model of agents and capabilities (hypothesis).

Generated programs enqueue tasks (some needing a capability), let agents join and leave the
team, and claim, complete and fail tasks as members or as strangers, with or without
`capability=`. Each claim must return exactly the task the model picks: the first pending task
in queue order that needs no capability, or one the claimer has in the team (and that matches
`capability=`, when given). A stranger has no capabilities.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import (
    AgentCoordinationState,
    OrchestrationStateManager,
    TaskPriority,
    TeamState,
)
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate import TaskClaim

CAPABILITIES = ["read", "write", "code"]
AGENTS = ["ann", "bob", "cid", "dee"]
MAX_RETRIES = 1

_capability = st.sampled_from([None, *CAPABILITIES])
Op = tuple[str, str, "str | None", "frozenset[str]"]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("enqueue"),
            st.sampled_from(list(TaskPriority)),
            _capability,
            st.just(frozenset()),
        ),
        st.tuples(
            st.just("join"),
            st.sampled_from(AGENTS),
            st.none(),
            st.frozensets(st.sampled_from(CAPABILITIES)),
        ),
        st.tuples(st.just("leave"), st.sampled_from(AGENTS), st.none(), st.just(frozenset())),
        st.tuples(st.just("claim"), st.sampled_from(AGENTS), _capability, st.just(frozenset())),
        st.tuples(st.just("complete"), st.just(""), st.none(), st.just(frozenset())),
        st.tuples(st.just("fail"), st.just(""), st.none(), st.just(frozenset())),
    ),
    max_size=30,
)


@dataclass
class Task:
    task_id: str
    rank: int
    sequence: int
    capability: str | None
    failures: int = 0


@dataclass
class Model:
    members: dict[str, frozenset[str]] = field(default_factory=dict)
    pending: list[Task] = field(default_factory=list)
    held: list[tuple[Task, TaskClaim]] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)

    def pick(self, agent: str, capability: str | None) -> Task | None:
        mine = self.members.get(agent, frozenset())  # a stranger has no capabilities
        for task in sorted(self.pending, key=lambda t: (t.rank, t.sequence)):
            if task.capability is None:
                return task
            if task.capability in mine and capability in (None, task.capability):
                return task
        return None


async def _run(orch: OrchestrationStateManager, team_id: str, ops: list[Op]) -> None:
    await orch.create_team(TeamState(team_id=team_id))
    model = Model()
    numbers = itertools.count(1)
    for kind, name, capability, capabilities in ops:
        if kind == "enqueue":
            number = next(numbers)
            priority = TaskPriority(name)
            await orch.enqueue_task(
                team_id,
                {"id": f"t{number}", "priority": priority.value, "capability": capability},
            )
            model.pending.append(Task(f"t{number}", priority.rank, number, capability))
        elif kind == "join" and name not in model.members:
            agent = AgentCoordinationState(agent_id=name, capabilities=sorted(capabilities))
            await orch.add_agent(team_id, agent)
            model.members[name] = capabilities
        elif kind == "leave":
            assert await orch.remove_agent(team_id, name) is (name in model.members)
            model.members.pop(name, None)
        elif kind == "claim":
            expected = model.pick(name, capability)
            claim = await orch.claim_task(team_id, name, capability=capability)
            assert (claim.task_id if claim else None) == (expected.task_id if expected else None)
            if claim is not None and expected is not None:
                model.pending.remove(expected)
                model.held.append((expected, claim))
        elif kind in ("complete", "fail") and model.held:
            task, claim = model.held.pop(0)
            if kind == "complete":
                await orch.complete_task(team_id, task.task_id, lease_token=claim.lease_token)
            else:
                await orch.fail_task(team_id, task.task_id, "boom", lease_token=claim.lease_token)
                task.failures += 1
                if task.failures > MAX_RETRIES:
                    model.dead.append(task.task_id)
                else:
                    model.pending.append(task)
    queue = await orch.get_queue_status(team_id)
    expected_pending = sorted(model.pending, key=lambda t: (t.rank, t.sequence))
    assert [t.task_id for t in queue.pending] == [t.task_id for t in expected_pending]
    assert sorted(t.task_id for t in queue.in_progress) == sorted(t.task_id for t, _ in model.held)
    assert sorted(t.task_id for t in queue.dead_letter) == sorted(model.dead)
    holders = {task.task_id: task.assigned_to for task in queue.in_progress}
    assert holders == {task.task_id: claim.task.assigned_to for task, claim in model.held}


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_claims_follow_the_capability_model(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Any program of joins, leaves, enqueues, claims and outcomes matches the model's claims."""
    ids = itertools.count()
    with open_state(backend_name, request, tmp_path) as (portal, state):
        orch = OrchestrationStateManager(state_manager=state, max_retries=MAX_RETRIES)

        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(ops=OPS)
        def check(ops: list[Op]) -> None:
            portal.call(_run, orch, f"team-{next(ids)}", ops)

        check()
