"""Every program in docs/examples runs to completion (the docs include them verbatim)."""

from __future__ import annotations

import os
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
