"""Error messages say the reason and what to do, in the user's terms."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

from agenticstate import AgentRecoveryManager, ScopedState, StateConfig, StateManager, sync
from agenticstate.exceptions import (
    ConfigurationError,
    InvalidArgumentError,
    UnsupportedTypeError,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


@dataclasses.dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"tags": {"a", "b"}}, "type set at $.tags; store a list instead, such as sorted(value)"),
        (Point(1), "type Point at $; store dataclasses.asdict(value), or make it a pydantic model"),
        ([Decimal("9.99")], "type Decimal at $[0]; store str(value) to keep it exact"),
    ],
)
async def test_unsupported_types_say_what_to_store(value: object, message: str) -> None:
    """A dataclass, a set, a Decimal: the error names the place and what to store instead."""
    async with StateManager() as state:
        with pytest.raises(UnsupportedTypeError) as caught:
            await state.save("k", value)
        assert message in str(caught.value)
        assert caught.value.path == message.split(" at ", 1)[1].split(";", 1)[0]
        assert not await state.exists("k")  # nothing written


@pytest.mark.parametrize(
    ("ttl", "shown"), [(-5, "-5 seconds"), (-0.5, "-0.5 seconds"), (0, "0 seconds")]
)
async def test_a_bad_ttl_shows_what_was_typed(ttl: float, shown: str) -> None:
    """`ttl=-5` reads "not -5 seconds", not the timedelta "-1 day, 23:59:55"."""
    async with StateManager() as state:
        with pytest.raises(InvalidArgumentError) as caught:
            await state.save("k", 1, ttl=ttl)
    assert str(caught.value) == f"ttl must be positive, not {shown}"


async def test_os_errors_are_in_words(tmp_path: Path) -> None:
    """An OS error reads as words with the errno name after it, not the bare name."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    state = StateManager(StateConfig(backend="file", file_path=blocker / "store" / "state.json"))
    with pytest.raises(ConfigurationError) as caught:  # a path to fix, not a failing backend
        await state.open()
    await state.aclose()
    assert str(caught.value) == (
        f"could not open {blocker / 'store'}: a part of the path is not a directory (ENOTDIR)"
    )


def _async_managers() -> list[type]:
    import agenticstate.managers as managers
    from agenticstate.managers._base import StateManagerBase

    found = [getattr(managers, name) for name in managers.__all__]
    return [
        kind
        for kind in found
        if isinstance(kind, type)
        and issubclass(kind, StateManagerBase)
        and kind is not StateManagerBase
    ]


@pytest.mark.parametrize("manager", _async_managers(), ids=lambda kind: kind.__name__)
def test_an_async_manager_given_a_blocking_state_manager_names_both_types(manager: type) -> None:
    """An async manager given a `sync.StateManager` names both types with their modules and says
    what to pass instead; the blocking twin it suggests accepts that object."""
    with sync.StateManager() as blocking:
        with pytest.raises(ConfigurationError) as caught:
            manager(state_manager=blocking)
        name = manager.__name__
        assert str(caught.value) == (
            f"{name}: state_manager must be an agenticstate.StateManager, not "
            f"agenticstate.sync.StateManager; {name} is the async API: use "
            f"agenticstate.sync.{name}(state_manager=...) for a blocking one over it, or pass "
            "state_manager.async_object from async code running on the sync API's loop"
        )
        twin = getattr(sync, name)(state_manager=blocking)  # the advice works
        assert twin.async_object.state is blocking.async_object


def _scope(blocking: sync.StateManager) -> object:
    return ScopedState(blocking, "p:")  # type: ignore[arg-type]


def _recovery(blocking: sync.StateManager) -> object:
    return AgentRecoveryManager(sync.AgentStateStore(state_manager=blocking))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "parameter", "expected"),
    [(_scope, "state", "StateManager"), (_recovery, "agent_store", "AgentStateStore")],
    ids=["ScopedState", "AgentRecoveryManager"],
)
def test_other_async_classes_given_a_blocking_object_name_both_types(
    build: Callable[[sync.StateManager], object], parameter: str, expected: str
) -> None:
    """`ScopedState` and `AgentRecoveryManager` given a blocking object name both types too,
    with the error every class raises for an object of the wrong kind (ConfigurationError)."""
    with sync.StateManager() as blocking, pytest.raises(ConfigurationError) as caught:
        build(blocking)
    text = str(caught.value)
    assert f"{parameter} must be an agenticstate.{expected}, not agenticstate.sync." in text
    assert f"{parameter}.async_object" in text
