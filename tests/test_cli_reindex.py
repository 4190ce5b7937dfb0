"""`agenticstate reindex`, run as a real process: a Redis store's key index built again, with
counts; a store without a separate index says so and exits 0; a missing store exits 1."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import redis as sync_redis

from agenticstate.backends._redis_keyindex import KEY_INDEX_NAMESPACE
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from pathlib import Path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m agenticstate ARGS...`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "agenticstate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.redis
def test_reindex_builds_a_lost_redis_index_again_and_counts(redis_url: str, tmp_path: Path) -> None:
    """A Redis store whose index was lost gets it back: the command counts the records it found
    and those it added, lists them again, and a second run adds nothing."""
    prefix = unique_prefix()
    base = ("--url", redis_url, "--prefix", prefix)
    for n in range(3):
        assert cli(*base, "set", f"agent:{n}", '{"n": 1}', cwd=tmp_path).returncode == 0
    with sync_redis.Redis.from_url(redis_url) as admin:  # what a restore without it leaves
        admin.delete(KEY_INDEX_NAMESPACE + prefix)
    first = cli(*base, "reindex", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    said = f"reindexed prefix {prefix!r}: 3 records found, 3 of them added to the key index\n"
    assert first.stdout == said
    assert first.stderr == ""
    listed = cli(*base, "--json", "keys", "agent:*", cwd=tmp_path)
    assert json.loads(listed.stdout) == ["agent:0", "agent:1", "agent:2"]
    again = cli(*base, "--json", "reindex", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"reindexed": True, "keys": 3, "added": 0}


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
def test_reindex_on_a_store_without_a_key_index_says_so(tmp_path: Path, scheme: str) -> None:
    """SQLite and file stores list from their records: reindex says there is nothing to do,
    exits 0 and changes nothing (a deploy step may run it on any store)."""
    url = f"sqlite://{tmp_path / 's.db'}" if scheme == "sqlite" else f"file://{tmp_path / 'f'}"
    assert cli("--url", url, "set", "k", "1", cwd=tmp_path).returncode == 0
    plain = cli("--url", url, "reindex", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith(f"nothing to reindex: a {scheme}:// store lists its keys")
    shown = cli("--url", url, "--json", "reindex", cwd=tmp_path)
    assert json.loads(shown.stdout) == {"reindexed": False, "backend": scheme}
    assert cli("--url", url, "keys", cwd=tmp_path).stdout == "k\n"


def test_reindex_refuses_a_missing_store(tmp_path: Path) -> None:
    """On a store that does not exist, reindex exits 1 with one line and creates nothing."""
    result = cli("--url", "sqlite://.state/nope.db", "reindex", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("agenticstate: no store at sqlite://.state/nope.db ")
    assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
