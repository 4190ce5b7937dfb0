"""The scan contract: Redis glob semantics on every backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from agenticstate import InvalidPatternError

if TYPE_CHECKING:
    from agenticstate.backends import Backend


KEYS = [
    "agent:1",
    "agent:2",
    "agent:10",
    "agent:a:status",
    "agents",
    "workflow:1",
    "x*y",
    "x?y",
    "x[1]",
    "xay",
    "back\\slash",
    "caret^",
    "é:1",
    "Agent:1",
]


CASES = [
    ("*", KEYS),
    ("agent:*", ["agent:1", "agent:2", "agent:10", "agent:a:status"]),
    ("agent:?", ["agent:1", "agent:2"]),
    ("agent:[12]", ["agent:1", "agent:2"]),
    ("agent:[^1]", ["agent:2"]),
    ("agent:[0-9]*", ["agent:1", "agent:2", "agent:10"]),
    ("agent:[9-0]", ["agent:1", "agent:2"]),
    ("*:status", ["agent:a:status"]),
    ("agent*", ["agent:1", "agent:2", "agent:10", "agent:a:status", "agents"]),
    ("x\\*y", ["x*y"]),
    ("x\\?y", ["x?y"]),
    ("x?y", ["x*y", "x?y", "xay"]),
    ("x\\[1\\]", ["x[1]"]),
    ("x[[]1]", ["x[1]"]),
    ("back\\\\slash", ["back\\slash"]),
    ("caret^", ["caret^"]),
    ("é:*", ["é:1"]),
    ("[aA]gent:1", ["agent:1", "Agent:1"]),
    ("nothing*", []),
    ("agent:1", ["agent:1"]),
    ("workflow:1*", ["workflow:1"]),
]


class ScanContract:
    """The scan contract: Redis glob semantics on every backend.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    @pytest_asyncio.fixture
    async def seeded(self, backend: Backend) -> Backend:
        await backend.set_many([(key, b"1") for key in KEYS])
        return backend

    @pytest.mark.parametrize(("pattern", "expected"), CASES)
    async def test_scan_follows_redis_glob_rules(
        self, seeded: Backend, pattern: str, expected: list[str]
    ) -> None:
        """Each pattern selects exactly the keys Redis would select."""
        found = [key async for key in seeded.scan(pattern)]
        assert sorted(found) == sorted(expected)
        assert len(found) == len(set(found))
        batched = [key async for batch in seeded.scan_batches(pattern) for key in batch]
        assert sorted(batched) == sorted(expected)

    async def test_scan_batches_can_stop_early(self, backend: Backend) -> None:
        """A caller may leave `scan_batches` after the first list; the backend stays usable."""
        await backend.set_many([(f"early:{i}", b"") for i in range(1500)])
        batches = backend.scan_batches("early:*")
        first = await anext(aiter(batches))
        assert first
        await batches.aclose()  # type: ignore[attr-defined]  # an async generator
        assert len([key async for key in backend.scan("early:*")]) == 1500

    async def test_scan_skips_deleted_keys(self, seeded: Backend) -> None:
        """A deleted key is no longer listed."""
        await seeded.delete("agent:1")
        assert sorted([key async for key in seeded.scan("agent:?")]) == ["agent:2"]

    async def test_scan_many_keys_returns_each_once(self, backend: Backend) -> None:
        """A scan over more keys than one batch returns every key exactly once."""
        keys = [f"bulk:{i}" for i in range(1500)]
        await backend.set_many([(key, b"") for key in keys])
        found = [key async for key in backend.scan("bulk:*")]
        assert len(found) == len(keys)
        assert set(found) == set(keys)
        batched = [key async for batch in backend.scan_batches("bulk:*") for key in batch]
        assert len(batched) == len(keys)
        assert set(batched) == set(keys)

    @pytest.mark.parametrize("bad", ["", "a\x00*", "a\n*", 5, None, "*" * 1025])
    async def test_invalid_pattern_is_rejected(self, backend: Backend, bad: object) -> None:
        """Empty, non-str, control-character and overlong patterns raise InvalidPatternError."""
        with pytest.raises(InvalidPatternError):
            [key async for key in backend.scan(bad)]  # type: ignore[arg-type]
        with pytest.raises(InvalidPatternError):
            async with backend.changes(bad):  # type: ignore[arg-type]
                pass
