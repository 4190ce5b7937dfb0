"""Every program in docs/examples runs to completion (the docs include them verbatim)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))


def test_examples_exist() -> None:
    """The docs have runnable examples."""
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    """The example exits 0 (its own asserts check what it shows)."""
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _check_stderr(result.stdout, result.stderr)


LABELLED = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)[ :]")


def _check_stderr(stdout: str, stderr: str) -> None:
    """What an example writes on stderr are labelled log lines (never a bare event line or a
    traceback, which read as a crash), and an example that logs a warning says on stdout that
    the failure behind it is deliberate."""
    lines = stderr.splitlines()
    assert all(LABELLED.match(line) for line in lines), stderr
    if any(not line.startswith(("DEBUG", "INFO")) for line in lines):
        assert "on purpose" in stdout, stdout
