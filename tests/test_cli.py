"""The `agenticstate` command, run as a real process against file and Redis stores."""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import pty
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import agenticstate
from agenticstate import StateManager, WorkflowState, WorkflowStateManager
from agenticstate._progress import Progress
from agenticstate.backends import FileBackend
from agenticstate.cli import _parser
from tests._redis_server import RedisServer
from tests.helpers import LineProcess, unique_prefix


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m agenticstate ARGS...` (the package's __main__), as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
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
    url = f"file://{tmp_path / 'store'}"
    assert cli("--url", url, "set", "other", "1", cwd=tmp_path).returncode == 0
    result = cli("--url", url, *args, cwd=tmp_path)
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


@pytest.mark.parametrize(
    ("what", "column", "shown"),
    [
        ("agents", "agent", ["critic", "writer"]),
        ("workflows", "workflow", ["run-a", "run-b"]),
        ("teams", "team", ["band", "crew"]),
        ("knowledge", "knowledge_base", ["docs", "notes"]),
        ("tools", "tool", ["calculator", "search_web"]),
        ("sessions", "session", ["chat-1", "chat-2"]),  # the latest activity first
        ("speech", "session", ["voice-b", "voice-a"]),  # the oldest first
    ],
)
def test_inspect_each_target(tmp_path: Path, what: str, column: str, shown: list[str]) -> None:
    """`inspect <what>` lists the records of each manager, read through its list methods."""
    from tests.managers.test_list_methods import _fill  # records of every manager

    store = tmp_path / "store"

    async def make() -> None:
        async with StateManager(backend=FileBackend(base_path=store)) as state:
            await _fill(state)

    anyio.run(make)
    result = cli("--url", f"file://{store}", "--json", "inspect", what, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    assert [row[column] for row in rows] == shown
    table = cli("--url", f"file://{store}", "inspect", what, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[0] == column.split("_")[0]
    assert all(name in table.stdout for name in shown)


def test_inspect_targets_are_the_table() -> None:
    """The `inspect` choices are the keys of the one table mapping a target to its reader."""
    from agenticstate.cli import _INSPECTORS

    commands = next(
        action for action in _parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    inspect = commands.choices["inspect"]
    what = next(action for action in inspect._actions if action.dest == "target")
    assert list(what.choices or []) == list(_INSPECTORS)
    assert set(_INSPECTORS) == {
        "agents",
        "workflows",
        "teams",
        "knowledge",
        "tools",
        "sessions",
        "speech",
    }


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
    """`agenticstate demo` runs the demo job; `inspect` then shows what every manager left."""
    result = cli("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "agenticstate demo, run 1" in result.stdout
    assert "queue: 6 completed" in result.stdout
    # The closing hints name a command that works from here (this interpreter's script).
    hint = next(line for line in result.stdout.splitlines() if line.startswith("inspect it: "))
    command = hint.removeprefix("inspect it: ").split(" --url ")[0]
    assert command in ("agenticstate", str(Path(sys.executable).parent / "agenticstate"))
    url = "sqlite://.state/demo/state.db"
    for what, expected in [
        ("agents", "writer"),
        ("knowledge", "research-notes"),
        ("teams", "research"),
        ("workflows", "pipeline-run1"),
        ("tools", "search_web"),
        ("speech", "briefing"),
    ]:
        shown = cli("--url", url, "inspect", what, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert expected in shown.stdout, (what, shown.stdout)
    rows = json.loads(cli("--url", url, "inspect", "knowledge", "--json", cwd=tmp_path).stdout)
    assert rows[0]["documents"] == 6


# --------------------------------------------------------------------------- conventions


def test_version() -> None:
    """--version prints the package version and exits 0."""
    result = cli("--version", cwd=Path.cwd())
    assert result.returncode == 0
    assert result.stdout == f"agenticstate {agenticstate.__version__}\n"


def test_help_names_the_default_url_the_variable_and_the_exit_codes(tmp_path: Path) -> None:
    """--help says where the store comes from and what each exit code means."""
    for args in (("--help",), ("get", "--help")):
        shown = cli(*args, cwd=tmp_path).stdout
        assert "sqlite://./state/state.db" in shown
        assert "AGENTICSTATE_URL" in shown
        for code in ("0  success", "1  the key, record or store was not found", "2  bad usage"):
            assert code in shown, (args, shown)
        assert "3  the backend failed" in shown


def test_every_positional_argument_has_help() -> None:
    """Each command's positional arguments are explained in its --help."""
    parser = _parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) >= {"keys", "get", "set", "delete", "watch", "inspect", "demo"}
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.option_strings:
                assert action.help, f"{name} {action.dest} has no help"


def test_global_options_after_the_command(tmp_path: Path) -> None:
    """--url, --prefix and --json work after the command as well as before it."""
    url = f"file://{tmp_path / 'store'}"
    assert cli("set", "k", "1", "--url", url, "--prefix", "p:", cwd=tmp_path).returncode == 0
    after = cli("get", "k", "--json", "--url", url, "--prefix", "p:", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["value"] == 1
    before = cli("--url", url, "--json", "--prefix", "p:", "get", "k", cwd=tmp_path)
    assert json.loads(before.stdout)["value"] == 1
    mixed = cli("--url", url, "keys", "--json", cwd=tmp_path)
    assert json.loads(mixed.stdout) == ["k"]
    # An option left out after the command keeps the value given before it.
    kept = cli("--json", "keys", "--url", url, cwd=tmp_path)
    assert json.loads(kept.stdout) == ["k"]


@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_json_get_of_a_key_with_a_ttl(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    """--json get on a key with a TTL prints the TTL in seconds (it crashed on a timedelta)."""
    if store == "redis":
        url = request.getfixturevalue("redis_url")
        prefix = unique_prefix()
    else:
        url, prefix = f"file://{tmp_path / 'store'}", ""
    saved = cli("--url", url, "--prefix", prefix, "set", "k", '"v"', "--ttl", "300", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    shown = cli("--url", url, "--prefix", prefix, "--json", "get", "k", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    entry = json.loads(shown.stdout)
    assert entry["value"] == "v"
    assert 290 < entry["ttl"] <= 300
    readable = cli("--url", url, "--prefix", prefix, "get", "k", cwd=tmp_path)
    # Whole seconds, rounded up: 0:05:00 within the first second, then 0:04:59 and down.
    assert re.search(r"expires in 0:0(4:[0-5]\d|5:00)\)", readable.stdout), readable.stdout


def test_set_creates_the_store(tmp_path: Path) -> None:
    """set is the one command that creates a store (./state/state.db by default)."""
    assert cli("set", "k", "1", cwd=tmp_path).returncode == 0
    assert (tmp_path / "state" / "state.db").exists()
    assert cli("keys", cwd=tmp_path).stdout == "k\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("watch", "*", "--count", "-1"), "must be 1 or more"),
        (("watch", "*", "--count", "0"), "must be 1 or more"),
        (("watch", "*", "--count", "x"), "must be a whole number"),
        (("set", "k", "1", "--ttl", "-5"), "must be a positive number of seconds, not -5"),
        (("set", "k", "1", "--ttl", "nan"), "must be a positive number of seconds, not nan"),
        (("set", "k", "1", "--ttl", "inf"), "must be a positive number of seconds, not inf"),
        (("set", "k", "1", "--ttl", "1e20"), "ttl of 1e+20 seconds is too long"),
        (("inspect", "nothing"), "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_saying_what_was_typed(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    """Bad numbers are refused up front, quoting what the user typed."""
    result = cli("--url", f"file://{tmp_path / 'store'}", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "store").exists()


def test_demo_on_a_broken_store_fails_in_one_line(tmp_path: Path) -> None:
    """The demo, like every command, reports a store it cannot use in one line and exits 3,
    also when its progress shows on a terminal (it printed a 50-line traceback)."""
    store = tmp_path / ".state" / "demo" / "state.db"
    store.parent.mkdir(parents=True)
    store.write_bytes(b"this is not a database" * 100)
    terminal, stdout = on_terminal("demo", cwd=tmp_path, code=3)
    assert stdout == ""
    [line] = screen(terminal)
    assert line.startswith("agenticstate: "), terminal
    assert "Traceback" not in terminal


def test_watch_on_a_file_store_says_it_holds_the_store(tmp_path: Path) -> None:
    """On a file store, watch says up front that other processes cannot write until it stops."""
    store = tmp_path / "store"
    assert cli("--url", f"file://{store}", "set", "k", "1", cwd=tmp_path).returncode == 0
    watcher = LineProcess("agenticstate", "--url", f"file://{store}", "watch", "*")
    try:
        with watcher.changed:
            said = watcher.changed.wait_for(
                lambda: any("holds the file store" in line for line in watcher.errors), 30
            )
        assert said, watcher.close()
        [note] = watcher.errors
        assert "other processes cannot open it, so cannot write, until watch stops" in note
        refused = cli("--url", f"file://{store}", "set", "k", "2", cwd=tmp_path)
        assert refused.returncode == 3
        assert f"in use by process {watcher.process.pid}" in refused.stderr
    finally:
        watcher.close()


class Lines:
    """A process's stdout read line by line as it arrives, with no PYTHONUNBUFFERED help."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agenticstate", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.errors: queue.Queue[str] = queue.Queue()
        for pipe, into in ((self.process.stdout, self.lines), (self.process.stderr, self.errors)):
            threading.Thread(target=self._read, args=(pipe, into), daemon=True).start()

    @staticmethod
    def _read(pipe: Any, into: queue.Queue[str]) -> None:
        with pipe:
            for line in pipe:
                into.put(line.rstrip("\n"))

    def next(self, into: queue.Queue[str] | None = None, timeout: float = 30) -> str:
        return (into or self.lines).get(timeout=timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.mark.redis
def test_watch_flushes_each_line_into_a_pipe(redis_url: str, tmp_path: Path) -> None:
    """Each change reaches a pipe as it happens (the next change is made only after the line
    for the last one arrived), and the lines say what happened."""
    prefix = unique_prefix()
    watcher = Lines("--url", redis_url, "--prefix", prefix, "watch", "agent:*", "--count", "3")
    try:
        assert "watching 'agent:*'" in watcher.next(watcher.errors)
        base = ("--url", redis_url, "--prefix", prefix)
        cli(*base, "set", "agent:1", '{"n": 1}', cwd=tmp_path)
        assert watcher.next().endswith('set    agent:1  v1  null -> {"n": 1}')
        cli(*base, "set", "agent:1", '{"n": 2}', cwd=tmp_path)
        assert watcher.next().endswith('set    agent:1  v2  {"n": 1} -> {"n": 2}')
        cli(*base, "delete", "agent:1", cwd=tmp_path)
        assert watcher.next().endswith('delete agent:1  v2  {"n": 2} -> (deleted)')
        assert watcher.process.wait(timeout=30) == 0
    finally:
        watcher.close()


@pytest.mark.redis
@pytest.mark.slow
def test_watch_shows_a_key_deleted_while_redis_was_down_as_gone(tmp_path: Path) -> None:
    """After a Redis restart that lost a key, its resync line says it is gone."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        watcher = Lines("--url", server.tcp_url, "watch", "agent:*", "--count", "2")
        try:
            assert "watching" in watcher.next(watcher.errors)
            cli("--url", server.tcp_url, "set", "agent:z", "1", cwd=tmp_path)
            assert watcher.next().endswith("set    agent:z  v1  null -> 1")
            server.restart()  # keeps nothing: agent:z is gone
            line = watcher.next(timeout=60)
            assert line.endswith(
                "resync agent:z  v1  (gone: deleted while the connection was down)"
            )
            assert watcher.process.wait(timeout=30) == 0
        finally:
            watcher.close()
    finally:
        server.stop()


# --------------------------------------------------------------------------- progress

KEYS = 3000
WORKFLOWS = 40


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file store with a few thousand keys and some workflows with checkpoints."""
    store = tmp_path_factory.mktemp("big") / "store"

    async def fill() -> None:
        async with StateManager(backend=FileBackend(base_path=store)) as state:
            await state.save_many({f"agent:{n:04}": {"n": n} for n in range(KEYS)})
            workflows = WorkflowStateManager(state_manager=state, checkpoint_interval=1)
            for n in range(WORKFLOWS):
                await workflows.create(WorkflowState(workflow_id=f"w{n:02}", total_steps=2))
                async with workflows.step(f"w{n:02}", 1, "collect"):
                    pass

    anyio.run(fill)
    return store


def on_terminal(*args: str, cwd: Path, stdout_too: bool = False, code: int = 0) -> tuple[str, str]:
    """Run the command with stderr (and stdout, if asked) on a pseudo-terminal.

    Returns what the terminal received and what the stdout pipe received.
    """
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "agenticstate.cli", *args],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=terminal if stdout_too else subprocess.PIPE,
            stderr=terminal,
        )
    finally:
        os.close(terminal)  # the child holds it now: end of file comes when the child exits
    received = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        stdout = process.stdout.read() if process.stdout is not None else b""
        assert process.wait(timeout=60) == code, bytes(received).decode(errors="replace")
        reader.join(timeout=60)
    finally:
        if process.stdout is not None:
            process.stdout.close()
        os.close(controller)
    return bytes(received).decode(), stdout.decode()


def screen(received: str) -> list[str]:
    """The non-blank lines a terminal shows after `received` (a carriage return overwrites)."""
    lines: list[str] = []
    line: list[str] = []
    column = 0
    for char in received:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line))
            line, column = [], 0
        else:
            line[column : column + 1] = [char]
            column += 1
    lines.append("".join(line))
    return [text.rstrip() for text in lines if text.strip()]


def test_progress_redraws_at_most_ten_times_a_second_and_erases_itself() -> None:
    """Updates within 0.1 s of the last redraw, or showing the same text, draw nothing."""
    now = [0.0]
    out = io.StringIO()
    progress = Progress(out, clock=lambda: now[0])
    for number, at in [(1, 0.0), (2, 0.05), (12000, 0.1), (12001, 0.15), (12000, 0.2), (3, 0.35)]:
        now[0] = at
        progress.update("scanning", number, "key")
    progress.clear()
    assert out.getvalue() == (
        "\rscanning... 1 key"
        "\rscanning... 12,000 keys"
        "\rscanning... 3 keys     "  # padded over the longer line before it
        "\r                  \r"  # erased
    )
    assert screen(out.getvalue()) == []
    assert not Progress(None).enabled
    assert Progress(None).wrap(out) is out


def test_keys_shows_progress_on_a_terminal_only(big_store: Path, tmp_path: Path) -> None:
    """keys counts on the terminal's stderr and erases it; stdout is the same as through a pipe."""
    url = f"file://{big_store}"
    piped = cli("--url", url, "keys", "agent:*", cwd=tmp_path)
    assert piped.returncode == 0
    assert piped.stderr == ""  # stderr is a pipe: no progress
    assert len(piped.stdout.splitlines()) == KEYS
    terminal, stdout = on_terminal("--url", url, "keys", "agent:*", cwd=tmp_path)
    assert re.search(r"\rscanning\.\.\. [0-9,]+ keys?", terminal), terminal
    assert "\ropening the store... 0 seconds" in terminal
    assert "\rclosing the store... 0 seconds" in terminal
    assert screen(terminal) == []  # erased at the end
    assert stdout == piped.stdout


def test_keys_output_is_intact_when_both_go_to_the_terminal(
    big_store: Path, tmp_path: Path
) -> None:
    """With stdout on the same terminal, the counter is erased before the keys are printed."""
    terminal, _ = on_terminal("--url", f"file://{big_store}", "keys", cwd=tmp_path, stdout_too=True)
    assert "scanning... " in terminal
    shown = screen(terminal)
    assert len(shown) == KEYS + WORKFLOWS * 2  # each workflow: its record and one checkpoint
    assert all(" " not in line for line in shown), [line for line in shown if " " in line]


async def test_progress_passes_errors_through_unchanged() -> None:
    """An error in a block that shows progress comes out as itself, and the line is erased."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(out)

    async def fail() -> None:
        async with progress.ticking("reading", lambda: 7, "record"):
            await anyio.lowlevel.checkpoint()  # the counter draws
            raise KeyError("k")

    with pytest.raises(KeyError):
        await fail()
    assert out.getvalue() == "\rreading... 7 records" + "\r" + " " * 20 + "\r"


def test_a_failing_store_is_reported_plainly_on_a_terminal(tmp_path: Path) -> None:
    """A store that fails to open while the counter shows exits 3 with a message."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "state.json").write_text("not a snapshot")
    terminal, stdout = on_terminal("--url", f"file://{store}", "keys", cwd=tmp_path, code=3)
    assert "opening the store... " in terminal
    assert screen(terminal)[0].startswith("agenticstate: "), terminal
    assert "Traceback" not in terminal
    assert stdout == ""


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("flag", ["--no-progress", "--json"])
def test_no_progress_with_the_flag_or_json(
    big_store: Path, tmp_path: Path, flag: str, where: str
) -> None:
    """--no-progress and --json keep the terminal free of progress, before or after the command."""
    url = f"file://{big_store}"
    args = [flag, "keys", "--url", url] if where == "before" else ["keys", flag, "--url", url]
    terminal, stdout = on_terminal(*args, cwd=tmp_path)
    assert terminal == ""
    assert len(json.loads(stdout) if flag == "--json" else stdout.splitlines()) > KEYS


def test_inspect_shows_progress(big_store: Path, tmp_path: Path) -> None:
    """inspect counts the records it reads on the terminal; its table is unchanged."""
    url = f"file://{big_store}"
    piped = cli("--url", url, "inspect", "workflows", cwd=tmp_path)
    assert piped.returncode == 0
    assert piped.stderr == ""
    assert len(piped.stdout.splitlines()) == WORKFLOWS + 2  # header, rule, rows
    terminal, stdout = on_terminal("--url", url, "inspect", "workflows", cwd=tmp_path)
    assert re.search(r"\rreading workflows\.\.\. [0-9,]+ records?", terminal), terminal
    assert screen(terminal) == []
    assert stdout == piped.stdout


def test_demo_shows_progress_when_its_report_goes_elsewhere(tmp_path: Path) -> None:
    """demo counts its writes on the terminal while the report goes to a pipe, not over it."""
    terminal, stdout = on_terminal("demo", cwd=tmp_path)
    assert "agenticstate demo, run 1" in stdout
    assert re.search(r"\rdemo\.\.\. [0-9,]+ writes?", terminal), terminal
    # Log lines (the retried tool) are printed on a clean line: the counter is erased first.
    shown = screen(terminal)
    assert shown, terminal
    assert all(re.match(r"\d{4}-\d\d-\d\d ", line) for line in shown), shown
    both, _ = on_terminal("demo", cwd=tmp_path, stdout_too=True)
    assert "agenticstate demo, run 2" in both
    assert "demo... " not in both  # the report itself shows the progress


def test_a_closed_pipe_ends_quietly(big_store: Path, tmp_path: Path) -> None:
    """`agenticstate keys | head -1`: no traceback when the reader goes away early."""
    # The keys (about 35 KB) would fit in a default 64 KB pipe: the command could write them
    # all and exit 0 before the reader goes, as it did on a busy machine. A 4 KB pipe makes it
    # wait for the reader, so it always meets the closed pipe.
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    with os.fdopen(read_end, "rb") as reader:
        process = subprocess.Popen(
            [sys.executable, "-m", "agenticstate", "--url", f"file://{big_store}", "keys"],
            cwd=tmp_path,
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
        os.close(write_end)
        assert reader.readline() == b"agent:0000\n"
    # the reader is gone
    assert process.wait(timeout=60) == 141
    assert process.stderr is not None
    assert process.stderr.read() == b""
    process.stderr.close()
