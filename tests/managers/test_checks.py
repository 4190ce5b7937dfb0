"""The shared argument checks (`agenticstate._checks`), as each manager reports them.

One helper checks a TTL (the core's `save(ttl=)`, `StateConfig.ttl`, `cached_call(ttl=)`,
`create_session(ttl=)` and the CLI's `--ttl`), one a positive timedelta (the managers' retention
options): the same input reads the same everywhere.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

from agenticstate import InvalidArgumentError, StateManager
from agenticstate._checks import as_ttl, positive_timedelta
from agenticstate.managers import (
    AgentStateStore,
    OrchestrationStateManager,
    SessionManager,
    SpeechStateManager,
    ToolStateManager,
)

if TYPE_CHECKING:
    from collections.abc import Callable


@pytest.mark.parametrize(
    ("ttl", "message"),
    [
        (-5, "ttl must be positive, not -5 seconds"),
        (0, "ttl must be positive, not 0 seconds"),
        (timedelta(0), "ttl must be positive, not 0:00:00"),
        (math.nan, "ttl must be a finite number of seconds, not nan"),
        (True, "ttl must be seconds or a timedelta, not a bool"),
        ("5", "ttl must be seconds or a timedelta, not str"),
        (1e20, "ttl of 1e+20 seconds is too long"),
    ],
)
def test_as_ttl_says_what_was_given(ttl: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        as_ttl(ttl)
    assert str(caught.value) == message


def test_as_ttl_accepts_seconds_and_timedeltas() -> None:
    assert as_ttl(None) is None
    assert as_ttl(1.5) == timedelta(seconds=1.5)
    assert as_ttl(timedelta(minutes=1)) == timedelta(minutes=1)


@pytest.mark.parametrize("value", [timedelta(0), timedelta(seconds=-1), 5, "1h"])
def test_positive_timedelta_names_the_option(value: object) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        positive_timedelta(value, "max_age")
    assert str(caught.value) == f"max_age must be a positive timedelta or None, not {value!r}"
    assert positive_timedelta(None, "max_age") is None


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda s: AgentStateStore(state_manager=s, max_age=timedelta(0)), "max_age"),
        (
            lambda s: OrchestrationStateManager(state_manager=s, finished_task_ttl=timedelta(0)),
            "finished_task_ttl",
        ),
        (lambda s: SpeechStateManager(state_manager=s, session_ttl=timedelta(0)), "session_ttl"),
        (
            lambda s: SpeechStateManager(state_manager=s, ended_session_ttl=timedelta(0)),
            "ended_session_ttl",
        ),
    ],
)
async def test_the_managers_share_the_timedelta_check(
    make: Callable[[StateManager], object], name: str
) -> None:
    async with StateManager() as state:
        with pytest.raises(InvalidArgumentError, match=f"^{name} must be a positive timedelta"):
            make(state)


async def test_the_managers_share_the_ttl_check() -> None:
    """`cached_call(ttl=)` and `create_session(ttl=)` read like `save(ttl=)`."""
    async with StateManager() as state:
        with pytest.raises(InvalidArgumentError) as saved:
            await state.save("k", 1, ttl=-5)
        tools = ToolStateManager(state_manager=state)
        with pytest.raises(InvalidArgumentError) as cached:
            await tools.cached_call("t", {}, _never, ttl=-5)
        sessions = SessionManager(state_manager=state)
        with pytest.raises(InvalidArgumentError) as created:
            await sessions.create_session("ann", ttl=-5)
        assert await state.list_keys("*") == []  # nothing written
    assert str(saved.value) == "ttl must be positive, not -5 seconds"
    assert str(cached.value) == "cached_call: ttl must be positive, not -5 seconds"
    assert str(created.value) == "ttl must be positive, not -5 seconds"


async def _never() -> None:
    raise AssertionError("the tool ran")  # pragma: no cover
