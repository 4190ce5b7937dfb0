"""The Makefile's targets, as a new user runs them: `make help` lists them, and `make demo`
installs only what the demo uses (not the test and docs toolchain `make test` needs).

Checked with `make -n` (print the commands, run nothing), so nothing is installed here; a clean
run of both orders (`make demo` then `make test`, and the reverse) was timed by hand and is in
the report of the change that made the lean install.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")


def make(*args: str) -> str:
    """`make ARGS` in the repository; its output."""
    done = subprocess.run(
        [str(MAKE), "--no-print-directory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_help_lists_every_described_target() -> None:
    """`make help` lists each target the Makefile describes (`target: ... ## what`), with what
    it does, and the ones a user needs first are among them."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    described = re.findall(r"^([a-z-]+):.*## (.+)$", makefile, re.MULTILINE)
    shown = make("help")
    for target, text in described:
        assert re.search(rf"^  make {target}\s+{re.escape(text)}$", shown, re.MULTILINE), target
    assert {"help", "demo", "test", "setup", "docs", "docs-check", "docs-serve"} <= {
        target for target, _ in described
    }


def test_the_demo_installs_the_package_alone() -> None:
    """`make demo`'s install (forced, printed, not run) installs the package with the `ui`
    extra it points to, and no dependency group (test, lint, docs) or other extra."""
    commands = make("-n", "-B", ".venv/.installed-demo")
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert len(installs) == 1
    assert '-e ".[ui]"' in installs[0]
    assert "--group" not in commands
    assert "redis" not in installs[0]


def test_the_demo_does_not_depend_on_the_full_install() -> None:
    """`make demo` needs only its own stamp: the full install (`make setup`) is not among what
    it would run, even when neither exists."""
    commands = make("-n", "-B", "demo")
    assert "--group dev" not in commands
    assert "python -m agenticstate.demo" in commands
