"""The command line as a new user meets it: global options anywhere, help that names what
works, errors that say what to do next, and `--json` output that is data.

The global options are checked as a class: every command of the parser, with every global
option before and after it, parses to the same thing (or is refused with the same words), and
its `--help` lists exactly the options it takes. The errors are a table of real processes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import StateManager
from agenticstate._registry import url_schemes
from agenticstate.backends import RedisBackend, SQLiteBackend
from agenticstate.cli import _check_global_options, _parser
from agenticstate.exceptions import BackendError
from tests._redis_server import RedisServer, make_test_ca

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# Every command with the arguments it needs after its name (the parser is never run here).
ARGS: dict[str, tuple[str, ...]] = {
    "keys": (),
    "get": ("k",),
    "set": ("k", "1"),
    "delete": ("k",),
    "watch": ("*",),
    "usage": (),
    "inspect": ("teams",),
    "history": ("k",),
    "changes": ("*",),
    "log": ("scope:",),
    "diff": ("a", "b"),
    "demo": (),
    "repair": (),
    "copy": ("sqlite://a.db", "sqlite://b.db"),
    "export": ("sqlite://a.db", "dump.jsonl"),
    "import": ("dump.jsonl", "sqlite://b.db"),
    "ui": (),
    "reindex": (),
}
GLOBAL_OPTIONS: dict[str, tuple[str, ...]] = {
    "--url": ("--url", "sqlite://other.db"),
    "--prefix": ("--prefix", "app:"),
    "--json": ("--json",),
    "--no-progress": ("--no-progress",),
}


def commands() -> dict[str, argparse.ArgumentParser]:
    """The parser's commands and their parsers."""
    [action] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def parse(argv: list[str]) -> tuple[int, str, dict[str, Any]]:
    """Parse `argv` as `main` does: (exit code, stderr, the parsed options)."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            args = _parser().parse_args(argv)
            _check_global_options(args)
        except SystemExit as exc:
            return int(exc.code or 0), errors.getvalue(), {}
    return 0, errors.getvalue(), vars(args)


def cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_every_command_is_in_the_table() -> None:
    """ARGS covers every command of the parser (a new command must be added)."""
    assert set(ARGS) == set(commands())


@pytest.mark.parametrize("option", list(GLOBAL_OPTIONS))
@pytest.mark.parametrize("command", list(ARGS))
def test_a_global_option_means_the_same_before_and_after_the_command(
    command: str, option: str
) -> None:
    """Before or after the command, a global option parses to the same options, or is refused
    with the same words (naming the command and why, exit 2); `COMMAND --help` lists it
    exactly when the command takes it."""
    given = list(GLOBAL_OPTIONS[option])
    before = parse([*given, command, *ARGS[command]])
    after = parse([command, *ARGS[command], *given])
    assert before == after
    code, message, parsed = before
    usage = commands()[command].format_usage()
    if code == 0:
        expected: object = given[1] if len(given) > 1 else True
        assert parsed[option.lstrip("-").replace("-", "_")] == expected
        assert option in usage
    else:
        assert code == 2
        assert message.startswith(f"agenticstate: {command} does not take {option}: ")
        assert option not in usage


def test_the_url_help_names_every_registered_scheme_and_the_default() -> None:
    """`--url`'s help lists every URL scheme a backend registered, and says the default is a
    SQLite database (not a file store's directory)."""
    text = " ".join(_parser().format_help().split())
    for scheme in url_schemes():
        assert f"{scheme}://" in text, scheme
    assert "sqlite://FILE (the default)" in text
    assert "the SQLite database ./state/state.db" in text
    assert "directory ./state" not in text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a SQLite store (`s.db`, one key), its dump and an empty directory."""
    directory = tmp_path_factory.mktemp("cli")
    assert cli("--url", "sqlite://s.db", "set", "k", "1", cwd=directory).returncode == 0
    assert cli("export", "sqlite://s.db", "dump.jsonl", cwd=directory).returncode == 0
    (directory / "adir").mkdir()
    return directory


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port something is listening on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


ERRORS = [
    # (case, arguments, exit code, the next step the message gives)
    ("sqlite-on-a-directory", ("--url", "sqlite://adir", "keys"), 2, "such as adir/state.db"),
    ("set-a-bare-word", ("--url", "sqlite://s.db", "set", "k", "hello"), 2, "'\"hello\"'"),
    ("set-into-memory", ("--url", "memory://", "set", "k", "1"), 2, "use sqlite://FILE"),
    ("import-into-memory", ("import", "dump.jsonl", "memory://"), 2, "use sqlite://FILE"),
    ("copy-into-memory", ("copy", "sqlite://s.db", "memory://"), 2, "use sqlite://FILE"),
    ("prefix-without-colon", ("--url", "sqlite://s.db", "--prefix", "app", "keys"), 2, "'app:'"),
    ("inspect-unknown", ("--url", "sqlite://s.db", "inspect", "tool"), 2, "argument TARGET"),
    ("ui-on-a-busy-port", ("--url", "sqlite://s.db", "ui", "--port", "BUSY"), 2, "--port 0"),
    ("demo-with-a-url", ("--url", "sqlite://s.db", "demo"), 2, "own store, ./.state/demo"),
    ("copy-with-a-url", ("copy", "sqlite://s.db", "sqlite://t.db", "--url", "x"), 2, "SRC_URL"),
]


@pytest.mark.parametrize(
    ("args", "code", "next_step"),
    [pytest.param(*case[1:], id=case[0]) for case in ERRORS],
)
def test_each_error_says_what_to_do_next(
    workdir: Path, args: tuple[str, ...], code: int, next_step: str
) -> None:
    """Each error exits with its code, prints nothing on stdout and says what to do next;
    nothing is created by a refused command."""
    before = sorted(path.name for path in workdir.iterdir())
    with busy_port() as port:
        result = cli(*(str(port) if arg == "BUSY" else arg for arg in args), cwd=workdir)
    assert result.returncode == code, result.stderr
    assert next_step in result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert sorted(path.name for path in workdir.iterdir()) == before


def test_memory_urls_still_read(workdir: Path) -> None:
    """Reading a memory:// store is allowed (it is empty): only writes into one are refused."""
    listed = cli("--url", "memory://", "--json", "keys", cwd=workdir)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []


def test_get_shows_the_expiry_in_whole_seconds(workdir: Path) -> None:
    """`get` shows the time written to the millisecond and the time left in whole seconds."""
    url = "sqlite://ttl.db"
    assert cli("--url", url, "set", "k", '"v"', "--ttl", "90.5", cwd=workdir).returncode == 0
    shown = cli("--url", url, "get", "k", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    last = shown.stdout.splitlines()[-1]
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00"
    assert re.fullmatch(rf"\(version 1, updated {stamp}, expires in 0:01:[0-3]\d\)", last), last


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store with records of every manager."""
    from tests.managers.test_list_methods import _fill

    path = tmp_path_factory.mktemp("records") / "state.db"

    async def fill() -> None:
        async with StateManager(backend=SQLiteBackend(path)) as state:
            await _fill(state)

    anyio.run(fill)
    return path


DISPLAY_STRINGS = re.compile(r"^-?[\d,]+(\.\d+)?%?$|^\d+/\d+$|^-$|^\S+:\S+(, \S+:\S+)+$")


@pytest.mark.parametrize("target", ["agents", "workflows", "teams", "knowledge", "tools",
                                    "sessions", "speech"])  # fmt: skip
def test_inspect_json_is_data(records: Path, tmp_path: Path, target: str) -> None:
    """`--json inspect` prints records as data: numbers as numbers, rates as fractions, lists
    and maps as JSON, missing as null; never the table's display strings ("50%", "1/4", "-")."""
    result = cli("--url", f"sqlite://{records}", "--json", "inspect", target, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    assert rows
    for row in rows:
        assert all(" " not in field for field in row), row  # field names, not headers
        for field, value in row.items():
            if isinstance(value, str):
                assert not DISPLAY_STRINGS.match(value), (field, value)
    table = cli("--url", f"sqlite://{records}", "inspect", target, cwd=tmp_path)
    assert len(table.stdout.splitlines()) == len(rows) + 2  # the same records, as a table


def test_inspect_json_types(records: Path, tmp_path: Path) -> None:
    """The fields a script computes with have JSON types: a rate is a float in [0, 1], a
    team's agents a map, a workflow's steps two integers."""

    def rows(target: str) -> list[dict[str, Any]]:
        shown = cli("--url", f"sqlite://{records}", "--json", "inspect", target, cwd=tmp_path)
        return json.loads(shown.stdout)  # type: ignore[no-any-return]

    tool = rows("tools")[0]
    assert isinstance(tool["success_rate"], float)
    assert 0 <= tool["success_rate"] <= 1
    assert isinstance(rows("teams")[0]["agents"], dict)
    workflow = rows("workflows")[0]
    assert (workflow["current_step"], workflow["total_steps"]) == (0, 2)


def test_transfer_commands_take_options_after_the_command(workdir: Path) -> None:
    """`copy`, `export` and `import` take --json and --prefix after the command, as the docs
    say every command does."""
    exported = cli("export", "sqlite://s.db", "out.jsonl", "--json", cwd=workdir)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["entries"] == 1
    imported = cli("import", "out.jsonl", "sqlite://in.db", "--json", cwd=workdir)
    assert json.loads(imported.stdout)["entries"] == 1, imported.stderr
    copied = cli("copy", "sqlite://s.db", "sqlite://c.db", "--json", "--prefix", "", cwd=workdir)
    assert json.loads(copied.stdout)["entries"] == 1, copied.stderr


def test_ui_takes_the_url_after_the_command(workdir: Path) -> None:
    """`ui --url URL --port 0 --json` serves that store and prints its address as JSON."""
    ui = ["ui", "--url", "sqlite://s.db", "--port", "0", "--json"]
    process = subprocess.Popen(
        [sys.executable, "-m", "agenticstate", *ui],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # blocks until it listens (or exits)
        shown = json.loads(first)
        assert shown["address"].startswith("http://127.0.0.1:")
        assert shown["allow_writes"] is False
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)


@pytest.mark.redis
async def test_tls_on_one_side_only_says_so(tmp_path: Path) -> None:
    """rediss:// on a plain port (which waits for the timeout) and redis:// on a TLS-only port
    (reset) say what to check: the TLS port, or the other scheme."""
    cert, key, ca = make_test_ca(tmp_path / "ca")
    plain = RedisServer(tmp_path / "plain")
    tls = RedisServer(tmp_path / "tls", tls_files=(cert, key, ca))
    plain.start()
    try:
        tls.start()
        try:
            cases = [
                (f"rediss://127.0.0.1:{plain.port}/0", "TLS port (tls-port), or use redis://"),
                (f"redis://127.0.0.1:{tls.port}/0", "TLS only (tls-port), use rediss://"),
            ]
            for url, hint in cases:
                backend = RedisBackend(url=url, connect_timeout=0.5, socket_timeout=0.5)
                with pytest.raises(BackendError) as caught:
                    await backend.get("k")
                await backend.aclose()
                assert hint in str(caught.value), url
        finally:
            tls.stop()
    finally:
        plain.stop()
