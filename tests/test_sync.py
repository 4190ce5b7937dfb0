"""agenticstate.sync: blocking StateManager and managers, from threads, loops and callbacks."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import TYPE_CHECKING, Any

import pytest

import agenticstate
from agenticstate import BackendError, NotFoundError, StateChange, StateConfig, sync
from agenticstate.scope import ScopedState as AsyncScopedState

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

WRAPPED = {
    sync.StateManager: agenticstate.StateManager,
    sync.ScopedState: AsyncScopedState,
    sync.AgentStateStore: agenticstate.AgentStateStore,
    sync.AgentRecoveryManager: agenticstate.AgentRecoveryManager,
    sync.WorkflowStateManager: agenticstate.WorkflowStateManager,
    sync.OrchestrationStateManager: agenticstate.OrchestrationStateManager,
    sync.KnowledgeStateManager: agenticstate.KnowledgeStateManager,
    sync.ToolStateManager: agenticstate.ToolStateManager,
    sync.SpeechStateManager: agenticstate.SpeechStateManager,
    sync.SessionManager: agenticstate.SessionManager,
}


@pytest.mark.parametrize("blocking", list(WRAPPED), ids=lambda c: c.__name__)
def test_every_public_method_has_a_blocking_twin(blocking: type[sync.Blocking[Any]]) -> None:
    """Each public method of the async class exists on the sync class, and none is async."""
    source = WRAPPED[blocking]
    names = [n for n, m in inspect.getmembers(source, inspect.isfunction) if not n.startswith("_")]
    assert names
    for name in names:
        method = getattr(blocking, name)
        assert callable(method), name
        assert not inspect.iscoroutinefunction(method), name
        if name not in ("subscribe", "unsubscribe"):  # written by hand: callbacks in threads
            assert method.__doc__ == getattr(source, name).__doc__, name


@pytest.mark.parametrize(
    "blocking", [sync.StateManager, sync.ScopedState], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("name", ["subscribe", "unsubscribe"])
def test_hand_written_methods_take_the_async_arguments(
    blocking: type[sync.Blocking[Any]], name: str
) -> None:
    """The hand-written subscribe/unsubscribe take the same parameters as the async ones."""
    ours = inspect.signature(getattr(blocking, name)).parameters
    theirs = inspect.signature(getattr(WRAPPED[blocking], name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_every_manager_is_wrapped() -> None:
    """Every manager exported by agenticstate.managers has a sync twin."""
    managers = {
        getattr(agenticstate.managers, n)
        for n in agenticstate.managers.__all__
        if n.endswith(("Manager", "Store")) and n != "StateManagerBase"
    }
    assert managers <= set(WRAPPED.values())


def test_blocking_calls_and_close() -> None:
    """save/get/update/list_keys block and return values; after close, calls raise."""
    with sync.StateManager() as state:
        assert state.save("agent:1", {"status": "idle"}) == 1
        assert state.get("agent:1") == {"status": "idle"}
        assert state.update("agent:1", {"progress": 0.5}) == {"status": "idle", "progress": 0.5}
        assert state.update("n", lambda n: n + 1, default=0) == 1
        assert state.list_keys() == ["agent:1", "n"]
        assert state.stats().saves == 1
        assert isinstance(state.async_object, agenticstate.StateManager)
    with pytest.raises(BackendError):
        state.get("agent:1")


def test_errors_pass_through_typed() -> None:
    """An exception of the async call reaches the blocking caller unchanged."""
    with sync.StateManager() as state, pytest.raises(NotFoundError):
        state.update("missing", {"a": 1})


def test_plain_threads_lose_no_update() -> None:
    """Blocking updates from several plain threads at once lose nothing."""
    with sync.StateManager() as state:
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(50):
                    state.update("counter", lambda n: n + 1, default=0)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert state.get("counter") == 200


def test_works_inside_a_running_event_loop() -> None:
    """Called from a coroutine (a Jupyter cell, an async framework's sync tool), it works."""
    with sync.StateManager() as state:

        async def cell() -> Any:
            state.save("k", [1, 2])
            return state.get("k")

        assert asyncio.run(cell()) == [1, 2]


def test_sync_callback_may_call_the_blocking_api() -> None:
    """A sync subscription callback runs in a worker thread and can use the blocking API."""
    with sync.StateManager() as state:
        seen: list[Any] = []
        done = threading.Event()

        def callback(key: str, old: Any, new: Any) -> None:
            seen.append((key, new, state.get(key)))
            state.save("audit:" + key, new)
            done.set()

        state.subscribe("agent:*", callback)
        state.save("agent:1", "busy")
        assert done.wait(10)
        assert seen == [("agent:1", "busy", "busy")]
        assert state.get("audit:agent:1") == "busy"
        assert state.unsubscribe("agent:*", callback)
        assert not state.unsubscribe("agent:*", callback)


def test_loop_thread_call_is_a_typed_error_not_a_deadlock() -> None:
    """Code on the loop thread (an async callback) that calls the blocking API gets an error."""
    with sync.StateManager() as state:
        outcome: list[BaseException] = []
        done = threading.Event()

        async def callback(key: str, old: Any, new: Any) -> None:
            try:
                state.get(key)
            except sync.SyncDeadlockError as exc:
                outcome.append(exc)
            done.set()

        state.subscribe("x", callback)
        state.save("x", 1)
        assert done.wait(10)
        assert len(outcome) == 1
        assert isinstance(outcome[0], agenticstate.AgenticStateError)
        with pytest.raises(sync.SyncDeadlockError):
            state.update("y", lambda v: state.get("x"), default=0)


def test_watch_is_a_blocking_iterator() -> None:
    """watch() returns a blocking context manager and iterator of StateChanges."""
    with sync.StateManager() as state, state.watch("agent:*") as changes:
        state.save("agent:1", {"status": "idle"})
        change = next(changes)
        assert isinstance(change, StateChange)
        assert (change.key, change.new_value) == ("agent:1", {"status": "idle"})


def test_scope_and_manager_results_come_back_wrapped() -> None:
    """scope() and a manager's .state return blocking objects; sync objects can be passed in."""
    with sync.StateManager() as state:
        scope = state.scope("session:u1:")
        assert isinstance(scope, sync.ScopedState)
        scope.save("cart", ["milk"])
        assert scope.get_all() == {"cart": ["milk"]}
        assert scope.clear() == 1
        sessions = sync.SessionManager(state_manager=state, default_state={"items": []})
        assert isinstance(sessions.state, sync.StateManager)
        session = sessions.create_session("u1")
        sessions.update_state(session.session_id, {"items": ["tea"]})
        sessions.add_message(session.session_id, "user", "hi")
        assert sessions.render(session.session_id, "{items.0}") == "tea"
        assert [m.content for m in sessions.get_messages(session.session_id)] == ["hi"]


def test_workflow_step_is_a_blocking_context_manager() -> None:
    """An async context manager method (WorkflowStateManager.step) becomes a blocking one."""
    with sync.WorkflowStateManager() as workflows:
        workflows.create(agenticstate.WorkflowState(workflow_id="wf", total_steps=1))
        workflows.start("wf")
        with workflows.step("wf", 1, "only") as step:
            step.result = {"ok": True}
        state = workflows.get("wf")
        assert state is not None
        assert state.steps[1].status == "completed"
        assert state.steps[1].result == {"ok": True}


def test_run_gives_typed_access_to_the_async_object() -> None:
    """run(fn) awaits fn(async_object) on the loop and returns its result."""
    with sync.StateManager() as state:

        async def read(s: agenticstate.StateManager) -> Any:
            await s.save("k", 5)
            return await s.get("k")

        assert state.run(read) == 5


@pytest.mark.redis
def test_redis_backend(redis_url: str) -> None:
    """The blocking API drives the Redis backend on its loop thread, from several threads."""
    prefix = f"sync{os.getpid()}:"
    _drive_from_threads(StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix))


@pytest.mark.postgres
def test_postgres_backend(postgres_url: str) -> None:
    """The blocking API drives the Postgres backend (asyncio) on its loop thread, from several
    threads."""
    prefix = f"sync{os.getpid()}:"
    _drive_from_threads(
        StateConfig(backend="postgres", postgres_url=postgres_url, key_prefix=prefix)
    )


def _drive_from_threads(config: StateConfig) -> None:
    with sync.StateManager(config) as state:
        state.save("k", {"v": 1})
        assert state.get("k") == {"v": 1}
        assert state.delete("k")
        sessions = sync.SessionManager(state_manager=state)
        session = sessions.create_session("u1")

        def append(tag: str) -> None:
            for i in range(20):
                sessions.add_message(session.session_id, "user", f"{tag}{i}")

        threads = [threading.Thread(target=append, args=(tag,)) for tag in "abc"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        messages = sessions.get_messages(session.session_id)
        assert [m.seq for m in messages] == list(range(1, 61))
        assert sessions.delete_user("u1").messages == 60


def test_unclosed_objects_are_closed_at_exit(tmp_path: Path) -> None:
    """A script that never closes its sync manager exits promptly, and its writes are on disk."""
    path = str(tmp_path / "s.json")
    script = textwrap.dedent(
        f"""
        from agenticstate import StateConfig, sync
        state = sync.StateManager(StateConfig(backend="file", file_path={path!r}))
        state.save("agent:1", {{"status": "done"}})
        sessions = sync.SessionManager(state_manager=state)
        sessions.create_session("u1", session_id="s1")
        """
    )
    check = textwrap.dedent(
        f"""
        from agenticstate import StateConfig, sync
        with sync.StateManager(StateConfig(backend="file", file_path={path!r})) as state:
            assert state.get("agent:1") == {{"status": "done"}}, state.list_keys()
            print(len(state.list_keys()))
        """
    )
    for source in (script, check):
        result = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


def test_blocking_stream_over_an_async_generator() -> None:
    """BlockingStream iterates any async iterator, an async generator included."""

    async def numbers() -> Any:
        for n in range(3):
            yield n

    assert list(sync.BlockingStream(numbers())) == [0, 1, 2]


def test_close_all_stops_the_loop_and_a_new_call_restarts_it() -> None:
    """close_all() closes what the module built; the next blocking call starts a new loop."""
    state = sync.StateManager()
    state.save("k", 1)
    sync.close_all()
    with pytest.raises(BackendError):
        state.get("k")
    with sync.StateManager() as again:
        assert again.save("k", 2) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_loop(tmp_path: Path) -> None:
    """After fork the child builds and uses its own objects; the parent's keep working."""
    with sync.StateManager() as parent:
        parent.save("k", "parent")
        reader, writer = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a threaded process is risky: that is the point.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: report through the pipe, never return into pytest
            code = 1
            try:
                with sync.StateManager() as child:
                    child.save("k", "child")
                    code = 0 if child.get("k") == "child" else 2
            finally:
                os.write(writer, bytes([code]))
                os._exit(code)
        os.close(writer)
        status = os.read(reader, 1)
        os.close(reader)
        os.waitpid(pid, 0)
        assert status == bytes([0])
        assert parent.get("k") == "parent"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_backend_error_from_every_parent_object() -> None:
    """In a forked child, every call on an object built before the fork (methods, generated or
    written by hand, run(), attributes, streams) raises BackendError; close() does nothing."""
    with sync.StateManager() as parent, sync.SessionManager() as sessions:
        parent.save("k", "parent")
        stream = parent.watch("k*")
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: parent.get("k"),
            "save": lambda: parent.save("k", "child"),
            "list_keys (plain)": lambda: parent.list_keys(),
            "a manager's method": lambda: sessions.create_session("u"),
            "a manager's state": lambda: sessions.state.get("k"),
            "run": lambda: parent.run(lambda s: s.get("k")),
            "attribute read": lambda: sessions.default_state,
            "attribute write": lambda: setattr(sessions, "default_state", {}),
            "subscribe": lambda: parent.subscribe("k*", lambda change: None),
            "a stream": lambda: stream.__enter__(),
        }
        reader, writer = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: report through the pipe, never return into pytest
            wrong = [b"?"]
            try:
                wrong = []
                for name, call in calls.items():
                    try:
                        call()
                    except BackendError:
                        continue
                    except BaseException as exc:  # noqa: BLE001
                        wrong.append(f"{name}: {type(exc).__name__}".encode())
                    else:
                        wrong.append(f"{name}: no error".encode())
                parent.close()
                sessions.close()
                stream.close()
            finally:
                os.write(writer, b";".join(wrong) or b"ok")
                os._exit(0)
        os.close(writer)
        report = b""
        while chunk := os.read(reader, 4096):
            report += chunk
        os.close(reader)
        os.waitpid(pid, 0)
        assert report == b"ok"
        assert parent.get("k") == "parent"  # the parent's objects still work


def test_attributes_read_and_write_through() -> None:
    """Public attributes are the async object's; wrap() refuses a foreign object."""
    with sync.SessionManager(default_state={"n": 0}) as sessions:
        assert sessions.default_state == {"n": 0}
        sessions.default_state = {"n": 1}
        assert sessions.async_object.default_state == {"n": 1}
        assert sessions.create_session("u1").session_id
    with pytest.raises(agenticstate.InvalidArgumentError):
        sync.StateManager.wrap("not a manager")  # type: ignore[arg-type]
