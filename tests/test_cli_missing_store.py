"""Every command on a store that does not exist: a clear error, an exit code, nothing created.

A typo in a URL must never look like an empty store (a backup job that exports nothing, an
inspector on a new empty database). Each command of the parser runs, as a real process, on a
missing file store and a missing SQLite database; only the commands that write a store may
create it (`set`, `import` and `copy` into their destination, `demo` its own).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from agenticstate.cli import _parser

if TYPE_CHECKING:
    from pathlib import Path

MISSING = {"file": "file://.state/dmeo", "sqlite": "sqlite://.state/dmeo/state.db"}

# The arguments each command gets after `--url MISSING` (or with MISSING as its store).
ON_URL: dict[str, tuple[str, ...]] = {
    "keys": ("keys",),
    "get": ("get", "k"),
    "delete": ("delete", "k"),
    "watch": ("watch", "*", "--count", "1"),
    "usage": ("usage",),
    "inspect": ("inspect", "teams"),
    "history": ("history", "k"),
    "changes": ("changes", "*"),
    "log": ("log", "scope:"),
    "diff": ("diff", "a", "b"),
    "ui": ("ui", "--port", "0"),
    "repair": ("repair",),
    "reindex": ("reindex",),
}
ON_ARGUMENT: dict[str, tuple[str, ...]] = {  # MISSING stands for the store
    "export": ("export", "MISSING", "dump.jsonl"),
    "copy": ("copy", "MISSING", "memory://"),
}
WRITERS = {"set", "import", "demo"}  # create a store: checked apart, below


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_command_is_in_the_table() -> None:
    """The table covers every command the parser has (a new command must be added here)."""
    commands = next(
        action for action in _parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    assert set(commands.choices) == set(ON_URL) | set(ON_ARGUMENT) | WRITERS


CASES = [
    pytest.param(scheme, args, id=f"{scheme}-{args[0]}")
    for scheme in MISSING
    for args in [
        *(("--url", MISSING[scheme], *rest) for rest in ON_URL.values()),
        *(
            tuple(MISSING[scheme] if a == "MISSING" else a for a in rest)
            for rest in ON_ARGUMENT.values()
        ),
    ]
]


@pytest.mark.parametrize(("scheme", "args"), CASES)
def test_a_command_on_a_missing_store_exits_1_and_creates_nothing(
    tmp_path: Path, scheme: str, args: tuple[str, ...]
) -> None:
    """Reading (or exporting, copying from, inspecting, serving, repairing) a store that does
    not exist says so in one line naming the URL, exits 1, and leaves the directory empty."""
    if args[-1] == "repair" and scheme == "sqlite":
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2  # repair is for file stores: said before looking
        assert "repair works on file stores" in result.stderr
    else:
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(f"agenticstate: no store at {MISSING[scheme]} ")
        assert "check " in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_the_default_store_is_not_created_by_a_read(tmp_path: Path) -> None:
    """Without --url, a read in a directory with no ./state names the default and creates it not."""
    result = cli("keys", cwd=tmp_path)
    assert result.returncode == 1
    assert "sqlite://./state/state.db" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", list(MISSING))
def test_the_writing_commands_create_their_store(tmp_path: Path, scheme: str) -> None:
    """set creates the store it writes; import and copy create their destination; then the
    reads find it."""
    url = MISSING[scheme]
    assert cli("--url", url, "set", "k", "1", cwd=tmp_path).returncode == 0
    assert cli("--url", url, "keys", cwd=tmp_path).stdout == "k\n"
    assert cli("export", url, "dump.jsonl", cwd=tmp_path).returncode == 0
    copied, imported = (url.replace("dmeo", name) for name in ("copied", "imported"))
    assert cli("copy", url, copied, cwd=tmp_path).returncode == 0
    assert cli("import", "dump.jsonl", imported, cwd=tmp_path).returncode == 0
    for made in (copied, imported):
        assert cli("--url", made, "keys", cwd=tmp_path).stdout == "k\n"
