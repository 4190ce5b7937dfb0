"""Passwords in URLs never show: a property test over generated passwords and every place a URL
can appear (reprs, `url`, every error raised while opening, log records, the CLI's output).

Each generated password is a run of random characters (every printable ASCII character, and
percent-encodings of the URL delimiters and of letters) with `TOKEN` between every two of them
and at both ends. A URL parser can cut a password into pieces at `/`, `?`, `#`, `@` or `:` and
show one of them as a port, a path or a query, so the assertion is that `TOKEN` appears nowhere:
any piece of the password long enough to mean something holds a whole token.

The inspector's page is told the backend's type only; its info API is checked too. The URLs are
made from the password every way a user can write one (raw user info, percent-encoded
user info, a `password=` query parameter, the same with its name percent-encoded, a unix socket,
a cluster) and each is opened against a real redis-server that has the user with that password
(the percent-encoded forms must then work), with a wrong password, on a closed port, with a bad
port and with an unknown query parameter.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import anyio
import httpx
import pytest
import redis as sync_redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import RedisBackend, StateConfig, StateManager
from agenticstate.backends import open_backend
from agenticstate.config import redact_url
from agenticstate.exceptions import ConfigurationError
from tests._redis_server import RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from agenticstate.backends import Backend

pytestmark = pytest.mark.redis

ROOT = Path(__file__).parent.parent.parent
TOKEN = "Qz7Kx"  # noqa: S105  # between every two characters of a generated password
USER = "tenant"
PRINTABLE = [chr(code) for code in range(0x20, 0x7F)]
ENCODINGS = ["%2F", "%3F", "%23", "%40", "%3A", "%25", "%77", "%2", "+", "%20"]


@st.composite
def passwords(draw: st.DrawFn) -> str:
    """`TOKEN`, then pieces of one random character or percent-encoding, each followed by it."""
    pieces = draw(st.lists(st.sampled_from(PRINTABLE) | st.sampled_from(ENCODINGS), max_size=8))
    return TOKEN + "".join(piece + TOKEN for piece in pieces)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(f"{record.getMessage()} {record.__dict__!r}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server (TCP and a unix socket) whose ACL users the tests set."""
    made = RedisServer(tmp_path_factory.mktemp("secrets"))
    made.start()
    try:
        yield made
    finally:
        made.stop()


def _set_password(server: RedisServer, password: str) -> None:
    with sync_redis.Redis(unix_socket_path=str(server.socket_path)) as admin:
        admin.execute_command(
            "ACL", "SETUSER", USER, "on", "resetpass", f">{password}", "~*", "&*", "+@all"
        )


def _urls(server: RedisServer, password: str) -> dict[str, str]:
    """Every way to write a URL with `password` in it, for the server's user."""
    encoded = quote(password, safe="")
    host = f"127.0.0.1:{server.port}"
    return {
        "raw": f"redis://{USER}:{password}@{host}/0",
        "encoded": f"redis://{USER}:{encoded}@{host}/0",
        "wrong-password": f"redis://{USER}:{quote(password + TOKEN, safe='')}@{host}/0",
        "query": f"redis://{USER}@{host}/0?password={encoded}",
        "query-name-encoded": f"redis://{USER}@{host}/0?pass%77ord={encoded}",
        "unix": f"unix://{USER}:{encoded}@{server.socket_path}",
        "unix-raw": f"unix://{USER}:{password}@{server.socket_path}",
        "cluster": f"redis+cluster://{USER}:{encoded}@{host}",
        "cluster-raw": f"redis+cluster://{USER}:{password}@{host}",
    }


def _variants(url: str, closed_port: int, server: RedisServer) -> dict[str, str]:
    """`url` as written, and broken each way a URL can fail to open."""
    host = f"127.0.0.1:{server.port}"
    return {
        "as-is": url,
        "closed-port": url.replace(host, f"127.0.0.1:{closed_port}"),
        "bad-port": url.replace(host, "127.0.0.1:99999"),
        "port-not-a-number": url.replace(host, "127.0.0.1:6x79"),
        "unknown-parameter": url + ("&" if "?" in url else "?") + "no_such_option=1",
    }


async def _inspector_info(state: StateManager) -> str:
    """What the inspector's page is told about the store (it names the backend's type)."""
    from agenticstate.ui import create_app

    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as client:
        return (await client.get("/api/info")).text


def _described(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)


def _without_retries(backend: Backend) -> Backend:
    """`backend` with its read retries off. A retry shows nothing (it logs nothing, and the last
    attempt's error is raised as the first one's would be), but its back-off sleeps 0.35 s per
    failing URL: a cluster URL that cannot open (a plain node, a closed or bad port) is
    retried, and those sleeps were most of this module's time (72 s of a suite run)."""
    if isinstance(backend, RedisBackend):
        backend.read_retries = 0
    return backend


async def _texts_for(url: str, inspect: bool) -> tuple[list[str], list[str]]:
    """Everything shown about `url` while it is configured, opened, used and closed, and the
    errors met (of three ways to open it)."""
    failures: list[str] = []
    texts = [redact_url(url)]
    try:  # a URL redis-py would fail on is refused here already
        config = StateConfig(backend="redis", redis_url=url)
        texts += [repr(config), str(config)]
    except ConfigurationError as exc:
        texts.append(_described(exc))
        failures.append(_described(exc))
    makers: list[Callable[[], Backend]] = [
        lambda: RedisBackend(url=url, connect_timeout=2.0, socket_timeout=5.0, read_retries=0),
        lambda: open_backend(url, connect_timeout=2.0, socket_timeout=5.0, read_retries=0),
        lambda: _without_retries(StateManager(StateConfig(backend="redis", redis_url=url)).backend),
    ]
    for make in makers:
        try:
            backend = make()
        except Exception as exc:  # noqa: BLE001  # every error is looked at
            texts.append(_described(exc))
            failures.append(_described(exc))
            continue
        state = StateManager(backend=backend)
        texts += [repr(backend), str(backend), repr(state), str(getattr(backend, "url", ""))]
        if inspect and make is makers[0]:  # the inspector, over one of them
            texts.append(await _inspector_info(state))
        try:
            with anyio.fail_after(30):
                await state.save("k", {"n": 1})
                assert await state.get("k") == {"n": 1}
        except Exception as exc:  # noqa: BLE001
            texts.append(_described(exc))
            failures.append(_described(exc))
        finally:
            with suppress(Exception):
                await state.aclose()
    return texts, failures


@pytest.mark.slow
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(password=passwords())
def test_no_piece_of_a_password_shows_anywhere(server: RedisServer, password: str) -> None:
    """For generated passwords, every URL form and every way of failing to open it: reprs,
    `url`, raised errors (with their causes) and log records never show a piece of it; the
    percent-encoded forms connect."""
    _set_password(server, password)
    closed_port = free_port()
    records = _Records()
    logger = logging.getLogger("agenticstate")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(records)
    try:
        texts: list[str] = []
        for form, url in _urls(server, password).items():
            for variant, broken in _variants(url, closed_port, server).items():
                works = variant == "as-is" and form in ("encoded", "query", "unix")
                works = works or (variant == "as-is" and form == "query-name-encoded")
                found, failures = anyio.run(_texts_for, broken, variant == "as-is")
                texts += [f"{form}/{variant}: {text}" for text in found]
                assert not (works and failures), failures
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    leaks = [text for text in texts + records.texts if TOKEN in text]
    assert leaks == []


HARD_PASSWORDS = [
    f"{TOKEN}?db=1#{TOKEN}@{TOKEN}/{TOKEN}",
    f"{TOKEN}:6379/{TOKEN}",
    f"{TOKEN}%77{TOKEN} {TOKEN}",
]


@pytest.mark.slow
@pytest.mark.parametrize("password", HARD_PASSWORDS)
def test_the_cli_never_shows_a_password(server: RedisServer, password: str) -> None:
    """`agenticstate --url URL get/keys` with a password holding URL delimiters, right or
    wrong, raw or encoded, in the user info or the query: neither stdout nor stderr shows it."""
    _set_password(server, password + "-not-this")  # so a URL that does connect fails its AUTH
    urls = _urls(server, password)
    for form, command in [
        ("raw", ["get", "k"]),
        ("encoded", ["keys"]),
        ("query-name-encoded", ["get", "k"]),
        ("cluster-raw", ["keys"]),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "agenticstate.cli", "--url", urls[form], *command],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "error"},
            check=False,
        )
        assert result.returncode != 0, (form, result.stdout, result.stderr)
        assert TOKEN not in result.stdout + result.stderr, (form, result.stderr)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://{USER}:{TOKEN}/x@nohost.invalid:6379/0",
        f"redis://{USER}:{TOKEN}@nohost.invalid:6379/0",
        f"redis://nohost.invalid:6379/0?password={TOKEN}",
        f"redis://{USER}:{TOKEN}@[::1/0",
        f"redis://:{TOKEN}/{TOKEN}",
        f"sqlite://?password={TOKEN}",
        f"sqlite://./x.db?key={TOKEN}",
        f"file://?token={TOKEN}#{TOKEN}",
        f"postgresql://{USER}:{TOKEN}@nohost.invalid:5432/db",
        f"postgresql://{USER}:{TOKEN}/x@nohost.invalid:5432/db",
        f"postgresql://nohost.invalid/db?password={TOKEN}",
        f"postgres://{USER}:{TOKEN}@127.0.0.1:1/db?connect_timeout=2",
        f"postgresql://{USER}:{TOKEN}@[::1/0",
        f"postgresql://h/db?sslpassword={TOKEN}&no_such_option={TOKEN}",
        f"nosuchscheme://{USER}:{TOKEN}@h",
        f"{USER}:{TOKEN}@h",
    ],
)
async def test_bad_hosts_and_other_schemes_never_echo_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A host that does not resolve, an unparsable host, a closed port, sqlite, file and
    postgres URLs with secrets in the query, an unknown scheme, no scheme: every error and repr
    keeps the secret out."""
    monkeypatch.chdir(tmp_path)  # a relative sqlite path lands in the test's directory
    texts = [redact_url(url)]
    try:
        texts.append(repr(StateConfig(backend="redis", redis_url=url)))
    except ConfigurationError as exc:
        texts.append(_described(exc))
    try:
        texts.append(repr(StateConfig(backend="postgres", postgres_url=url)))
    except ConfigurationError as exc:
        texts.append(_described(exc))
    try:
        backend = open_backend(url)
    except Exception as exc:  # noqa: BLE001
        texts.append(_described(exc))
    else:
        texts.append(repr(backend))
        try:
            with anyio.fail_after(30):
                async with StateManager(backend=backend) as state:
                    texts.append(repr(state))
                    await state.get("k")
        except Exception as exc:  # noqa: BLE001
            texts.append(_described(exc))
    assert [text for text in texts if TOKEN in text] == []
