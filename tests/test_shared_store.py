"""One open file store per path per process: every opener shares it, the last close closes it.

Across processes the one-owner rule stays: proven with spawned processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import StateConfig, StateManager
from agenticstate.backends import FileBackend, open_backend
from agenticstate.backends._shared import _stores
from agenticstate.exceptions import BackendError, ConfigurationError
from agenticstate.managers import (
    AgentSnapshot,
    AgentStateStore,
    WorkflowState,
    WorkflowStateManager,
)

if TYPE_CHECKING:
    from pathlib import Path

OPEN_IN_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from agenticstate import StateConfig, StateManager
    from agenticstate.exceptions import BackendError

    async def main() -> None:
        try:
            async with StateManager(StateConfig(backend="file", file_path=sys.argv[1])) as s:
                print("opened", await s.get("k"))
        except BackendError as exc:
            print("refused:", exc)

    anyio.run(main)
    """
)


def open_in_child(path: Path) -> str:
    """What a second process gets when it opens the store at `path`."""
    result = subprocess.run(
        [sys.executable, "-c", OPEN_IN_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def config(path: Path, **options: object) -> StateConfig:
    return StateConfig(backend="file", file_path=path, **options)


@pytest.mark.parametrize("first_closes", ["agents", "workflows"])
async def test_two_managers_with_file_persistence(tmp_path: Path, first_closes: str) -> None:
    """AgentStateStore then WorkflowStateManager with persistence="file": one store, both work,
    closed in either order, and the store is whole afterwards."""
    agents = AgentStateStore(persistence="file", base_path=tmp_path)
    workflows = WorkflowStateManager(persistence="file", base_path=tmp_path)
    await agents.save_snapshot(AgentSnapshot(agent_id="a", snapshot_id="s1"))
    await workflows.create(WorkflowState(workflow_id="w", total_steps=2))
    assert isinstance(agents.state.backend, FileBackend)
    # Both see everything: it is one store.
    keys = await agents.state.list_keys("*")
    assert len(keys) >= 2
    assert await workflows.state.list_keys("*") == keys

    first, second = (agents, workflows) if first_closes == "agents" else (workflows, agents)
    await first.aclose()
    # The other still writes and reads after the first closed.
    if second is agents:
        await agents.save_snapshot(AgentSnapshot(agent_id="a", snapshot_id="s2"))
    else:
        await workflows.create(WorkflowState(workflow_id="w2", total_steps=1))
    with pytest.raises(BackendError, match="closed"):
        await first.state.list_keys("*")
    await second.aclose()

    assert not _stores  # the last close closed the store
    async with AgentStateStore(persistence="file", base_path=tmp_path) as again:
        workflows_again = WorkflowStateManager(state_manager=again.state)
        assert {s.snapshot_id for s in await again.list_snapshots("a")} >= {"s1"}
        assert await workflows_again.get("w") is not None
        expected = {"s1", "s2"} if first_closes == "workflows" else {"s1"}
        assert {s.snapshot_id for s in await again.list_snapshots("a")} == expected


@pytest.mark.parametrize("order", ["first-opened-closes-first", "last-opened-closes-first"])
async def test_two_state_managers_on_one_path(tmp_path: Path, order: str) -> None:
    """Two StateManagers on one path share it; either may close first; the other goes on."""
    path = tmp_path / "app.json"
    one, two = StateManager(config(path)), StateManager(config(path))
    await one.save("a", 1)
    assert await two.get("a") == 1
    await two.save("b", 2)
    assert await one.get("b") == 2
    closing, staying = (one, two) if order == "first-opened-closes-first" else (two, one)
    await closing.aclose()
    assert len(_stores) == 1  # still open for the other
    await staying.update("a", lambda n: n + 10)
    assert await staying.get("a") == 11
    await staying.aclose()
    assert not _stores
    async with StateManager(config(path)) as again:
        assert await again.get("a") == 11
        assert await again.get("b") == 2


async def test_closing_one_ends_only_its_subscriptions(tmp_path: Path) -> None:
    """A manager that closes stops its own watchers (after their buffered changes); the other
    manager's watchers keep receiving."""
    path = tmp_path / "app.json"
    one, two = StateManager(config(path)), StateManager(config(path))
    seen_one: list[str] = []
    seen_two: list[str] = []
    one_ended = anyio.Event()
    one_got_before = anyio.Event()
    two_got_after = anyio.Event()

    async def watch(state: StateManager, into: list[str], ended: anyio.Event | None) -> None:
        async with state.watch("k*") as changes:
            ready.set()
            async for change in changes:
                into.append(change.key)
                if into is seen_one:
                    one_got_before.set()
                if change.key == "k-after":
                    two_got_after.set()
                    return
        if ended is not None:
            ended.set()

    async with anyio.create_task_group() as tg:
        ready = anyio.Event()
        tg.start_soon(watch, one, seen_one, one_ended)
        await ready.wait()
        ready = anyio.Event()
        tg.start_soon(watch, two, seen_two, None)
        await ready.wait()
        await one.save("k-before", 1)
        with anyio.fail_after(10):
            await one_got_before.wait()
        await one.aclose()
        with anyio.fail_after(10):
            await one_ended.wait()  # its watch ended by itself: no 5 s wait, no hang
        await two.save("k-after", 2)
        with anyio.fail_after(10):
            await two_got_after.wait()
    assert seen_one == ["k-before"]
    assert seen_two == ["k-before", "k-after"]
    await two.aclose()
    assert not _stores


async def test_another_process_is_refused_with_the_owners_pid(tmp_path: Path) -> None:
    """While any opener here holds the store, another process gets the owner's pid; once the
    last one closed, another process opens it."""
    path = tmp_path / "app.json"
    one, two = StateManager(config(path)), StateManager(config(path))
    await one.save("k", "v")
    await two.open()
    assert open_in_child(path) == (
        f"refused: the store {path} is in use by process {os.getpid()}; "
        "one process owns a store at a time"
    )
    await one.aclose()
    assert open_in_child(path).startswith(f"refused: the store {path} is in use by process")
    await two.aclose()
    assert open_in_child(path) == "opened v"


async def test_url_openers_share_too(tmp_path: Path) -> None:
    """`open_backend("file://DIR")` joins the store a StateConfig opened on the same path, even
    spelled differently (a relative path, a symlink)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path, target_is_directory=True)
    async with StateManager(config(tmp_path / "state.json")) as one:
        await one.save("k", 1)
        async with StateManager(backend=open_backend(f"file://{link}")) as two:
            assert await two.get("k") == 1
            assert len(_stores) == 1
        assert await one.get("k") == 1


async def test_many_openers_at_once_share_one_store(tmp_path: Path) -> None:
    """Twenty managers opened concurrently share one store and see each other's writes."""
    path = tmp_path / "app.json"
    states = [StateManager(config(path)) for _ in range(20)]
    async with anyio.create_task_group() as tg:
        for i, state in enumerate(states):
            tg.start_soon(state.save, f"k{i}", i)
    assert len(_stores) == 1
    assert await states[0].list_keys("k*") == sorted(f"k{i}" for i in range(20))
    async with anyio.create_task_group() as tg:
        for state in states:
            tg.start_soon(state.aclose)
    assert not _stores


async def test_different_on_disk_settings_are_refused(tmp_path: Path) -> None:
    """A second opener that wants another format is told, and changes nothing."""
    path = tmp_path / "app.json"
    async with StateManager(config(path)) as one:
        await one.save("k", 1)
        other = StateManager(config(path, format="msgpack"))
        with pytest.raises(ConfigurationError, match="format='json'"):
            await other.open()
        assert await one.get("k") == 1
        await other.aclose()
    assert not _stores


async def test_another_event_loop_is_refused(tmp_path: Path) -> None:
    """A store open in this event loop is not shared with another loop (another thread)."""
    path = tmp_path / "app.json"

    async def in_other_loop() -> str:
        try:
            async with StateManager(config(path)) as state:
                await state.get("k")
        except BackendError as exc:
            return str(exc)
        return "opened"

    async with StateManager(config(path)) as one:
        await one.save("k", 1)
        message = await anyio.to_thread.run_sync(lambda: anyio.run(in_other_loop))
        assert "open in another event loop of this process" in message
        assert await one.get("k") == 1


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["write", "close"])), max_size=14)
)
def test_any_order_of_writes_and_closes(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[int, str]]
) -> None:
    """Model: four openers, any interleaving of writes and closes. Every open one sees every
    write; the store is open exactly while some opener is; nothing is lost on reopen."""
    path = tmp_path_factory.mktemp("shared") / "app.json"

    async def run() -> None:
        states = [StateManager(config(path)) for _ in range(4)]
        closed: set[int] = set()
        written: dict[str, int] = {}
        for n, (i, action) in enumerate(steps):
            if i in closed:
                with pytest.raises(BackendError, match="closed"):
                    await states[i].save("x", 0)
                continue
            if action == "write":
                await states[i].save(f"k{n}", n)
                written[f"k{n}"] = n
            else:
                await states[i].aclose()
                closed.add(i)
            opened = [s for j, s in enumerate(states) if j not in closed and s._is_open]
            assert (len(_stores) == 1) == bool(opened)
            for state in opened:
                assert await state.get_many(list(written)) == written
        for state in states:
            await state.aclose()
        assert not _stores
        async with StateManager(config(path)) as again:
            assert await again.get_many(list(written)) == written

    anyio.run(run)
