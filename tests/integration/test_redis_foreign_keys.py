"""Another application's keys under a Redis store's prefix (a shared server, the empty prefix).

For every kind of Redis value another application may keep (a string that is not a record, a
list, a hash, a set, a sorted set, a stream) and every operation that meets the key: reading it
raises `ForeignRecordError` and writing it raises the same and changes nothing; listings that
read headers only (`stat_many`, `value_sizes`, `usage`, the inspector's key list) give it as
missing, so one foreign key never hides the store's own; the inspector answers 422 for its
value and history, never 500.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis as sync_redis

from agenticstate import ForeignRecordError, RedisBackend, StateConfig, StateManager
from agenticstate.backends import Put
from agenticstate.ui import create_app
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.redis

FOREIGN: dict[str, Callable[[sync_redis.Redis, str], Any]] = {
    "string": lambda r, name: r.set(name, b"plain text of another app"),
    "short-string": lambda r, name: r.set(name, b"+1"),
    "list": lambda r, name: r.rpush(name, b"a", b"b"),
    "hash": lambda r, name: r.hset(name, mapping={"f": "v"}),
    "set": lambda r, name: r.sadd(name, b"m"),
    "zset": lambda r, name: r.zadd(name, {"m": 1.0}),
    "stream": lambda r, name: r.xadd(name, {"f": "v"}),
}


def _dump(r: sync_redis.Redis, name: str) -> object:
    kind = r.type(name)
    return kind, r.dump(name)


@pytest.mark.parametrize("kind", sorted(FOREIGN))
async def test_a_foreign_key_is_refused_typed_and_hides_nothing(redis_url: str, kind: str) -> None:
    """Reads and writes of the foreign key raise ForeignRecordError and change nothing; the
    listings and usage skip it; the inspector lists the store's keys and answers 422 for it."""
    prefix = unique_prefix()
    admin = sync_redis.Redis.from_url(redis_url)
    try:
        async with StateManager(
            StateConfig(history={"agent:*": 3}),
            backend=RedisBackend(url=redis_url, key_prefix=prefix),
        ) as state:
            for n in range(3):
                await state.save(f"agent:{n}", {"n": n})
            name = f"{prefix}agent:foreign"
            FOREIGN[kind](admin, name)
            before = _dump(admin, name)
            backend = state.backend
            keys = ["agent:0", "agent:foreign", "agent:2"]

            stats = await backend.stat_many(keys)
            assert [s is None for s in stats] == [False, True, False]
            assert await backend.value_sizes(keys) == [None if s is None else s.size for s in stats]
            usage = await state.usage()
            assert usage.keys == 3
            for read in (
                lambda: state.get("agent:foreign"),
                lambda: state.get_entry("agent:foreign"),
                lambda: state.history("agent:foreign"),
            ):
                with pytest.raises(ForeignRecordError):
                    await read()
            for write in (
                lambda: state.save("agent:foreign", {"mine": True}),
                lambda: state.update("agent:foreign", {"mine": True}),
                lambda: state.delete("agent:foreign"),
                lambda: state.save_many({"agent:0": {"n": -1}, "agent:foreign": {"mine": True}}),
                lambda: backend.transact([], [Put("agent:0", b"x"), Put("agent:foreign", b"y")]),
            ):
                with pytest.raises(ForeignRecordError):
                    await write()
                assert _dump(admin, name) == before
                assert await state.get("agent:0") == {"n": 0}  # nothing before it was written

            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(state)),
                base_url="http://127.0.0.1:8765",
            ) as client:
                listed = await client.get("/api/keys", params={"pattern": "agent:*"})
                assert listed.status_code == 200, listed.text
                assert [k["key"] for k in listed.json()["keys"]] == [
                    "agent:0",
                    "agent:1",
                    "agent:2",
                ]
                for path in ("/api/value", "/api/history"):
                    answer = await client.get(path, params={"key": "agent:foreign"})
                    assert answer.status_code == 422, (path, answer.status_code, answer.text)
                    assert "ForeignRecordError" in answer.text
            assert _dump(admin, name) == before
    finally:
        admin.close()
