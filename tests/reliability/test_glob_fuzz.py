r"""The glob matcher, fuzzed: against real Redis, through every backend's list_keys, and its cost.

`agenticstate._glob` decides `list_keys`, `scan` and subscriptions on the memory and file
backends, so it must select exactly the keys Redis's `SCAN MATCH` selects. Patterns come from
structured generators (`_bad_glob`) that produce well-formed and malformed classes, escapes at
the end, `[^`, `[]`, `[a-]`, `\\` inside classes, ranges with multi-byte bounds and unicode
keys; `tests/integration/test_glob_differential.py` is the smaller random-alphabet version.

The figures: `test_glob_agrees_with_redis_on_structured_patterns` compares 6,000 patterns (each
over about 310 keys: 1.85 million pattern-key pairs) and requires 0 disagreements; the
hypothesis test adds 300 shrinkable examples, and `list_keys` is checked for 1,000 patterns on
each backend (Redis with a key prefix full of metacharacters). Cost is measured in steps (calls
of the matcher's core and the lines it executes, counted by a tracer), never in seconds; a
match that blows its step budget is stopped at once, so a regression fails instead of hanging.
"""

from __future__ import annotations

import random
import uuid
from typing import TYPE_CHECKING

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import FileBackend, MemoryBackend, RedisBackend, SQLiteBackend, StateManager
from agenticstate._glob import GlobMatcher, glob_match
from agenticstate._keys import escape_glob
from tests.reliability._bad_glob import (
    Token,
    count_steps,
    glob_keys,
    key_near,
    pattern_tokens,
    patterns,
    random_key,
    random_pattern,
    stars,
)

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Backend

# A database of its own keeps SCAN from walking the keys other tests leave in database 0.
GLOB_DB = 12
BATCHES = 60
PATTERNS_PER_BATCH = 100


def _client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, db=GLOB_DB)


def _redis_selects(client: redis.Redis, prefix: str, pattern: str) -> set[str]:
    return _redis_selects_many(client, prefix, [pattern])[0]


def _redis_selects_many(client: redis.Redis, prefix: str, patterns: list[str]) -> list[set[str]]:
    """SCAN MATCH each pattern (after the literal prefix, so the pattern decides, as in our
    backends); the first SCAN of every pattern goes out in one pipeline."""
    pipeline = client.pipeline(transaction=False)
    for pattern in patterns:
        pipeline.scan(0, match=prefix + pattern, count=10_000)
    selected = []
    for pattern, (cursor, batch) in zip(patterns, pipeline.execute(), strict=True):
        found = set(batch)
        while cursor:
            cursor, batch = client.scan(cursor, match=prefix + pattern, count=10_000)
            found.update(batch)
        selected.append({raw.decode()[len(prefix) :] for raw in found})
    return selected


@pytest.mark.redis
def test_glob_agrees_with_redis_on_structured_patterns(redis_url: str) -> None:
    """6,000 generated patterns over keys built to match them: 0 disagreements with SCAN MATCH."""
    client = _client(redis_url)
    rng = random.Random(20261123)
    compared = pairs = 0
    disagreements: list[tuple[str, list[str]]] = []
    try:
        for batch in range(BATCHES):
            prefix = f"globfuzz:{uuid.uuid4().hex[:8]}:{batch}:"
            generated = [random_pattern(rng) for _ in range(PATTERNS_PER_BATCH)]
            keys = {random_key(rng) for _ in range(60)}
            keys |= {key_near(tokens, rng) for _, tokens in generated for _ in range(3)}
            client.mset({prefix + key: b"1" for key in keys})
            try:
                patterns = [pattern for pattern, _ in generated]
                selections = _redis_selects_many(client, prefix, patterns)
                for pattern, found in zip(patterns, selections, strict=True):
                    ours = {key for key in keys if glob_match(pattern, key)}
                    compared += 1
                    pairs += len(keys)
                    if found != ours:
                        disagreements.append((pattern, sorted(found ^ ours)[:3]))
            finally:
                client.delete(*(prefix + key for key in keys))
    finally:
        client.close()
    assert disagreements == []
    assert compared == BATCHES * PATTERNS_PER_BATCH
    assert pairs > 1_800_000


@pytest.mark.redis
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=pattern_tokens(),
    keys=st.lists(glob_keys, min_size=1, max_size=12, unique=True),
    rng=st.randoms(use_true_random=False),
)
def test_glob_agrees_with_redis_hypothesis(
    redis_url: str, drawn: tuple[str, list[Token]], keys: list[str], rng: random.Random
) -> None:
    """Hypothesis patterns and keys (some built to match): Redis and we select the same keys."""
    pattern, tokens = drawn
    keys = sorted({*keys, pattern, *(key_near(tokens, rng) for _ in range(6))})
    client = _client(redis_url)
    prefix = f"globhyp:{uuid.uuid4().hex[:8]}:"
    try:
        client.mset({prefix + key: b"1" for key in keys})
        found = _redis_selects(client, prefix, pattern)
    finally:
        client.delete(*(prefix + key for key in keys))
        client.close()
    assert found == {key for key in keys if glob_match(pattern, key)}


@pytest.fixture(
    params=["memory", "file", "sqlite", pytest.param("redis", marks=pytest.mark.redis)],
)
async def listing_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A backend for the list_keys comparison (Redis on its own database, so SCAN stays short)."""
    backend: Backend
    if request.param == "memory":
        backend = MemoryBackend()
    elif request.param == "file":
        backend = FileBackend(base_path=tmp_path / "store", durability="none", auto_save=False)
    elif request.param == "sqlite":
        backend = SQLiteBackend(tmp_path / "state.db", synchronous="normal")
    else:
        url = request.getfixturevalue("redis_url")
        backend = RedisBackend(url=url, db=GLOB_DB, key_prefix=f"glob[{uuid.uuid4().hex[:6]}]*:")
    return backend


async def test_list_keys_selects_what_the_matcher_selects(listing_backend: Backend) -> None:
    """Through StateManager.list_keys, each backend lists exactly the keys our matcher selects."""
    rng = random.Random(7)
    generated = [random_pattern(rng) for _ in range(1000)]
    keys = {random_key(rng) for _ in range(100)}
    keys |= {key_near(tokens, rng) for _, tokens in generated[:100] for _ in range(2)}
    async with StateManager(backend=listing_backend) as state:
        await state.save_many(dict.fromkeys(keys, 1))
        try:
            mismatches = [
                pattern
                for pattern, _ in generated
                if await state.list_keys(pattern)
                != sorted(key for key in keys if glob_match(pattern, key))
            ]
            assert mismatches == []
            # Every key, escaped, lists itself and nothing else.
            for key in keys:
                assert await state.list_keys(escape_glob(key)) == [key]
        finally:
            for key in keys:
                await state.delete(key)


# The cost of matching, in steps. `calls` counts the recursive core's invocations: Redis's early
# exit makes each run of `*` loop over the key at most once, so calls <= (stars + 1) * (len + 1).
# `lines` counts the Python lines the matcher executed, a machine-independent measure of time.
# A class is parsed once per matcher, so `*[long class]b` costs pattern + key, not their product
# (before that fix: 3.6 million lines, 0.1 to 0.3 s, for a 904-byte pattern and a 1000-byte key).

PATHOLOGICAL = [
    pytest.param("*a*a*a*a*a*a*a*a*b", "a" * 1000, id="stars-a-1000"),
    pytest.param("a*" * 30 + "b", "a" * 1000, id="a-star-30"),
    pytest.param("*a" * 511 + "*b", "a" * 1024, id="512-stars-max-length"),
    pytest.param("*" * 1024, "a" * 1024, id="1024-stars"),
    pytest.param("*?" * 512, "a" * 1023, id="star-question-512"),
    pytest.param("?" * 1024, "a" * 1023, id="1024-questions"),
    pytest.param("*[ab]" * 200 + "c", "ab" * 500, id="star-class-200"),
    pytest.param("[" + "a-y" * 300 + "]*", "z" * 1000, id="long-class"),
    pytest.param("[^" + "a-y" * 300 + "]*", "z" * 1000, id="long-negated-class"),
    pytest.param("*[" + "a-y" * 300 + "]b", "z" * 1000, id="star-long-class"),
    pytest.param("*[^a]" * 200 + "b", "b" * 1000, id="star-negated-classes"),
    pytest.param("*\\*" * 300 + "x", "*" * 1000, id="escaped-stars"),
    pytest.param("*é*é*é*é*é*é*ü", "é" * 500, id="multibyte-stars"),
]


@pytest.mark.parametrize(("pattern", "key"), PATHOLOGICAL)
def test_pathological_patterns_cost_linear_steps(pattern: str, key: str) -> None:
    """Backtracking patterns cost steps linear in the key: 2x the key, at most ~2x the steps."""
    matcher = GlobMatcher(pattern)
    size = len(pattern.encode()) + len(key.encode())
    _, short = count_steps(lambda: matcher.match(key), budget=64 * size)
    _, double = count_steps(lambda: matcher.match(key * 2), budget=128 * size)
    assert short.calls <= (stars(pattern) + 1) * (len(key.encode()) + 1)
    assert short.max_depth <= stars(pattern) + 1
    assert short.lines <= 64 * size
    assert double.lines <= 2.2 * short.lines + 64 * len(pattern.encode())


@settings(max_examples=500, deadline=None)
@given(pattern=patterns, key=st.text(alphabet=st.sampled_from("ab*?[]^\\-é"), max_size=60))
def test_steps_are_bounded_for_any_pattern(pattern: str, key: str) -> None:
    """For any pattern and key: calls <= (stars + 1)(len + 1), lines <= 32 (plen + 1)(len + 1)."""
    pattern_bytes, key_bytes = len(pattern.encode()), len(key.encode())
    budget = 32 * (pattern_bytes + 1) * (key_bytes + 1)
    _, steps = count_steps(lambda: GlobMatcher(pattern).match(key), budget=budget)
    assert steps.calls <= (stars(pattern) + 1) * (key_bytes + 1)
    assert steps.lines <= 32 * (pattern_bytes + 1) * (key_bytes + 1)
