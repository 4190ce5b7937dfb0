"""redis-py's internals: used in one module only, and still there after an upgrade (issue #18, 5).

`agenticstate/backends/_redis_wire.py` is the only module that imports redis-py and the only one
that touches its internals (the connection class, a pub/sub object's connection, the names of
the functions that connect). If an upgrade of redis-py removes or changes one of them, a test
here fails and names it, with the installed version: then fix `_redis_wire.py` (or lower the cap
on redis in pyproject.toml).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import traceback
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from redis.asyncio.client import PubSub  # noqa: E402  # after the importorskip
from redis.asyncio.cluster import ClusterNode, RedisCluster  # noqa: E402
from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPool  # noqa: E402

from agenticstate.backends import _redis_wire as wire  # noqa: E402
from agenticstate.backends._redis_wire import _CONNECT_FRAMES, _failed_to_connect  # noqa: E402
from agenticstate.exceptions import WriteOutcomeUnknownError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agenticstate"
WIRE = PACKAGE / "backends" / "_redis_wire.py"
REDIS_MODULES = sorted((PACKAGE / "backends").glob("*redis*.py"))

# Attributes of redis-py's connection and pub/sub objects that only the wire module may use.
# The first set is distinctive anywhere in the package; the second only in the Redis modules
# (`connect` and `connection` mean other things in the file and SQLite backends).
INTERNAL_NAMES = {
    "make_connection",
    "send_packed_command",
    "read_response",
    "send_command",
    "can_read",
    "is_connected",
    "connection_pool",
    "acquire_connection",
    "get_connection_kwargs",
}
INTERNAL_NAMES_IN_REDIS_MODULES = {"connect", "connection", "disconnect"}

# What the wire module calls, with the parameters it passes: (owner, attribute, parameters).
USED: list[tuple[Any, str, tuple[str, ...]]] = [
    (ConnectionPool, "make_connection", ()),
    (AbstractConnection, "connect", ()),
    (AbstractConnection, "disconnect", ("nowait",)),
    (AbstractConnection, "can_read", ()),
    (AbstractConnection, "send_packed_command", ("command", "check_health")),
    (AbstractConnection, "read_response", ()),
    (AbstractConnection, "send_command", ()),
    (PubSub, "connect", ()),
    (PubSub, "get_message", ("timeout",)),
    (PubSub, "ping", ()),
    (PubSub, "psubscribe", ()),
    (PubSub, "aclose", ()),
    (RedisCluster, "initialize", ()),
    (RedisCluster, "get_nodes", ()),
    (RedisCluster, "get_connection_kwargs", ()),
    (ClusterNode, "__init__", ("host", "port", "max_connections")),
    (ClusterNode, "acquire_connection", ()),
]
EXCEPTIONS = (
    "AskError",
    "AuthenticationError",
    "ClusterDownError",
    "ConnectionError",
    "MasterDownError",
    "MaxConnectionsError",
    "MovedError",
    "NoScriptError",
    "RedisClusterException",
    "RedisError",
    "ResponseError",
    "TimeoutError",
    "TryAgainError",
)


def _missing(what: str) -> str:
    return _changed(f"has no {what}")


def _changed(how: str) -> str:
    return (
        f"redis-py {redis.__version__} {how}; agenticstate/backends/_redis_wire.py relies on it: "
        "adapt that module to this version, or cap redis lower in pyproject.toml"
    )


def _redis_imports(source: str) -> list[int]:
    """The lines of `source` that import redis-py outside `if TYPE_CHECKING:` blocks
    (annotations may name anything)."""
    tree = ast.parse(source)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for inner in ast.walk(node))
    lines = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if id(node) not in typing_only and any(
            name == "redis" or name.startswith("redis.") for name in names
        ):
            lines.append(node.lineno)  # type: ignore[attr-defined]
    return lines


def _internal_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Where `source` uses an attribute named in `names`: `(line, name)`."""
    return [
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in names
    ]


def _others() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path != WIRE]


def test_only_the_wire_module_imports_redis_py() -> None:
    """No module but `_redis_wire.py` imports redis-py at run time."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _others()
        for line in _redis_imports(path.read_text())
    ]
    assert offenders == []


def test_only_the_wire_module_touches_redis_py_internals() -> None:
    """The connection-level names appear in `_redis_wire.py` and nowhere else."""
    offenders = []
    for path in _others():
        names = INTERNAL_NAMES | (
            INTERNAL_NAMES_IN_REDIS_MODULES if path in REDIS_MODULES else set()
        )
        offenders += [
            f"{path.relative_to(ROOT)}:{line} uses .{name}"
            for line, name in _internal_uses(path.read_text(), names)
        ]
    assert offenders == []
    used = {
        node.attr
        for node in ast.walk(ast.parse(WIRE.read_text(), filename=str(WIRE)))
        if isinstance(node, ast.Attribute)
    }
    assert used >= INTERNAL_NAMES  # the list names what the wire module really uses


def test_the_checks_see_a_violation() -> None:
    """The walkers find a run-time import of redis-py (not one under TYPE_CHECKING) and a use
    of an internal (so `offenders == []` above means something)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import redis.asyncio\n"
        "def f(client):\n"
        "    from redis.exceptions import ResponseError\n"
        "    return client.connection_pool.make_connection().read_response()\n"
    )
    assert _redis_imports(source) == [5]
    found = {name for _, name in _internal_uses(source, INTERNAL_NAMES)}
    assert found == {"connection_pool", "make_connection", "read_response"}
    assert len(REDIS_MODULES) >= 4  # redis.py and the three _redis_* modules


@pytest.mark.parametrize(
    ("owner", "name", "parameters"), USED, ids=[f"{o.__name__}.{n}" for o, n, _ in USED]
)
def test_redis_py_has_what_the_wire_module_calls(
    owner: type, name: str, parameters: tuple[str, ...]
) -> None:
    """Each method the wire module calls exists and takes the parameters it passes."""
    member = inspect.getattr_static(owner, name, None)
    assert callable(member), _missing(f"{owner.__qualname__}.{name}()")
    signature = inspect.signature(member)
    for parameter in parameters:
        assert parameter in signature.parameters, _missing(
            f"parameter {parameter!r} of {owner.__qualname__}.{name}{signature}"
        )


def test_redis_py_has_the_attributes_the_wire_module_reads() -> None:
    """`is_connected` (a property of connections) and a pub/sub object's `connection`."""
    assert isinstance(inspect.getattr_static(AbstractConnection, "is_connected", None), property), (
        _missing("property AbstractConnection.is_connected")
    )
    pubsub = PubSub(ConnectionPool())
    assert hasattr(pubsub, "connection"), _missing("attribute PubSub.connection")


def test_redis_py_has_the_exceptions_the_mapping_names() -> None:
    """Every exception `translated` tells apart still exists, under its name."""
    for name in EXCEPTIONS:
        kind = getattr(redis.exceptions, name, None)
        assert isinstance(kind, type), _missing(f"redis.exceptions.{name}")
        assert issubclass(kind, Exception)


def test_redirect_replies_parse_into_slot_host_and_port() -> None:
    """A MOVED or ASK reply is raised as MovedError or AskError with the slot and the address
    the cluster routing follows (`Cluster.call`)."""
    for kind in (redis.exceptions.MovedError, redis.exceptions.AskError):
        error = kind("3999 127.0.0.1:6381")
        assert (error.slot_id, error.host, error.port) == (3999, "127.0.0.1", 6381), _changed(
            f"parses a redirect reply differently ({kind.__name__})"
        )
    assert issubclass(redis.exceptions.MovedError, redis.exceptions.ResponseError)
    assert issubclass(redis.exceptions.AskError, redis.exceptions.ResponseError)


def test_our_key_slot_is_redis_pys() -> None:
    """`key_slot` (CRC16 of the hash tag) agrees with redis-py's on tags, empty tags and bytes."""
    from redis.crc import key_slot

    keys = ["", "a", "agent:1", "{team}:queue", "x{}y", "{}{a}", "a{b}{c}", "{a", "caf\u00e9"]
    keys += [f"k{n}" for n in range(200)]
    for key in keys:
        assert wire.key_slot(key) == key_slot(key.encode()), key
        assert wire.key_slot(key.encode()) == key_slot(key.encode()), key


def test_the_connect_step_runs_through_the_named_functions() -> None:
    """The traceback test for "was the write sent" looks for these function names: the
    connection class still connects through them (`connect`, `_connect`, `on_connect`...)."""
    for name in ("connect", "_connect", "on_connect"):
        assert name in _CONNECT_FRAMES
        assert callable(inspect.getattr_static(Connection, name, None)), _missing(
            f"Connection.{name}() (a name in _CONNECT_FRAMES)"
        )


async def _silent_server() -> tuple[asyncio.Server, int]:
    """A TCP server that accepts connections and never answers."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read()  # until the client goes away
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_handshake_that_times_out_counts_as_not_sent() -> None:
    """A connection whose handshake gets no answer fails inside the connect step: the frame
    test sees it, so a write on such a connection is known not to have been sent."""
    server, port = await _silent_server()
    try:
        connection = Connection(host="127.0.0.1", port=port, socket_timeout=0.2)
        with pytest.raises(Exception) as caught:  # noqa: PT011  # whatever this version raises
            await asyncio.wait_for(connection.connect(), 5)  # type: ignore[no-untyped-call]
        await connection.disconnect(nowait=True)
        frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
        assert _failed_to_connect(caught.value), _changed(
            f"no longer connects through any of {sorted(_CONNECT_FRAMES)} (frames: {frames})"
        )
        shown = wire.translated(caught.value, "redis://127.0.0.1", "k")
        assert not isinstance(shown, WriteOutcomeUnknownError)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.redis
async def test_a_reply_that_times_out_counts_as_maybe_sent(redis_url: str) -> None:
    """A command sent on a connected connection whose reply does not come in time is not a
    connect failure: a write there has an unknown outcome."""
    pool = ConnectionPool.from_url(redis_url)
    connection = pool.make_connection()  # type: ignore[no-untyped-call]
    try:
        await connection.connect()
        await connection.send_packed_command(wire.pack(("BLPOP", "agenticstate-test:none", 0)))
        with pytest.raises(TimeoutError) as caught:
            async with asyncio.timeout(0.2):
                await connection.read_response()
        assert not _failed_to_connect(caught.value)
        shown = wire.translated(caught.value, "redis://x", "k")
        assert isinstance(shown, WriteOutcomeUnknownError)
    finally:
        await connection.disconnect(nowait=True)
        await pool.aclose()


async def test_redis_py_has_what_the_pubsub_link_reads(redis_url: str) -> None:
    """`PubSubLink` reads a connected pub/sub connection's stream reader and writer and its
    hiredis reader (`_reader`, `_writer`, `_parser._reader`, `NOT_ENOUGH_DATA`): it takes the
    fast path, and a PING written on it comes back as a reply."""
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
    from redis.asyncio import Redis

    assert NOT_ENOUGH_DATA is not None, _missing("redis._parsers.hiredis.NOT_ENOUGH_DATA")
    client = Redis.from_url(redis_url)
    pubsub = client.pubsub()
    try:
        await wire.connect_pubsub(pubsub)
        connection: Any = pubsub.connection
        parser = connection._parser
        assert isinstance(parser, _AsyncHiredisParser), _changed("uses another parser")
        link = wire.PubSubLink(pubsub)
        assert link._gets is not None, _changed("moved the hiredis reader or its stream")
        link.send("PING", b"hello")
        async with asyncio.timeout(5):
            assert await link.read() == [b"hello"]
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
