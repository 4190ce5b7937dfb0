"""Every public duration parameter accepts what its annotation and docs say, and refuses the rest
with `InvalidArgumentError` (never a raw `TypeError`, never a silent default).

The parameters are found by introspection: every public class of `agenticstate`,
`agenticstate.managers`, `agenticstate.backends` and `agenticstate.langgraph`, every public method
and constructor, every parameter (and property setter) named like a duration (`ttl`, `lease`,
`*_timeout`, `*_delay`, `*_interval`, `max_age`, `older_than`, `max_time`). What each accepts
comes from its annotation: `timedelta` and/or a number of seconds (`float`), and `None` if it is
optional; the table below says how to call it and whether zero is allowed. A duration parameter
added without a row here fails `test_every_duration_parameter_is_in_the_table`.

Pydantic records (`StateConfig`, `RetryState`, ...) are validated by pydantic and raise its
`ValidationError`, as every record does; they are not in this table.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import StateConfig, StateManager, txn
from agenticstate.exceptions import ConfigurationError, InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

MODULES = (
    "agenticstate",
    "agenticstate.managers",
    "agenticstate.backends",
    "agenticstate.langgraph",
    "agenticstate.txn",
)
DURATION = re.compile(r"(^|_)(ttl|lease|timeout|delay|interval|max_age|older_than|max_time)$")
TIME_TYPES = ("timedelta", "float", "int")  # `refresh_ttl: bool` and `ttl: TTLConfig` are not


def _is_duration(name: str, annotation: object) -> bool:
    # `checkpoint_interval: int` counts steps, not time.
    text = str(annotation)
    return (
        bool(DURATION.search(name))
        and name != "checkpoint_interval"
        and any(kind in text for kind in TIME_TYPES)
    )


def _public_classes() -> list[type]:
    found: dict[int, type] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, type) and not hasattr(obj, "model_fields"):
                found.setdefault(id(obj), obj)
    return list(found.values())


def _found() -> dict[str, str]:
    """`{"Class.method.param": annotation}` of every duration parameter (and setter)."""
    out: dict[str, str] = {}
    for kind in _public_classes():
        if issubclass(kind, BaseException):
            continue
        # `txn.Put` (a transaction's write) and the backend contract's `Put` share a name.
        label = f"txn.{kind.__name__}" if kind.__module__ == "agenticstate.txn" else kind.__name__
        for name, member in inspect.getmembers(kind):
            if isinstance(member, property) and member.fset is not None:
                value = list(inspect.signature(member.fset).parameters.values())[1]
                if _is_duration(name, value.annotation):
                    out[f"{label}.{name}.<set>"] = str(value.annotation)
                continue
            if name != "__init__" and (name.startswith("_") or not inspect.isfunction(member)):
                continue
            if name == "__init__" and member is object.__init__:
                continue
            for param in inspect.signature(member).parameters.values():
                if _is_duration(param.name, param.annotation):
                    out[f"{label}.{name}.{param.name}"] = str(param.annotation)
    return out


@dataclass
class Ctx:
    """What the calls need: a memory StateManager and a temporary directory."""

    state: StateManager
    tmp: Path


async def _team(ctx: Ctx) -> Any:
    from agenticstate.managers import OrchestrationStateManager, TeamState

    orch = OrchestrationStateManager(state_manager=ctx.state)
    if "t" not in await orch.list_teams():
        await orch.create_team(TeamState(team_id="t"))
    return orch


async def _claim(ctx: Ctx, lease: Any) -> object:
    orch = await _team(ctx)
    await orch.enqueue_task("t", {"n": 1})
    return await orch.claim_task("t", "w", lease=lease)


async def _heartbeat(ctx: Ctx, lease: Any) -> object:
    orch = await _team(ctx)
    await orch.enqueue_task("t", {"n": 1})
    claim = await orch.claim_task("t", "w")
    assert claim is not None
    return await orch.heartbeat("t", claim.task.task_id, claim.lease_token, lease=lease)


def _worker(option: str) -> Callable[[Ctx, Any], Any]:
    async def call(ctx: Ctx, value: Any) -> object:
        orch = await _team(ctx)

        def handler(task: Any) -> None:
            return None

        return await orch.run_worker("t", "w", handler, until_empty=True, **{option: value})

    return call


async def _purge(ctx: Ctx, older_than: Any) -> object:
    orch = await _team(ctx)
    return await orch.purge_finished("t", older_than=older_than)


async def _cached(ctx: Ctx, ttl: Any) -> object:
    from agenticstate.managers import ToolStateManager

    async def run() -> int:
        return 1

    tools = ToolStateManager(state_manager=ctx.state)
    return await tools.cached_call("tool", {"ttl": repr(ttl)}, run, ttl=ttl)


async def _retries(ctx: Ctx, name: str, value: Any) -> object:
    from agenticstate.managers import ToolStateManager

    async def run() -> int:
        return 1

    tools = ToolStateManager(state_manager=ctx.state)
    options: dict[str, Any] = {name: value}
    return await tools.run_with_retries("e", "tool", {}, run, **options)


def _recovery(ctx: Ctx, retry_delay: Any) -> object:
    from agenticstate.managers import AgentRecoveryManager, AgentStateStore

    return AgentRecoveryManager(AgentStateStore(state_manager=ctx.state), retry_delay=retry_delay)


def _manager(name: str, **kwargs: object) -> Callable[[Ctx, object], object]:
    def build(ctx: Ctx, value: object) -> object:
        import agenticstate.managers as managers

        key = next(iter(kwargs))
        return getattr(managers, name)(state_manager=ctx.state, **{key: value})

    return build


def _setter(build: Callable[[Ctx], object], name: str) -> Callable[[Ctx, object], object]:
    def assign(ctx: Ctx, value: object) -> object:
        obj = build(ctx)
        setattr(obj, name, value)
        return obj

    return assign


def _orch(ctx: Ctx) -> object:
    from agenticstate.managers import OrchestrationStateManager

    return OrchestrationStateManager(state_manager=ctx.state)


def _store_put(ctx: Ctx, ttl: Any) -> Awaitable[object]:
    from agenticstate.langgraph import Store

    return Store(ctx.state).aput(("ns",), "k", {"v": 1}, ttl=ttl)


def _retention(**duration: Any) -> object:
    from agenticstate.langgraph import CheckpointRetention

    return CheckpointRetention(keep_last=1, **duration)


def _view_update(ctx: Ctx, ttl: Any) -> Awaitable[object]:
    async def run() -> object:
        async with ctx.state.view("v:*") as view:
            return await view.update("v:k", lambda _: 1, default=0, ttl=ttl)

    return run()


@dataclass
class Row:
    call: Callable[[Ctx, Any], Any]
    zero: bool = False
    """Whether zero is a legal value (a delay or an age), not only positive ones."""
    error: type[Exception] = InvalidArgumentError
    """What a bad value raises."""


# Keyed as the introspection names them; the sync API's classes wrap these very methods.
TABLE: dict[str, Row] = {
    **{
        f"{owner}.{method}.ttl": Row(call)
        for owner in ("StateManager", "ScopedState")
        for method, call in {
            "save": lambda c, v, o=owner: _target(c, o).save("k", 1, ttl=v),
            "save_many": lambda c, v, o=owner: _target(c, o).save_many({"k": 1}, ttl=v),
            "update": lambda c, v, o=owner: _target(c, o).update("k", {"a": 1}, default={}, ttl=v),
            "revert": lambda c, v, o=owner: _revert(c, o, v),
        }.items()
    },
    "StateManager.usage.max_time": Row(lambda c, v: c.state.usage("*", max_time=v)),
    "LocalView.update.ttl": Row(_view_update),
    "FileBackend.__init__.save_interval": Row(
        lambda c, v: __import__("agenticstate").FileBackend(c.tmp / "f.json", save_interval=v)
    ),
    "SQLiteBackend.__init__.lock_timeout": Row(
        lambda c, v: __import__("agenticstate").SQLiteBackend(c.tmp / "s.db", lock_timeout=v)
    ),
    "SQLiteBackend.__init__.poll_interval": Row(
        lambda c, v: __import__("agenticstate").SQLiteBackend(c.tmp / "s.db", poll_interval=v)
    ),
    "RedisBackend.__init__.connect_timeout": Row(
        lambda c, v: __import__("agenticstate").RedisBackend(connect_timeout=v)
    ),
    "RedisBackend.__init__.socket_timeout": Row(
        lambda c, v: __import__("agenticstate").RedisBackend(socket_timeout=v)
    ),
    # Backend configuration, checked before any connection is made.
    "PostgresBackend.__init__.pool_timeout": Row(
        lambda c, v: __import__("agenticstate").PostgresBackend(pool_timeout=v),
        error=ConfigurationError,
    ),
    # The feed's retention is configuration, refused as StateConfig's other options are.
    "FeedRetention.__init__.max_age": Row(
        lambda c, v: __import__("agenticstate").FeedRetention(max_age=v), error=ConfigurationError
    ),
    "AgentStateStore.__init__.max_age": Row(_manager("AgentStateStore", max_age=None)),
    "AgentRecoveryManager.__init__.retry_delay": Row(_recovery, zero=True),
    "OrchestrationStateManager.__init__.sync_interval": Row(
        _manager("OrchestrationStateManager", sync_interval=None)
    ),
    "OrchestrationStateManager.__init__.default_lease": Row(
        _manager("OrchestrationStateManager", default_lease=None)
    ),
    "OrchestrationStateManager.__init__.finished_task_ttl": Row(
        _manager("OrchestrationStateManager", finished_task_ttl=None)
    ),
    "OrchestrationStateManager.sync_interval.<set>": Row(_setter(_orch, "sync_interval")),
    "OrchestrationStateManager.default_lease.<set>": Row(_setter(_orch, "default_lease")),
    "OrchestrationStateManager.finished_task_ttl.<set>": Row(_setter(_orch, "finished_task_ttl")),
    "OrchestrationStateManager.claim_task.lease": Row(_claim),
    "OrchestrationStateManager.heartbeat.lease": Row(_heartbeat),
    "OrchestrationStateManager.run_worker.lease": Row(_worker("lease")),
    "OrchestrationStateManager.run_worker.heartbeat_interval": Row(_worker("heartbeat_interval")),
    "OrchestrationStateManager.run_worker.poll_interval": Row(_worker("poll_interval")),
    "OrchestrationStateManager.purge_finished.older_than": Row(_purge, zero=True),
    "SessionManager.create_session.ttl": Row(
        lambda c, v: (
            __import__("agenticstate")
            .SessionManager(state_manager=c.state)
            .create_session("u", ttl=v)
        )
    ),
    "SpeechStateManager.__init__.session_ttl": Row(
        _manager("SpeechStateManager", session_ttl=None)
    ),
    "SpeechStateManager.__init__.ended_session_ttl": Row(
        _manager("SpeechStateManager", ended_session_ttl=None)
    ),
    "ToolStateManager.__init__.cache_ttl": Row(_manager("ToolStateManager", cache_ttl=None)),
    "ToolStateManager.__init__.flight_timeout": Row(
        _manager("ToolStateManager", flight_timeout=None)
    ),
    "ToolStateManager.cached_call.ttl": Row(_cached),
    "ToolStateManager.run_with_retries.base_delay": Row(
        lambda c, v: _retries(c, "base_delay", v), zero=True
    ),
    "ToolStateManager.run_with_retries.max_delay": Row(
        lambda c, v: _retries(c, "max_delay", v), zero=True
    ),
    "txn.Put.__init__.ttl": Row(lambda c, v: c.state.transact([], [txn.Put("k", 1, ttl=v)])),
    # A saver's retention is configuration too (`keep_last` set, so `None` is a valid choice).
    "CheckpointRetention.__init__.max_age": Row(
        lambda c, v: _retention(max_age=v), error=ConfigurationError
    ),
    "CheckpointRetention.__init__.thread_ttl": Row(
        lambda c, v: _retention(thread_ttl=v), error=ConfigurationError
    ),
    "Store.aput.ttl": Row(_store_put),
    "Store.put.ttl": Row(_store_put),  # the sync method runs the same check (see its body)
}


def _target(ctx: Ctx, owner: str) -> Any:
    return ctx.state if owner == "StateManager" else ctx.state.scope("s:")


async def _revert(ctx: Ctx, owner: str, ttl: Any) -> object:
    target = _target(ctx, owner)
    await target.save("r", 1)
    await target.save("r", 2)
    return await target.revert("r", to_version=1, ttl=ttl)


# Found by introspection, checked elsewhere: the backend contract's `ttl` is a positive timedelta
# or None, and `agenticstate.testing` (StorageContract.test_invalid_ttl_is_rejected) refuses the
# rest with InvalidArgumentError on every backend.
ELSEWHERE = {
    f"{kind}.{method}.ttl"
    for kind in (
        "Backend",
        "MemoryBackend",
        "FileBackend",
        "SQLiteBackend",
        "RedisBackend",
        "PostgresBackend",
    )
    for method in ("set", "set_many", "update")
}
ELSEWHERE.add("Put.__init__.ttl")


def test_every_duration_parameter_is_in_the_table() -> None:
    """Introspection finds no duration parameter without a row, and no row without one."""
    found = _found()
    assert sorted(set(found) - set(TABLE) - ELSEWHERE) == []
    assert sorted(set(TABLE) - set(found)) == []


class _Opaque:
    """Neither a number nor a timedelta (a stable repr keeps the test ids stable)."""

    def __repr__(self) -> str:
        return "Opaque()"


def _values(annotation: str, zero: bool) -> tuple[list[object], list[object]]:
    """(good, bad) values for a parameter with this annotation."""
    takes_delta = "timedelta" in annotation
    takes_seconds = "float" in annotation
    optional = "None" in annotation
    good: list[object] = []
    bad: list[object] = [True, "5", _Opaque(), math.nan, math.inf, -1, timedelta(seconds=-1)]
    if takes_delta:
        good.append(timedelta(seconds=1.5))
    else:
        bad.append(timedelta(seconds=1))
    if takes_seconds:
        good += [2, 0.5]
    else:
        bad.append(5)
    (good if optional else bad).append(None)
    zeros = ([timedelta(0)] if takes_delta else []) + ([0, 0.0] if takes_seconds else [])
    (good if zero else bad).extend(zeros)
    return good, bad


def _cases() -> list[Any]:
    found = _found()
    cases: list[Any] = []
    for name in sorted(TABLE):
        if name not in found:
            continue
        good, bad = _values(found[name], TABLE[name].zero)
        cases.extend(
            pytest.param(name, value, ok, id=f"{name}-{'ok' if ok else 'bad'}-{value!r}")
            for ok, values in ((True, good), (False, bad))
            for value in values
        )
    return cases


@pytest.mark.parametrize(("name", "value", "ok"), _cases())
async def test_a_duration_is_accepted_or_refused_as_documented(
    name: str, value: object, ok: bool, tmp_path: Path
) -> None:
    """A documented duration (timedelta and/or seconds, None if optional, zero where a delay or
    an age may be zero) is accepted; anything else raises InvalidArgumentError."""
    async with StateManager(StateConfig(backend="memory", history={"*": 5})) as state:
        ctx = Ctx(state, tmp_path)
        call = TABLE[name].call

        async def run() -> None:
            result = call(ctx, value)
            if inspect.isawaitable(result):
                await result

        if ok:
            await run()
            return
        with pytest.raises(TABLE[name].error):
            await run()
