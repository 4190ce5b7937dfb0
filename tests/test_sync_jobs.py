"""A job handed to a manager (a tool's `fn`, a recovery-guarded `job`) runs once when it
succeeds, plain function or coroutine function, in the sync API and the async one.

The table `sync._JOBS` names every public manager method that runs a job the caller hands over;
a test finds every such method by its signature, so a new one must join the table (where the
sync API runs a plain function in a worker thread).
"""

from __future__ import annotations

import collections.abc
import inspect
import threading
import typing
from typing import Any

import pytest

from agenticstate import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentStateStore,
    ToolStateManager,
    sync,
)
from agenticstate import managers as async_managers


class _Agent:
    id = "a1"

    def restore_from_checkpoint(self, state: Any) -> None:
        pass


def _run(manager: Any, method: str, job: Any) -> Any:
    """Call `method` of a sync or async manager with `job` as its job."""
    if method == "run_with_retries":
        return manager.run_with_retries("e1", "pay", {"amount": 5}, job, base_delay=0)
    if method == "cached_call":
        return manager.cached_call("pay", {"amount": 5}, job)
    return manager.run(_Agent(), job)


def _sync_manager(method: str) -> Any:
    if method == "run":
        store = sync.AgentStateStore()
        store.save_checkpoint(AgentCheckpoint(agent_id="a1", state={}))
        return sync.AgentRecoveryManager(agent_store=store, max_recovery_attempts=3)
    return sync.ToolStateManager()


@pytest.mark.parametrize(("cls", "method"), sorted(sync._JOBS))
def test_a_plain_job_that_succeeds_runs_once_in_a_worker_thread(cls: str, method: str) -> None:
    """The sync API runs a plain function job once, off the loop thread (so it may call the
    blocking API), and returns its value."""
    manager = _sync_manager(method)
    runs: list[str] = []

    def job() -> dict[str, bool]:
        runs.append(threading.current_thread().name)
        sync.StateManager().close()  # the blocking API works from here
        return {"ok": True}

    try:
        assert _run(manager, method, job) == {"ok": True}
    finally:
        manager.close()
    assert len(runs) == 1
    assert runs[0] != threading.current_thread().name


@pytest.mark.parametrize(("cls", "method"), sorted(sync._JOBS))
def test_a_plain_job_returning_an_awaitable_is_awaited(cls: str, method: str) -> None:
    """A plain function that returns a coroutine (`lambda: client.fetch()`) has it awaited."""
    manager = _sync_manager(method)

    async def fetch() -> int:
        return 7

    try:
        assert _run(manager, method, lambda: fetch()) == 7
    finally:
        manager.close()


@pytest.mark.parametrize(("cls", "method"), sorted(sync._JOBS))
async def test_the_async_api_runs_a_plain_job_once(cls: str, method: str) -> None:
    """Given a plain function, an async manager takes its value as the result (it succeeded):
    never a TypeError counted as a failure and a second run."""
    if method == "run":
        store = AgentStateStore()
        await store.save_checkpoint(AgentCheckpoint(agent_id="a1", state={}))
        manager: Any = AgentRecoveryManager(agent_store=store, max_recovery_attempts=3)
    else:
        manager = ToolStateManager()
    runs: list[int] = []

    def job() -> str:
        runs.append(1)
        return "done"

    assert await _run(manager, method, job) == "done"
    assert runs == [1]


def test_every_method_that_runs_a_job_is_in_the_table() -> None:
    """Every public coroutine method of a manager with a `Callable[[], Awaitable]` parameter
    is in `sync._JOBS` under that parameter."""
    found: set[tuple[str, str, str]] = set()
    for name in async_managers.__all__:
        cls = getattr(async_managers, name)
        if not inspect.isclass(cls):
            continue
        for method_name, method in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if method_name.startswith("_"):
                continue
            hints = typing.get_type_hints(
                method, {**vars(collections.abc), **vars(inspect.getmodule(method))}
            )
            for parameter, hint in hints.items():
                if (
                    typing.get_origin(hint) is not None
                    and "Callable[[], " in str(hint)
                    and ("Awaitable" in str(hint))
                ):
                    found.add((cls.__name__, method_name, parameter))
    table = {(cls, method, parameter) for (cls, method), parameter in sync._JOBS.items()}
    assert found == table
