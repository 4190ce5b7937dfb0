"""Every command that reads a store exits 3 with the reason when the store cannot be reached.

`agenticstate ui` used to start on an unreachable Redis (a closed port, a wrong password): it
printed its address, served a page that could read nothing, and logged `ui_sample_failed` every
two seconds, while every other command exited 3 naming the reason. The table runs every command
that takes `--url` against a closed port and against a real server with a wrong password.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests._redis_server import free_port
from tests.test_cli_usability import ARGS

if TYPE_CHECKING:
    from pathlib import Path

# The commands that open --url (the others name their stores as arguments, or use their own).
ON_URL = {
    name: args
    for name, args in ARGS.items()
    if name not in {"demo", "copy", "export", "import", "repair"}
}
ON_URL["diff"] = ("01234567", "89abcdef")  # well-formed commit ids: the store is read
EXTRA = {"ui": ("--port", "0")}


def _run(url: str, command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agenticstate",
            "--url",
            url,
            command,
            *ON_URL[command],
            *EXTRA.get(command, ()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=False,
    )


def test_the_table_has_ui() -> None:
    """The table covers `ui` (the command that used to start anyway)."""
    assert "ui" in ON_URL


@pytest.fixture(scope="module")
def wrong_password(redis_url: str) -> str:
    """The test server's URL for an ACL user `reader`, with a wrong password."""
    import redis as sync_redis

    if not redis_url.startswith("unix://"):
        pytest.skip("needs the test server's unix socket")
    path = redis_url.removeprefix("unix://")
    with sync_redis.Redis(unix_socket_path=path) as admin:
        admin.execute_command("ACL", "SETUSER", "reader", "on", ">right-password", "~*", "+@all")
    return f"unix://reader:not-the-password@{path}"


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(ON_URL))
def test_a_closed_port_exits_3_with_the_reason(command: str, tmp_path: Path) -> None:
    """Nothing listening: exit 3, one line naming the reason, nothing on stdout (the
    inspector prints no address), for every command on --url."""
    result = _run(f"redis://127.0.0.1:{free_port()}/0", command, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 3, result.stderr
    assert len(lines) == 1, result.stderr
    assert "connection refused" in lines[0]
    assert result.stdout == ""


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("command", ["keys", "ui"])
def test_a_wrong_password_exits_3_like_every_command(
    command: str, wrong_password: str, tmp_path: Path
) -> None:
    """A wrong password: `ui` exits 3 with the same line as `keys`, never showing it."""
    result = _run(wrong_password, command, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 3, result.stderr
    assert len(lines) == 1, result.stderr
    assert "not-the-password" not in result.stderr
    assert result.stdout == ""
