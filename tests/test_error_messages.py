"""Error messages say the reason and what to do, in the user's terms."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

from agenticstate import StateConfig, StateManager
from agenticstate.exceptions import BackendError, InvalidArgumentError, UnsupportedTypeError

if TYPE_CHECKING:
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
    with pytest.raises(BackendError) as caught:
        await state.open()
    await state.aclose()
    assert str(caught.value) == (
        f"could not create the store directory {blocker / 'store'}: not a directory (ENOTDIR)"
    )
