"""Every program in docs/examples, and the README's first example, runs to completion twice in a
row from one directory, as a reader trying them one after another would run them (the docs
include the programs verbatim)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
FIRST_PYTHON_BLOCK = re.compile(r"^```python\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def run(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python PATH` in `cwd`, warnings as errors."""
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )


def readme_example(directory: Path) -> Path:
    """The README's first python block, written to a file in `directory`."""
    found = FIRST_PYTHON_BLOCK.search((ROOT / "README.md").read_text(encoding="utf-8"))
    assert found is not None, "the README has no python block"
    path = directory / "readme_example.py"
    path.write_text(found["body"], encoding="utf-8")
    return path


def test_examples_exist() -> None:
    """The docs have runnable examples."""
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs_twice(path: Path, tmp_path: Path) -> None:
    """The example exits 0 (its own asserts check what it shows), and again in the same place."""
    for attempt in ("first", "second"):
        result = run(path, tmp_path)
        assert result.returncode == 0, f"{attempt} run:\n" + result.stdout + result.stderr
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


def test_every_example_then_the_readme_in_one_directory(tmp_path: Path) -> None:
    """All the examples, then the README's example twice, in one directory: no example writes
    a store another one reads, and the CLI opens the README's store by its file name."""
    for path in EXAMPLES:
        result = run(path, tmp_path)
        assert result.returncode == 0, f"{path.name}:\n" + result.stdout + result.stderr
    snippet = readme_example(tmp_path)
    for attempt in ("first", "second"):
        result = run(snippet, tmp_path)
        assert result.returncode == 0, f"{attempt} run:\n" + result.stdout + result.stderr
        assert result.stderr == "", f"{attempt} run logged:\n" + result.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "agenticstate", "--url", "file://./state/app_state.json", "keys"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["agent:researcher", "runs"]
