"""The soak's workload: mixed operations across the six managers and plain StateManager calls.

A few worker tasks share one StateManager and run short scenarios, picked at random from the
table `Workload.scenarios` by weight, until the shared operation budget is spent; each scenario
then rolls for one of its operations. One operation is one call of a public API method (`save`,
`claim_task`, `end_session`, one `async with step(...)`, ...), counted by `Counted`.

Every scenario ends what it creates, the way an application would (docs/reliability.md has the
table): TTLs and retention (`max_snapshots`, `max_age`, `finished_task_ttl`, `cache_ttl`,
`history_limit`, `ended_session_ttl`), deletes (`delete`, `delete_agent`, `remove_source`,
`delete_knowledge_base`, `clear_retry_state`), and `Workload.drain` at the end of a cycle
(queues emptied, `purge_finished`, `delete_team`, `clear_history`, `reset_stats`).

Any key left when the TTLs have run out is a leak, and `soak.py` fails. (Until the managers had
`delete_team`, `delete_task`, `purge_finished` / `finished_task_ttl`, `delete_knowledge_base`,
`reset_stats` and `clear_history`, the soak listed the kinds of record no public API removed;
docs/reliability.md tells how those gaps were closed.)
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

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
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager

T = TypeVar("T")

TEAMS = ("team-0", "team-1", "team-2", "team-3")
TEAM_AGENTS = ("planner", "writer")
KNOWLEDGE_BASES = ("kb-0", "kb-1", "kb-2", "kb-3")
TOOLS = ("search", "fetch", "calc", "flaky")
HISTORY_LIMIT = 20
MAX_SNAPSHOTS = 3
MAX_CHECKPOINTS = 2
WORKFLOW_CHECKPOINTS = 2
AGENT_GENERATION = 25  # scenarios an agent id lives for before it is retired
WORDS = ("hello", "state", "for", "agents", "soak")


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
    flight_timeout: float = 3.0  # the single-flight lock's TTL (the lock is deleted at once)
    lease: float = 30.0  # claims that are completed or failed at once: no TTL to wait for

    @property
    def longest(self) -> float:
        """The longest time anything created waits for its TTL (every field but `lease`)."""
        return float(max(getattr(self, f.name) for f in fields(self) if f.name != "lease"))


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

    def count(self, area: str) -> None:
        self.done += 1
        self.by_area[area] += 1

    def error(self, area: str, exc: BaseException) -> None:
        self.errors[f"{area}: {type(exc).__name__}"] += 1
        if len(self.error_samples) < 8:
            self.error_samples.append(f"{area}: {type(exc).__name__}: {exc}")


class Counted:
    """Awaits one API call of an area and counts it (`await call(state.save(...))`)."""

    def __init__(self, load: Workload, area: str) -> None:
        self.load = load
        self.area = area

    async def __call__(self, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        finally:
            self.load.ops.count(self.area)

    def count(self) -> None:
        """Count one call that is not awaited (subscribe, one `async with step(...)`)."""
        self.load.ops.count(self.area)


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
        ended = timedelta(seconds=timings.ended_session_ttl)
        self.speech = SpeechStateManager(
            state_manager=state,
            ended_session_ttl=ended,
            session_ttl=timedelta(seconds=timings.session_ttl),
        )
        # Live sessions of this one never expire: late updates must still expire with the
        # ended session.
        self.untimed_speech = SpeechStateManager(state_manager=state, ended_session_ttl=ended)
        self.ops = Ops(0)
        self.plain_events = 0
        self.retention_violations: list[str] = []
        # (scenario, weight): picked by weight until the budget is spent.
        self.scenarios: tuple[tuple[Callable[[WorkerState], Awaitable[None]], float], ...] = (
            (self.plain, 14.0),
            (self.tool_calls, 11.0),
            (self.agent_state, 8.0),
            (self.orchestration_work, 2.0),
            (self.knowledge_work, 2.6),
            (self.speech_session, 1.0),
            (self.workflow_run, 0.75),
            (self.subscription_churn, 1.6),
        )

    def ids(self, w: WorkerState, kind: str) -> str:
        """An id of this cycle, worker and scenario: `kind-phase-worker-scenario`."""
        return f"{kind}-{self.phase}-{w.number}-{w.scenarios}"

    # ---------------------------------------------------------------- running

    async def setup(self) -> None:
        """Create the teams and the knowledge bases' progress records."""
        orchestration, knowledge = Counted(self, "orchestration"), Counted(self, "knowledge")
        for team_id in TEAMS:
            agents = {
                name: AgentCoordinationState(agent_id=name, capabilities=[name])
                for name in TEAM_AGENTS
            }
            team = TeamState(team_id=team_id, agents=agents)
            await orchestration(self.orchestration.create_team(team))
        for kb in KNOWLEDGE_BASES:
            progress = IndexingProgress(knowledge_base_id=kb, total_documents=10_000)
            await knowledge(self.knowledge.update_indexing_progress(progress))

    def _on_plain(self, key: str, old: object, new: object) -> None:
        self.plain_events += 1

    async def run(self, operations: int, workers: int, seed: int) -> float:
        """Spend `operations` operations from `workers` tasks; return the seconds it took."""
        self.ops = Ops(operations)
        subscriptions = Counted(self, "subscriptions")
        self.state.subscribe("plain:*", self._on_plain)  # one long-lived callback
        subscriptions.count()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for number in range(workers):
                worker = WorkerState(number, random.Random(f"{seed}:{self.phase}:{number}"))
                tg.start_soon(self._work, worker)
        elapsed = time.perf_counter() - start
        self.state.unsubscribe("plain:*", self._on_plain)
        subscriptions.count()
        return elapsed

    async def _work(self, worker: WorkerState) -> None:
        functions = [scenario for scenario, _ in self.scenarios]
        weights = [weight for _, weight in self.scenarios]
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
        rng, state, call = w.rng, self.state, Counted(self, "state")
        base = f"plain:{self.phase}:{w.number}"
        key = f"{base}:{rng.randrange(256)}"
        life = rng.uniform(self.timings.plain_ttl / 4, self.timings.plain_ttl)
        roll = rng.random()
        if roll < 0.35:
            value = {"n": w.scenarios, "text": "x" * rng.randrange(16, 400)}
            await call(state.save(key, value, ttl=life))
        elif roll < 0.55:
            await call(state.update(key, {"seen": w.scenarios}, default={}, ttl=life))
        elif roll < 0.65:
            counter = f"{base}:counter:{rng.randrange(8)}"
            await call(state.update(counter, lambda n: n + 1, default=0, ttl=life))
        elif roll < 0.8:
            await call(state.get(key))
            await call(state.exists(key))
        elif roll < 0.88:
            durable = f"{base}:durable:{w.scenarios}"
            await call(state.save(durable, {"kept": False}, ttl=None))
            await call(state.get_entry(durable))
            if not await call(state.delete(durable)):
                raise Failed(f"{durable} was saved but delete() found nothing")
        elif roll < 0.95:
            items = {f"{key}:batch:{i}": {"i": i} for i in range(4)}
            await call(state.save_many(items, ttl=life))
            await call(state.get_many(list(items)))
        elif roll < 0.99:
            await call(state.delete(key))
        else:
            await call(state.list_keys(f"{base}:*"))

    # ---------------------------------------------------------------- tools

    async def tool_calls(self, w: WorkerState) -> None:
        rng, tools, call = w.rng, self.tools, Counted(self, "tools")
        tool = rng.choice(TOOLS)
        parameters = {"query": f"q{rng.randrange(48)}", "page": rng.randrange(2)}
        roll = rng.random()
        if roll < 0.45:

            async def run_tool() -> dict[str, Any]:
                await anyio.lowlevel.checkpoint()
                return {"tool": tool, "hits": [parameters["query"]] * 3}

            await call(tools.cached_call(tool, parameters, run_tool))
        elif roll < 0.6:
            execution = ToolExecution(tool_name=tool, parameters=parameters)
            await call(tools.start_execution(execution))
            if rng.random() < 0.8:
                await call(tools.complete_execution(execution.execution_id, {"ok": True}, 3.0))
            else:
                await call(tools.fail_execution(execution.execution_id, "Timeout", 9.0))
            await call(tools.get_execution(execution.execution_id))
        elif roll < 0.72:
            await self._flaky_tool(w, tool, parameters)
        elif roll < 0.82:
            await call(tools.get_tool_stats(tool))
            await call(tools.get_execution_history(tool, limit=5))
            if rng.random() < 0.02:
                await call(tools.reset_stats(tool))
            if rng.random() < 0.02:
                await call(tools.clear_history(tool))
        elif roll < 0.9:
            digest = hash_parameters(parameters)
            entry = ToolCacheEntry(tool_name=tool, parameters_hash=digest, result={"manual": 1})
            await call(tools.cache_result(entry))
            await call(tools.get_cached_result(tool, parameters))
        elif roll < 0.96:
            await call(tools.invalidate_cache(tool, parameters))
        else:
            await call(tools.get_pending_retries(due_only=False))

    async def _flaky_tool(self, w: WorkerState, tool: str, parameters: dict[str, Any]) -> None:
        """`run_with_retries` on a tool that fails 0 to 3 times (3: every attempt fails)."""
        call = Counted(self, "tools")
        execution_id = self.ids(w, "retry")
        failures, tries = w.rng.choice((0, 1, 1, 2, 3)), 0

        async def flaky() -> str:
            nonlocal tries
            tries += 1
            if tries <= failures:
                raise TimeoutError("flaky tool")
            return "ok"

        retries = self.tools.run_with_retries(
            execution_id, tool, parameters, flaky, max_attempts=3, base_delay=0.002, max_delay=0.01
        )
        try:
            await call(retries)
        except RetryExhaustedError:
            self.ops.expected["tool retries exhausted"] += 1
            if not await call(self.tools.clear_retry_state(execution_id)):
                raise Failed(f"exhausted retry {execution_id} had no schedule") from None

    # ---------------------------------------------------------------- agents

    async def agent_state(self, w: WorkerState) -> None:
        rng, agents, call = w.rng, self.agents, Counted(self, "agents")
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
            await call(agents.save_snapshot(snapshot))
        elif roll < 0.7:
            state = {"step": w.agent_steps}
            checkpoint = AgentCheckpoint(agent_id=agent_id, step=w.agent_steps, state=state)
            await call(agents.save_checkpoint(checkpoint))
        elif roll < 0.85:
            snapshots = await call(agents.list_snapshots(agent_id))
            checkpoints = await call(agents.list_checkpoints(agent_id))
            if len(snapshots) > MAX_SNAPSHOTS or len(checkpoints) > MAX_CHECKPOINTS:
                self.retention_violations.append(
                    f"{agent_id}: {len(snapshots)} snapshots, {len(checkpoints)} checkpoints"
                )
        elif roll < 0.93:
            self.recovery.register(DummyAgent(agent_id))
            try:
                await call(self.recovery.recover(agent_id))
                await call(self.recovery.reset_attempts(agent_id))
            finally:
                self.recovery.unregister(agent_id)
            w.agent_recovered = True
        else:
            await call(agents.get_latest_checkpoint(agent_id))
            await call(agents.get_latest_snapshot(agent_id))
        if w.agent_steps >= AGENT_GENERATION:
            await self._retire_agent(w)

    async def _retire_agent(self, w: WorkerState) -> None:
        # max_age expires an abandoned agent's snapshots, checkpoints and recovery record; half
        # the agents that went through recovery are deleted instead.
        if w.agent_recovered and w.rng.random() < 0.5:
            await Counted(self, "agents")(self.agents.delete_agent(w.agent_id))
        w.agent_generation += 1
        w.agent_steps = 0
        w.agent_recovered = False

    # ---------------------------------------------------------------- workflows

    async def workflow_run(self, w: WorkerState) -> None:
        rng, flows, call = w.rng, self.workflows, Counted(self, "workflows")
        workflow_id = self.ids(w, "wf")
        steps = rng.randrange(3, 7)
        await call(
            flows.create(WorkflowState(workflow_id=workflow_id, total_steps=steps, name="soak"))
        )
        try:
            await call(flows.start(workflow_id))
            for number in range(1, steps + 1):
                await self._workflow_step(w, workflow_id, number)
            checkpoints = await call(flows.list_checkpoints(workflow_id))
            if len(checkpoints) > WORKFLOW_CHECKPOINTS:
                self.retention_violations.append(f"{workflow_id}: {len(checkpoints)} checkpoints")
            roll = rng.random()
            if roll < 0.75:
                await call(flows.complete(workflow_id, result={"ok": True}))
            elif roll < 0.9:
                await call(flows.cancel(workflow_id, reason="soak"))
            else:
                await call(flows.fail(workflow_id, "soak"))
            status = await call(flows.get_status(workflow_id))
            ended = (WorkflowStatus.COMPLETED, WorkflowStatus.CANCELLED, WorkflowStatus.FAILED)
            if status not in ended:
                raise Failed(f"{workflow_id} ended {status}")
        finally:
            with anyio.CancelScope(shield=True):
                await call(flows.delete(workflow_id))

    async def _workflow_step(self, w: WorkerState, workflow_id: str, number: int) -> None:
        """One step (15% wait out a pause), sometimes a manual checkpoint or a fail + resume."""
        rng, flows, call = w.rng, self.workflows, Counted(self, "workflows")
        if rng.random() < 0.15:
            await self._paused_step(workflow_id, number)
            return
        async with flows.step(workflow_id, number, f"step-{number}") as step:
            step.result = {"n": number}
            step.context_update = {"last": number}
        call.count()
        if rng.random() < 0.1:
            checkpoint = WorkflowCheckpoint(
                workflow_id=workflow_id,
                checkpoint_id=f"manual-{number}",
                step=number,
                context={"manual": number},
            )
            await call(flows.checkpoint(checkpoint))
        if number >= 2 and rng.random() < 0.06:  # auto-step-2 exists by now
            await call(flows.fail(workflow_id, "soak failure"))
            await call(flows.resume_from(workflow_id))

    async def _paused_step(self, workflow_id: str, number: int) -> None:
        """Pause the workflow, run a step that waits for the resume, and resume it."""
        flows, call = self.workflows, Counted(self, "workflows")
        await call(flows.pause(workflow_id))

        async def run_step() -> None:
            async with flows.step(workflow_id, number, f"step-{number}") as step:
                step.result = {"n": number, "after_pause": True}
            call.count()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_step)
                await anyio.sleep(0.002)
                await call(flows.resume(workflow_id))

    # ---------------------------------------------------------------- orchestration

    async def orchestration_work(self, w: WorkerState) -> None:
        rng, orch, call = w.rng, self.orchestration, Counted(self, "orchestration")
        team_id = rng.choice(TEAMS)
        roll = rng.random()
        if roll < 0.75:
            await self._task_round(w, team_id)
        elif roll < 0.9:
            start = time.perf_counter()
            await call(orch.reap_expired(team_id))
            self.ops.reaps += 1
            self.ops.reap_seconds += time.perf_counter() - start
        elif roll < 0.92:
            purged = await call(orch.purge_finished(team_id, older_than=timedelta(seconds=1)))
            self.ops.expected["finished tasks purged"] += purged
        elif roll < 0.97:
            name = rng.choice(TEAM_AGENTS)
            await call(orch.update_agent_status(team_id, name, "busy"))
            await call(orch.get_available_agents(team_id))
            await call(orch.update_agent_status(team_id, name, "idle"))
        else:
            await call(orch.get_queue_status(team_id, include_finished=rng.random() < 0.5))

    async def _task_round(self, w: WorkerState, team_id: str) -> None:
        """Enqueue a task or two (a few deleted at once), then claim one and finish it: complete,
        fail (retried, then dead-lettered) or abandon it to its short lease."""
        rng, orch, call = w.rng, self.orchestration, Counted(self, "orchestration")
        for _ in range(rng.choice((1, 1, 2))):
            task = {
                "id": f"{self.ids(w, 'task')}-{rng.randrange(10**9)}",
                "priority": rng.choice(list(TaskPriority)).value,
                "type": "soak",
            }
            item = await call(orch.enqueue_task(team_id, task))
            if rng.random() < 0.04:
                try:
                    await call(orch.delete_task(team_id, item.task_id))
                except NotFoundError:
                    pass  # never: nothing else deletes tasks
                else:
                    self.ops.expected["tasks deleted before a claim"] += 1
        member = rng.random() < 0.3
        worker_id = rng.choice(TEAM_AGENTS) if member else f"worker-{w.number}"
        abandon = rng.random() < 0.08
        lease = timedelta(seconds=self.timings.short_lease if abandon else self.timings.lease)
        capability = None if member else "any"
        claim = await call(orch.claim_task(team_id, worker_id, capability=capability, lease=lease))
        if claim is None or abandon:
            if abandon and claim is not None:
                self.ops.expected["claims abandoned (lease runs out)"] += 1
            return
        token = claim.lease_token
        try:
            await call(orch.heartbeat(team_id, claim.task_id, token))
            if rng.random() < 0.85:
                await call(
                    orch.complete_task(team_id, claim.task_id, {"ok": True}, lease_token=token)
                )
            else:
                await call(orch.fail_task(team_id, claim.task_id, "soak", lease_token=token))
        except ConflictError:
            self.ops.expected["leases lost to the reaper"] += 1

    # ---------------------------------------------------------------- knowledge

    async def knowledge_work(self, w: WorkerState) -> None:
        rng, kb, call = w.rng, self.knowledge, Counted(self, "knowledge")
        kb_id = rng.choice(KNOWLEDGE_BASES)
        roll = rng.random()
        if roll < 0.45:
            processed = rng.randrange(1, 20)
            await call(kb.increment_progress(kb_id, processed=processed, embeddings=10))
        elif roll < 0.5:
            progress = IndexingProgress(knowledge_base_id=kb_id, total_documents=10_000)
            await call(kb.update_indexing_progress(progress))
        elif roll < 0.6:
            await call(kb.estimate(kb_id))
        elif roll < 0.87:
            await self._synced_source(w, kb_id)
        elif roll < 0.9:
            await self._short_lived_knowledge_base(w)
        else:
            await call(kb.get_knowledge_base_state(kb_id))

    async def _synced_source(self, w: WorkerState, kb_id: str) -> None:
        """A source that syncs, is listed, and is removed."""
        kb, call = self.knowledge, Counted(self, "knowledge")
        source_id = self.ids(w, "src")
        for status in (SyncStatus.SYNCING, SyncStatus.SYNCED):
            source = SourceState(
                source_id=source_id,
                knowledge_base_id=kb_id,
                sync_status=status,
                documents_synced=w.rng.randrange(100),
            )
            await call(kb.update_source_state(source))
        await call(kb.get_sources(kb_id))
        if not await call(kb.remove_source(kb_id, source_id)):
            raise Failed(f"source {source_id} vanished before remove_source")

    async def _short_lived_knowledge_base(self, w: WorkerState) -> None:
        """A knowledge base of its own: indexed, given a source, then deleted whole."""
        kb, call = self.knowledge, Counted(self, "knowledge")
        kb_id = self.ids(w, "kb")
        progress = IndexingProgress(knowledge_base_id=kb_id, total_documents=5)
        await call(kb.update_indexing_progress(progress))
        await call(kb.increment_progress(kb_id, processed=5))
        source = SourceState(source_id="only", knowledge_base_id=kb_id, documents_synced=5)
        await call(kb.update_source_state(source))
        await call(kb.get_knowledge_base_state(kb_id))
        deleted = await call(kb.delete_knowledge_base(kb_id))
        if deleted != 2:
            raise Failed(f"delete_knowledge_base({kb_id}) deleted {deleted} records, not 2")

    # ---------------------------------------------------------------- speech

    async def speech_session(self, w: WorkerState) -> None:
        rng, speech, call = w.rng, self.speech, Counted(self, "speech")
        session_id = await call(speech.create_session(session_id=self.ids(w, "s")))
        await call(speech.update_session_status(session_id, AudioSessionStatus.ACTIVE))
        for n in range(rng.randrange(2, 6)):
            stt = STTState(
                session_id=session_id,
                status=TranscriptionStatus.TRANSCRIBING,
                audio_received_bytes=3200 * (n + 1),
                interim_transcript=" ".join(WORDS[: n + 1]),
            )
            await call(speech.update_stt_state(stt))
        tts = TTSState(session_id=session_id, text_queue=["Hi there"], is_speaking=True)
        await call(speech.update_tts_state(tts))
        await call(speech.append_turn(session_id, "user", "hello"))
        await call(speech.append_turn(session_id, "assistant", "hi"))
        if rng.random() < 0.2:
            await call(speech.update_session_status(session_id, AudioSessionStatus.PAUSED))
            await call(speech.update_session_status(session_id, AudioSessionStatus.ACTIVE))
        await call(speech.get_conversation_state(session_id))
        if rng.random() < 0.03:
            await call(speech.list_active_sessions())
        if rng.random() < 0.85:
            await call(speech.end_session(session_id, reason="done"))
        else:
            self.ops.expected["speech sessions abandoned (session_ttl)"] += 1
        if rng.random() < 0.3:
            await self._late_speech_updates(w)

    async def _late_speech_updates(self, w: WorkerState) -> None:
        """A session (live ones never expire) that gets updates after it ended."""
        speech, call = self.untimed_speech, Counted(self, "speech")
        session_id = await call(speech.create_session(session_id=self.ids(w, "late")))
        await call(speech.append_turn(session_id, "user", "bye"))
        await call(speech.end_session(session_id, reason="hung up"))
        final = STTState(
            session_id=session_id, status=TranscriptionStatus.COMPLETED, final_transcript="bye"
        )
        await call(speech.update_stt_state(final))
        await call(speech.update_tts_state(TTSState(session_id=session_id)))
        conversation = VoiceConversationState(session_id=session_id, turn_count=1, stt_state=final)
        await call(speech.update_conversation_state(conversation))
        self.ops.expected["speech updates after end_session"] += 3

    # ---------------------------------------------------------------- subscriptions

    async def subscription_churn(self, w: WorkerState) -> None:
        state, call = self.state, Counted(self, "subscriptions")
        prefix = f"subs:{self.phase}:{w.number}:{w.scenarios}"
        key, ttl = f"{prefix}:k", self.timings.plain_ttl
        if w.rng.random() < 0.5:
            seen = anyio.Event()

            def callback(changed: str, old: object, new: object) -> None:
                if changed == key:
                    seen.set()

            state.subscribe(f"{prefix}:*", callback)
            call.count()
            try:
                await call(state.save(key, 1, ttl=ttl))
                with anyio.fail_after(10):
                    await seen.wait()
            finally:
                state.unsubscribe(f"{prefix}:*", callback)
                call.count()
        else:
            async with state.watch(f"{prefix}:*") as changes:
                await call(state.save(key, 2, ttl=ttl))
                with anyio.fail_after(10):
                    change = await anext(changes)
                if change.key != key:
                    raise Failed(f"watch on {prefix}:* saw {change.key}")
            call.count()

    # ---------------------------------------------------------------- the end

    async def drain(self, say: Callable[[str], None]) -> dict[str, int]:
        """End everything the API can end: queues, team agents, sources, leftovers."""
        orch = self.orchestration
        counts: Counter[str] = Counter()
        for team_id in TEAMS:
            await self._drain_queue(team_id, counts, say)
            counts["team agents removed"] += await orch.remove_agent(team_id, TEAM_AGENTS[0])
            counts["finished tasks purged"] += await orch.purge_finished(team_id)
            counts["team records deleted by delete_team"] += await orch.delete_team(team_id)
        for kb_id in KNOWLEDGE_BASES:
            counts["knowledge records deleted"] += await self.knowledge.delete_knowledge_base(kb_id)
        for tool in TOOLS:
            counts["tool executions cleared"] += await self.tools.clear_history(tool)
            counts["tool statistics reset"] += await self.tools.reset_stats(tool)
        for workflow in await self.workflows.list_workflows():
            deleted = await self.workflows.delete(workflow.workflow_id)
            counts["leftover workflows deleted"] += deleted
        for retry in await self.tools.get_pending_retries(due_only=False):
            cleared = await self.tools.clear_retry_state(retry.execution_id)
            counts["leftover retry schedules cleared"] += cleared
        return dict(counts)

    async def _drain_queue(
        self, team_id: str, counts: Counter[str], say: Callable[[str], None]
    ) -> None:
        """Claim and complete every task; abandoned claims wait for their short lease."""
        orch, short_lease = self.orchestration, self.timings.short_lease
        deadline = time.monotonic() + 60 + short_lease
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
                return
            if time.monotonic() > deadline:
                raise Failed(f"{team_id}: tasks still pending or in progress after 60 s")
            say(
                f"  {team_id}: {len(queue.in_progress)} abandoned claims wait for their "
                f"lease ({short_lease:.1f} s)"
            )
            await anyio.sleep(short_lease)
