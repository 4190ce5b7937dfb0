"""The scan contract: Redis glob semantics on every backend."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from agenticstate import InvalidPatternError
from agenticstate.backends.base import Backend as _Backend

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

TAG_KEYS = [
    "ns:{a}:meta",
    "ns:{a}:cp:1",
    "ns:{a}:cp:2",
    "ns:{a!}:meta",  # sorts before every `ns:{a}` key, its tag after `a`
    "ns:{a}x}:y",  # a second `}`: the tag is `a`
    "ns:{b}",
    "ns:{}:empty",
    "ns:{c",  # no `}`: no tag
    "ns:{c*?[\\]}:glob",
    "ns:{\U0010ffff}:top",
    "ns:{d}}:",
    "ns:x{e}:other",
    "nsx:{f}:other",
    "other:{g}:z",
]
TAG_ALPHABET = "ab{}*?[]\\:\U0010ffff"


def _tags_of(keys: list[str], prefix: str) -> list[str]:
    """The tags `scan_tags(prefix)` must give over `keys`: the definition, one key at a time."""
    start = prefix + "{"
    return sorted(
        {
            key[len(start) : key.index("}", len(start))]
            for key in keys
            if key.startswith(start) and "}" in key[len(start) :]
        }
    )


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

    async def test_scan_tags_lists_each_tag_once(self, backend: Backend) -> None:
        """`scan_tags` gives the distinct text between `<prefix>{` and the next `}`, sorted."""
        await backend.set_many([(key, b"1") for key in TAG_KEYS])
        expected = ["", "a", "a!", "b", "c*?[\\]", "d", "\U0010ffff"]
        assert _tags_of(TAG_KEYS, "ns:") == expected
        assert await backend.scan_tags("ns:") == expected
        assert await backend.scan_tags("ns:x") == ["e"]
        assert await backend.scan_tags("missing:") == []
        for key in ("ns:{a}:meta", "ns:{a}:cp:1", "ns:{a}:cp:2", "ns:{b}"):
            await backend.delete(key)
        assert await backend.scan_tags("ns:") == ["", "a", "a!", "c*?[\\]", "d", "\U0010ffff"]
        await backend.delete("ns:{a}x}:y")
        assert await backend.scan_tags("ns:") == ["", "a!", "c*?[\\]", "d", "\U0010ffff"]

    @pytest.mark.parametrize("seed", range(3))
    async def test_scan_tags_equals_the_listing(self, backend: Backend, seed: int) -> None:
        """Under generated keys (braces, glob metacharacters, U+10FFFF), `scan_tags` equals
        the tags of what `scan_batches` lists, as the default implementation finds them."""
        rng = random.Random(seed)  # noqa: S311  # reproducible test data

        def text(size: int) -> str:
            return "".join(rng.choice(TAG_ALPHABET) for _ in range(size))

        keys = sorted({text(rng.randint(1, 7)) for _ in range(300)})
        await backend.set_many([(key, b"1") for key in keys])
        for prefix in ["", "a", "{", "a:", "}", "\U0010ffff", *(text(2) for _ in range(6))]:
            found = await backend.scan_tags(prefix)
            assert found == _tags_of(keys, prefix), prefix
            assert found == await _Backend.scan_tags(backend, prefix), prefix

    @pytest.mark.parametrize("bad", ["", "a\x00*", "a\n*", 5, None, "*" * 1025])
    async def test_invalid_pattern_is_rejected(self, backend: Backend, bad: object) -> None:
        """Empty, non-str, control-character and overlong patterns raise InvalidPatternError."""
        with pytest.raises(InvalidPatternError):
            [key async for key in backend.scan(bad)]  # type: ignore[arg-type]
        with pytest.raises(InvalidPatternError):
            async with backend.changes(bad):  # type: ignore[arg-type]
                pass
