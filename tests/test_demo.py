"""`make demo`: the job runs on the SQLite backend and a second run continues from the first.

Its report reads as text (no Python reprs, no "time(s)"), says where a failure is deliberate,
and its warnings about those failures are marked as such; what it leaves is finished (the
indexing run completed, speech sessions ended with a final transcript) and fills every tab of the
inspector (sessions included).
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio

from agenticstate import (
    IndexingStatus,
    KnowledgeStateManager,
    SessionManager,
    SpeechStateManager,
    StateConfig,
    StateManager,
    TranscriptionStatus,
    WorkflowStateManager,
)

if TYPE_CHECKING:
    from pathlib import Path


def run_demo(cwd: Path) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "agenticstate.demo"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, result.stderr


REPR = re.compile(r"\['|\{'|\(s\)|\w\(\w+=")
"""What a Python repr or a lazy plural looks like in a report line."""


def check_report(report: str, log: str) -> None:
    """The report reads as text; each deliberate failure is announced; its warning is marked."""
    for line in report.splitlines():
        assert not REPR.search(line), line
    for announced in (
        "fails on purpose (a source timed out); it goes back in the queue for a retry",
        "fetch_page times out twice on purpose",
        "the writer crashes on purpose before its last section; recovering",
    ):
        assert announced in report, announced
    assert "Traceback" not in log
    warnings = [line for line in log.splitlines() if "[WARNING]" in line]
    assert len(warnings) == 4, log  # the failed task, two fetch retries, the writer's crash
    assert all(line.endswith("demo='on purpose'") for line in warnings), log


def test_demo_uses_every_manager_and_continues(tmp_path: Path) -> None:
    """Run 1 does a round with every manager; run 2 continues from the state run 1 left."""
    first, log = run_demo(tmp_path)
    check_report(first, log)
    for line in (
        "agenticstate demo, run 1",
        "workflow pipeline-run1: 6 of 6 steps, checkpoints auto-step-6, auto-step-4, auto-step-2",
        "search_web: 2 identical calls, the tool ran once, the cache served the rest",
        "fetch_page: succeeded on attempt 3",
        "5 interim transcripts, a final one, 2 turns, ended",
        "chat session chat-run1 of user ada: 5 messages, a summary of the first 3",
        "user ada has 1 chat session, one per run",
        "writer crashed; recovered from checkpoint run1-findings",
        "writer finished intro, findings, outlook after the recovery",
        "queue: 6 completed, 0 pending, 0 dead-lettered; done this run by analyst 2, "
        "researcher 2, writer 2",
        "knowledge base: 6 notes, 48 vectors, indexing completed",
    ):
        assert line in first, line
    assert (tmp_path / ".state" / "demo" / "state.db").exists()
    second, log = run_demo(tmp_path)
    check_report(second, log)
    for line in (
        "continuing from the last run: 6 tasks completed, 6 notes indexed",
        "search_web: 2 identical calls, both served from the cache an earlier run filled "
        "(the tool did not run)",
        "user ada has 2 chat sessions, one per run",
        "queue: 12 completed, 0 pending, 0 dead-lettered",
        "knowledge base: 12 notes, 96 vectors, indexing completed",
    ):
        assert line in second, line
    anyio.run(check_store, tmp_path / ".state" / "demo" / "state.db")


async def check_store(path: Path) -> None:
    """What two runs left: finished, and something in every manager's records."""
    async with StateManager(StateConfig(backend="sqlite", sqlite_path=path)) as state:
        progress = await KnowledgeStateManager(state_manager=state).get_indexing_progress(
            "research-notes"
        )
        assert progress is not None
        assert progress.status is IndexingStatus.COMPLETED
        speech = SpeechStateManager(state_manager=state)
        ended = await speech.list_sessions(active_only=False)
        assert len(ended) == 2
        for session in ended:
            stt = await speech.get_stt_state(session.session_id)
            assert stt is not None
            assert (stt.status, stt.final_transcript) == (
                TranscriptionStatus.COMPLETED,
                "what did the team find?",
            )
        sessions = SessionManager(state_manager=state)
        chats = await sessions.list_sessions("ada")
        assert sorted(chat.session_id for chat in chats) == ["chat-run1", "chat-run2"]
        for chat in chats:
            assert len(await sessions.get_messages(chat.session_id)) == 5
            assert await sessions.get_summary(chat.session_id) is not None
            assert (await sessions.get_state(chat.session_id))["follow_up"] is True
        workflows = WorkflowStateManager(state_manager=state)
        names = [str(workflow.name) for workflow in await workflows.list_workflows()]
        assert sorted(names) == ["research pipeline, run 1", "research pipeline, run 2"]
