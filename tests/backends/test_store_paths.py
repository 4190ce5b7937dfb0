"""A store path a retry cannot fix is one typed error, the same for the file and SQLite backends.

Every cause (the store path is a file, runs through a file, has a name too long, loops through
symbolic links, holds a NUL byte) x every backend that keeps files x constructor or URL x with
and without `create` raises `ConfigurationError` naming the cause, and creates nothing; the CLI
reports it in one line with exit 2, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest

from agenticstate import ConfigurationError, FileBackend, NotFoundError, SQLiteBackend
from agenticstate.backends import open_backend

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agenticstate.backends.base import Backend

CLI = [sys.executable, "-m", "agenticstate"]


def _a_file(tmp: Path) -> str:
    (tmp / "plain-file").write_text("")
    return str(tmp / "plain-file")


def _through_a_file(tmp: Path) -> str:
    return os.path.join(_a_file(tmp), "store")


def _too_long(tmp: Path) -> str:
    return str(tmp / ("x" * 300))


def _symlink_loop(tmp: Path) -> str:
    os.symlink(tmp / "loop-b", tmp / "loop-a")
    os.symlink(tmp / "loop-a", tmp / "loop-b")
    return str(tmp / "loop-a" / "store")


def _nul(tmp: Path) -> str:
    return str(tmp / "a\x00b")


# The directory a store lives in (the file store's directory; the SQLite file is `s.db` in it).
CAUSES: dict[str, Callable[[Path], str]] = {
    "a file": _a_file,
    "through a file": _through_a_file,
    "name too long": _too_long,
    "symlink loop": _symlink_loop,
    "NUL byte": _nul,
}

OPENERS: dict[str, Callable[[str, bool], Backend]] = {
    "FileBackend": lambda where, create: FileBackend(where, create=create),
    "SQLiteBackend": lambda where, create: SQLiteBackend(
        os.path.join(where, "s.db"), create=create
    ),
    "file://": lambda where, create: open_backend(f"file://{quote(where)}", create=create),
    "sqlite://": lambda where, create: open_backend(
        f"sqlite://{quote(os.path.join(where, 's.db'))}", create=create
    ),
}


def _listing(tmp: Path) -> list[str]:
    return sorted(os.listdir(tmp))


@pytest.mark.parametrize("create", [True, False], ids=["create", "no-create"])
@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("cause", CAUSES)
async def test_a_path_to_fix_is_a_configuration_error(
    cause: str, opener: str, create: bool, tmp_path: Path
) -> None:
    """Each cause of a bad store path is one typed error on every backend; nothing is created."""
    where = CAUSES[cause](tmp_path)
    before = _listing(tmp_path)
    expected: tuple[type[Exception], ...] = (ConfigurationError,)
    if not create and cause not in ("NUL byte", "name too long"):
        # Nothing to open and nothing may be created: "no store here" is the answer too.
        expected = (ConfigurationError, NotFoundError)
    with pytest.raises(expected):  # noqa: PT012  # from the constructor or from open
        backend = OPENERS[opener](where, create)
        try:
            await backend.open()
        finally:
            await backend.aclose()
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("scheme", ["file", "sqlite"])
@pytest.mark.parametrize("cause", CAUSES)
def test_the_cli_reports_a_path_to_fix_in_one_line(cause: str, scheme: str, tmp_path: Path) -> None:
    """The CLI gives a bad store path exit 2 and one line, never a traceback."""
    where = CAUSES[cause](tmp_path)
    if scheme == "sqlite":
        where = os.path.join(where, "s.db")
    url = f"{scheme}://{quote(where)}"
    run = subprocess.run([*CLI, "--url", url, "set", "k", "1"], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
