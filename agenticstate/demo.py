"""A small research pipeline on agenticstate: `python -m agenticstate.demo` (or `make demo`).

It runs on the embedded default, the SQLite backend, in `.state/demo/state.db`, and uses every
manager on one `StateManager`:

- a team of three agents works a leased queue with `run_worker` (one task fails once, on
  purpose, and is retried);
- a workflow advances step by step, checkpointing every two steps;
- a tool's results are cached (an identical call is served from the cache, also on the next run)
  and a flaky tool (failing on purpose) is retried with backoff;
- a knowledge base counts what was indexed, in an indexing run that completes;
- a speech session streams interim transcripts, a final transcript, records turns and ends;
- a user's chat session keeps messages, state and a running summary;
- the writer agent crashes mid-task, on purpose, and is recovered from its last checkpoint.

The failures are deliberate, and the report says so where each one happens; the library's
warnings about them (`task_handler_failed`, `tool_retry_scheduled`, `guarded_job_failed`) are
marked `demo='on purpose'` on their log line.

Run it again and it continues from the state the last run left: the run counter, the team, the
finished tasks, workflows, cache, knowledge counts, sessions and recovery records are all still
there. Afterwards, `agenticstate --url sqlite://.state/demo/state.db inspect teams` (or agents,
workflows, knowledge, tools, speech, sessions) shows the state, also while the demo runs: SQLite
lets several processes share it; and `agenticstate --url sqlite://.state/demo/state.db ui` serves
the live web inspector on it. The demo's last lines say how to run the command from where you are
(`.venv/bin/agenticstate` in the repository, `agenticstate` in an activated environment).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    SessionManager,
    SourceState,
    SpeechStateManager,
    StateConfig,
    StateManager,
    StreamingMode,
    STTState,
    SyncStatus,
    TaskItem,
    TeamState,
    ToolStateManager,
    TranscriptionStatus,
    WorkflowState,
    WorkflowStateManager,
)
from agenticstate._progress import Progress

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from agenticstate import SessionMessage

STORE = Path(".state/demo/state.db")
TEAM = "research"
AGENTS = {"researcher": ["research"], "analyst": ["analysis"], "writer": ["writing"]}
TOPICS = ["llm agents", "state machines", "vector search", "tool use", "speech", "evaluation"]
USER = "ada"

DELIBERATE = {
    "agenticstate.managers.orchestration": "task_handler_failed",
    "agenticstate.managers.tools": "tool_retry_scheduled",
    "agenticstate.managers.agents": "guarded_job_failed",
}
"""The library's warnings about the demo's deliberate failures, by logger."""


class _OnPurpose(logging.Filter):
    """Mark the warnings about the demo's deliberate failures as such, on their log line."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, dict) and record.msg.get("event") == self.event:
            record.msg["demo"] = "on purpose"
        return True


@contextlib.contextmanager
def deliberate_failures_marked() -> Iterator[None]:
    """Mark the library's warnings about the demo's own failures while the demo runs."""
    filters = [(logging.getLogger(name), _OnPurpose(event)) for name, event in DELIBERATE.items()]
    for logger, on_purpose in filters:
        logger.addFilter(on_purpose)
    try:
        yield
    finally:
        for logger, on_purpose in filters:
            logger.removeFilter(on_purpose)


def listed(items: Iterable[object]) -> str:
    """`a, b, c`: a list as the report prints it."""
    return ", ".join(str(item) for item in items) or "none"


def times(count: int) -> str:
    """`once`, `twice`, `3 times`; `no time` for 0."""
    return {0: "no time", 1: "once", 2: "twice"}.get(count, f"{count} times")


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
    """Work the queue with `run_worker` until it has no task for this agent; count the tasks."""
    done = 0

    async def handle(task: TaskItem) -> dict[str, str]:
        nonlocal done
        data = task.data
        if data.get("flaky") and task.failures == 0:
            say(
                f"  {agent_id}: {task.task_id} fails on purpose (a source timed out); "
                "it goes back in the queue for a retry"
            )
            raise TimeoutError("source timed out")  # run_worker fails the task: a retry
        await kb.increment_progress("research-notes", processed=1, embeddings=8, bytes_indexed=4096)
        say(f"  {agent_id}: {task.task_id} ({data['topic']}) done")
        done += 1
        return {"summary": f"notes on {data['topic']}"}

    await orch.run_worker(TEAM, agent_id, handle, lease=timedelta(seconds=30), until_empty=True)
    return done


async def start_indexing(kb: KnowledgeStateManager) -> None:
    """Start this run's indexing: the notes so far, and this run's to come (one per topic).

    The run completes when the last of this run's notes is counted.
    """
    earlier = await kb.get_indexing_progress("research-notes")
    await kb.update_indexing_progress(
        IndexingProgress(
            knowledge_base_id="research-notes",
            total_documents=(earlier.processed_documents if earlier else 0) + len(TOPICS),
            processed_documents=earlier.processed_documents if earlier else 0,
            embeddings_generated=earlier.embeddings_generated if earlier else 0,
            bytes_indexed=earlier.bytes_indexed if earlier else 0,
        )
    )


async def run_workflow(workflows: WorkflowStateManager, run: int) -> None:
    """A six-step workflow, checkpointed every two steps."""
    workflow_id = f"pipeline-run{run}"
    await workflows.create(
        WorkflowState(workflow_id=workflow_id, total_steps=6, name=f"research pipeline, run {run}")
    )
    for number, name in enumerate(["plan", "collect", "read", "analyze", "draft", "review"], 1):
        async with workflows.step(workflow_id, number, name) as step:
            step.result = {"step": name}
            step.context_update = {name: "ok"}
    await workflows.complete(workflow_id)
    checkpoints = await workflows.list_checkpoints(workflow_id)
    say(
        f"  workflow {workflow_id}: 6 of 6 steps, checkpoints "
        f"{listed(c.checkpoint_id for c in checkpoints)}"
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
    if runs:
        say(
            f"  search_web: 2 identical calls, the tool ran {times(runs)}, "
            "the cache served the rest"
        )
    else:
        say(
            "  search_web: 2 identical calls, both served from the cache an earlier run filled "
            "(the tool did not run)"
        )

    attempts = 0

    async def fetch() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise TimeoutError("upstream slow")
        return "<html>paper</html>"

    say("  fetch_page times out twice on purpose; it is retried with exponential backoff")
    await tools.run_with_retries(
        f"fetch-run{run}",
        "fetch_page",
        {"url": "https://example.org/paper"},
        fetch,
        max_attempts=5,
        base_delay=0.01,
    )
    say(f"  fetch_page: succeeded on attempt {attempts}")


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
    question = " ".join(words) + "?"
    # The utterance is over: the transcript is final before the session ends.
    await speech.update_stt_state(
        STTState(
            session_id=session_id,
            status=TranscriptionStatus.COMPLETED,
            interim_transcript="",
            final_transcript=question,
            transcription_progress=1.0,
            confidence=0.94,
        )
    )
    await speech.append_turn(session_id, "user", question)
    await speech.append_turn(session_id, "assistant", "Six topics, summarized in the notes.")
    await speech.end_session(session_id, reason="briefing_done")
    say(f"  speech session {session_id[:8]}: 5 interim transcripts, a final one, 2 turns, ended")


async def chat_session(sessions: SessionManager, run: int) -> None:
    """A user's chat about this run: messages, state, and a summary of the older messages."""
    session_id = f"chat-run{run}"
    await sessions.create_session(
        USER,
        session_id=session_id,
        name=f"Questions about run {run}",
        state={"run": run, "topics_asked": []},
    )
    exchange = [
        ("user", "Which topics did the team cover?"),
        ("assistant", f"{len(TOPICS)} topics: {listed(TOPICS)}."),
        ("user", "Which one failed first?"),
        ("assistant", "Tool use: its source timed out once, and the retry succeeded."),
        ("user", "Save tool use for the follow-up."),
    ]
    for role, content in exchange:
        await sessions.add_message(session_id, role, content)
    await sessions.update_state(session_id, {"topics_asked": ["tool use"], "follow_up": True})

    def summarizer(previous: str | None, messages: list[SessionMessage]) -> str:
        asked = [str(m.content) for m in messages if m.role == "user"]
        return f"The user asked: {' / '.join(asked)}"

    summary = await sessions.summarize(session_id, summarizer, keep_last=2)
    covered = summary.covers_through if summary is not None else 0
    state = await sessions.get_state(session_id)
    say(
        f"  chat session {session_id} of user {USER}: {len(exchange)} messages, "
        f"a summary of the first {covered}, state keys {listed(sorted(state))}"
    )
    count = len(await sessions.list_sessions(USER))
    say(f"  user {USER} has {count} chat session{'s' if count != 1 else ''}, one per run")


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
            with deliberate_failures_marked():
                await pipeline(state)
    command = cli_command()
    say(
        f"inspect it: {command} --url sqlite://.state/demo/state.db inspect teams "
        "(or agents, workflows, knowledge, tools, speech, sessions)"
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
    sessions = SessionManager(state_manager=state)
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
    await start_indexing(kb)
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
    say("sessions:")
    await chat_session(sessions, run)

    say("recovery:")
    recovery = AgentRecoveryManager(agent_store=agents, max_recovery_attempts=3)

    def recovered(event: RecoveryEvent) -> None:
        source = event.checkpoint.checkpoint_id if event.checkpoint else "nothing"
        say(f"  writer crashed; recovered from checkpoint {source}")

    recovery.on_after_recovery(recovered)
    writer = Writer()
    say("  the writer crashes on purpose before its last section; recovering")
    sections = await recovery.run(writer, lambda: writer.write(agents, run))
    say(f"  writer finished {listed(sections)} after the recovery")

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
    by_agent = listed(f"{agent_id} {counts.get(agent_id, 0)}" for agent_id in sorted(AGENTS))
    say(
        f"  queue: {len(queue.completed)} completed, {len(queue.pending)} pending, "
        f"{len(queue.dead_letter)} dead-lettered; done this run by {by_agent}"
    )
    notes, vectors = overview.total_documents, overview.total_embeddings
    status = progress.status.value.replace("_", " ") if progress else "not started"
    say(f"  knowledge base: {notes} notes, {vectors} vectors, indexing {status}")
    say(f"  search_web cache hit rate: {search.cache_hit_rate:.0%}")
    if queue.pending or queue.in_progress or len(queue.completed) != run * len(TOPICS):
        raise SystemExit("demo failed: the queue did not finish")


if __name__ == "__main__":
    from agenticstate.cli import main as cli

    cli([*sys.argv[1:], "demo"])  # global options (--no-progress) go first
