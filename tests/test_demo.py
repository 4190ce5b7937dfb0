"""`make demo`: the job runs on the SQLite backend and a second run continues from the first."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def run_demo(cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "agenticstate.demo"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_demo_uses_every_manager_and_continues(tmp_path: Path) -> None:
    """Run 1 does a round with every manager; run 2 continues from the state run 1 left."""
    first = run_demo(tmp_path)
    for line in (
        "agenticstate demo, run 1",
        "failed once, back in the queue",
        "workflow pipeline-run1: 6/6 steps",
        "search_web: 2 identical calls, the tool ran 1 time(s)",
        "fetch_page: succeeded on attempt 3",
        "2 turns, ended",
        "writer crashed; recovered from checkpoint run1-findings",
        "queue: 6 completed, 0 pending, 0 dead-lettered",
        "knowledge base: 6 notes",
    ):
        assert line in first, line
    assert (tmp_path / ".state" / "demo" / "state.db").exists()
    second = run_demo(tmp_path)
    assert "continuing from the last run: 6 tasks completed, 6 notes indexed" in second
    assert "search_web: 2 identical calls, the tool ran 0 time(s)" in second
    assert "queue: 12 completed, 0 pending, 0 dead-lettered" in second
