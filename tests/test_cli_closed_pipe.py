"""A reader that goes away early ends every command's output with exit 141, `--json` or not.

`agenticstate keys --json | head -c 10` used to exit 0: the listing went out in one large
write, which a pipe whose reader leaves part-way cuts short without an error, so a pipeline
could not tell a cut-off listing from a complete one. Output now goes out in pieces, and the
piece after the reader left raises `BrokenPipeError` (exit 141, as SIGPIPE would). The table
runs each kind of output (a listing, one large value, JSON lines) as a table and as `--json`,
through a 4 KB pipe so that the command always meets the closed pipe.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import StateManager
from agenticstate.backends import SQLiteBackend

if TYPE_CHECKING:
    from pathlib import Path

KEYS = 3000
COMMANDS = [
    ("keys",),
    ("keys", "--json"),
    ("get", "big"),
    ("get", "big", "--json"),
    ("changes", "*"),
    ("changes", "*", "--json"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite store whose listings, one value and feed are each far larger than a pipe."""
    path = tmp_path_factory.mktemp("pipe") / "s.db"

    async def fill() -> None:
        async with StateManager(backend=SQLiteBackend(path)) as state:
            await state.save_many({f"k:{i:06d}:" + "x" * 40: i for i in range(KEYS)})
            await state.save("big", "y" * 200_000)

    anyio.run(fill)
    return path


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_reader_gone_early_ends_the_command_with_141(
    store: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """The reader takes one byte and goes: exit 141, nothing on stderr."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    with os.fdopen(read_end, "rb") as reader:
        process = subprocess.Popen(
            [sys.executable, "-m", "agenticstate", "--url", f"sqlite://{store}", *args],
            cwd=tmp_path,
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
        os.close(write_end)
        assert reader.read(1)
    assert process.wait(timeout=60) == 141
    assert process.stderr is not None
    assert process.stderr.read() == b""
    process.stderr.close()
