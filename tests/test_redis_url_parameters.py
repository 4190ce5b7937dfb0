"""A Redis URL's query parameters are checked when the URL is given, not at the first command.

`redis://h/0?bogus=1` used to be accepted by `open_backend`, `RedisBackend` and `StateConfig`
and then fail inside redis-py at the first command (`TypeError: ... unexpected keyword argument
'bogus'`: a traceback from the CLI). Now every Redis scheme refuses, at construction and with a
`ConfigurationError` naming the parameter (never the password), a parameter it does not know, a
repeated or empty one, and a typed setting redis-py cannot read. The tables cover every scheme
against every way of giving a URL; the parameters a scheme takes are held against redis-py's
own connection classes, so each one accepted is one redis-py takes.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import StateConfig
from agenticstate.backends import Backend, RedisBackend, open_backend, open_config_backend
from agenticstate.config import REDIS_URL_PARAMETERS, REDIS_URL_VALUE_KINDS
from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

SECRET = "Sekr3tPassw0rd"  # noqa: S105  # a test password, looked for in messages
BASES = {
    "redis": f"redis://app:{SECRET}@127.0.0.1:1/0",
    "rediss": f"rediss://app:{SECRET}@127.0.0.1:1/0",
    "unix": f"unix://app:{SECRET}@/tmp/agenticstate-no-such.sock",
    "redis+cluster": f"redis+cluster://app:{SECRET}@127.0.0.1:1,127.0.0.1:2",
    "rediss+cluster": f"rediss+cluster://app:{SECRET}@127.0.0.1:1,127.0.0.1:2",
}
OWN = ("key_prefix=app:", "feed=off", "feed_max_changes=10", "feed_max_age=60")

# Ways to give a URL: each must refuse a bad one when called, before anything connects.
MAKERS: dict[str, Callable[[str], Any]] = {
    "open_backend": open_backend,
    "RedisBackend": lambda url: RedisBackend(url=url),
    "RedisBackend.from_url": RedisBackend.from_url,
    "StateConfig": lambda url: StateConfig(backend="redis", redis_url=url),
}

# A setting the scheme does not take, for every scheme (`decode_responses` and friends are
# redis-py's, but would break the backend: refused as unknown).
UNKNOWN = ["bogus=1", "decode_responses=true", "max_connections=3", "retry_on_timeout=1"]
MALFORMED = ["bogus", "bogus=", "=1", "db=1&db=1", "a=1&&b=2"]


def _with(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


def _bad_values(scheme: str) -> list[str]:
    """A value redis-py cannot read for every typed setting the scheme takes."""
    return [
        f"{name}=x1"
        for name in sorted(REDIS_URL_VALUE_KINDS)
        if name in REDIS_URL_PARAMETERS[scheme]
    ]


CASES = [
    (scheme, query) for scheme in BASES for query in [*UNKNOWN, *MALFORMED, *_bad_values(scheme)]
]


@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize(("scheme", "query"), CASES)
def test_a_parameter_redis_py_cannot_take_is_refused_at_construction(
    scheme: str, query: str, maker: str
) -> None:
    """Every scheme x an unknown, repeated, empty or unreadable parameter, given every way:
    `ConfigurationError` at once, naming the parameter, never showing the password."""
    with pytest.raises(ConfigurationError) as caught:
        MAKERS[maker](_with(BASES[scheme], query))
    message = str(caught.value)
    assert SECRET not in message
    name = query.partition("=")[0]
    if name and "&" not in query and query.count("=") == 1 and query.partition("=")[2]:
        assert repr(name) in message, message


@pytest.mark.parametrize("scheme", sorted(BASES))
def test_the_backends_own_parameters_are_taken_by_urls_only(scheme: str) -> None:
    """`key_prefix` and the feed's parameters are the URL's (`open_backend`), not redis-py's:
    `RedisBackend(url=...)` and `StateConfig(redis_url=...)`, which take them as arguments,
    refuse them in the URL instead of passing them on to redis-py."""
    for query in OWN:
        url = _with(BASES[scheme], query)
        assert isinstance(open_backend(url), RedisBackend)
        for maker in ("RedisBackend", "StateConfig"):
            with pytest.raises(ConfigurationError, match=repr(query.partition("=")[0])):
                MAKERS[maker](url)


def _connection_class(scheme: str) -> type:
    from redis.asyncio import connection

    return {
        "redis": connection.Connection,
        "rediss": connection.SSLConnection,
        "unix": connection.UnixDomainSocketConnection,
    }[scheme]


def _parameters(cls: type) -> set[str]:
    """The keyword arguments `cls` takes, through the `**kwargs` of its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {
            p.name for p in parameters if p.kind is p.KEYWORD_ONLY or p.default is not p.empty
        }
        names |= {p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names - {"self"}


@pytest.mark.parametrize("scheme", ["redis", "rediss", "unix"])
def test_every_parameter_a_scheme_takes_is_one_redis_py_takes(scheme: str) -> None:
    """Each parameter a scheme's URL may give is an argument of its redis-py connection class,
    and each typed one is read by redis-py as the check reads it."""
    from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

    assert REDIS_URL_PARAMETERS[scheme] <= _parameters(_connection_class(scheme))
    for name in REDIS_URL_PARAMETERS[scheme]:
        if name in URL_QUERY_ARGUMENT_PARSERS and name not in (
            "ssl_include_verify_flags",
            "ssl_exclude_verify_flags",
        ):
            assert name in REDIS_URL_VALUE_KINDS, name


GOOD_VALUES = {
    "a whole number": "1",
    "a whole number (2 or 3)": "2",
    "a whole number of seconds": "5",
    "a whole number of bytes": "65536",
    "a number of seconds": "1.5",
    "true or false (1 or 0)": "true",
}
STRING_VALUES = {
    "ssl_cert_reqs": "required",
    "ssl_min_version": "3",
    "ssl_include_verify_flags": "VERIFY_X509_STRICT",
    "ssl_exclude_verify_flags": "VERIFY_X509_STRICT",
}


def _good(name: str) -> str:
    if name in STRING_VALUES:
        return STRING_VALUES[name]
    kind = REDIS_URL_VALUE_KINDS.get(name)
    return GOOD_VALUES[kind[1]] if kind else "x"


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        (scheme, name)
        for scheme in ("redis", "rediss", "unix")
        for name in sorted(REDIS_URL_PARAMETERS[scheme])
    ],
)
def test_every_parameter_a_scheme_takes_builds_a_connection(scheme: str, name: str) -> None:
    """Every scheme x every parameter it takes: the backend is built, and redis-py builds a
    connection from it (the step that used to raise `TypeError`), without connecting."""

    async def main() -> None:
        backend = open_backend(_with(BASES[scheme], f"{name}={_good(name)}"))
        assert isinstance(backend, RedisBackend)
        await backend.open()
        assert backend._client is not None
        backend._client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        await backend.aclose()

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize("scheme", sorted(BASES))
def test_a_config_with_a_bad_redis_url_is_refused(scheme: str) -> None:
    """`StateConfig(redis_url=...)` refuses a URL redis-py cannot take, so
    `open_config_backend` never builds a backend that fails at its first command."""
    with pytest.raises(ConfigurationError, match="bogus"):
        open_config_backend(StateConfig(backend="redis", redis_url=_with(BASES[scheme], "bogus=1")))
    backend: Backend = open_config_backend(StateConfig(backend="redis", redis_url=BASES[scheme]))
    assert isinstance(backend, RedisBackend)


def test_a_redis_url_in_a_config_must_name_a_redis_scheme() -> None:
    """`StateConfig(redis_url="sqlite://...")` is refused, naming the schemes it takes."""
    with pytest.raises(ConfigurationError, match="redis://"):
        StateConfig(backend="redis", redis_url="sqlite://x.db")


@pytest.mark.parametrize("scheme", sorted(BASES))
def test_the_cli_refuses_an_unknown_parameter_in_one_line(scheme: str, tmp_path: Path) -> None:
    """`agenticstate --url URL?bogus=1 keys` exits 2 with one line naming the parameter: no
    traceback, no password."""
    url = _with(BASES[scheme], "bogus=1")
    result = subprocess.run(
        [sys.executable, "-m", "agenticstate", "--url", url, "keys"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "'bogus'" in lines[0]
    assert SECRET not in result.stderr + result.stdout
