"""A transfer command stopped by a signal cleans up as after Ctrl-C.

Every stop signal (SIGINT, SIGTERM, SIGHUP) x every transfer command (export, import, copy):
the command is frozen (SIGSTOP) once it has begun writing, the signal is sent, and it resumes.
It exits with 128 + the signal's number, without a traceback, leaves no `.partial` file, and
the destination opens afterwards.
"""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import FileBackend, SQLiteBackend
from agenticstate.transfer import export_state

if TYPE_CHECKING:
    from pathlib import Path

KEYS, SIZE = 20_000, 1000


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store big enough that a transfer takes a while, and its dump."""
    folder = tmp_path_factory.mktemp("signals")

    async def fill() -> None:
        async with SQLiteBackend(folder / "source.db") as store:
            await store.set_many([(f"k{i:05d}", b"x" * SIZE) for i in range(KEYS)])
            await export_state(store, folder / "source.jsonl")

    anyio.run(fill)
    return folder


def _begun(tmp_path: Path, command: str) -> bool:
    """Whether the command has begun writing its destination."""
    if command == "export":
        return bool(glob.glob(str(tmp_path / ".dump.jsonl.*.partial")))
    return (tmp_path / "dest.db").exists() or (tmp_path / "dest").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "import", "copy"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_transfer_leaves_nothing_behind(
    signum: signal.Signals, command: str, source: Path, tmp_path: Path
) -> None:
    """A transfer stopped by a signal exits 128+N in one piece and leaves no temporary file."""
    db = f"sqlite://{source / 'source.db'}"
    args = {
        "export": ["export", db, str(tmp_path / "dump.jsonl")],
        "import": ["import", str(source / "source.jsonl"), f"sqlite://{tmp_path / 'dest.db'}"],
        "copy": ["copy", db, f"file://{tmp_path / 'dest'}"],
    }[command]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agenticstate", "--no-progress", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _begun(tmp_path, command):  # waiting for a file to appear: no event to wait on
            assert proc.poll() is None, "the transfer ended before it could be stopped"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        # Frozen mid-way, the signal waits; it is handled as soon as the process resumes.
        proc.send_signal(signal.SIGSTOP)
        proc.send_signal(signum)
        proc.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert glob.glob(str(tmp_path / "*.partial")) + glob.glob(str(tmp_path / ".*.partial")) == []

    async def reopen() -> None:
        if command == "import":
            async with SQLiteBackend(tmp_path / "dest.db") as store:
                await store.get("k00000")
        elif command == "copy":
            async with FileBackend(tmp_path / "dest") as store:
                await store.get("k00000")

    anyio.run(reopen)
