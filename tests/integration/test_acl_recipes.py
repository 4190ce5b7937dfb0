"""The ACL recipes of docs/security.md, held to what the page claims, on real servers.

The recipes are read from the page itself (the `ACL SETUSER` line after each `acl-recipe`
marker), so the page and the tests cannot drift. For each recipe:

- it covers every Redis namespace the backend uses (`KEY_NAMESPACES`, `CHANNEL_NAMESPACES`) for
  its own prefix and none for another, and it grants every command the backend and its Lua
  scripts name, and no other (the code is scanned: a command added later fails here);
- a user made from it, on a private redis-server and on the session's 3-primary cluster, runs
  every operation of the library (`_acl_workload`) with nothing refused in the server's ACL log;
- `ACL DRYRUN` (Redis 7+) and running them as the user show that the dangerous and keyless
  commands, another prefix's keys and (for the tenant recipe) another prefix's channels are
  refused, and that what the page says a user *can* do, it can.
"""

from __future__ import annotations

import ast
import re
import uuid
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis as sync_redis
from redis.exceptions import ResponseError

from agenticstate import FeedRetention, RedisBackend, StateConfig, StateManager
from agenticstate._glob import compile_glob
from agenticstate._keys import escape_glob
from agenticstate.backends._redis_feed import FEED_NAMESPACE, REGISTRY_NAMESPACE, ancestors
from agenticstate.backends._redis_keyindex import KEY_INDEX_NAMESPACE
from agenticstate.backends.redis import CHANNEL_NAMESPACES, KEY_NAMESPACES
from tests._redis_server import RedisServer
from tests.integration._acl_workload import workload

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "security.md"
BACKEND_MODULES = sorted((ROOT / "agenticstate" / "backends").glob("*redis*.py"))
USER, PASSWORD, PREFIX = "app", "secret", "myapp:"  # as the page writes them

# Commands the recipes grant that the backend's code does not name: what redis-py sends on its
# own (HELLO, SELECT for a database other than 0; on a cluster COMMAND, to learn key positions,
# and ASKING, during a slot migration).
CLIENT_COMMANDS = {"hello", "select", "command", "asking"}


def _recipes() -> dict[str, list[str]]:
    """`{name: the ACL SETUSER arguments}` of every recipe on the page."""
    found = re.findall(
        r"<!-- acl-recipe: (\S+) -->\n```text\n(ACL SETUSER [^\n]+)\n```", PAGE.read_text()
    )
    return {name: line.split()[2:] for name, line in found}


RECIPES = _recipes()


def _for(recipe: str, user: str, prefix: str) -> list[str]:
    """The recipe's arguments for another user name and key prefix (the page's, replaced)."""
    arguments = RECIPES[recipe]
    assert arguments[0] == USER
    return [user] + [argument.replace(PREFIX, prefix) for argument in arguments[1:]]


def _granted(arguments: list[str]) -> set[str]:
    return {argument[1:].lower() for argument in arguments if argument.startswith("+")}


def test_the_page_has_both_recipes() -> None:
    """The security page shows a tenant recipe and an application recipe, for the user, the
    password and the prefix the tests replace."""
    assert sorted(RECIPES) == ["application", "tenant"]
    for arguments in RECIPES.values():
        assert arguments[:4] == [USER, "reset", "on", f">{PASSWORD}"]
        assert not any(argument.startswith("+@") for argument in arguments), "no categories"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_covers_every_namespace_of_its_prefix_and_no_other(recipe: str) -> None:
    """Every key namespace the backend uses (`KEY_NAMESPACES`) has a key rule for the prefix;
    no key rule reaches another prefix's; the channel rules are the prefix's (tenant) or all
    (application)."""
    arguments = RECIPES[recipe]
    rules = [compile_glob(argument[1:]) for argument in arguments if argument.startswith("~")]
    for namespace in KEY_NAMESPACES:
        mine, other = f"{namespace}{PREFIX}probe", f"{namespace}otherapp:probe"
        assert any(rule.match(mine) for rule in rules), f"{recipe}: no rule for {mine!r}"
        assert not any(rule.match(other) for rule in rules), f"{recipe}: a rule reaches {other!r}"
    channels = [argument for argument in arguments if argument.startswith("&")]
    if recipe == "tenant":
        assert "resetchannels" in arguments
        # Redis compares a PSUBSCRIBE pattern with the rule literally: the rule must be the
        # pattern the backend subscribes with `subscribe_whole_prefix`.
        assert channels == [f"&{escape_glob(ns + PREFIX)}*" for ns in CHANNEL_NAMESPACES]
    else:
        assert "allchannels" in arguments
        assert channels == []


def _named_commands() -> set[str]:
    """The commands the Redis backend's modules send: the first word of every command tuple or
    call argument list in Python (`("SCAN", cursor, ...)`, `_read("GET", name)`), and every
    quoted upper-case word in a Lua script (`redis.call('GET', ...)`, `zmany('ZADD', ...)`)."""
    words: set[str] = set()
    for path in BACKEND_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            first: ast.expr | None = None
            if isinstance(node, ast.Tuple) and node.elts:
                first = node.elts[0]
            elif isinstance(node, ast.Call) and node.args:
                first = node.args[0]
            first_text = first.value if isinstance(first, ast.Constant) else None
            if isinstance(first_text, str) and re.fullmatch(r"[A-Z]{3,}", first_text):
                words.add(first_text)
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and "redis.call(" in text:
                words.update(re.findall(r"'([A-Z]{3,})'", text))
    return words


@pytest.mark.redis
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_grants_the_commands_the_backend_sends_and_no_other(
    recipe: str, server: RedisServer
) -> None:
    """Every Redis command the backend's code names (its own calls and its scripts') is granted,
    with `SCRIPT` and `CLUSTER` only for the subcommands it uses; every granted command is one
    the code names or redis-py sends by itself."""
    with sync_redis.Redis(unix_socket_path=str(server.socket_path)) as admin:
        table: Any = admin.execute_command("COMMAND")  # redis-py: {name: details}
    commands = {_text(name).lower() for name in table}
    named = {word.lower() for word in _named_commands()} & commands
    assert {"get", "evalsha", "xadd", "psubscribe"} <= named  # the scan sees the code
    granted = _granted(RECIPES[recipe])
    missing = {
        c for c in named if c not in granted and not any(g.startswith(c + "|") for g in granted)
    }
    assert missing == set(), f"{recipe} misses {sorted(missing)}"
    extra = {g for g in granted if g.partition("|")[0] not in named | CLIENT_COMMANDS}
    assert extra == set(), f"{recipe} grants {sorted(extra)}, which nothing sends"
    assert {g for g in granted if "|" in g} == {"script|load", "cluster|slots"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- real users -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server: the tests run dangerous commands on it (as a refused user)."""
    made = RedisServer(tmp_path_factory.mktemp("acl"))
    made.start()
    try:
        yield made
    finally:
        made.stop()


def _admins(url: str, server: RedisServer) -> list[sync_redis.Redis]:
    """An unrestricted client to the private server, or to every node of the cluster."""
    if url.startswith("redis+cluster://"):
        nodes = urlsplit(url).netloc.rpartition("@")[2].split(",")
        return [
            sync_redis.Redis(host=host, port=int(port), socket_timeout=10)
            for host, _, port in (node.rpartition(":") for node in nodes)
        ]
    return [sync_redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=10)]


def _user_url(url: str, server: RedisServer, user: str) -> str:
    if url.startswith("redis+cluster://"):
        return url.replace("redis+cluster://", f"redis+cluster://{user}:{PASSWORD}@", 1)
    # Database 1: redis-py sends SELECT on every connection (a recipe without it fails).
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/1"


@pytest.fixture(params=["redis", pytest.param("redis-cluster", marks=pytest.mark.slow)])
def where(request: pytest.FixtureRequest, server: RedisServer) -> str:
    """The private server's URL, or the session's cluster's."""
    if request.param == "redis":
        return f"redis://127.0.0.1:{server.port}/0"
    url: str = request.getfixturevalue("redis_cluster_url")
    return url


def _denials(admin: sync_redis.Redis, user: str, prefix: str) -> list[str]:
    """The ACL log's entries for `user`, less redis-py's best-effort `CLIENT SETINFO` and the
    documented probes of the prefixes its prefix is nested in (the empty one here): reading
    that prefix's feed (on a cluster, each slot's stream of it) and key index, and joining their
    registries, each refused once (then the backend knows), where the log counts them."""
    entries: list[dict[str, Any]] = admin.acl_log()
    probes = {
        namespace + outer
        for namespace in (FEED_NAMESPACE, REGISTRY_NAMESPACE, KEY_INDEX_NAMESPACE)
        for outer in ancestors(prefix)
    }
    # The key index's: reading an outer prefix's index, joining its registry of nested stores.
    probes |= {KEY_INDEX_NAMESPACE + outer + "#nested" for outer in ancestors(prefix)}
    slot_tagged = re.compile(r"\{[0-9A-Za-z]+\}\Z")  # a cluster's stream of one slot
    found = []
    for entry in entries:
        if _text(entry["username"]) != user or _text(entry["object"]) == "client|setinfo":
            continue
        named = _text(entry["object"])
        if int(entry["count"]) == 1 and (named in probes or slot_tagged.sub("", named) in probes):
            continue
        found.append(
            f"{_text(entry['reason'])} {_text(entry['object'])} ({_text(entry['context'])})"
            f" x{entry['count']}"
        )
    return found


@pytest.mark.redis
@pytest.mark.parametrize("recipe", sorted(RECIPES))
async def test_a_recipe_user_runs_every_operation_of_the_library(
    recipe: str, where: str, server: RedisServer
) -> None:
    """A user made from the recipe runs every operation of the library on its prefix (the
    core, subscriptions, the feed's replay, history, commits, every manager, LangGraph, the
    inspector's queries), in database 1 on a plain server, and the server refused none of its
    commands."""
    user, prefix = f"app{uuid.uuid4().hex[:8]}", f"acl{uuid.uuid4().hex[:8]}:"
    admins = _admins(where, server)
    try:
        for admin in admins:
            admin.execute_command("ACL", "SETUSER", *_for(recipe, user, prefix))  # type: ignore[no-untyped-call]
            admin.acl_log_reset()
        backend = RedisBackend(
            url=_user_url(where, server, user),
            key_prefix=prefix,
            feed=FeedRetention(max_changes=50),  # trimmed as it goes: XTRIM is sent
            subscribe_whole_prefix=recipe == "tenant",
        )
        state = StateManager(StateConfig(history={"agent:*": 5}), backend=backend)
        with anyio.fail_after(240):
            async with state:
                await workload(state)
        assert [d for admin in admins for d in _denials(admin, user, prefix)] == []
    finally:
        for admin in admins:
            with suppress(Exception):
                admin.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
            admin.close()


# -- what a user can and cannot do ------------------------------------------------------------

OTHER = "otherapp:"
SCRIPT = "#!lua name=acltest\nredis.register_function('f', function() return 1 end)"
# Refused to every recipe's user: the table's "no" rows. Keyed ones use the user's own prefix
# where that makes the point (a key rule does not save them).
REFUSED: list[tuple[str, ...]] = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("SWAPDB", "0", "1"),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("FUNCTION", "FLUSH"),
    ("FUNCTION", "DELETE", "acltest"),
    ("FUNCTION", "LOAD", SCRIPT),
    ("FCALL", "f", "0"),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("CONFIG", "GET", "*"),
    ("DEBUG", "SLEEP", "0"),
    ("SHUTDOWN", "NOSAVE"),
    ("MONITOR",),
    ("CLIENT", "LIST"),
    ("CLIENT", "KILL", "ID", "1"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "intruder", "on", "+@all"),
    ("INFO",),
    ("KEYS", "*"),
    ("MIGRATE", "127.0.0.1", "1", f"{PREFIX}k", "0", "100"),
    ("MOVE", f"{PREFIX}k", "1"),
    ("COPY", f"{PREFIX}k", f"{PREFIX}copy"),
    ("RENAME", f"{PREFIX}k", f"{PREFIX}renamed"),
    ("DUMP", f"{PREFIX}k"),
    ("RESTORE", f"{PREFIX}restored", "0", "x"),
    ("OBJECT", "ENCODING", f"{PREFIX}k"),
    ("SAVE",),
    ("BGSAVE",),
    ("BGREWRITEAOF",),
    ("REPLICAOF", "NO", "ONE"),
    ("MODULE", "LIST"),
    ("PUBSUB", "CHANNELS"),
    ("RANDOMKEY",),
    ("DBSIZE",),
    ("SUBSCRIBE", f"__agenticstate__:{PREFIX}k"),
    # Another prefix's keys, directly and through a script.
    ("GET", f"{OTHER}k"),
    ("SET", f"{OTHER}k", "stolen"),
    ("DEL", f"{OTHER}k"),
    ("MGET", f"{PREFIX}k", f"{OTHER}k"),
    ("EVAL", "return redis.call('GET', KEYS[1])", "1", f"{OTHER}k"),
    ("EVAL", f"return redis.call('GET', '{OTHER}k')", "0"),
    ("XRANGE", f"__agenticstate_feed__:{OTHER}", "-", "+"),
    ("GET", f"__agenticstate_feedseq__:{OTHER}"),
    ("ZRANGE", f"__agenticstate_idx__:{OTHER}queue", "0", "-1"),
    ("LRANGE", f"__agenticstate_hist__:{OTHER}k", "0", "-1"),
]
# Refused to the tenant only: another prefix's channels.
TENANT_REFUSED: list[tuple[str, ...]] = [
    ("PUBLISH", f"__agenticstate__:{OTHER}k", "forged"),
    ("PSUBSCRIBE", f"__agenticstate__:{OTHER}*"),
    ("PSUBSCRIBE", "__agenticstate__:*"),
    ("EVAL", f"return redis.call('PUBLISH', '__agenticstate__:{OTHER}k', 'x')", "0"),
]
# Allowed to every recipe's user: the table's "yes" rows that are not the library's own use.
ALLOWED: list[tuple[str, ...]] = [
    ("SCAN", "0", "MATCH", f"{OTHER}*", "COUNT", "1000"),
    ("PUBLISH", f"__agenticstate__:{PREFIX}k", "own"),
    ("EVAL", "return 1", "0"),
]


def _dry_run(admin: sync_redis.Redis, user: str, command: tuple[str, ...]) -> str | None:
    """`ACL DRYRUN`'s verdict ("OK" or why not), or None on a server without it (Redis 6.2)."""
    try:
        reply = admin.execute_command("ACL", "DRYRUN", user, *command)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        if "dryrun" in str(exc).lower():
            return None
        return str(exc)  # a command this server does not know
    return _text(reply)


def _run_as(server: RedisServer, user: str, command: tuple[str, ...]) -> str:
    """Run `command` as `user` on a fresh connection: "OK", or the refusal's text."""
    client = sync_redis.Redis(
        host="127.0.0.1", port=server.port, username=user, password=PASSWORD, socket_timeout=10
    )
    try:
        client.execute_command(*command)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        return str(exc)
    finally:
        client.close()
    return "OK"


_REFUSALS = (
    "noperm",  # run: NOPERM ...
    "no permissions",  # ACL DRYRUN's answer
    "can't access",  # a key refused inside a script
    "can't publish",  # a channel refused inside a script
    "unknown command",  # a command this server does not have (FUNCTION before Redis 7)
    "not found",  # the same, as ACL DRYRUN says it
    "not allowed",  # DEBUG, kept from every connection unless enable-debug-command allows it
)


def _refused(verdict: str) -> bool:
    lowered = verdict.lower()
    return any(word in lowered for word in _REFUSALS)


@pytest.mark.redis
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_user_is_refused_what_the_page_says_and_allowed_the_rest(
    recipe: str, server: RedisServer
) -> None:
    """Dangerous and keyless commands, another prefix's keys (directly and in a script) and,
    for the tenant, another prefix's channels are refused, by `ACL DRYRUN` and when run; a
    `SCAN` still lists another prefix's key names, and a script of the user's own runs."""
    user = f"app{uuid.uuid4().hex[:8]}"
    with sync_redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=10) as admin:
        admin.execute_command("ACL", "SETUSER", *_for(recipe, user, PREFIX))
        admin.set(f"{OTHER}k", "theirs")
        admin.set(f"{PREFIX}k", "mine")
        try:
            refused = REFUSED + (TENANT_REFUSED if recipe == "tenant" else [])
            allowed = ALLOWED + ([] if recipe == "tenant" else TENANT_REFUSED)
            wrong: list[str] = []
            for command in refused:
                # A script with no declared keys passes DRYRUN: its commands are checked as
                # they run.
                inner = command[0] == "EVAL" and command[2] == "0"
                verdict = None if inner else _dry_run(admin, user, command)
                if verdict is not None and not _refused(verdict):
                    wrong.append(f"DRYRUN allows {command}: {verdict}")
                    continue  # never run a dangerous command that was not refused
                ran = _run_as(server, user, command)
                if not _refused(ran):
                    wrong.append(f"ran {command}: {ran}")
            for command in allowed:
                verdict = _dry_run(admin, user, command)
                if verdict is not None and verdict != "OK":
                    wrong.append(f"DRYRUN refuses {command}: {verdict}")
                if command[0] != "PSUBSCRIBE" and _refused(_run_as(server, user, command)):
                    wrong.append(f"refused {command}")
            assert wrong == []
            # Nothing was changed by what was refused, and SCAN does see the other's key name.
            assert admin.get(f"{OTHER}k") == b"theirs"
            assert admin.get(f"{PREFIX}k") == b"mine"
            user_client = sync_redis.Redis(
                host="127.0.0.1",
                port=server.port,
                username=user,
                password=PASSWORD,
            )
            with user_client:
                _, names = user_client.scan(0, match=f"{OTHER}*", count=1000)
                assert f"{OTHER}k".encode() in names  # key names are not protected
                # The same key rules hold in another database.
                user_client.execute_command("SELECT", "1")  # type: ignore[no-untyped-call]
                assert user_client.set(f"{PREFIX}elsewhere", "x")
                user_client.delete(f"{PREFIX}elsewhere")
        finally:
            admin.execute_command("ACL", "DELUSER", user)
            admin.delete(f"{OTHER}k", f"{PREFIX}k")


def test_every_namespace_the_backend_names_is_listed() -> None:
    """Every reserved namespace the Redis backend's modules name (`__agenticstate..__:`) is in
    `KEY_NAMESPACES` or `CHANNEL_NAMESPACES`, which the recipes are checked against."""
    named: set[str] = set()
    for path in BACKEND_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and re.fullmatch(r"__agenticstate\w*:", text):
                named.add(text)
    assert "__agenticstate_feed__:" in named  # the scan sees the code
    assert named <= {*KEY_NAMESPACES, *CHANNEL_NAMESPACES}


@pytest.mark.redis
async def test_a_whole_prefix_subscription_uses_one_pattern_and_matches_locally(
    server: RedisServer,
) -> None:
    """With `subscribe_whole_prefix`, the backend holds one pattern on the server (the one a
    tenant's channel rule allows) and each subscription still gets only the keys it matches."""
    prefix = f"w{uuid.uuid4().hex[:8]}:"
    url = f"redis://127.0.0.1:{server.port}/0"
    backend = RedisBackend.from_url(f"{url}?subscribe_whole_prefix=1", key_prefix=prefix)
    assert backend.subscribe_whole_prefix
    other = RedisBackend(url=url, key_prefix=f"o{prefix}")
    async with (
        StateManager(backend=backend) as state,
        StateManager(backend=other) as elsewhere,
        state.watch("agent:*") as agents,
        state.watch("job:1") as job,
    ):
        with sync_redis.Redis(unix_socket_path=str(server.socket_path)) as admin:
            assert admin.pubsub_numpat() == 1
        await elsewhere.save("agent:1", "not mine")
        await state.save("job:2", 2)
        await state.save("agent:1", 1)
        await state.save("job:1", 1)
        await state.save("agent:2", 2)
        got_agents = [c.key for c in await _changes(agents, 2)]
        got_job = [c.key for c in await _changes(job, 1)]
    assert (got_agents, got_job) == (["agent:1", "agent:2"], ["job:1"])


async def _changes(changes: Any, count: int) -> list[Any]:
    taken: list[Any] = []
    with anyio.fail_after(20):
        async for change in changes:
            taken.append(change)
            if len(taken) == count:
                break
    return taken
