"""Every manager method refuses a wrongly typed count or mapping argument with
InvalidArgumentError before it reads or writes anything.

Generated from the methods' signatures: each public coroutine method of each manager with a
count parameter (`limit`, `last`, `since`, `max_tokens`: an int or None) or a mapping parameter
(`parameters`, `changes`) is called with each bad value there (the other arguments are
placeholders: the check comes first, so they are never looked at). The store sees no call.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from agenticstate import InvalidArgumentError, StateManager
from agenticstate import managers as async_managers
from tests.managers._interleave import points

COUNTS = ("limit", "last", "since", "max_tokens")
MAPPINGS = ("parameters", "changes")
BAD_COUNTS = [-1, "a", 1.5, True]
BAD_MAPPINGS = [[("a", 1)], 5, "ab"]


def _cases() -> list[tuple[str, str, str, Any]]:
    cases = []
    for class_name in sorted(async_managers.__all__):
        cls = getattr(async_managers, class_name)
        if not inspect.isclass(cls) or not class_name.endswith(("Manager", "Store")):
            continue
        for name, method in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if name.startswith("_"):
                continue
            for parameter in inspect.signature(method).parameters:
                if parameter in COUNTS:
                    cases += [(class_name, name, parameter, bad) for bad in BAD_COUNTS]
                elif parameter in MAPPINGS:
                    cases += [(class_name, name, parameter, bad) for bad in BAD_MAPPINGS]
    return cases


CASES = _cases()


def test_the_generator_finds_the_methods() -> None:
    """The table covers the known methods (so a rename does not empty it)."""
    found = {(cls, method) for cls, method, _, _ in CASES}
    assert ("ToolStateManager", "get_execution_history") in found
    assert ("AgentStateStore", "list_snapshots") in found
    assert ("WorkflowStateManager", "update_context") in found
    assert ("ToolStateManager", "cached_call") in found


@pytest.mark.parametrize(
    ("cls", "method", "parameter", "bad"),
    CASES,
    ids=[f"{c}.{m}({p}={b!r})" for c, m, p, b in CASES],
)
async def test_a_wrongly_typed_argument_is_refused_first(
    cls: str, method: str, parameter: str, bad: Any
) -> None:
    """InvalidArgumentError, and no storage call made."""
    state = StateManager()
    try:
        manager = getattr(async_managers, cls)(state_manager=state)
        bound = getattr(manager, method)
        args: dict[str, Any] = {}
        for name, spec in inspect.signature(bound).parameters.items():
            if name == parameter:
                args[name] = bad
            elif spec.default is inspect.Parameter.empty and spec.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            ):
                args[name] = _placeholder(name)
        raised: list[BaseException] = []

        async def call() -> None:
            try:
                await bound(**args)
            except BaseException as exc:  # noqa: BLE001  # judged below
                raised.append(exc)

        made = await points(state, call)
        assert raised, "accepted"
        assert isinstance(raised[0], InvalidArgumentError), repr(raised[0])
        assert made == 0
    finally:
        await state.aclose()


def _placeholder(name: str) -> Any:
    if name in ("fn", "job"):

        async def job() -> None:
            raise AssertionError("ran")

        return job
    if name == "agent":
        return type("Agent", (), {"id": "a"})()
    return "x"


@pytest.mark.parametrize(
    "bad",
    [{"max_attempts": 0}, {"max_attempts": "3"}, {"backoff_factor": 0.5}, {"max_attempts": True}],
    ids=str,
)
async def test_run_with_retries_refuses_a_bad_schedule_before_running(bad: dict[str, Any]) -> None:
    """A schedule argument out of range raises InvalidArgumentError; the tool never runs."""
    from agenticstate import ToolStateManager

    tools = ToolStateManager()
    ran: list[int] = []

    async def tool() -> int:
        ran.append(1)
        return 1

    with pytest.raises(InvalidArgumentError):
        await tools.run_with_retries("e", "t", {}, tool, **bad)
    assert ran == []
