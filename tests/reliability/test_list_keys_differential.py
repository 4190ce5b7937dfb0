"""`list_keys` on every backend against the memory backend, over exotic characters.

The SQLite backend answers a pattern with a literal prefix from a range of its index
(`prefix <= key < prefix-with-its-last-character-moved-up`), Redis with `SCAN MATCH` on the
prefixed name, the file and memory stores with the glob matcher. The range's edges are where
they can disagree: the last code point (U+10FFFF cannot move up, and once the range dropped it
from the low bound too, listing keys outside the pattern), the surrogate gap (U+D7FF to U+E000),
the ends of each UTF-8 length (U+007F/U+0080 are control characters and refused; U+07FF/U+0800,
U+FFFF/U+10000), glob metacharacters and escapes. Hypothesis draws keys and patterns over those
characters, with keys built around each pattern's literal prefix, and every backend must list
exactly what the memory backend lists.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import MemoryBackend, StateConfig, StateManager
from agenticstate._glob import glob_match
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

# Next to the edges of the code space and of each UTF-8 length, and the metacharacters.
EDGE: tuple[str, ...] = ("\U0010ffff", "\U0010fffe", "\U00010000", "\uffff", "\ue000")
EDGE += ("\ud7ff", "\u0800", "\u07ff", "\u00a0", "~", "a", "b", ":", "é")
META = ("*", "?", "[", "]", "^", "-", "\\")
key_text = st.text(alphabet=st.sampled_from(EDGE + META), min_size=1, max_size=5)
edge_text = st.text(alphabet=st.sampled_from(EDGE), max_size=3)
# What follows a pattern's literal head: nothing, a star (the range alone answers it), a tail
# the matcher must still filter, or an escaped metacharacter (literal, so part of the head).
TAILS = st.one_of(
    st.sampled_from(["*", "", "?*", "*a", "[a\U0010ffff]*", "\\*", "\\[*", "**"]),
    st.text(alphabet=st.sampled_from(EDGE + META), min_size=1, max_size=3),
)


@st.composite
def keys_and_pattern(draw: st.DrawFn) -> tuple[list[str], str]:
    """A pattern (a literal head that often ends in high code points, then a tail) and keys:
    random ones and ones made of the head cut at each place and any tail, which sit on the
    edges of the range a prefix is read from."""
    head = draw(edge_text) + draw(st.text(alphabet=st.just("\U0010ffff"), max_size=2))
    pattern = head + draw(TAILS)
    if not pattern:
        pattern = "*"
    keys = draw(st.lists(key_text, max_size=6))
    for cut in range(len(head) + 1):
        keys.append(head[:cut] + draw(edge_text))
    return [key for key in dict.fromkeys(keys) if key], pattern


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_list_keys_agrees_with_memory_on_exotic_characters(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Every backend lists exactly the keys the memory backend lists, for any keys and pattern."""
    with open_state(backend_name, request, tmp_path) as (portal, state):

        async def both(keys: list[str], pattern: str) -> tuple[list[str], list[str]]:
            async with StateManager(StateConfig(), backend=MemoryBackend()) as memory:
                await memory.save_many(dict.fromkeys(keys, 1))
                expected = await memory.list_keys(pattern)
            await state.save_many(dict.fromkeys(keys, 1))
            try:
                found = await state.list_keys(pattern)
            finally:
                for key in keys:
                    await state.delete(key)
            return expected, found

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(drawn=keys_and_pattern())
        def check(drawn: tuple[list[str], str]) -> None:
            keys, pattern = drawn
            namespace = f"x{uuid.uuid4().hex[:8]}:"  # a fresh one per example: none meet
            stored = [namespace + key for key in keys]
            expected, found = portal.call(both, stored, namespace + pattern)
            assert found == expected
            assert expected == sorted(k for k in stored if glob_match(namespace + pattern, k))

        check()


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_a_prefix_ending_in_the_last_code_point_lists_only_its_keys(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`a\\U0010ffff*` lists the keys that start with it, never `ab` or `a`."""
    keys = ["a", "ab", "a\U0010ffff", "a\U0010ffffz", "a\U0010ffff\U0010ffff", "b"]

    async def listing() -> list[str]:
        await state.save_many(dict.fromkeys(keys, 1))
        try:
            return await state.list_keys("a\U0010ffff*")
        finally:
            for key in keys:
                await state.delete(key)

    with open_state(backend_name, request, tmp_path) as (portal, state):
        found = portal.call(listing)
    assert found == ["a\U0010ffff", "a\U0010ffffz", "a\U0010ffff\U0010ffff"]
