r"""Glob patterns and keys for the differential and cost tests, seeded or as hypothesis strategies.

Patterns are built from tokens, so that every corner of Redis's `stringmatchlen` is reached:
literals (`]`, `^` and `-` are literal outside a class), escapes (`\x`, a trailing `\`), `?`,
runs of `*`, and classes, well-formed or not: `[^...]`, ranges (reversed, multi-byte bounds that
Redis compares as signed chars), escapes inside classes, `]` first, unterminated classes. Each
token also knows how to make text it (probably) matches, so generated keys hit often.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st

from agenticstate import _glob

if TYPE_CHECKING:
    import random
    from collections.abc import Callable
    from types import FrameType

# ASCII, every metacharacter, and UTF-8 of 2, 3 and 4 bytes (bytes >= 0x80 are negative chars).
CHARS: tuple[str, ...] = (
    "a",
    "b",
    "c",
    "z",
    "A",
    "0",
    ":",
    "-",
    "^",
    "]",
    "[",
    "*",
    "?",
    "\\",
    " ",
    "~",
)
CHARS += ("é", "ÿ", "¡", "中", "😀")
LITERALS = tuple(char for char in CHARS if char not in "*?[\\")
# Fragments that are easy to get wrong: empty and negated-empty classes, a dash at either end,
# an unterminated class or escape, escaped `]`, `\` and `-` inside a class, `!` (not negation).
FRAGMENTS = (
    "[]",
    "[^]",
    "[a-]",
    "[-a]",
    "[^",
    "[",
    "[\\",
    "[a-\\]",
    "[\\]]",
    "[]]",
    "[^]]",
    "[z-a]",
    "[!a]",
    "[a-c-e]",
    "[\\\\]",
    "[\\-]",
    "[^\\^]",
    "[é-ÿ]",
    "[\\é]",
    "\\",
    "\\\\",
    "**",
    "*?*",
)


@dataclass(frozen=True)
class Token:
    """One piece of a pattern, and a way to make text it probably matches."""

    text: str
    sample: Callable[[random.Random], str]


def _constant(text: str) -> Callable[[random.Random], str]:
    return lambda rng: text


def _any_char(rng: random.Random) -> str:
    return rng.choice(CHARS)


def _any_run(rng: random.Random) -> str:
    return "".join(rng.choices(CHARS, k=rng.randint(0, 3)))


def random_class(rng: random.Random) -> Token:
    """A bracket class: negated or not, chars, ranges, escapes, terminated or not."""
    body = "^" if rng.random() < 0.3 else ""
    members: list[str] = []
    for _ in range(rng.randint(0, 4)):
        roll = rng.random()
        if roll < 0.4:
            char = rng.choice(CHARS)
            body += char
            members.append(char)
        elif roll < 0.75:
            low, high = rng.choice(CHARS), rng.choice(CHARS)
            body += f"{low}-{high}"
            members += [low, high]
        else:
            char = rng.choice(CHARS)
            body += "\\" + char
            members.append(char)
    text = "[" + body + ("]" if rng.random() < 0.85 else "")
    pool = members or list(CHARS)
    return Token(text, lambda r: r.choice(pool) if r.random() < 0.8 else r.choice(CHARS))


def random_token(rng: random.Random) -> Token:
    """One token, with the mix of kinds the module docstring lists."""
    roll = rng.random()
    if roll < 0.30:
        char = rng.choice(LITERALS)
        return Token(char, _constant(char))
    if roll < 0.40:
        char = rng.choice(CHARS)
        return Token("\\" + char, _constant(char))
    if roll < 0.52:
        return Token("?", _any_char)
    if roll < 0.67:
        return Token(rng.choice(("*", "*", "**")), _any_run)
    if roll < 0.93:
        return random_class(rng)
    fragment = rng.choice(FRAGMENTS)
    return Token(fragment, _any_run)


def random_pattern(rng: random.Random) -> tuple[str, list[Token]]:
    """A pattern of one to six tokens (sometimes with a trailing backslash), and its tokens."""
    tokens = [random_token(rng) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.08:
        tokens.append(Token("\\", _constant("\\")))
    return "".join(token.text for token in tokens), tokens


def random_key(rng: random.Random) -> str:
    """A key of one to eight characters from `CHARS`."""
    return "".join(rng.choices(CHARS, k=rng.randint(1, 8)))


def key_near(tokens: list[Token], rng: random.Random) -> str:
    """Text built to match the pattern of `tokens`, sometimes mutated by one character."""
    text = "".join(token.sample(rng) for token in tokens)
    if text and rng.random() < 0.25:
        position = rng.randrange(len(text))
        text = text[:position] + rng.choice(("", rng.choice(CHARS))) + text[position + 1 :]
    return text or rng.choice(CHARS)


# The same as hypothesis strategies (for shrinking to a minimal disagreement).


@st.composite
def pattern_tokens(draw: st.DrawFn) -> tuple[str, list[Token]]:
    """A pattern drawn token by token, with its tokens (to build keys that match it)."""
    rng = draw(st.randoms(use_true_random=False))
    count = draw(st.integers(min_value=1, max_value=6))
    tokens = [random_token(rng) for _ in range(count)]
    if draw(st.booleans()):
        tokens.append(Token(draw(st.sampled_from(FRAGMENTS)), _any_run))
    return "".join(token.text for token in tokens), tokens


patterns = pattern_tokens().map(lambda drawn: drawn[0])
"""Just the pattern text of `pattern_tokens`."""

glob_keys = st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=8)


def stars(pattern: str) -> int:
    """How many runs of `*` the pattern has (each is one level of the matcher's recursion)."""
    runs = 0
    previous = ""
    for char in pattern:
        if char == "*" and previous != "*":
            runs += 1
        previous = char
    return runs


@dataclass
class Steps:
    """What one match cost: calls of the matcher's core and lines it executed."""

    calls: int = 0
    lines: int = 0
    depth: int = 0
    max_depth: int = 0


class StepBudgetExceededError(AssertionError):
    """The match took more steps than its budget (raised from the tracer, so it stops at once)."""


def count_steps(match: Callable[[], bool], *, budget: int = 10**8) -> tuple[bool, Steps]:
    """Run `match()` under a tracer counting the glob core's calls and the matcher's lines.

    A deterministic measure of the algorithm's work, free of timing: the same input always
    takes the same steps, on any machine. A match that exceeds `budget` lines is stopped with
    `StepBudgetExceededError`, so an exponential regression fails at once instead of hanging.
    """
    core = _glob._match.__code__
    steps = Steps()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            steps.lines += 1
            if steps.lines > budget:
                raise StepBudgetExceededError(f"more than {budget} steps")
        elif event == "return" and frame.f_code is core:
            steps.depth -= 1
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        # Every function of the matcher's module counts (the core and the class parser).
        if frame.f_code.co_filename != core.co_filename:
            return None
        if frame.f_code is core:
            steps.calls += 1
            steps.depth += 1
            steps.max_depth = max(steps.max_depth, steps.depth)
        return local

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        result = match()
    finally:
        sys.settrace(previous)
    return result, steps
