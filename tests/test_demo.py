"""`make demo`: the job runs on the file backend and a second run continues from the first."""

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


def test_demo_runs_and_continues(tmp_path: Path) -> None:
    """Run 1 processes 12 documents; run 2 finds them done and processes 12 more."""
    first = run_demo(tmp_path)
    assert "processed 12 documents in all (1 runs)" in first
    assert (tmp_path / ".state" / "demo" / "state.json").exists()
    second = run_demo(tmp_path)
    assert "continuing from the last run: 12 documents were already processed" in second
    assert "processed 24 documents in all (2 runs)" in second
