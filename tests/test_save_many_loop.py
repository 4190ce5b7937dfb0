"""`save_many` of a large batch encodes in chunks and lets the event loop run between them.

A ticker task records, at each of its turns, how many values have been encoded so far (each
value is a model whose serializer counts its calls). The most values encoded between two turns
is the longest stretch the loop was held by encoding: it must be one chunk, whatever the batch
size. No timing is measured.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel, model_serializer

from agenticstate import StateManager
from agenticstate.backends import MemoryBackend

ENCODED = [0]  # how many values have been encoded


class Counted(BaseModel):
    """A value that counts how many times it is encoded."""

    n: int

    @model_serializer
    def _dump(self) -> dict[str, Any]:
        ENCODED[0] += 1
        return {"n": self.n}


@pytest.mark.parametrize("size", [10, 5_000, 50_000])
async def test_save_many_yields_while_it_encodes(size: int) -> None:
    """Between two turns of a ticker, save_many encodes at most one chunk of values (it used
    to encode the whole batch in one go), and every value is saved."""
    ENCODED[0] = 0
    seen: list[int] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            seen.append(ENCODED[0])
            await anyio.lowlevel.checkpoint()

    items = {f"k{n}": Counted(n=n) for n in range(size)}
    async with StateManager(backend=MemoryBackend()) as state, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()  # the ticker has started
        versions = await state.save_many(items)
        done.set()
    assert ENCODED[0] == size
    assert len(versions) == size
    longest = max(b - a for a, b in zip([0, *seen], [*seen, ENCODED[0]], strict=True))
    assert longest <= 512, (size, longest)
    assert len(seen) >= size // 512
