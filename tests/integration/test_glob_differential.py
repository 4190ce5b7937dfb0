"""Our glob matcher against real Redis SCAN MATCH on generated patterns and keys."""

from __future__ import annotations

import random

import pytest

from agenticstate._glob import glob_match

pytestmark = pytest.mark.redis

ALPHABET = ["a", "b", ":", "*", "?", "[", "]", "^", "\\", "-", "é", "z", "A", "0"]


def test_glob_agrees_with_redis_scan(redis_url: str) -> None:
    """On thousands of generated patterns, our matcher and Redis select the same keys."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(redis_url)
    rng = random.Random(20261122)
    prefix = "globdiff:"
    keys = sorted({"".join(rng.choices(ALPHABET, k=rng.randint(1, 6))) for _ in range(300)})
    try:
        client.mset({prefix + key: b"1" for key in keys})
        disagreements = []
        for _ in range(2000):
            pattern = "".join(rng.choices(ALPHABET, k=rng.randint(1, 7)))
            # The prefix is literal, so the pattern after it decides, exactly as in our backends.
            found = {
                raw.decode()[len(prefix) :]
                for raw in client.scan_iter(match=prefix + pattern, count=1000)
            }
            ours = {key for key in keys if glob_match(pattern, key)}
            if found != ours:
                disagreements.append((pattern, sorted(found ^ ours)[:3]))
        assert disagreements == []
    finally:
        client.delete(*(prefix + key for key in keys))
        client.close()
