"""Per-key history on Redis, a single server and a 3-primary cluster (issue #23, point 3).

A key with a history rule has a list of its versions (`_redis_history`), written by the same
script as the key: these tests read the versions back through the backend, and look at the
lists themselves (their slot, their expiry) through the backend's own command path.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import RedisBackend
from agenticstate.backends import Delete, Get, Put, Version
from agenticstate.backends import _redis_history as history_lists
from agenticstate.backends import _redis_wire as wire
from agenticstate.exceptions import (
    BackendError,
    ConfigurationError,
    ConflictError,
    InvalidArgumentError,
)
from tests._commandstats import count_commands
from tests._redis_server import RedisServer
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from agenticstate.backends import Entry

RULES = {"agent:*": 3, "deep:*": 50}


# ------------------------------------------------------------------ naming (no server)


def test_slot_tag_covers_every_slot_with_a_short_tag() -> None:
    for slot in range(wire.SLOTS):
        tag = history_lists.slot_tag(slot)
        assert 1 <= len(tag) <= 3
        assert tag.isalnum()
        assert wire.key_slot("{" + tag + "}anything") == slot


PREFIXES = ["", "p:", "app:t1:", "{x}:", "a{:", "a}:", "{}:"]
KEYS = ["agent:1", "agent:{team}:a", "x:{}:y", "x:{open", "x:}{y}", "{T}a", "b}c", "ü:ключ"]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("key", KEYS)
def test_a_history_list_hashes_to_its_keys_slot(prefix: str, key: str) -> None:
    listed = history_lists.history_key(prefix, key)
    name = prefix + key
    assert wire.key_slot(listed) == wire.key_slot(name)
    assert redis_key_slot(listed) == redis_key_slot(name)
    if "{" not in prefix:  # an ACL key pattern `~__agenticstate_hist__:<prefix>*` reaches it
        assert listed.startswith(history_lists.HISTORY_NAMESPACE + prefix)


def redis_key_slot(name: str) -> int:
    """redis-py's own computation of a key's slot (the client's `key_slot`)."""
    from redis.crc import key_slot

    slot: int = key_slot(name.encode())
    return slot


def test_history_list_names_never_collide() -> None:
    """Two lists share a name only when they are one Redis key's (`a` may get the tag `T`
    while `{T}a` reuses its own; a prefix may hold a brace)."""
    tag = history_lists.slot_tag(wire.key_slot("a"))
    keys = [*KEYS, "a", "{" + tag + "}a", "{" + tag + "}{" + tag + "}a", "{a}", "{a}b", "x:a"]
    prefixes = [*PREFIXES, "{" + tag + "}:", "x:"]
    owners: dict[str, str] = {}
    for prefix in prefixes:
        for key in keys:
            listed = history_lists.history_key(prefix, key)
            assert owners.setdefault(listed, prefix + key) == prefix + key


def test_history_rules_must_be_valid() -> None:
    with pytest.raises(ConfigurationError):
        RedisBackend(history={"agent:*": 0})


# ------------------------------------------------------------------ a server and a cluster


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> str:
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    address: str = request.getfixturevalue(fixture)
    return address


@pytest.fixture
async def backend(url: str) -> AsyncIterator[RedisBackend]:
    async with RedisBackend(url=url, key_prefix=unique_prefix(), history=RULES) as made:
        yield made


def versions(entries: list[Entry]) -> list[int]:
    return [entry.version for entry in entries]


async def raw(backend: RedisBackend, *args: str | int) -> Any:
    """One command on the backend's own connections (routed by its first key on a cluster)."""
    return await backend._read(*args)


async def expire_together(backend: RedisBackend, listed: str, name: str) -> None:
    """The list expires with the key: not before it, and at most the script's run time after.

    (The list's PEXPIRE runs after the key's SET PX in the same script; Redis may read its clock
    for each, so the two moments can differ by the milliseconds between them.) Redis 7 tells
    the moments themselves (PEXPIRETIME); before it, PTTL's time left, read at two moments
    (which a busy machine may set apart), is compared with as much slack either way.
    """
    try:
        key_at, list_at = await expiry(backend, "PEXPIRETIME", name, listed)
        slack = 0
    except BackendError:  # Redis 6.2: no PEXPIRETIME
        key_at, list_at = await expiry(backend, "PTTL", name, listed)
        slack = 250
    assert key_at > 0
    assert key_at - slack <= list_at <= key_at + 250


async def expiry(backend: RedisBackend, command: str, *names: str) -> list[int]:
    """`command` (PEXPIRETIME or PTTL) of each name, in one script."""
    read = "local t = {} for i, k in ipairs(KEYS) do t[i] = redis.call(ARGV[1], k) end return t"
    found: list[int] = await raw(backend, "EVAL", read, len(names), *names, command)
    return found


def list_name(backend: RedisBackend, key: str) -> str:
    return history_lists.history_key(backend.key_prefix, key)


@pytest.mark.redis
async def test_history_keeps_the_last_depth_versions_newest_first(backend: RedisBackend) -> None:
    for n in range(1, 6):
        await backend.set("agent:1", f"v{n}".encode())
    found = await backend.history("agent:1")
    assert versions(found) == [5, 4, 3]
    assert [entry.value for entry in found] == [b"v5", b"v4", b"v3"]
    assert found[0] == await backend.get("agent:1")
    assert all(entry.key == "agent:1" for entry in found)
    assert found[0].updated_at >= found[1].updated_at >= found[2].updated_at
    assert len({entry.created_at for entry in found}) == 1
    assert versions(await backend.history("agent:1", limit=2)) == [5, 4]
    assert versions(await backend.history("agent:1", limit=1)) == [5]
    assert await backend.history("agent:1", limit=0) == []
    assert await raw(backend, "LLEN", list_name(backend, "agent:1")) == 3


@pytest.mark.redis
async def test_get_version_reads_a_retained_version(backend: RedisBackend) -> None:
    for n in range(1, 6):
        await backend.set("agent:1", f"v{n}".encode())
    current = await backend.get("agent:1")
    assert await backend.get_version("agent:1", 5) == current
    four = await backend.get_version("agent:1", 4)
    assert four is not None
    assert (four.version, four.value) == (4, b"v4")
    assert four == (await backend.history("agent:1"))[1]
    assert await backend.get_version("agent:1", 2) is None  # trimmed
    assert await backend.get_version("agent:1", 6) is None  # not written yet
    assert await backend.get_version("missing:1", 1) is None
    assert await backend.get_version("agent:2", 1) is None
    with pytest.raises(InvalidArgumentError):
        await backend.get_version("agent:1", 0)


@pytest.mark.redis
async def test_a_key_no_rule_names_has_only_its_current_version(backend: RedisBackend) -> None:
    await backend.set("other:1", b"a")
    await backend.set("other:1", b"b")
    assert versions(await backend.history("other:1")) == [2]
    assert await backend.get_version("other:1", 1) is None
    assert (await backend.get_version("other:1", 2)) == await backend.get("other:1")
    assert await raw(backend, "EXISTS", list_name(backend, "other:1")) == 0
    assert await backend.history("agent:missing") == []
    assert await backend.history("other:missing") == []


@pytest.mark.redis
async def test_a_delete_ends_the_history_and_a_new_life_starts_fresh(
    backend: RedisBackend,
) -> None:
    for n in range(3):
        await backend.set("agent:1", bytes([n]))
    await backend.delete("agent:1")
    assert await backend.history("agent:1") == []
    assert await raw(backend, "EXISTS", list_name(backend, "agent:1")) == 0
    await backend.set("agent:1", b"again")
    found = await backend.history("agent:1")
    assert versions(found) == [1]
    assert found[0].value == b"again"


@pytest.mark.redis
async def test_a_conflicting_write_keeps_nothing(backend: RedisBackend) -> None:
    await backend.set("agent:1", b"a")
    with pytest.raises(ConflictError):
        await backend.set("agent:1", b"b", expected_version=5)
    with pytest.raises(ConflictError):
        await backend.delete("agent:1", expected_version=5)
    assert versions(await backend.history("agent:1")) == [1]
    await backend.set("agent:1", b"b", expected_version=1)
    assert versions(await backend.history("agent:1")) == [2, 1]


@pytest.mark.redis
async def test_update_keeps_history(backend: RedisBackend) -> None:
    for _ in range(4):
        await backend.update("agent:n", lambda entry: b"%d" % (entry.version if entry else 0))
    assert [entry.value for entry in await backend.history("agent:n")] == [b"3", b"2", b"1"]


@pytest.mark.redis
async def test_the_history_list_expires_with_the_key(backend: RedisBackend) -> None:
    listed = list_name(backend, "agent:1")
    name = backend.key_prefix + "agent:1"
    await backend.set("agent:1", b"a", ttl=timedelta(hours=1))
    await backend.set("agent:1", b"b", ttl=timedelta(hours=2))
    await expire_together(backend, listed, name)
    found = await backend.history("agent:1")
    assert found[1].expires_at is not None  # each version as it was written
    assert found[0].expires_at is not None
    assert found[0].expires_at - found[1].expires_at >= timedelta(minutes=59)
    await backend.set("agent:1", b"c")  # no TTL: the key and its list persist
    assert await expiry(backend, "PTTL", name, listed) == [-1, -1]
    await backend.set("agent:1", b"d", ttl=timedelta(minutes=5))
    await expire_together(backend, listed, name)
    assert versions(await backend.history("agent:1")) == [4, 3, 2]


@pytest.mark.redis
async def test_a_new_life_after_expiry_starts_a_fresh_history(backend: RedisBackend) -> None:
    """An expired key (here: its record and list removed as expiry removes them) restarts at 1."""
    for n in range(3):
        await backend.set("agent:1", bytes([n]), ttl=timedelta(minutes=1))
    # What expiry does, at once: both go (they share the moment).
    await backend._execute("DEL", backend.key_prefix + "agent:1")
    assert await backend.history("agent:1") == []
    await backend.set("agent:1", b"new")
    assert versions(await backend.history("agent:1")) == [1]


@pytest.mark.redis
async def test_a_list_left_by_a_writer_without_rules_shows_no_other_life(url: str) -> None:
    """A writer without the rules deletes and rewrites: the stale list never shows through."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix, history=RULES) as keeper,
        RedisBackend(url=url, key_prefix=prefix) as plain,
    ):
        for n in range(3):
            await keeper.set("agent:1", bytes([n]))
        await plain.delete("agent:1")  # the list stays: this writer keeps no history
        assert await keeper.history("agent:1") == []
        await plain.set("agent:1", b"x")
        await plain.set("agent:1", b"y")
        await keeper.set("agent:1", b"z")  # version 3 of a new life
        found = await keeper.history("agent:1")
        assert versions(found) == [3]
        assert found[0].value == b"z"
        assert await keeper.get_version("agent:1", 2) is None
        assert await keeper.get_version("agent:1", 1) is None


@pytest.mark.redis
async def test_set_many_keeps_history_of_the_keys_rules_name(backend: RedisBackend) -> None:
    items = [("agent:1", b"a1"), ("other:1", b"o1"), ("agent:2", b"b1"), ("deep:1", b"d1")]
    await backend.set_many(items)
    await backend.set_many([(key, value + b"+") for key, value in items])
    # One key twice in one call: each write is kept.
    await backend.set_many([("agent:1", b"a3"), ("other:1", b"o3"), ("agent:1", b"a4")])
    assert [entry.value for entry in await backend.history("agent:1")] == [b"a4", b"a3", b"a1+"]
    assert [entry.value for entry in await backend.history("agent:2")] == [b"b1+", b"b1"]
    assert [entry.value for entry in await backend.history("deep:1")] == [b"d1+", b"d1"]
    assert versions(await backend.history("other:1")) == [3]
    await backend.set_many([("deep:1", b"t")], ttl=timedelta(minutes=3))
    listed, name = list_name(backend, "deep:1"), backend.key_prefix + "deep:1"
    await expire_together(backend, listed, name)


@pytest.mark.redis
async def test_set_many_over_many_keys_and_slots(backend: RedisBackend) -> None:
    """600 keys (more than one script's chunk), most in slots of their own on a cluster."""
    keys = [f"agent:{n}" if n % 3 else f"plain:{n}" for n in range(600)]
    for round_ in range(4):
        await backend.set_many([(key, f"{key}/{round_}".encode()) for key in keys])
    for key in keys[::7]:
        found = await backend.history(key)
        if key.startswith("agent:"):
            assert [entry.value for entry in found] == [f"{key}/{r}".encode() for r in (3, 2, 1)]
        else:
            assert versions(found) == [4]


@pytest.mark.redis
async def test_keys_without_hash_tags_across_many_slots(backend: RedisBackend) -> None:
    keys = [f"deep:{n}" for n in range(300)]
    slots = {wire.key_slot(backend.key_prefix + key) for key in keys}
    if backend.is_cluster:
        assert len(slots) > 250
    for n in range(3):
        for key in keys:
            await backend.set(key, f"{key}:{n}".encode())
    for key in keys:
        found = await backend.history(key)
        assert [entry.value for entry in found] == [f"{key}:{n}".encode() for n in (2, 1, 0)]
    if backend.is_cluster:  # the server agrees that each list lives in its key's slot
        for key in keys[:20]:
            name = backend.key_prefix + key
            assert await raw(backend, "CLUSTER", "KEYSLOT", list_name(backend, key)) == await raw(
                backend, "CLUSTER", "KEYSLOT", name
            )


@pytest.mark.redis
async def test_keys_with_hash_tags(backend: RedisBackend) -> None:
    keys = ["agent:{team1}:a", "agent:{team1}:b", "agent:{team2}:a", "agent:{}:x", "agent:{x"]
    for n in range(4):
        await backend.set_many([(key, b"%d" % n) for key in keys])
    for key in keys:
        assert [entry.value for entry in await backend.history(key)] == [b"3", b"2", b"1"]
        assert wire.key_slot(list_name(backend, key)) == wire.key_slot(backend.key_prefix + key)


@pytest.mark.redis
async def test_transact_puts_and_deletes_keep_history(backend: RedisBackend) -> None:
    a, b, plain = "agent:{t}:a", "agent:{t}:b", "plain:{t}"
    await backend.set(a, b"a1")
    result = await backend.transact(
        [Version(a, 1)], [Put(a, b"a2"), Put(b, b"b1"), Put(plain, b"p1"), Put(a, b"a3")]
    )
    assert result.succeeded
    assert [entry.value for entry in await backend.history(a)] == [b"a3", b"a2", b"a1"]
    assert [entry.value for entry in await backend.history(b)] == [b"b1"]
    assert versions(await backend.history(plain)) == [1]
    result = await backend.transact(
        [Version(a, 3)],
        [Put(b, b"b2", ttl=timedelta(minutes=10)), Get(b), Delete(a)],
    )
    assert result.succeeded
    assert await backend.history(a) == []
    assert await raw(backend, "EXISTS", list_name(backend, a)) == 0
    assert [entry.value for entry in await backend.history(b)] == [b"b2", b"b1"]
    assert result.results[1] == (await backend.history(b))[0]
    listed, name = list_name(backend, b), backend.key_prefix + b
    await expire_together(backend, listed, name)
    # The else branch keeps history too; a delete of a missing key drops nothing.
    result = await backend.transact([Version(a, 7)], [], [Put(a, b"new"), Delete("agent:{t}:z")])
    assert not result.succeeded
    assert versions(await backend.history(a)) == [1]
    result = await backend.transact([], [Put(a, b"again"), Delete(a), Put(a, b"third")])
    assert [entry.value for entry in await backend.history(a)] == [b"third"]


@pytest.mark.redis
async def test_history_rules_set_later_apply_from_the_next_write(url: str) -> None:
    async with RedisBackend(url=url, key_prefix=unique_prefix()) as backend:
        await backend.set("agent:1", b"a")
        backend.keep_history({"agent:*": 5})
        assert versions(await backend.history("agent:1")) == [1]
        await backend.set("agent:1", b"b")
        await backend.set("agent:1", b"c")
        assert versions(await backend.history("agent:1")) == [3, 2]
        backend.keep_history({})
        assert versions(await backend.history("agent:1")) == [3]


@pytest.mark.redis
async def test_a_save_with_a_history_rule_is_still_one_command(url: str) -> None:
    async with RedisBackend(url=url, key_prefix=unique_prefix(), history=RULES) as backend:
        await backend.set("agent:1", b"a")
        await backend.set("other:1", b"a")
        counts = await count_commands(url, lambda: backend.set("agent:1", b"b"))
        assert counts.sent == {"evalsha": 1}, counts.describe()
        assert counts.calls["lpush"] == 1
        plain = await count_commands(url, lambda: backend.set("other:1", b"b"))
        assert plain.sent == {"evalsha": 1}, plain.describe()
        assert "lpush" not in plain.calls
        assert "ltrim" not in plain.calls
        reads = await count_commands(url, lambda: backend.history("agent:1"))
        assert reads.sent == {"evalsha": 1}, reads.describe()


@pytest.mark.redis
async def test_history_lists_are_never_listed_as_keys(url: str) -> None:
    """Under the empty prefix a scan could see the lists' names: it never lists them."""
    marker = unique_prefix().rstrip(":")
    async with RedisBackend(url=url, history={f"{marker}:*": 4}) as backend:
        for n in range(3):
            await backend.set_many([(f"{marker}:a", b"%d" % n), (f"{marker}:{{t}}b", b"x")])
        assert sorted([key async for key in backend.scan(f"*{marker}*")]) == [
            f"{marker}:a",
            f"{marker}:{{t}}b",
        ]
        assert versions(await backend.history(f"{marker}:a")) == [3, 2, 1]
        for key in (f"{marker}:a", f"{marker}:{{t}}b"):
            await backend.delete(key)
        assert [key async for key in backend.scan(f"*{marker}*")] == []


@pytest.mark.redis
async def test_concurrent_writers_leave_one_unbroken_history(url: str) -> None:
    """Two clients updating one key at once: its history is every version, in order, once."""
    prefix = unique_prefix()
    async with (
        RedisBackend(url=url, key_prefix=prefix, history=RULES) as one,
        RedisBackend(url=url, key_prefix=prefix, history=RULES) as two,
    ):

        async def bump(backend: RedisBackend, times: int) -> None:
            for _ in range(times):
                await backend.update(
                    "deep:n", lambda entry: b"%d" % ((int(entry.value) if entry else 0) + 1)
                )

        await asyncio.gather(bump(one, 30), bump(two, 30), bump(one, 10))
        found = await one.history("deep:n")
        assert versions(found) == list(range(70, 20, -1))  # the last 50 of 70
        assert [int(entry.value) for entry in found] == versions(found)
        assert found == await two.history("deep:n")


@pytest.mark.redis
async def test_a_transaction_on_a_key_without_a_hash_tag(backend: RedisBackend) -> None:
    """On a cluster the key's list shares its slot, so a one-key transaction still runs."""
    for n in range(4):
        result = await backend.transact([Version("agent:solo", n)], [Put("agent:solo", b"%d" % n)])
        assert result.succeeded
    assert [entry.value for entry in await backend.history("agent:solo")] == [b"3", b"2", b"1"]
    assert (await backend.transact([], [Delete("agent:solo")])).succeeded
    assert await backend.history("agent:solo") == []


@pytest.mark.redis
async def test_the_read_script_is_loaded_again_after_a_script_flush(redis_url: str) -> None:
    async with RedisBackend(url=redis_url, key_prefix=unique_prefix(), history=RULES) as backend:
        await backend.set("agent:1", b"a")
        await backend.set("agent:1", b"b")
        assert versions(await backend.history("agent:1")) == [2, 1]
        await backend._execute("SCRIPT", "FLUSH")
        assert versions(await backend.history("agent:1")) == [2, 1]
        await backend._execute("SCRIPT", "FLUSH")
        entry = await backend.get_version("agent:1", 1)
        assert entry is not None
        assert entry.value == b"a"
        await backend._execute("SCRIPT", "FLUSH")
        await backend.set("agent:1", b"c")
        assert versions(await backend.history("agent:1")) == [3, 2, 1]


@pytest.mark.redis
async def test_an_acl_user_reaches_its_prefixes_history_lists(tmp_path: Path) -> None:
    """`~__agenticstate_hist__:myapp:*` grants an ACL user its own prefix's lists (as
    `~__agenticstate_idx__:myapp:*` grants its indexes), and no other prefix's."""
    from redis import Redis
    from redis.exceptions import NoPermissionError

    server = RedisServer(tmp_path / "acl")
    server.start()
    admin = Redis(unix_socket_path=str(server.socket_path))
    try:
        recipe = (
            "app on >secret ~myapp:* ~__agenticstate_hist__:myapp:* "
            "~__agenticstate_rev__:myapp:* ~__agenticstate_keys__:myapp:* allchannels "
            "+@read +@write +@scripting +@pubsub +ping +hello +time"
        )
        admin.execute_command("ACL", "SETUSER", *recipe.split())  # type: ignore[no-untyped-call]
        url = f"redis://app:secret@127.0.0.1:{server.port}/0"
        # feed=None: the feed's streams (`__agenticstate_feed__:{tag}myapp:`) put the tag
        # before the prefix, so no key pattern per prefix reaches them.
        async with RedisBackend(url=url, key_prefix="myapp:", history=RULES, feed=None) as backend:
            for n in range(4):
                await backend.set("agent:1", b"%d" % n)
            await backend.set_many([("agent:2", b"a"), ("agent:2", b"b")])
            assert versions(await backend.history("agent:1")) == [4, 3, 2]
            assert versions(await backend.history("agent:2")) == [2, 1]
            await backend.delete("agent:2")
        assert admin.exists(history_lists.history_key("myapp:", "agent:1")) == 1
        listed = history_lists.history_key("otherapp:", "agent:1")
        user = Redis(host="127.0.0.1", port=server.port, username="app", password="secret")  # noqa: S106
        with pytest.raises(NoPermissionError):
            user.rpush(listed, "x")
        user.close()
    finally:
        admin.close()
        server.stop()
