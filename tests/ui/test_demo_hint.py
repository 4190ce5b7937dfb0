"""`make demo` ends by printing how to open the inspector; that command serves the demo's store."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import urllib.request
from typing import TYPE_CHECKING

import pytest

from tests.helpers import LineProcess

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


def test_the_demo_prints_an_inspector_command_that_serves_its_store(tmp_path: Path) -> None:
    demo = subprocess.run(
        [sys.executable, "-m", "agenticstate.demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    hint = next(line for line in demo.stdout.splitlines() if "see it live:" in line)
    command = shlex.split(hint.split("see it live:", 1)[1].split("(")[0])
    # This interpreter's command, as the demo names it (a path when it is not on PATH).
    assert command[0].rsplit("/", 1)[-1] == "agenticstate"
    assert command[-1] == "ui"
    # The hint is relative to where the demo ran; the server runs from the repository.
    args = [arg.replace("sqlite://.state", f"sqlite://{tmp_path}/.state") for arg in command[1:]]
    assert args != command[1:]
    server = LineProcess("agenticstate.cli", *args, "--port", "0")
    try:
        assert server.wait_until(lambda lines: any("http://" in line for line in lines), 30), (
            server.close()
        )
        address = next(line for line in server.lines if "http://" in line).split()[-1]
        with urllib.request.urlopen(f"{address}api/teams", timeout=10) as response:  # noqa: S310
            teams = json.load(response)["teams"]
        assert [team["team_id"] for team in teams] == ["research"]
        assert teams[0]["completed"] == 6
    finally:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGINT)
            server.process.wait(timeout=20)
        server.close()
