"""The Redis-compatible glob matcher, case by case (the differential test is in integration/)."""

from __future__ import annotations

import pytest

from agenticstate._glob import GlobMatcher, glob_match
from agenticstate._keys import escape_glob


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("*", "anything:at:all", True),
        ("a*", "a", True),
        ("a*b", "a:x:b", True),
        ("a?c", "abc", True),
        ("a?c", "ac", False),
        ("?", "é", False),  # ? is one byte, é is two in UTF-8
        ("??", "é", True),
        ("[abc]", "b", True),
        ("[^abc]", "b", False),
        ("[^abc]", "d", True),
        ("[a-c]", "b", True),
        ("[c-a]", "b", True),  # reversed ranges work
        ("[a-]", "-", False),  # Redis reads "a-]" as the range ]..a, then runs to the end
        ("[\\]]", "]", True),
        ("[\\^]", "^", True),
        ("\\*", "*", True),
        ("\\*", "x", False),
        ("a\\", "a\\", True),  # a trailing backslash is literal
        ("[abc", "a", True),  # an unterminated class runs to the end
        ("[abc", "[abc", False),
        ("*:status", "agent:1:status", True),
        ("[", "[", False),
        ("x[]y", "x]y", False),
    ],
)
def test_redis_glob_cases(pattern: str, key: str, expected: bool) -> None:
    """Each case matches as Redis's stringmatchlen decides."""
    assert glob_match(pattern, key) is expected


def test_escape_glob_matches_only_itself() -> None:
    """An escaped string matches itself and nothing else."""
    literal = "t[1]*?^\\:x"
    pattern = escape_glob(literal)
    assert glob_match(pattern, literal)
    assert not glob_match(pattern, "t1:x")
    matcher = GlobMatcher(pattern)
    assert matcher.is_literal
    assert matcher.literal_prefix == literal


def test_literal_prefix_stops_at_first_metacharacter() -> None:
    """The literal prefix is the text before the first unescaped metacharacter."""
    assert GlobMatcher("agent:\\*x*y").literal_prefix == "agent:*x"
    assert not GlobMatcher("agent:*").is_literal


def test_pathological_pattern_is_fast() -> None:
    """Many stars against a long non-matching key finish (no exponential backtracking).

    Without Redis's early exit this case would run for longer than the test suite's timeout.
    """
    assert not glob_match("a*" * 30 + "b", "a" * 1000)
    assert glob_match("a*" * 30, "a" * 1000)
