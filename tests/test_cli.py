"""The `agenticstate` command, run as a real process against file and Redis stores."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import StateManager, WorkflowState, WorkflowStateManager
from agenticstate.backends import FileBackend
from tests._procs import LineProcess
from tests.conftest import unique_prefix

if TYPE_CHECKING:
    from pathlib import Path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agenticstate.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_set_get_keys_delete_on_a_file_store(tmp_path: Path) -> None:
    """set, get, keys and delete work, with readable and --json output and clean stdout."""
    url = f"file://{tmp_path / 'store'}"
    saved = cli("--url", url, "set", "agent:1", '{"status": "idle"}', cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert saved.stdout.strip() == "saved agent:1 (version 1)"
    listed = cli("--url", url, "--json", "keys", "agent:*", cwd=tmp_path)
    assert json.loads(listed.stdout) == ["agent:1"]
    shown = cli("--url", url, "--json", "get", "agent:1", cwd=tmp_path)
    entry = json.loads(shown.stdout)
    assert (entry["value"], entry["version"]) == ({"status": "idle"}, 1)
    readable = cli("--url", url, "get", "agent:1", cwd=tmp_path)
    assert '"status": "idle"' in readable.stdout
    assert "version 1" in readable.stdout
    deleted = cli("--url", url, "delete", "agent:1", cwd=tmp_path)
    assert deleted.returncode == 0
    assert json.loads(cli("--url", url, "--json", "keys", cwd=tmp_path).stdout) == []


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("get", "missing"), 1, "no state at key 'missing'"),
        (("delete", "missing"), 1, "no state at key 'missing'"),
        (("set", "k", "{not json"), 2, "not valid JSON"),
        (("set", "bad\tkey", "1"), 2, "control character"),
        (("keys", ""), 2, "must not be empty"),
    ],
)
def test_errors_have_exit_codes_and_messages(
    tmp_path: Path, args: tuple[str, ...], code: int, message: str
) -> None:
    """Not found exits 1, bad input exits 2, each with a message on stderr."""
    result = cli("--url", f"file://{tmp_path / 'store'}", *args, cwd=tmp_path)
    assert result.returncode == code
    assert message in result.stderr
    assert result.stdout == ""


def test_backend_problems_exit_3(tmp_path: Path) -> None:
    """An unreachable Redis and an unknown scheme are reported plainly."""
    down = cli("--url", f"unix://{tmp_path}/none.sock", "keys", cwd=tmp_path)
    assert down.returncode == 3
    assert "cannot reach Redis" in down.stderr
    unknown = cli("--url", "ftp://x", "keys", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "unknown backend scheme" in unknown.stderr


def test_inspect_workflows(tmp_path: Path) -> None:
    """inspect workflows shows status, step and checkpoints."""
    store = tmp_path / "store"

    async def make() -> None:
        async with StateManager(backend=FileBackend(base_path=store)) as state:
            workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=1)
            await workflows.create(WorkflowState(workflow_id="research", total_steps=4))
            async with workflows.step("research", 1, "collect"):
                pass

    anyio.run(make)
    result = cli("--url", f"file://{store}", "inspect", "workflows", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "research" in result.stdout
    assert "1/4" in result.stdout
    assert "auto-step-1" in result.stdout
    rows: list[dict[str, Any]] = json.loads(
        cli("--url", f"file://{store}", "--json", "inspect", "workflows", cwd=tmp_path).stdout
    )
    assert rows[0]["status"] == "running"


@pytest.mark.redis
def test_watch_streams_changes_from_another_process(redis_url: str, tmp_path: Path) -> None:
    """watch prints each change (old -> new) made by another process."""
    prefix = unique_prefix()
    watcher = LineProcess(
        "agenticstate.cli",
        "--url",
        redis_url,
        "--prefix",
        prefix,
        "--json",
        "watch",
        "agent:*",
        "--count",
        "2",
    )
    try:
        with watcher.changed:
            subscribed = watcher.changed.wait_for(
                lambda: any("watching" in line for line in watcher.errors), 30
            )
        assert subscribed, watcher.close()
        cli("--url", redis_url, "--prefix", prefix, "set", "agent:1", '{"n": 1}', cwd=tmp_path)
        cli("--url", redis_url, "--prefix", prefix, "delete", "agent:1", cwd=tmp_path)
        assert watcher.wait_lines(2, timeout=30), watcher.close()
        first, second = (json.loads(line) for line in watcher.lines[:2])
        assert first["key"] == "agent:1"
        assert second["op"] in ("set", "delete")
        assert watcher.process.wait(timeout=30) == 0
    finally:
        watcher.close()


def test_demo_command(tmp_path: Path) -> None:
    """`agenticstate demo` runs the demo job."""
    result = cli("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "agenticstate demo, run 1" in result.stdout
    assert "queue: 6 completed" in result.stdout
