"""The library is quiet: its events go through `logging`, and the application decides.

Each claim about "no configuration" runs in a fresh interpreter, since pytest configures logging
in this one.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog

from agenticstate import StateConfig, StateManager
from agenticstate._log import get_logger

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agenticstate"

README_PRINTS = (
    "agent:researcher None -> {'status': 'running', 'progress': 0.45}\n"
    "agent:researcher {'status': 'running', 'progress': 0.45} -> "
    "{'status': 'running', 'progress': 0.75}\n"
    "['agent:researcher']\n"
)


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert match is not None
    return match.group(1)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_readme_snippet_prints_exactly_what_it_prints(tmp_path: Path) -> None:
    """The README's program, as a user runs it: its own prints on stdout, nothing on stderr."""
    result = run_python(readme_snippet(), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == README_PRINTS
    assert result.stderr == ""
    assert (tmp_path / "state" / "app_state.json").exists()  # it did write its snapshot


def test_basic_config_debug_shows_events_with_context(tmp_path: Path) -> None:
    """`logging.basicConfig(level=DEBUG)` shows the library's events, each with its context."""
    code = "import logging\nlogging.basicConfig(level=logging.DEBUG)\n" + readme_snippet()
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == README_PRINTS  # logging writes to stderr, never among the prints
    # The last snapshot: a new store writes an empty one at open (it holds the store's id).
    line = [x for x in result.stderr.splitlines() if "file_store_snapshot" in x][-1]
    assert line.startswith("DEBUG:agenticstate.backends.file:file_store_snapshot ")
    assert "path='state/app_state.json'" in line
    assert "entries=2" in line


def test_unconfigured_shows_only_warnings_on_stderr(tmp_path: Path) -> None:
    """With no configuration: nothing below WARNING, and warnings go to stderr."""
    code = (
        "from agenticstate._log import get_logger\n"
        "log = get_logger('agenticstate.backends.file')\n"
        "log.debug('quiet_debug', n=1)\n"
        "log.info('quiet_info', n=2)\n"
        "log.warning('loud_warning', n=3)\n"
        "log.error('loud_error', n=4)\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["loud_warning n=3", "loud_error n=4"]


def test_logger_level_quiets_the_library(tmp_path: Path) -> None:
    """`logging.getLogger("agenticstate").setLevel(...)` is obeyed (it was not, with structlog's
    default printer)."""
    code = (
        "import logging\nlogging.basicConfig(level=logging.DEBUG)\n"
        "logging.getLogger('agenticstate').setLevel(logging.ERROR)\n" + readme_snippet()
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == README_PRINTS
    assert "agenticstate" not in result.stderr


@pytest.fixture
def library_records() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("agenticstate")
    handler = Keep(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_records_carry_the_event_dict(library_records: list[logging.LogRecord]) -> None:
    """A record's message is the event dict (for ProcessorFormatter) that prints as key=value."""
    get_logger("agenticstate.test").bind(manager="M").info("thing_done", count=3)
    [record] = library_records
    assert record.name == "agenticstate.test"
    assert record.levelno == logging.INFO
    assert isinstance(record.msg, dict)
    assert dict(record.msg) == {"event": "thing_done", "manager": "M", "count": 3}
    assert record.getMessage() == "thing_done manager='M' count=3"


def test_exception_carries_the_traceback(library_records: list[logging.LogRecord]) -> None:
    """`log.exception` records the exception being handled, for any formatter."""
    try:
        raise KeyError("boom")
    except KeyError:
        get_logger("agenticstate.test").exception("it_failed", where="here")
    [record] = library_records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is KeyError
    text = logging.Formatter().format(record)
    assert "it_failed where='here'" in text
    assert "KeyError: 'boom'" in text


def test_disabled_level_builds_nothing(library_records: list[logging.LogRecord]) -> None:
    """A disabled level is skipped before the context is even looked at."""

    class Explodes:
        def __repr__(self) -> str:
            raise AssertionError("rendered a disabled event")

    logging.getLogger("agenticstate").setLevel(logging.INFO)
    get_logger("agenticstate.test").debug("hidden", value=Explodes())
    assert library_records == []


async def test_processor_formatter_recipe(tmp_path: Path) -> None:
    """The documented recipe: structlog's ProcessorFormatter renders the events as JSON."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ]
        )
    )
    logger = logging.getLogger("agenticstate")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        path = tmp_path / "app_state.json"
        async with StateManager(StateConfig(backend="file", file_path=path)) as state:
            await state.save("k", 1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    snapshot = [e for e in events if e["event"] == "file_store_snapshot"][-1]  # the closing one
    assert snapshot == {
        "event": "file_store_snapshot",
        "path": str(path),
        "entries": 1,
        "level": "debug",
        "logger": "agenticstate.backends.file",
    }


def test_cli_configures_its_own_output(tmp_path: Path) -> None:
    """The command line is an application: library warnings reach its stderr, formatted, and
    nothing below WARNING; stdout stays for the output."""
    code = (
        "from agenticstate.cli import configure_logging\n"
        "configure_logging()\n"
        "from agenticstate._log import get_logger\n"
        "get_logger('agenticstate.events').info('not_shown')\n"
        "get_logger('agenticstate.events').warning('subscriber_overflow', pattern='a*')\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[WARNING\] agenticstate.events: "
        r"subscriber_overflow pattern='a\*'\n",
        result.stderr,
    ), result.stderr


def test_no_module_uses_structlogs_global_logger() -> None:
    """Every module logs through `agenticstate._log.get_logger`: no `structlog.get_logger`,
    and nothing calls `structlog.configure` (that is the application's)."""
    offenders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("get_logger", "configure")
                and isinstance(node.value, ast.Name)
                and node.value.id == "structlog"
            ):
                offenders.append(f"{where} structlog.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "structlog":
                names = {alias.name for alias in node.names}
                if names & {"get_logger", "configure"}:
                    offenders.append(f"{where} from structlog")
    assert offenders == []
    # And the loggers the modules hold write to `logging.getLogger("agenticstate.<module>")`.
    from agenticstate import events
    from agenticstate.backends import _fanout, file

    for module in (_fanout, events, file):
        assert module.log._logger is logging.getLogger(module.__name__)


def test_capture_logs_sees_every_level() -> None:
    """`structlog.testing.capture_logs()` captures the library's events at any logging level."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        get_logger("agenticstate.test").bind(manager="M").debug("small_fact", n=1)
    assert logs == [{"event": "small_fact", "manager": "M", "n": 1, "log_level": "debug"}]
