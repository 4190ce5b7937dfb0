"""`StateManager.transact`: values in and out through the codec, on every backend."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from pydantic import BaseModel

from agenticstate import StateConfig, StateManager
from agenticstate.backends import MemoryBackend
from agenticstate.encryption import Encryption
from agenticstate.exceptions import DecodeError, InvalidArgumentError, SerializationError
from agenticstate.txn import (
    Delete,
    Exists,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Version,
)

if TYPE_CHECKING:
    from agenticstate.events import StateChange


class Hit(BaseModel):
    answer: int


async def test_then_runs_when_every_compare_holds(state: StateManager) -> None:
    await state.save("t:{a}:cache", {"answer": 42})
    result = await state.transact(
        compare=[Exists("t:{a}:cache"), Version("t:{a}:cache", 1)],
        then=[Get("t:{a}:cache", model=Hit), IndexIncr("t:{a}:counters", "hits", 1)],
        orelse=[Get("t:{a}:other")],
    )
    assert result.succeeded
    entry, hits = result.results
    assert entry.value == Hit(answer=42)
    assert entry.version == 1
    assert hits == 1
    again = await state.transact([Exists("t:{a}:cache")], [IndexIncr("t:{a}:counters", "hits", 2)])
    assert again.results == [3]


async def test_orelse_runs_when_a_compare_fails(state: StateManager) -> None:
    await state.save("t:{b}:k", "v1")
    result = await state.transact(
        compare=[Version("t:{b}:k", 7)],
        then=[Put("t:{b}:k", "never")],
        orelse=[Get("t:{b}:k"), Get("t:{b}:missing")],
    )
    assert not result.succeeded
    current, missing = result.results
    assert current.value == "v1"
    assert missing is None
    assert await state.get("t:{b}:k") == "v1"


async def test_writes_return_versions_and_emit_changes(state: StateManager) -> None:
    await state.save("t:{c}:gone", 1)
    seen: list[StateChange] = []
    async with state.watch("t:{c}:*") as changes:
        result = await state.transact(
            compare=[Version("t:{c}:new", 0)],
            then=[
                Put("t:{c}:new", {"n": 1}, ttl=timedelta(minutes=5)),
                Delete("t:{c}:gone"),
                Delete("t:{c}:never"),
                IndexAdd("t:{c}:idx", {"x": 1.0, "y": 2.0}),
                IndexRemove("t:{c}:idx", ["x"]),
                IndexRange("t:{c}:idx"),
            ],
        )
        async for change in changes:
            seen.append(change)
            if len(seen) == 2:
                break
    assert result.results == [1, True, False, 2, 1, [("y", 2.0)]]
    assert {(c.key, c.op.value) for c in seen} == {("t:{c}:new", "set"), ("t:{c}:gone", "delete")}
    entry = await state.get_entry("t:{c}:new")
    assert entry is not None
    assert entry.value == {"n": 1}
    assert entry.ttl is not None
    assert timedelta(minutes=4) < entry.ttl <= timedelta(minutes=5)
    assert not await state.exists("t:{c}:gone")


async def test_bad_input_changes_nothing(state: StateManager) -> None:
    await state.save("t:{d}:k", 1)
    with pytest.raises(SerializationError):
        await state.transact([], [Put("t:{d}:k", 2), Put("t:{d}:bad", {1, 2})])
    with pytest.raises(InvalidArgumentError):
        await state.transact([], [Put("t:{d}:k", 3), Put("t:{d}:k2", 4, ttl=-5)])
    with pytest.raises(TypeError):
        await state.transact([], [Put("t:{d}:k", 5), "not an op"])  # type: ignore[list-item]
    assert await state.get_entry("t:{d}:k") is not None
    assert await state.get("t:{d}:k") == 1
    assert not await state.exists("t:{d}:bad")
    assert state.stats().saves == 1


async def test_values_are_encrypted_under_their_key() -> None:
    encryption = Encryption({"k1": Encryption.generate_key()})
    backend = MemoryBackend()
    async with StateManager(StateConfig(encryption=encryption), backend=backend) as state:
        await state.transact([], [Put("secret:{1}", {"card": "4111"})])
        raw = await backend.get("secret:{1}")
        assert raw is not None
        assert b"4111" not in raw.value
        result = await state.transact([], [Get("secret:{1}")])
        assert result.results[0].value == {"card": "4111"}


async def test_a_get_that_does_not_validate_says_the_step_happened(state: StateManager) -> None:
    """Values are decoded after the step commits: the error must not invite a blind retry."""
    with pytest.raises(DecodeError) as raised:
        await state.transact(
            [], [Put("t:{e}:k", {"answer": "not a number"}), Get("t:{e}:k", model=Hit)]
        )
    assert any("already committed" in note for note in raised.value.__notes__)
    assert await state.get("t:{e}:k") == {"answer": "not a number"}
