"""Background tasks for objects that are used without `async with`.

A `StateManager` entered with `async with` runs its subscription pumps in its own anyio task group,
on asyncio or trio. The seed API also lets users call `subscribe()` on a manager they never
entered; there is no task group to put the pump in then, so on asyncio this module starts a plain
`asyncio` task (the one place in the core that imports asyncio). Trio has no detached tasks by
design, so there `async with StateManager(...)` is required before subscribing a callback.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

__all__ = ["spawn_detached"]


def spawn_detached(fn: Callable[[], Coroutine[Any, Any, None]], *, name: str) -> asyncio.Task[None]:
    """Start `fn()` as a free-standing asyncio task and return it.

    Raises:
        ConfigurationError: Not running under asyncio (under trio, enter the manager first).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            "subscribing a callback outside `async with StateManager(...)` needs asyncio; "
            "under trio, enter the manager with `async with` first"
        ) from None
    return loop.create_task(fn(), name=name)
