"""One backend kept open across hypothesis examples: an event loop in a thread (a portal).

Hypothesis drives sync tests, and the backends are async. A sync test takes `backend_name`
(parametrised over every backend, as the `backend` fixture), opens the backend once in a
blocking portal, and runs each generated example through `portal.call`, with fresh ids per
example so that examples never see each other's records.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from anyio.from_thread import start_blocking_portal

from agenticstate import StateConfig, StateManager
from tests.helpers import BACKEND_MAKERS, backend_params

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    import pytest
    from anyio.from_thread import BlockingPortal

    from agenticstate.backends import Backend

BACKEND_NAMES = backend_params()
"""Parametrise `backend_name` with this: every backend, Redis ones marked."""


@contextmanager
def open_state(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[BlockingPortal, StateManager]]:
    """Open backend `name` in a portal; yield the portal and a StateManager over it."""
    # Resolve the server fixtures here, in the test's thread; the makers find them cached.
    if name == "redis":
        request.getfixturevalue("redis_url")
    elif name == "redis-cluster":
        request.getfixturevalue("redis_cluster_url")

    async def make(backend: Backend) -> StateManager:
        # Built inside the loop: a StateManager's primitives belong to the loop that runs it.
        return StateManager(StateConfig(), backend=backend, close_backend=False)

    with (
        start_blocking_portal("asyncio") as portal,
        portal.wrap_async_context_manager(BACKEND_MAKERS[name](request, tmp_path)) as backend,
    ):
        state = portal.call(make, backend)
        try:
            yield portal, state
        finally:
            portal.call(state.aclose)
