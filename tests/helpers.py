"""What tests share besides fixtures: fresh namespaces, the backend makers, child processes.

Test files import these from here, never from `conftest.py` (pytest loads conftest itself; a
test importing it loads it a second time under another name). `tests/test_test_layout.py`
holds that rule.

- `unique_prefix()`: a fresh key prefix, so tests on a shared server never see each other.
- `BACKEND_MAKERS`: every backend the contract suite runs on, by name; the `backend` fixture
  (conftest.py) and the hypothesis portal (managers/_portal.py) both take their list from here.
  A maker passes keyword options on to the backend's constructor (`feed=FeedRetention(...)`).
- `start_module` / `LineProcess`: a child `python -m MODULE`, with pipes, from the repository
  root; `LineProcess` collects its output lines as they arrive, so tests wait on lines instead
  of sleeping. `json_events`, `wait_for_event` and `stop_process` serve the tests that read a
  child's JSON lines themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import psycopg
import pytest

from agenticstate import FileBackend, MemoryBackend, PostgresBackend, RedisBackend, SQLiteBackend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from contextlib import AbstractAsyncContextManager

    from agenticstate.backends import Backend

    BackendMaker = Callable[
        ..., AbstractAsyncContextManager[Backend]
    ]  # (request, tmp_path, **options)

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: child processes run from here, so `python -m tests...` imports."""


def unique_prefix() -> str:
    """A fresh key prefix (`t` and 12 hex digits, then `:`)."""
    return f"t{uuid.uuid4().hex[:12]}:"


# ------------------------------------------------------------------ the backends


@asynccontextmanager
async def _memory(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    async with MemoryBackend(**options) as backend:
        yield backend


@asynccontextmanager
async def _redis(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_url")
    async with RedisBackend(url=url, key_prefix=unique_prefix(), **options) as backend:
        yield backend


@asynccontextmanager
async def _redis_cluster(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_cluster_url")
    async with RedisBackend(url=url, key_prefix=unique_prefix(), **options) as backend:
        yield backend


@asynccontextmanager
async def _file(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    async with FileBackend(base_path=tmp_path / "store", **options) as backend:
        yield backend


@asynccontextmanager
async def _sqlite(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    async with SQLiteBackend(tmp_path / "store" / "state.db", **options) as backend:
        yield backend


@asynccontextmanager
async def _postgres(
    request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> AsyncIterator[Backend]:
    """A store of its own: a Postgres schema named after `tmp_path` (a test's other stores, made
    under paths of their own, get schemas of their own), dropped at the end."""
    url = request.getfixturevalue("postgres_url")
    schema = "t" + hashlib.sha1(str(tmp_path).encode(), usedforsecurity=False).hexdigest()[:20]
    try:
        async with PostgresBackend(
            url, schema=schema, key_prefix=unique_prefix(), **options
        ) as backend:
            yield backend
    finally:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())


# Each backend module adds its maker here; the contract suite runs against every one.
BACKEND_MAKERS: dict[str, BackendMaker] = {
    "memory": _memory,
    "file": _file,
    "sqlite": _sqlite,
    "redis": _redis,
    "redis-cluster": _redis_cluster,
    "postgres": _postgres,
}
REDIS_BACKENDS = {"redis", "redis-cluster"}
SERVER_MARKS = {"redis": "redis", "redis-cluster": "redis", "postgres": "postgres"}


def backend_params() -> list[Any]:
    """Every name in `BACKEND_MAKERS` as a pytest parameter, those needing a server marked
    (`redis`, `postgres`)."""
    return [
        pytest.param(name, marks=getattr(pytest.mark, SERVER_MARKS[name]))
        if name in SERVER_MARKS
        else name
        for name in BACKEND_MAKERS
    ]


# ------------------------------------------------------------------ child processes


def start_module(module: str, *args: str) -> subprocess.Popen[str]:
    """Start `python -m MODULE ARGS...` from the repository root, unbuffered, with text pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def stop_process(process: subprocess.Popen[str]) -> None:
    """SIGKILL `process`, wait for it and close its pipes."""
    process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def json_events(process: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    """Yield the process's JSON lines as they come (readline blocks until the next one)."""
    assert process.stdout is not None
    for line in process.stdout:
        yield json.loads(line)


def wait_for_event(
    stream: Iterator[dict[str, Any]], name: str, seen: list[dict[str, Any]]
) -> dict[str, Any]:
    """Read `stream` (adding to `seen`) up to the first event called `name`."""
    for event in stream:
        seen.append(event)
        if event["event"] == name:
            return event
    raise AssertionError(f"process ended before {name!r}; saw {seen}")


class LineProcess:
    """`python -m MODULE ARGS...`, its stdout lines collected by a thread as they arrive.

    Tests wait on those lines (with a timeout) instead of sleeping.
    """

    def __init__(self, module: str, *args: str) -> None:
        self.process = start_module(module, *args)
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(
                target=self._read, args=(self.process.stdout, self.lines), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.process.stderr, self.errors), daemon=True
            ),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe: TextIO | None, into: list[str]) -> None:
        assert pipe is not None
        with pipe:
            for line in pipe:
                with self.changed:
                    into.append(line.rstrip("\n"))
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_until(self, predicate: Callable[[list[str]], bool], timeout: float = 60) -> bool:
        """Wait until `predicate(lines)` holds; False if the process ended or time ran out."""
        with self.changed:
            self.changed.wait_for(
                lambda: predicate(self.lines) or self.process.poll() is not None, timeout
            )
            return predicate(self.lines)

    def wait_lines(self, count: int, timeout: float = 60) -> bool:
        """Wait until the process printed `count` lines."""
        return self.wait_until(lambda lines: len(lines) >= count, timeout)

    def stop(self) -> None:
        """Ask it to stop (close its stdin) and wait for it."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            self.close()

    def kill(self) -> None:
        """SIGKILL it and wait for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.close()

    def close(self) -> str:
        """Make sure it has ended; return what it wrote on stderr."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        for reader in self.readers:
            reader.join(10)
        return "\n".join(self.errors)


# ------------------------------------------------------------------ the workflow worker


WORKFLOW_WORKER = "tests.integration._workflow_worker"


def spawn_workflow_worker(mode: str, url: str, prefix: str, *extra: str) -> subprocess.Popen[str]:
    """Start the workflow worker (`tests/integration/_workflow_worker.py`) in `mode`."""
    return start_module(WORKFLOW_WORKER, mode, url, prefix, *extra)


def run_workflow_worker(mode: str, url: str, prefix: str) -> list[dict[str, Any]]:
    """Run the workflow worker in `mode` to its end; return the events it printed."""
    process = spawn_workflow_worker(mode, url, prefix)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]
