"""Subscriber processes read a writer's fast overwrites of large values, held by reference in
the feed: every change arrives with its exact old and new values (live and replayed), on Redis
and SQLite."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

import pytest

from agenticstate import StateManager
from agenticstate.backends import open_backend
from tests.helpers import LineProcess
from tests.integration._overwrite_worker import text

if TYPE_CHECKING:
    from pathlib import Path

WORKER = "tests.integration._overwrite_worker"
KEYS = 3
ROUNDS = 40  # writes per key: each overwrite displaces the value a change before it holds


def _url(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("redis_url"))


@pytest.mark.parametrize("kind", [pytest.param("redis", marks=pytest.mark.redis), "sqlite"])
async def test_subscriber_processes_get_exact_values_while_a_writer_overwrites(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """A live subscriber process and a replaying one each get every overwrite and delete of
    large values with the exact old and new value, while this process writes as fast as it can."""
    url = _url(request, tmp_path, kind)
    prefix = f"o{uuid.uuid4().hex[:8]}:"
    expected = KEYS * ROUNDS + KEYS  # the writes, then one delete per key
    async with StateManager(backend=open_backend(url, key_prefix=prefix)) as state:
        cursor = await state.feed_cursor()
        assert cursor is not None
        live = LineProcess(WORKER, url, prefix, str(expected))
        try:
            assert live.wait_until(lambda lines: "live" in lines, 60), live.close()
            for round_ in range(1, ROUNDS + 1):
                for k in range(KEYS):
                    key = f"doc:{k}"
                    await state.save(key, {"v": round_, "text": text(key, round_)})
                    if round_ == ROUNDS // 2 and k == 0:
                        replay = LineProcess(WORKER, url, prefix, str(expected), cursor)
            for k in range(KEYS):
                await state.delete(f"doc:{k}")
            try:
                for process in (live, replay):
                    assert process.wait_lines(expected + 1, 120), process.close()
            finally:
                replay.close()
        finally:
            errors = live.close()
        assert "Traceback" not in errors, errors
    for process in (live, replay):
        rows = [json.loads(line) for line in process.lines[1:]]
        assert len(rows) == expected
        versions: dict[str, list[int]] = {}
        for key, op, version, old_ok, new_ok in rows:
            versions.setdefault(key, []).append(version)
            if op == "set":
                assert new_ok is True, (key, version)
                assert old_ok is (None if version == 1 else True), (key, version)
            else:
                assert (old_ok, new_ok) == (True, None), (key, version)
        assert all(v == [*range(1, ROUNDS + 1), ROUNDS] for v in versions.values()), versions
