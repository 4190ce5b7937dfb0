"""A small research pipeline on agenticstate: `python -m agenticstate.demo` (or `make demo`).

It runs on the embedded default, the SQLite backend, in `.state/demo/state.db`, and uses every
manager on one `StateManager`:

- a team of three agents takes tasks from a leased queue (one task fails once and is retried);
- a workflow advances step by step, checkpointing every two steps;
- a tool's results are cached (an identical call is served from the cache, also on the next run)
  and a flaky tool is retried with backoff;
- a knowledge base counts what was indexed;
- a speech session streams interim transcripts, records turns and ends;
- the writer agent crashes mid-task and is recovered from its last checkpoint.

Run it again and it continues from the state the last run left: the run counter, the team, the
finished tasks, workflows, cache, knowledge counts and recovery records are all still there.
Afterwards, `agenticstate --url sqlite://.state/demo/state.db inspect teams` (or agents, workflows,
knowledge, tools, speech) shows the state, also while the demo runs: SQLite lets several processes
share it; and `agenticstate --url sqlite://.state/demo/state.db ui` serves the live web inspector on
it. The demo's last lines say how to run the command from where you are (`.venv/bin/agenticstate`
in the repository, `agenticstate` in an activated environment).
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from agenticstate import (
    AgentCheckpoint,
    AgentCoordinationState,
    AgentRecoveryManager,
    AgentStateStore,
    AudioSessionStatus,
    ConflictError,
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    RecoveryEvent,
    SourceState,
    SpeechStateManager,
    StateConfig,
    StateManager,
    StreamingMode,
    STTState,
    SyncStatus,
    TeamState,
    ToolStateManager,
    TranscriptionStatus,
    WorkflowState,
    WorkflowStateManager,
)
from agenticstate._progress import Progress

STORE = Path(".state/demo/state.db")
TEAM = "research"
AGENTS = {"researcher": ["research"], "analyst": ["analysis"], "writer": ["writing"]}
TOPICS = ["llm agents", "state machines", "vector search", "tool use", "speech", "evaluation"]


def say(text: str) -> None:
    """Print one line of the demo's report."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def setup_team(orch: OrchestrationStateManager, run: int) -> list[str]:
    """Create the team on the first run; enqueue this run's tasks."""
    # A later run finds the team already there.
    with contextlib.suppress(ConflictError):
        await orch.create_team(
            TeamState(
                team_id=TEAM,
                agents={
                    name: AgentCoordinationState(agent_id=name, capabilities=skills)
                    for name, skills in AGENTS.items()
                },
            )
        )
    ids = []
    for n, topic in enumerate(TOPICS):
        skill = list(AGENTS.values())[n % 3][0]
        task = await orch.enqueue_task(
            TEAM,
            {
                "id": f"run{run}-{n}",
                "priority": "high" if n == 0 else "normal",
                "capability": skill,
                "data": {"topic": topic, "flaky": n == 3},
            },
        )
        ids.append(task.task_id)
    return ids


async def work_queue(
    orch: OrchestrationStateManager, kb: KnowledgeStateManager, agent_id: str
) -> int:
    """Claim and complete tasks until the queue has none for this agent."""
    done = 0
    failed_once: set[str] = set()
    while (claim := await orch.claim_task(TEAM, agent_id, lease=timedelta(seconds=30))) is not None:
        data = claim.task.data
        if data.get("flaky") and claim.task_id not in failed_once:
            failed_once.add(claim.task_id)
            await orch.fail_task(
                TEAM, claim.task_id, "source timed out", lease_token=claim.lease_token
            )
            say(f"  {agent_id}: {claim.task_id} failed once, back in the queue")
            continue
        await orch.heartbeat(TEAM, claim.task_id, claim.lease_token)
        await orch.complete_task(
            TEAM,
            claim.task_id,
            {"summary": f"notes on {data['topic']}"},
            lease_token=claim.lease_token,
        )
        await kb.increment_progress("research-notes", processed=1, embeddings=8, bytes_indexed=4096)
        say(f"  {agent_id}: {claim.task_id} ({data['topic']}) done")
        done += 1
    return done


async def run_workflow(workflows: WorkflowStateManager, run: int) -> None:
    """A six-step workflow, checkpointed every two steps."""
    workflow_id = f"pipeline-run{run}"
    await workflows.create(WorkflowState(workflow_id=workflow_id, total_steps=6, name="research"))
    for number, name in enumerate(["plan", "collect", "read", "analyze", "draft", "review"], 1):
        async with workflows.step(workflow_id, number, name) as step:
            step.result = {"step": name}
            step.context_update = {name: "ok"}
    await workflows.complete(workflow_id)
    checkpoints = await workflows.list_checkpoints(workflow_id)
    say(
        f"  workflow {workflow_id}: 6/6 steps, checkpoints {[c.checkpoint_id for c in checkpoints]}"
    )


async def use_tools(tools: ToolStateManager, run: int) -> None:
    """A cached search (run twice) and a flaky fetch retried with backoff."""
    runs = 0

    async def search() -> dict[str, Any]:
        nonlocal runs
        runs += 1
        return {"hits": ["agenticstate", "anyio", "redis"]}

    for _ in range(2):
        await tools.cached_call("search_web", {"query": "agent state"}, search)
    say(f"  search_web: 2 identical calls, the tool ran {runs} time(s) (the cache served the rest)")

    attempts = 0

    async def fetch() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise TimeoutError("upstream slow")
        return "<html>paper</html>"

    await tools.run_with_retries(
        f"fetch-run{run}",
        "fetch_page",
        {"url": "https://example.org/paper"},
        fetch,
        max_attempts=5,
        base_delay=0.01,
    )
    say(f"  fetch_page: succeeded on attempt {attempts} (exponential backoff with jitter)")


async def speech_session(speech: SpeechStateManager) -> None:
    """A short voice briefing: interim transcripts, two turns, then the end."""
    session_id = await speech.create_session(
        session_type="briefing", streaming_mode=StreamingMode.BIDIRECTIONAL
    )
    await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
    words = ["what", "did", "the", "team", "find"]
    for n in range(1, len(words) + 1):
        await speech.update_stt_state(
            STTState(
                session_id=session_id,
                status=TranscriptionStatus.TRANSCRIBING,
                interim_transcript=" ".join(words[:n]),
                transcription_progress=n / len(words),
            )
        )
    await speech.append_turn(session_id, "user", " ".join(words) + "?")
    await speech.append_turn(session_id, "assistant", "Six topics, summarized in the notes.")
    await speech.end_session(session_id, reason="briefing_done")
    say(f"  speech session {session_id[:8]}: 5 interim transcripts, 2 turns, ended")


class Writer:
    """An agent whose long task crashes once, then resumes from its checkpoint."""

    def __init__(self) -> None:
        self.id = "writer"
        self.sections: list[str] = []
        self.crashed = False

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        """Take the sections written before the crash."""
        self.sections = list(state["sections"])

    async def write(self, store: AgentStateStore, run: int) -> list[str]:
        """Write the report's sections, checkpointing after each one."""
        for section in ["intro", "findings", "outlook"]:
            if section in self.sections:
                continue
            if section == "outlook" and not self.crashed:
                self.crashed = True
                self.sections = []  # the crash loses what was only in memory
                raise RuntimeError("the model endpoint went away")
            self.sections.append(section)
            await store.save_checkpoint(
                AgentCheckpoint(
                    agent_id=self.id,
                    checkpoint_id=f"run{run}-{section}",
                    step=len(self.sections),
                    state={"sections": self.sections},
                )
            )
        return self.sections


async def main(progress: Progress | None = None) -> None:
    """Run the next round of the pipeline and print what happened.

    Args:
        progress: Where to count the writes while the pipeline runs (the command passes one
            drawn on stderr when the report does not go to the terminal).
    """
    config = StateConfig(backend="sqlite", sqlite_path=STORE)
    progress = progress or Progress(None)
    async with StateManager(config=config) as state:

        def writes() -> int:
            stats = state.stats()
            return stats.saves + stats.updates + stats.deletes

        async with progress.ticking("demo", writes, "write"):
            await pipeline(state)
    command = cli_command()
    say(
        f"inspect it: {command} --url sqlite://.state/demo/state.db inspect teams "
        "(or agents, workflows, knowledge, tools, speech)"
    )
    say(f"see it live: {command} --url sqlite://.state/demo/state.db ui   (open the address)")
    say(f"run `{command} demo` again to continue from this state")


def cli_command() -> str:
    """How to run the `agenticstate` command of this interpreter, from here.

    `agenticstate` when that is on PATH and is this environment's; else the script next to this
    interpreter (`.venv/bin/agenticstate` in the repository); else `python -m agenticstate`.
    """
    bin_dir = Path(sys.executable).parent
    on_path = shutil.which("agenticstate")
    if on_path is not None and Path(on_path).parent.resolve() == bin_dir.resolve():
        return "agenticstate"
    script = bin_dir / "agenticstate"
    target = script if script.exists() else Path(sys.executable)
    with contextlib.suppress(ValueError):
        target = target.absolute().relative_to(Path.cwd())
    shown = shlex.quote(str(target) if target.is_absolute() else f"{target}")
    return shown if script.exists() else f"{shown} -m agenticstate"


async def pipeline(state: StateManager) -> None:
    """One round of the pipeline on `state`, reported line by line."""
    run = await state.update("demo:runs", lambda n: n + 1, default=0)
    say(f"agenticstate demo, run {run}")
    where = STORE.parent.resolve() / STORE.name
    say(f"state lives in {where} (SQLite backend: durable, shared by processes)")
    orch = OrchestrationStateManager(state_manager=state)
    workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=2)
    tools = ToolStateManager(state_manager=state, cache_ttl=3600)
    kb = KnowledgeStateManager(state_manager=state)
    speech = SpeechStateManager(state_manager=state)
    agents = AgentStateStore(state_manager=state, max_checkpoints=5)

    if run > 1:
        before = await orch.get_queue_status(TEAM)
        earlier = await kb.get_indexing_progress("research-notes")
        indexed = earlier.processed_documents if earlier else 0
        say(
            f"continuing from the last run: {len(before.completed)} tasks completed, "
            f"{indexed} notes indexed"
        )

    say("team and queue:")
    await setup_team(orch, run)
    if await kb.get_indexing_progress("research-notes") is None:
        await kb.update_indexing_progress(IndexingProgress(knowledge_base_id="research-notes"))
    counts: dict[str, int] = {}

    async def worker(agent_id: str) -> None:
        counts[agent_id] = await work_queue(orch, kb, agent_id)

    async with anyio.create_task_group() as tg:
        for agent_id in AGENTS:
            tg.start_soon(worker, agent_id)

    say("workflow:")
    await run_workflow(workflows, run)
    say("tools:")
    await use_tools(tools, run)
    say("speech:")
    await speech_session(speech)

    say("recovery:")
    recovery = AgentRecoveryManager(agent_store=agents, max_recovery_attempts=3)

    def recovered(event: RecoveryEvent) -> None:
        source = event.checkpoint.checkpoint_id if event.checkpoint else "nothing"
        say(f"  writer crashed; recovered from checkpoint {source}")

    recovery.on_after_recovery(recovered)
    writer = Writer()
    sections = await recovery.run(writer, lambda: writer.write(agents, run))
    say(f"  writer finished {sections} after the recovery")

    progress = await kb.get_indexing_progress("research-notes")
    await kb.update_source_state(
        SourceState(
            source_id="team-notes",
            knowledge_base_id="research-notes",
            sync_status=SyncStatus.SYNCED,
            documents_synced=progress.processed_documents if progress else 0,
        )
    )
    queue = await orch.get_queue_status(TEAM)
    overview = await kb.get_knowledge_base_state("research-notes")
    search = await tools.get_tool_stats("search_web")
    say("summary:")
    say(
        f"  queue: {len(queue.completed)} completed, {len(queue.pending)} pending, "
        f"{len(queue.dead_letter)} dead-lettered; this run by agent: {counts}"
    )
    notes, vectors = overview.total_documents, overview.total_embeddings
    say(f"  knowledge base: {notes} notes, {vectors} vectors")
    say(f"  search_web cache hit rate: {search.cache_hit_rate:.0%}")
    if queue.pending or queue.in_progress or len(queue.completed) != run * len(TOPICS):
        raise SystemExit("demo failed: the queue did not finish")


if __name__ == "__main__":
    from agenticstate.cli import main as cli

    cli([*sys.argv[1:], "demo"])  # global options (--no-progress) go first
