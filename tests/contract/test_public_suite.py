"""`agenticstate.testing` as a third-party author meets it: a fresh pytest run in a project of
their own (no conftest of ours, pytest-asyncio in strict mode), against the docs' example backend
and against broken copies of it, which the suite must fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agenticstate.testing import (
    BackendContract,
    EventsContract,
    ExpiryContract,
    FeedContract,
    HistoryContract,
    IndexContract,
    ManagerContract,
    ScanContract,
    StorageContract,
    TransactContract,
)

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "docs" / "examples"

# A subclass of the example backend with one rule broken, and a test the suite fails it with.
BROKEN = {
    "versions": (
        "async def set(self, key, value, **kw):\n"
        "        change = await super().set(key, value, **kw)\n"
        "        self._entries[key] = dataclasses.replace(self._entries[key], version=7)\n"
        "        return change\n",
        "test_versions_grow_by_one_per_write",
    ),
    "silent_events": (
        "def changes(self, pattern, *, max_buffer=10_000):\n"
        "        # A fan-out of its own: the writes publish to another one.\n"
        "        return ChangeFanout().subscribe(pattern, max_buffer)\n",
        "test_subscription_sees_set_and_delete_with_old_and_new",
    ),
    "ttl_ignored": (
        "async def set(self, key, value, *, ttl=None, expected_version=None):\n"
        "        return await super().set(key, value, expected_version=expected_version)\n",
        "test_expired_key_is_missing_everywhere",
    ),
}


def _project(tmp_path: Path, backend_class: str, extra: str = "") -> Path:
    """A project of the author's own: the example backend, a test module, and a pytest config
    that is not ours (strict asyncio mode, no `-p no:anyio`, no conftest)."""
    shutil.copy(EXAMPLES / "dict_backend.py", tmp_path / "dict_backend.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
    )
    (tmp_path / "test_mine.py").write_text(
        "import dataclasses\n"
        "import pytest_asyncio\n"
        "from dict_backend import DictBackend\n"
        "from agenticstate.backends import ChangeFanout\n"
        "from agenticstate.testing import BackendContract\n\n"
        f"class Mine(DictBackend):\n    {extra or 'pass'}\n\n"
        "class TestMine(BackendContract):\n"
        "    @pytest_asyncio.fixture\n"
        "    async def backend(self):\n"
        f"        async with {backend_class}() as backend:\n"
        "            yield backend\n"
    )
    return tmp_path


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def _counts(output: str) -> dict[str, int]:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error|skipped)", output)}


def test_the_contract_is_all_the_parts() -> None:
    """`BackendContract` is every part, so passing it means passing each."""
    for part in (
        StorageContract,
        ExpiryContract,
        EventsContract,
        ScanContract,
        IndexContract,
        TransactContract,
        FeedContract,
        HistoryContract,
        ManagerContract,
    ):
        assert issubclass(BackendContract, part)
    tests = [name for name in dir(BackendContract) if name.startswith("test_")]
    assert len(tests) > 70


def test_the_example_passes_in_a_project_of_its_own(tmp_path: Path) -> None:
    """The docs' few lines, in a fresh project with strict pytest-asyncio, run the whole suite
    and pass it: as many tests as one of our backends runs (the example keeps no change feed
    and no history, so it skips those parts)."""
    result = _pytest(_project(tmp_path, "DictBackend"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    ours = len(
        [
            item
            for item in dir(BackendContract)
            if item.startswith("test_") and callable(getattr(BackendContract, item))
        ]
    )
    counts = _counts(result.stdout)
    assert counts["passed"] + counts.get("skipped", 0) >= ours


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_backend_fails_the_suite(tmp_path: Path, broken: str) -> None:
    """A backend that breaks one rule of the contract fails the test written for that rule."""
    method, failing = BROKEN[broken]
    result = _pytest(_project(tmp_path, "Mine", method), "-k", failing)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert _counts(result.stdout).get("failed", 0) >= 1
    assert failing in result.stdout
    if broken == "versions":  # an assert fails (the others fail by timeout or exception)
        # pytest rewrote the suite's asserts: the report shows what was compared.
        assert "assert [1, 8, 8, 8, 8] == [1, 2, 3, 4, 5]" in result.stdout, result.stdout[-3000:]


def test_a_backend_without_transact_skips_the_transaction_tests(tmp_path: Path) -> None:
    """`transact` is optional: a backend whose `transact` raises `UnsupportedOperationError` (the
    base class's default) skips the transaction tests and passes the rest."""
    extra = (
        "async def transact(self, compare, then, orelse=()):\n"
        "        from agenticstate import UnsupportedOperationError\n"
        "        raise UnsupportedOperationError('not here')\n"
    )
    result = _pytest(_project(tmp_path, "Mine", extra), "-k", "compares_pick or get_missing")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"1 passed, 1 skipped", result.stdout), result.stdout[-3000:]


def test_a_backend_without_feed_or_history_skips_those_tests(tmp_path: Path) -> None:
    """The feed and history are contract parts a backend may lack: one whose `feed` is `None`
    and whose `keep_history` refuses rules (the base class's defaults, as in the example)
    skips those tests, each with its reason, and passes the rest."""
    result = _pytest(
        _project(tmp_path, "Mine"),
        "-rs",
        "-k",
        "feed_cursor_is_the_head or history_limit or get_missing",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"1 passed, 2 skipped", result.stdout), result.stdout[-3000:]
    assert "keeps no change feed" in result.stdout
    assert "keeps no history" in result.stdout


def test_without_pytest_the_error_names_the_extra(tmp_path: Path) -> None:
    """Importing `agenticstate.testing` where pytest is missing says which extra to install."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pytest', 'pytest_asyncio', '_pytest'):\n"
        "            raise ImportError(name=name.split('.')[0])\n"
        "sys.meta_path.insert(0, Block())\n"
        "from agenticstate.exceptions import MissingDependencyError\n"
        "try:\n"
        "    import agenticstate.testing\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc.extra, exc.package)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["testing", "pytest"]
