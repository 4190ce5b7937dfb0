"""Every wrapper of a public API returns and raises what the call it wraps does.

The pairs are found by introspection: `ScopedState` and `StateManager` (the methods they share),
and each blocking class of `agenticstate.sync` and the async class it wraps (every public
method). For each pair the test compares

- the signatures (names, kinds and defaults of the parameters; a scope supplies `scope`
  itself) and the return annotations (a scope's watch is a `ScopedWatch`),
- what a call returns: the same kind of object (the sync API hands back the blocking wrapper of
  what the async call returned, or a blocking stream for a context manager or iterator),
- what a call raises: each parameter given a bad value, on both sides, raises the same error.

Arguments come from two tables by parameter name (`GOOD`, `BAD`); a method with a required
parameter missing from `GOOD` is listed in `UNCALLED` with the reason, so a new method is
either called here or named there.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import ScopedState, StateConfig, StateManager, sync
from agenticstate.events import Subscription

if TYPE_CHECKING:
    from collections.abc import Callable


def _noop(key: str, old: Any, new: Any) -> None:
    """A subscription callback."""


IDS = (
    "agent_id",
    "workflow_id",
    "team_id",
    "task_id",
    "session_id",
    "user_id",
    "tool_name",
    "execution_id",
    "knowledge_base_id",
    "source_id",
    "checkpoint_id",
    "snapshot_id",
)
"""Ids the managers' methods take: "x" is a good one (unknown), "" and "{x}" bad ones."""

GOOD: dict[str, Callable[[], Any]] = {
    "key": lambda: "k",
    "keys": lambda: ["k"],
    "pattern": lambda: "*",
    "value": lambda: 1,
    "items": lambda: {"k": 1},
    "change": lambda: {"a": 1},
    "callback": lambda: _noop,
    "index": lambda: "idx",
    "members": lambda: {"m": 1.0},
    "prefix": lambda: "p:",
    "to_version": lambda: 1,
    **{name: (lambda: "x") for name in IDS},
}
"""A valid argument for each parameter name a core method may require."""

BAD: dict[str, list[Any]] = {
    "key": ["", "\x00", 5],
    "keys": [[""], 5],
    "pattern": ["", "\x00", 5],
    "ttl": [-1, "5", True],
    "expected_version": [-1, "1"],
    "since": [5, "not-a-cursor"],
    "on_gap": ["nope"],
    "callback": [5],
    "on_overflow": [5],
    "limit": [-1, "3"],
    "max_buffer": [0, "x"],
    "model": [5],
    "version": [-1, "x"],
    "to_version": [-1, "x"],
    "index": [""],
    "prefix": ["", 5],
    "change": [5],
    "items": [{"": 1}],
    "value": [{1, 2}],
    **{name: ["", "{x}"] for name in IDS},
}
"""Bad arguments: each is given alone, the other parameters taking their `GOOD` value."""

UNCALLED = {
    "commit",  # the scope names its own scope; compared through log/rollback's signatures
    "rollback",  # needs a commit id: tests/test_commits.py covers a scope's rollback
}
"""Shared methods not called here, with the reason."""


def _normal(param: inspect.Parameter) -> tuple[str, str, str]:
    default = param.default
    shown = repr(default)
    if type(default) is object:  # a private "missing" sentinel: each module has its own
        shown = "<missing>"
    return (param.name, param.kind.name, shown)


def _signature(method: Callable[..., Any], supplied: frozenset[str] = frozenset()) -> list[Any]:
    params = inspect.signature(method).parameters.values()
    return [_normal(p) for p in params if p.name not in supplied and p.name != "self"]


def _shared_scope_methods() -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(ScopedState)
        if not name.startswith("_") and callable(member) and hasattr(StateManager, name)
    )


SCOPE_SUPPLIES = frozenset({"scope"})
SCOPE_RETURNS = {"Watch": "ScopedWatch"}


@pytest.mark.parametrize("name", _shared_scope_methods())
def test_a_scope_method_has_the_managers_signature(name: str) -> None:
    """A ScopedState method takes the parameters of the StateManager method it wraps (less the
    scope it supplies) and returns the same type (a scope's watch is a ScopedWatch)."""
    ours = getattr(ScopedState, name)
    theirs = getattr(StateManager, name)
    assert _signature(ours) == _signature(theirs, SCOPE_SUPPLIES)
    expected = str(inspect.signature(theirs).return_annotation)
    assert str(inspect.signature(ours).return_annotation) == SCOPE_RETURNS.get(expected, expected)
    assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs)


def test_a_scoped_watch_has_the_public_api_of_a_watch() -> None:
    """What a scope's watch returns offers everything a manager's Watch does."""
    from agenticstate.events import Watch
    from agenticstate.scope import ScopedWatch

    public = {n for n in dir(Watch) if not n.startswith("_")} | {"cursor"}
    assert public <= {n for n in dir(ScopedWatch) if not n.startswith("_")}
    for dunder in ("__aenter__", "__aexit__", "__aiter__", "__anext__"):
        assert hasattr(ScopedWatch, dunder), dunder


def _arguments(method: Callable[..., Any], bad: tuple[str, Any] | None) -> dict[str, Any] | None:
    """Keyword arguments for `method`: required ones from GOOD, `bad` replacing one; None if a
    required parameter has no GOOD value."""
    args: dict[str, Any] = {}
    for param in inspect.signature(method).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if bad is not None and param.name == bad[0]:
            args[param.name] = bad[1]
        elif param.default is param.empty:
            if param.name not in GOOD:
                return None
            args[param.name] = GOOD[param.name]()
    return args


async def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("raised", error type) or ("returned", the value, awaited if it is a coroutine)."""
    try:
        result = call()
        if inspect.iscoroutine(result):
            result = await result
    except Exception as exc:  # noqa: BLE001  # the error is what is compared
        return ("raised", type(exc))
    return ("returned", result)


def _kind(value: Any) -> str:
    """What a result is, for comparing a wrapper's with the wrapped call's."""
    if isinstance(value, Subscription):
        return "Subscription"
    if hasattr(value, "__aenter__") or hasattr(value, "__anext__"):
        return "stream"
    return type(value).__name__


def _scope_cases() -> list[Any]:
    cases = []
    for name in _shared_scope_methods():
        if name in UNCALLED:
            continue
        method = getattr(ScopedState, name)
        params = [p.name for p in inspect.signature(method).parameters.values()]
        cases.append(pytest.param(name, None, id=f"{name}-good"))
        cases.extend(
            pytest.param(name, (param, value), id=f"{name}-{param}={value!r}")
            for param in params
            if param in BAD
            for value in BAD[param]
        )
    return cases


@pytest.mark.parametrize(("name", "bad"), _scope_cases())
async def test_a_scope_method_returns_and_raises_what_the_managers_does(
    name: str, bad: tuple[str, Any] | None
) -> None:
    """A ScopedState method, called with good arguments or with one bad one, returns the same
    kind of result as the StateManager method (a subscription: its awaitable handle) or raises
    the same error."""
    async with StateManager(StateConfig(history={"*": 3})) as state:
        scope = state.scope("s:")
        args = _arguments(getattr(ScopedState, name), bad)
        assert args is not None, f"{name}: a required parameter has no GOOD value"
        await state.save("s:k", {"a": 0})
        await state.save("s:k", {"a": 0, "b": 1})
        ours = await _outcome(lambda: getattr(scope, name)(**args))
        theirs = await _outcome(lambda: getattr(state, name)(**_prefixed(name, args)))
    if ours[0] == "raised" or theirs[0] == "raised":
        assert ours == theirs
    else:
        assert _kind(ours[1]) == _kind(theirs[1]).replace("Watch", "ScopedWatch")


def _prefixed(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The manager's arguments for a scope's call under `s:`."""
    out = dict(args)
    if "scope" in inspect.signature(getattr(StateManager, name)).parameters:
        out["scope"] = "s:"
    for name in ("key", "pattern", "index"):
        if isinstance(out.get(name), str) and out[name]:
            out[name] = "s:" + out[name]
    if isinstance(out.get("keys"), list):
        out["keys"] = [("s:" + k) if isinstance(k, str) and k else k for k in out["keys"]]
    if isinstance(out.get("items"), dict):
        out["items"] = {("s:" + k) if k else k: v for k, v in out["items"].items()}
    return out


# ------------------------------------------------------------------ the sync API


def _wrapped_pairs() -> list[Any]:
    return [
        pytest.param(blocking, wrapped, id=blocking.__name__)
        for wrapped, blocking in sync._WRAPPERS.items()  # the sync API's own table
    ]


@pytest.mark.parametrize(("blocking", "wrapped"), _wrapped_pairs())
def test_a_blocking_method_has_the_async_signature(blocking: type, wrapped: type) -> None:
    """Every public method of an async class has a blocking twin with its parameters and its
    return annotation, hand-written ones (subscribe, unsubscribe) included."""
    names = [
        n for n, m in inspect.getmembers(wrapped) if not n.startswith("_") and inspect.isfunction(m)
    ]
    assert names
    for name in names:
        ours = getattr(blocking, name)
        theirs = getattr(wrapped, name)
        assert not inspect.iscoroutinefunction(ours), name
        assert _signature(ours) == _signature(theirs), name
        mine = str(inspect.signature(ours).return_annotation)
        expected = str(inspect.signature(theirs).return_annotation)
        assert mine in (expected, "inspect._empty") or mine.endswith(expected), name


def _targets() -> dict[str, type]:
    """The async classes whose blocking twins are called: the core and every manager."""
    skip = {"Subscription", "Checkout", "LocalView"}  # handles, reached through a call
    return {
        wrapped.__name__: wrapped
        for wrapped in sync._WRAPPERS  # the sync API's own table
        if wrapped.__name__ not in skip
    }


def _sync_cases() -> list[Any]:
    cases = []
    for target, wrapped in sorted(_targets().items()):
        for name, member in inspect.getmembers(wrapped):
            if name.startswith("_") or not inspect.isfunction(member) or name in SYNC_UNCALLED:
                continue
            if _arguments(member, None) is None:
                continue
            params = [p.name for p in inspect.signature(member).parameters.values()]
            cases.append(pytest.param(target, name, None, id=f"{target}.{name}-good"))
            cases.extend(
                pytest.param(target, name, (p, v), id=f"{target}.{name}-{p}={v!r}")
                for p in params
                if p in BAD
                for v in BAD[p]
            )
    return cases


SYNC_UNCALLED = {
    "aclose",  # closes the object under test
    "flush",
    "open",
    "reencrypt",  # needs StateConfig(encryption=...)
    "view",  # a LocalView, compared as a stream below
}


def _build(target: str, state: Any, module: Any) -> Any:
    """The object named `target` over `state`, from `module` (agenticstate or its sync API)."""
    if target == "StateManager":
        return state
    if target == "ScopedState":
        return state.scope("s:")
    if target == "AgentRecoveryManager":
        return module.AgentRecoveryManager(module.AgentStateStore(state_manager=state))
    return getattr(module, target)(state_manager=state)


@pytest.mark.parametrize(("target", "name", "bad"), _sync_cases())
async def test_a_blocking_method_returns_and_raises_what_the_async_one_does(
    target: str, name: str, bad: tuple[str, Any] | None
) -> None:
    """A blocking method, called with good arguments or with one bad one, returns the blocking
    twin of what the async method returns (a blocking Subscription for subscribe, at once) or
    raises the same error."""
    import agenticstate

    args = _arguments(getattr(_targets()[target], name), bad)
    assert args is not None
    config = StateConfig(history={"*": 3})
    async with StateManager(config) as state:
        for key in ("k", "s:k"):
            await state.save(key, {"a": 0})
            await state.save(key, {"a": 0, "b": 1})
        async_target = _build(target, state, agenticstate)
        theirs = await _outcome(lambda: getattr(async_target, name)(**args))
    with sync.StateManager(config) as blocking:
        for key in ("k", "s:k"):
            blocking.save(key, {"a": 0})
            blocking.save(key, {"a": 0, "b": 1})
        sync_target = _build(target, blocking, sync)
        ours = _sync_outcome(lambda: getattr(sync_target, name)(**args))
    if ours[0] == "raised" or theirs[0] == "raised":
        assert ours == theirs
        return
    expected = _kind(theirs[1])
    found = ours[1]
    if expected == "Subscription":
        assert isinstance(found, sync.Subscription)
    elif expected == "stream":
        assert isinstance(found, (sync.BlockingStream, sync.Blocking))
    else:
        wrapper = sync._WRAPPERS.get(type(theirs[1]))  # the sync API's own table
        assert type(found) is (wrapper or type(theirs[1]))


def _sync_outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("returned", call())
    except Exception as exc:  # noqa: BLE001  # the error is what is compared
        return ("raised", type(exc))
