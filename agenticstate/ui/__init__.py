"""The live web inspector: `agenticstate ui --url URL` (extra `agenticstate[ui]`).

```console
agenticstate --url redis://localhost:6379/0 ui            # http://127.0.0.1:8765/, read-only
agenticstate --url redis://localhost:6379/0 ui --allow-writes
agenticstate --url redis://... ui --host 0.0.0.0          # prints an address with a token
```

Keys by glob with version, TTL and size; a value with its retained versions; the live change
stream (server-sent events fed by `StateManager.watch`); teams and queues with a chart over time;
workflows with their step timeline and checkpoints; agents with their checkpoints and recovery
record; knowledge bases with their indexing run and sources; tool statistics; sessions with their
messages; speech sessions. Every view has an address (`#/<tab>/<item>?glob=...`). Read-only
unless started with `allow_writes`; see `docs/inspector.md` for the security model.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket
from typing import TYPE_CHECKING

import anyio

from agenticstate.exceptions import (
    InvalidArgumentError,
    MissingDependencyError,
    UnsupportedOperationError,
)

try:
    import starlette  # noqa: F401  # optional dependency
    import uvicorn
except ImportError as exc:  # pragma: no cover - the extra is installed in the test env
    raise MissingDependencyError(exc.name or "starlette", "ui") from None

from agenticstate.ui._app import LOOPBACK_HOSTS, create_app

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from agenticstate.manager import StateManager

__all__ = ["create_app", "is_loopback", "serve"]

_EVERY_VERSION = 2**31 - 1
"""A history depth no writer's rule exceeds: read every retained version."""


def is_loopback(host: str) -> bool:
    """Return whether `host` names this machine only (127.0.0.0/8, ::1 or localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve(
    state: StateManager,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    allow_writes: bool = False,
    token: str | None = None,
    require_token: bool = False,
    allowed_hosts: Iterable[str] = (),
    sample_interval: float = 2.0,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the inspector over `state` until cancelled (or SIGINT / SIGTERM).

    Bound to a loopback address, the Host header must name this machine (no DNS rebinding) and
    no token is needed unless `require_token`. Bound elsewhere, a token is always required: one
    is generated unless given, and `ready` receives the address that carries it.

    History: a backend reads as many retained versions of a key as its own history rules name
    (the writers keep them). When `state`'s backend has no rules, `serve` gives it one naming
    every key, so the value view lists whatever versions the writers kept; the inspector's own
    saves (`allow_writes`) then keep the key's earlier versions too. A backend with rules keeps
    them (`create_app`, for embedding, never changes them).

    Args:
        state: An open `StateManager`; the caller closes it.
        host: The address to bind.
        port: The port (0: any free one).
        allow_writes: Let the page save and delete keys (each with a version check).
        token: The token to require (default: a random one when needed).
        require_token: Require a token on a loopback address too.
        allowed_hosts: More host names the Host header may carry (a reverse proxy's name).
        sample_interval: Seconds between two samples of the queue chart.
        ready: Called with the address to open once the socket listens.
    """
    if type(port) is not int or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int from 0 to 65535, not {port!r}")
    extra = frozenset(name.lower() for name in allowed_hosts)
    loopback = is_loopback(host)
    if not loopback or require_token:
        token = token or secrets.token_urlsafe(24)
    if token is not None and (len(token) < 16 or not token.isascii() or not token.isprintable()):
        raise InvalidArgumentError("a token must be at least 16 printable ASCII characters")
    if loopback:
        hosts: frozenset[str] | None = LOOPBACK_HOSTS | {host.strip("[]").lower()} | extra
    else:
        # The machine's names are unknown here: the token guards it (and --allowed-host narrows).
        hosts = (extra | {host.lower()}) if extra else None
    if not state.backend.history_rules:
        # A store that keeps no history refuses rules: the view then shows the current version.
        with contextlib.suppress(UnsupportedOperationError):
            state.backend.keep_history({"*": _EVERY_VERSION})
    app = create_app(
        state,
        allow_writes=allow_writes,
        token=token,
        allowed_hosts=hosts,
        sample_interval=sample_interval,
    )
    sock = _bind(host, port)
    try:
        bound_port = sock.getsockname()[1]
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        address = f"http://{shown}:{bound_port}/"
        if token is not None:
            address += f"?token={token}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
            access_log=False,
            server_header=False,
        )
        server = _Server(config, app.state.stopping)
        if ready is not None:
            ready(address)
        await _serve_until_cancelled(server, sock)
    finally:
        sock.close()


class _Server(uvicorn.Server):
    # uvicorn waits for open responses before it stops; the live streams never end by
    # themselves, so tell them first.
    def __init__(self, config: uvicorn.Config, stopping: anyio.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stopping.set()
        await super().shutdown(sockets)


async def _serve_until_cancelled(server: uvicorn.Server, sock: socket.socket) -> None:
    # Cancelling the caller shuts the server down gracefully (streams closed, lifespan ended)
    # instead of tearing it apart mid-request.
    done = anyio.Event()

    async def run() -> None:
        with anyio.CancelScope(shield=True):
            try:
                await server.serve(sockets=[sock])
            finally:
                done.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        try:
            await done.wait()
        finally:
            server.should_exit = True
