"""The soak's workload: mixed operations across the six managers and plain StateManager calls.

A few worker tasks share one StateManager and run short scenarios, picked at random by weight,
until the shared operation budget is spent. One operation is one call of a public API method
(`save`, `claim_task`, `end_session`, one `async with step(...)`, ...). Every scenario ends what
it creates, the way an application would:

- plain keys get a short TTL or are deleted; counters are updated with a TTL;
- agent snapshots and checkpoints are pruned by `max_snapshots` / `max_checkpoints` and expire
  after `max_age`, and so do recovery records; half the agents that went through recovery are
  deleted with `delete_agent`, the others are abandoned to `max_age`;
- workflows run to completed, cancelled or failed, then `delete()` removes them and their
  checkpoints;
- tasks are claimed and completed, failed (retried, then dead-lettered), abandoned (the lease
  runs out and `reap_expired` puts them back) or deleted before anyone claims them; finished
  tasks expire after `finished_task_ttl` or are purged with `purge_finished`; `drain()` empties
  every queue and deletes the teams with `delete_team`;
- knowledge sources are removed with `remove_source`; short-lived knowledge bases are deleted
  whole with `delete_knowledge_base`, and `drain()` deletes the long-lived ones the same way;
- tool results are cached with a short `cache_ttl`; retry schedules are cleared (by success or
  `clear_retry_state`); execution history is capped by `history_limit`, and `drain()` clears it
  and the statistics with `clear_history` and `reset_stats`;
- speech sessions are ended (`ended_session_ttl`) or abandoned (`session_ttl`); some sessions of
  a manager without `session_ttl` get STT, TTS and conversation updates after they ended, which
  must expire with them;
- subscriptions and watches are opened and closed again.

Whatever is left when the TTLs have run out is reported by `soak.py`: `RESIDUE` lists the kinds
of record that no public API removes (none since the gaps the soak found were closed), and
anything else is a leak.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from agenticstate import (
    AgentCheckpoint,
    AgentCoordinationState,
    AgentRecoveryManager,
    AgentSnapshot,
    AgentStateStore,
    AudioSessionStatus,
    ConflictError,
    IndexingProgress,
    KnowledgeStateManager,
    NotFoundError,
    OrchestrationStateManager,
    RetryExhaustedError,
    SourceState,
    SpeechStateManager,
    STTState,
    SyncStatus,
    TaskPriority,
    TeamState,
    ToolCacheEntry,
    ToolExecution,
    ToolStateManager,
    TranscriptionStatus,
    TTSState,
    VoiceConversationState,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
    hash_parameters,
)

if TYPE_CHECKING:
    import re
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager

TEAMS = ("team-0", "team-1", "team-2", "team-3")
TEAM_AGENTS = ("planner", "writer")
KNOWLEDGE_BASES = ("kb-0", "kb-1", "kb-2", "kb-3")
TOOLS = ("search", "fetch", "calc", "flaky")
HISTORY_LIMIT = 20
MAX_SNAPSHOTS = 3
MAX_CHECKPOINTS = 2
WORKFLOW_CHECKPOINTS = 2
AGENT_GENERATION = 25  # scenarios an agent id lives for before it is retired


@dataclass(frozen=True)
class Timings:
    """The short TTLs and tight retention the soak runs with, in seconds."""

    plain_ttl: float = 2.0
    cache_ttl: float = 2.0
    ended_session_ttl: float = 2.0
    session_ttl: float = 4.0
    agent_max_age: float = 4.0
    finished_task_ttl: float = 2.0
    short_lease: float = 0.3  # abandoned claims: reaped soon after
    lease: float = 30.0  # claims that are completed or failed at once
    flight_timeout: float = 3.0  # the single-flight lock's TTL (the lock is deleted at once)

    @property
    def longest(self) -> float:
        """The longest time anything created waits for its TTL."""
        return max(
            self.plain_ttl,
            self.cache_ttl,
            self.ended_session_ttl,
            self.session_ttl,
            self.agent_max_age,
            self.finished_task_ttl,
            self.short_lease,
            self.flight_timeout,
        )


@dataclass(frozen=True)
class Residue:
    """A kind of record that no public API removes: what it is, and whether it is bounded."""

    name: str
    pattern: re.Pattern[str]
    bound: int | None  # the most that can remain by design; None: grows with the operations
    why: str


RESIDUE: tuple[Residue, ...] = ()
"""Kinds of record no public API removes: none left. Until the managers had `delete_team`,
`delete_task`, `purge_finished` / `finished_task_ttl`, `delete_knowledge_base`, `reset_stats`
and `clear_history`, the soak explained finished tasks, teams and their sequences, knowledge
progress records, tool statistics and history here; now any key left is unexplained, and fails."""


class Failed(Exception):  # noqa: N818  # a check inside a scenario that did not hold
    """A scenario saw something the library promises never happens."""


@dataclass
class Ops:
    """The shared operation budget and what was spent on what."""

    target: int
    done: int = 0
    by_area: Counter[str] = field(default_factory=Counter)
    expected: Counter[str] = field(default_factory=Counter)  # outcomes that are part of the mix
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    reaps: int = 0
    reap_seconds: float = 0.0  # reset by the sampler, for a per-window mean

    @property
    def finished(self) -> bool:
        return self.done >= self.target

    def error(self, area: str, exc: BaseException) -> None:
        self.errors[f"{area}: {type(exc).__name__}"] += 1
        if len(self.error_samples) < 8:
            self.error_samples.append(f"{area}: {type(exc).__name__}: {exc}")


class DummyAgent:
    """What AgentRecoveryManager.register needs."""

    def __init__(self, agent_id: str) -> None:
        self.id = agent_id
        self.restored: dict[str, Any] | None = None

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        self.restored = state


@dataclass
class WorkerState:
    """What one worker keeps between scenarios."""

    number: int
    rng: random.Random
    scenarios: int = 0
    agent_generation: int = 0
    agent_steps: int = 0
    agent_recovered: bool = False

    @property
    def agent_id(self) -> str:
        return f"agent-{self.number}-{self.agent_generation}"


class Workload:
    """The six managers on one StateManager, and the scenarios that drive them."""

    def __init__(self, state: StateManager, timings: Timings, *, phase: str) -> None:
        self.state = state
        self.timings = timings
        self.phase = phase.replace(" ", "-")  # in ids: they differ from one cycle to the next
        self.agents = AgentStateStore(
            state_manager=state,
            max_snapshots=MAX_SNAPSHOTS,
            max_checkpoints=MAX_CHECKPOINTS,
            max_age=timedelta(seconds=timings.agent_max_age),
        )
        self.recovery = AgentRecoveryManager(agent_store=self.agents, max_recovery_attempts=3)
        self.workflows = WorkflowStateManager(
            state_manager=state, checkpoint_interval=2, max_checkpoints=WORKFLOW_CHECKPOINTS
        )
        self.orchestration = OrchestrationStateManager(
            state_manager=state,
            default_lease=timedelta(seconds=timings.lease),
            max_retries=1,
            finished_task_ttl=timedelta(seconds=timings.finished_task_ttl),
        )
        self.knowledge = KnowledgeStateManager(state_manager=state)
        self.tools = ToolStateManager(
            state_manager=state,
            cache_ttl=timings.cache_ttl,
            history_limit=HISTORY_LIMIT,
            flight_timeout=timings.flight_timeout,
        )
        self.speech = SpeechStateManager(
            state_manager=state,
            ended_session_ttl=timedelta(seconds=timings.ended_session_ttl),
            session_ttl=timedelta(seconds=timings.session_ttl),
        )
        # Live sessions of this one never expire: late updates must still expire with the
        # ended session.
        self.untimed_speech = SpeechStateManager(
            state_manager=state, ended_session_ttl=timedelta(seconds=timings.ended_session_ttl)
        )
        self.ops = Ops(0)
        self.plain_events = 0
        self.retention_violations: list[str] = []
        self.scenarios: list[tuple[Callable[[WorkerState], Awaitable[None]], float, str]] = [
            (self.plain, 14.0, "state"),
            (self.tool_calls, 11.0, "tools"),
            (self.agent_state, 8.0, "agents"),
            (self.orchestration_work, 2.0, "orchestration"),
            (self.knowledge_work, 2.6, "knowledge"),
            (self.speech_session, 1.0, "speech"),
            (self.workflow_run, 0.75, "workflows"),
            (self.subscription_churn, 1.6, "subscriptions"),
        ]

    async def call(self, area: str, awaitable: Awaitable[Any]) -> Any:
        """Await one API call and count it."""
        try:
            return await awaitable
        finally:
            self.ops.done += 1
            self.ops.by_area[area] += 1

    def count(self, area: str) -> None:
        """Count one API call that is not awaited (subscribe, unsubscribe)."""
        self.ops.done += 1
        self.ops.by_area[area] += 1

    # ---------------------------------------------------------------- running

    async def setup(self) -> None:
        """Create the teams and the knowledge bases' progress records."""
        for team_id in TEAMS:
            agents = {
                name: AgentCoordinationState(agent_id=name, capabilities=[name])
                for name in TEAM_AGENTS
            }
            await self.call(
                "orchestration",
                self.orchestration.create_team(TeamState(team_id=team_id, agents=agents)),
            )
        for kb in KNOWLEDGE_BASES:
            await self.call(
                "knowledge",
                self.knowledge.update_indexing_progress(
                    IndexingProgress(knowledge_base_id=kb, total_documents=10_000)
                ),
            )

    def _on_plain(self, key: str, old: object, new: object) -> None:
        self.plain_events += 1

    async def run(self, operations: int, workers: int, seed: int) -> float:
        """Spend `operations` operations from `workers` tasks; return the seconds it took."""
        self.ops = Ops(operations)
        self.state.subscribe("plain:*", self._on_plain)  # one long-lived callback
        self.count("subscriptions")
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for number in range(workers):
                worker = WorkerState(number, random.Random(f"{seed}:{self.phase}:{number}"))
                tg.start_soon(self._work, worker)
        elapsed = time.perf_counter() - start
        self.state.unsubscribe("plain:*", self._on_plain)
        self.count("subscriptions")
        return elapsed

    async def _work(self, worker: WorkerState) -> None:
        functions = [scenario for scenario, _, _ in self.scenarios]
        weights = [weight for _, weight, _ in self.scenarios]
        while not self.ops.finished:
            scenario = worker.rng.choices(functions, weights)[0]
            worker.scenarios += 1
            try:
                await scenario(worker)
            except Exception as exc:  # noqa: BLE001  # counted and reported; the run goes on
                self.ops.error(scenario.__name__, exc)
        await self._retire_agent(worker)

    # ---------------------------------------------------------------- plain StateManager

    async def plain(self, w: WorkerState) -> None:
        rng, state, ttl = w.rng, self.state, self.timings.plain_ttl
        key = f"plain:{self.phase}:{w.number}:{rng.randrange(256)}"
        life = rng.uniform(ttl / 4, ttl)
        roll = rng.random()
        if roll < 0.35:
            value = {"n": w.scenarios, "text": "x" * rng.randrange(16, 400)}
            await self.call("state", state.save(key, value, ttl=life))
        elif roll < 0.55:
            await self.call("state", state.update(key, {"seen": w.scenarios}, default={}, ttl=life))
        elif roll < 0.65:
            counter = f"plain:{self.phase}:{w.number}:counter:{rng.randrange(8)}"
            await self.call("state", state.update(counter, lambda n: n + 1, default=0, ttl=life))
        elif roll < 0.8:
            await self.call("state", state.get(key))
            await self.call("state", state.exists(key))
        elif roll < 0.88:
            durable = f"plain:{self.phase}:{w.number}:durable:{w.scenarios}"
            await self.call("state", state.save(durable, {"kept": False}, ttl=None))
            await self.call("state", state.get_entry(durable))
            if not await self.call("state", state.delete(durable)):
                raise Failed(f"{durable} was saved but delete() found nothing")
        elif roll < 0.95:
            items = {f"{key}:batch:{i}": {"i": i} for i in range(4)}
            await self.call("state", state.save_many(items, ttl=life))
            await self.call("state", state.get_many(list(items)))
        elif roll < 0.99:
            await self.call("state", state.delete(key))
        else:
            await self.call("state", state.list_keys(f"plain:{self.phase}:{w.number}:*"))

    # ---------------------------------------------------------------- tools

    async def tool_calls(self, w: WorkerState) -> None:
        rng, tools = w.rng, self.tools
        tool = rng.choice(TOOLS)
        parameters = {"query": f"q{rng.randrange(48)}", "page": rng.randrange(2)}
        roll = rng.random()
        if roll < 0.45:

            async def run_tool() -> dict[str, Any]:
                await anyio.lowlevel.checkpoint()
                return {"tool": tool, "hits": [parameters["query"]] * 3}

            await self.call("tools", tools.cached_call(tool, parameters, run_tool))
        elif roll < 0.6:
            execution = ToolExecution(tool_name=tool, parameters=parameters)
            await self.call("tools", tools.start_execution(execution))
            if rng.random() < 0.8:
                finish = tools.complete_execution(execution.execution_id, {"ok": True}, 3.0)
            else:
                finish = tools.fail_execution(execution.execution_id, "Timeout", 9.0)
            await self.call("tools", finish)
            await self.call("tools", tools.get_execution(execution.execution_id))
        elif roll < 0.72:
            execution_id = f"retry-{self.phase}-{w.number}-{w.scenarios}"
            failures = rng.choice((0, 1, 1, 2, 3))  # 3: every attempt fails
            tries = 0

            async def flaky() -> str:
                nonlocal tries
                tries += 1
                if tries <= failures:
                    raise TimeoutError("flaky tool")
                return "ok"

            try:
                await self.call(
                    "tools",
                    tools.run_with_retries(
                        execution_id,
                        tool,
                        parameters,
                        flaky,
                        max_attempts=3,
                        base_delay=0.002,
                        max_delay=0.01,
                    ),
                )
            except RetryExhaustedError:
                self.ops.expected["tool retries exhausted"] += 1
                if not await self.call("tools", tools.clear_retry_state(execution_id)):
                    raise Failed(f"exhausted retry {execution_id} had no schedule") from None
        elif roll < 0.82:
            await self.call("tools", tools.get_tool_stats(tool))
            await self.call("tools", tools.get_execution_history(tool, limit=5))
            if rng.random() < 0.02:
                await self.call("tools", tools.reset_stats(tool))
            if rng.random() < 0.02:
                await self.call("tools", tools.clear_history(tool))
        elif roll < 0.9:
            entry = ToolCacheEntry(
                tool_name=tool, parameters_hash=hash_parameters(parameters), result={"manual": 1}
            )
            await self.call("tools", tools.cache_result(entry))
            await self.call("tools", tools.get_cached_result(tool, parameters))
        elif roll < 0.96:
            await self.call("tools", tools.invalidate_cache(tool, parameters))
        else:
            await self.call("tools", tools.get_pending_retries(due_only=False))

    # ---------------------------------------------------------------- agents

    async def agent_state(self, w: WorkerState) -> None:
        rng, agents = w.rng, self.agents
        agent_id = w.agent_id
        w.agent_steps += 1
        roll = rng.random()
        if roll < 0.4:
            snapshot = AgentSnapshot(
                agent_id=agent_id,
                step=w.agent_steps,
                memory_state={"facts": ["f"] * rng.randrange(1, 20)},
                conversation_history=[{"role": "user", "content": "hi"}],
            )
            await self.call("agents", agents.save_snapshot(snapshot))
        elif roll < 0.7:
            checkpoint = AgentCheckpoint(
                agent_id=agent_id, step=w.agent_steps, state={"step": w.agent_steps}
            )
            await self.call("agents", agents.save_checkpoint(checkpoint))
        elif roll < 0.85:
            snapshots = await self.call("agents", agents.list_snapshots(agent_id))
            checkpoints = await self.call("agents", agents.list_checkpoints(agent_id))
            if len(snapshots) > MAX_SNAPSHOTS or len(checkpoints) > MAX_CHECKPOINTS:
                self.retention_violations.append(
                    f"{agent_id}: {len(snapshots)} snapshots, {len(checkpoints)} checkpoints"
                )
        elif roll < 0.93:
            agent = DummyAgent(agent_id)
            self.recovery.register(agent)
            try:
                await self.call("agents", self.recovery.recover(agent_id))
                await self.call("agents", self.recovery.reset_attempts(agent_id))
            finally:
                self.recovery.unregister(agent_id)
            w.agent_recovered = True
        else:
            await self.call("agents", agents.get_latest_checkpoint(agent_id))
            await self.call("agents", agents.get_latest_snapshot(agent_id))
        if w.agent_steps >= AGENT_GENERATION:
            await self._retire_agent(w)

    async def _retire_agent(self, w: WorkerState) -> None:
        # max_age expires an abandoned agent's snapshots, checkpoints and recovery record; half
        # the agents that went through recovery are deleted instead.
        if w.agent_recovered and w.rng.random() < 0.5:
            await self.call("agents", self.agents.delete_agent(w.agent_id))
        w.agent_generation += 1
        w.agent_steps = 0
        w.agent_recovered = False

    # ---------------------------------------------------------------- workflows

    async def workflow_run(self, w: WorkerState) -> None:
        rng, flows = w.rng, self.workflows
        workflow_id = f"wf-{self.phase}-{w.number}-{w.scenarios}"
        steps = rng.randrange(3, 7)
        await self.call(
            "workflows",
            flows.create(WorkflowState(workflow_id=workflow_id, total_steps=steps, name="soak")),
        )
        try:
            await self.call("workflows", flows.start(workflow_id))
            for number in range(1, steps + 1):
                if rng.random() < 0.15:
                    await self._paused_step(workflow_id, number)
                    continue
                async with flows.step(workflow_id, number, f"step-{number}") as step:
                    step.result = {"n": number}
                    step.context_update = {"last": number}
                self.count("workflows")
                if rng.random() < 0.1:
                    await self.call(
                        "workflows",
                        flows.checkpoint(
                            WorkflowCheckpoint(
                                workflow_id=workflow_id,
                                checkpoint_id=f"manual-{number}",
                                step=number,
                                context={"manual": number},
                            )
                        ),
                    )
                if number >= 2 and rng.random() < 0.06:  # auto-step-2 exists by now
                    await self.call("workflows", flows.fail(workflow_id, "soak failure"))
                    await self.call("workflows", flows.resume_from(workflow_id))
            checkpoints = await self.call("workflows", flows.list_checkpoints(workflow_id))
            if len(checkpoints) > WORKFLOW_CHECKPOINTS:
                self.retention_violations.append(f"{workflow_id}: {len(checkpoints)} checkpoints")
            ending = rng.random()
            if ending < 0.75:
                await self.call("workflows", flows.complete(workflow_id, result={"ok": True}))
            elif ending < 0.9:
                await self.call("workflows", flows.cancel(workflow_id, reason="soak"))
            else:
                await self.call("workflows", flows.fail(workflow_id, "soak"))
            status = await self.call("workflows", flows.get_status(workflow_id))
            if status not in (
                WorkflowStatus.COMPLETED,
                WorkflowStatus.CANCELLED,
                WorkflowStatus.FAILED,
            ):
                raise Failed(f"{workflow_id} ended {status}")
        finally:
            with anyio.CancelScope(shield=True):
                await self.call("workflows", flows.delete(workflow_id))

    async def _paused_step(self, workflow_id: str, number: int) -> None:
        """Pause the workflow, run a step that waits for the resume, and resume it."""
        flows = self.workflows
        await self.call("workflows", flows.pause(workflow_id))

        async def run_step() -> None:
            async with flows.step(workflow_id, number, f"step-{number}") as step:
                step.result = {"n": number, "after_pause": True}
            self.count("workflows")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_step)
                await anyio.sleep(0.002)
                await self.call("workflows", flows.resume(workflow_id))

    # ---------------------------------------------------------------- orchestration

    async def orchestration_work(self, w: WorkerState) -> None:
        rng, orch, timings = w.rng, self.orchestration, self.timings
        team_id = rng.choice(TEAMS)
        roll = rng.random()
        if roll < 0.75:
            for _ in range(rng.choice((1, 1, 2))):
                task = {
                    "id": f"task-{self.phase}-{w.number}-{w.scenarios}-{rng.randrange(10**9)}",
                    "priority": rng.choice(list(TaskPriority)).value,
                    "type": "soak",
                }
                item = await self.call("orchestration", orch.enqueue_task(team_id, task))
                if rng.random() < 0.04:
                    try:
                        await self.call("orchestration", orch.delete_task(team_id, item.task_id))
                    except NotFoundError:
                        pass  # never: nothing else deletes tasks
                    else:
                        self.ops.expected["tasks deleted before a claim"] += 1
            member = rng.random() < 0.3
            worker_id = rng.choice(TEAM_AGENTS) if member else f"worker-{w.number}"
            abandon = rng.random() < 0.08
            lease = timings.short_lease if abandon else timings.lease
            claim = await self.call(
                "orchestration",
                orch.claim_task(
                    team_id,
                    worker_id,
                    capability=None if member else "any",
                    lease=timedelta(seconds=lease),
                ),
            )
            if claim is None or abandon:
                if abandon and claim is not None:
                    self.ops.expected["claims abandoned (lease runs out)"] += 1
                return
            try:
                await self.call(
                    "orchestration", orch.heartbeat(team_id, claim.task_id, claim.lease_token)
                )
                if rng.random() < 0.85:
                    await self.call(
                        "orchestration",
                        orch.complete_task(
                            team_id, claim.task_id, {"ok": True}, lease_token=claim.lease_token
                        ),
                    )
                else:
                    await self.call(
                        "orchestration",
                        orch.fail_task(
                            team_id, claim.task_id, "soak", lease_token=claim.lease_token
                        ),
                    )
            except ConflictError:
                self.ops.expected["leases lost to the reaper"] += 1
        elif roll < 0.9:
            start = time.perf_counter()
            await self.call("orchestration", orch.reap_expired(team_id))
            self.ops.reaps += 1
            self.ops.reap_seconds += time.perf_counter() - start
        elif roll < 0.92:
            purged = await self.call(
                "orchestration", orch.purge_finished(team_id, older_than=timedelta(seconds=1))
            )
            self.ops.expected["finished tasks purged"] += purged
        elif roll < 0.97:
            name = rng.choice(TEAM_AGENTS)
            await self.call("orchestration", orch.update_agent_status(team_id, name, "busy"))
            await self.call("orchestration", orch.get_available_agents(team_id))
            await self.call("orchestration", orch.update_agent_status(team_id, name, "idle"))
        else:
            await self.call(
                "orchestration",
                orch.get_queue_status(team_id, include_finished=rng.random() < 0.5),
            )

    # ---------------------------------------------------------------- knowledge

    async def knowledge_work(self, w: WorkerState) -> None:
        rng, kb = w.rng, self.knowledge
        kb_id = rng.choice(KNOWLEDGE_BASES)
        roll = rng.random()
        if roll < 0.45:
            await self.call(
                "knowledge",
                kb.increment_progress(kb_id, processed=rng.randrange(1, 20), embeddings=10),
            )
        elif roll < 0.5:
            await self.call(
                "knowledge",
                kb.update_indexing_progress(
                    IndexingProgress(knowledge_base_id=kb_id, total_documents=10_000)
                ),
            )
        elif roll < 0.6:
            await self.call("knowledge", kb.estimate(kb_id))
        elif roll < 0.87:
            source_id = f"src-{self.phase}-{w.number}-{w.scenarios}"
            for status in (SyncStatus.SYNCING, SyncStatus.SYNCED):
                source = SourceState(
                    source_id=source_id,
                    knowledge_base_id=kb_id,
                    sync_status=status,
                    documents_synced=rng.randrange(100),
                )
                await self.call("knowledge", kb.update_source_state(source))
            await self.call("knowledge", kb.get_sources(kb_id))
            if not await self.call("knowledge", kb.remove_source(kb_id, source_id)):
                raise Failed(f"source {source_id} vanished before remove_source")
        elif roll < 0.9:
            await self._short_lived_knowledge_base(w)
        else:
            await self.call("knowledge", kb.get_knowledge_base_state(kb_id))

    async def _short_lived_knowledge_base(self, w: WorkerState) -> None:
        """A knowledge base of its own: indexed, given a source, then deleted whole."""
        kb = self.knowledge
        kb_id = f"kb-{self.phase}-{w.number}-{w.scenarios}"
        await self.call(
            "knowledge",
            kb.update_indexing_progress(
                IndexingProgress(knowledge_base_id=kb_id, total_documents=5)
            ),
        )
        await self.call("knowledge", kb.increment_progress(kb_id, processed=5))
        source = SourceState(source_id="only", knowledge_base_id=kb_id, documents_synced=5)
        await self.call("knowledge", kb.update_source_state(source))
        await self.call("knowledge", kb.get_knowledge_base_state(kb_id))
        deleted = await self.call("knowledge", kb.delete_knowledge_base(kb_id))
        if deleted != 2:
            raise Failed(f"delete_knowledge_base({kb_id}) deleted {deleted} records, not 2")

    # ---------------------------------------------------------------- speech

    async def speech_session(self, w: WorkerState) -> None:
        rng, speech = w.rng, self.speech
        session_id = await self.call(
            "speech", speech.create_session(session_id=f"s-{self.phase}-{w.number}-{w.scenarios}")
        )
        await self.call(
            "speech", speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
        )
        words = ["hello", "state", "for", "agents", "soak"]
        for n in range(rng.randrange(2, 6)):
            stt = STTState(
                session_id=session_id,
                status=TranscriptionStatus.TRANSCRIBING,
                audio_received_bytes=3200 * (n + 1),
                interim_transcript=" ".join(words[: n + 1]),
            )
            await self.call("speech", speech.update_stt_state(stt))
        tts = TTSState(session_id=session_id, text_queue=["Hi there"], is_speaking=True)
        await self.call("speech", speech.update_tts_state(tts))
        await self.call("speech", speech.append_turn(session_id, "user", "hello"))
        await self.call("speech", speech.append_turn(session_id, "assistant", "hi"))
        if rng.random() < 0.2:
            await self.call(
                "speech", speech.update_session_status(session_id, AudioSessionStatus.PAUSED)
            )
            await self.call(
                "speech", speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
            )
        await self.call("speech", speech.get_conversation_state(session_id))
        if rng.random() < 0.03:
            await self.call("speech", speech.list_active_sessions())
        if rng.random() < 0.85:
            await self.call("speech", speech.end_session(session_id, reason="done"))
        else:
            self.ops.expected["speech sessions abandoned (session_ttl)"] += 1
        if rng.random() < 0.3:
            await self._late_speech_updates(w)

    async def _late_speech_updates(self, w: WorkerState) -> None:
        """A session (live ones never expire) that gets updates after it ended."""
        speech = self.untimed_speech
        session_id = await self.call(
            "speech",
            speech.create_session(session_id=f"late-{self.phase}-{w.number}-{w.scenarios}"),
        )
        await self.call("speech", speech.append_turn(session_id, "user", "bye"))
        await self.call("speech", speech.end_session(session_id, reason="hung up"))
        final = STTState(
            session_id=session_id,
            status=TranscriptionStatus.COMPLETED,
            final_transcript="bye",
        )
        await self.call("speech", speech.update_stt_state(final))
        await self.call("speech", speech.update_tts_state(TTSState(session_id=session_id)))
        await self.call(
            "speech",
            speech.update_conversation_state(
                VoiceConversationState(session_id=session_id, turn_count=1, stt_state=final)
            ),
        )
        self.ops.expected["speech updates after end_session"] += 3

    # ---------------------------------------------------------------- subscriptions

    async def subscription_churn(self, w: WorkerState) -> None:
        rng, state = w.rng, self.state
        prefix = f"subs:{self.phase}:{w.number}:{w.scenarios}"
        key = f"{prefix}:k"
        if rng.random() < 0.5:
            seen = anyio.Event()

            def callback(changed: str, old: object, new: object) -> None:
                if changed == key:
                    seen.set()

            state.subscribe(f"{prefix}:*", callback)
            self.count("subscriptions")
            try:
                await self.call("subscriptions", state.save(key, 1, ttl=self.timings.plain_ttl))
                with anyio.fail_after(10):
                    await seen.wait()
            finally:
                state.unsubscribe(f"{prefix}:*", callback)
                self.count("subscriptions")
        else:
            async with state.watch(f"{prefix}:*") as changes:
                await self.call("subscriptions", state.save(key, 2, ttl=self.timings.plain_ttl))
                with anyio.fail_after(10):
                    change = await changes.__anext__()
                if change.key != key:
                    raise Failed(f"watch on {prefix}:* saw {change.key}")
            self.count("subscriptions")

    # ---------------------------------------------------------------- the end

    async def drain(self, say: Callable[[str], None]) -> dict[str, int]:
        """End everything the API can end: queues, team agents, sources, leftovers."""
        orch, timings = self.orchestration, self.timings
        counts: Counter[str] = Counter()
        deadline = time.monotonic() + 60 + timings.short_lease
        for team_id in TEAMS:
            while True:
                counts["tasks requeued by reap_expired"] += len(await orch.reap_expired(team_id))
                while (
                    claim := await orch.claim_task(
                        team_id, "drainer", capability="any", lease=timedelta(seconds=60)
                    )
                ) is not None:
                    await orch.complete_task(
                        team_id, claim.task_id, {"drained": True}, lease_token=claim.lease_token
                    )
                    counts["tasks completed by the drain"] += 1
                queue = await orch.get_queue_status(team_id)
                if not queue.pending and not queue.in_progress:
                    counts["tasks completed"] += len(queue.completed)
                    counts["tasks dead-lettered"] += len(queue.dead_letter)
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"{team_id}: tasks still pending or in progress after 60 s")
                say(
                    f"  {team_id}: {len(queue.in_progress)} abandoned claims wait for their "
                    f"lease ({timings.short_lease:.1f} s)"
                )
                await anyio.sleep(timings.short_lease)
            counts["team agents removed"] += await orch.remove_agent(team_id, TEAM_AGENTS[0])
            counts["finished tasks purged"] += await orch.purge_finished(team_id)
            counts["team records deleted by delete_team"] += await orch.delete_team(team_id)
        for kb_id in KNOWLEDGE_BASES:
            counts["knowledge records deleted"] += await self.knowledge.delete_knowledge_base(kb_id)
        for tool in TOOLS:
            counts["tool executions cleared"] += await self.tools.clear_history(tool)
            counts["tool statistics reset"] += await self.tools.reset_stats(tool)
        for workflow in await self.workflows.list_workflows():
            counts["leftover workflows deleted"] += await self.workflows.delete(
                workflow.workflow_id
            )
        for retry in await self.tools.get_pending_retries(due_only=False):
            counts["leftover retry schedules cleared"] += await self.tools.clear_retry_state(
                retry.execution_id
            )
        return dict(counts)
