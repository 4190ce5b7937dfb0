"""Run a manager call with another process's work slipped in, or a crash, at one storage call.

Another process acting at a precise point of a call is what breaks a read-then-write: the call
reads, the other process deletes the record and writes a new one under the same id, the call
writes on what it read. `at_call` stands in for that process: it counts the calls the code under
test makes on its `StateManager` (every storage method in `HOOKED`), and just before call `at`
it runs `intruder` (whose own calls are not counted) or, with `crash=True`, raises `Crash` (a
process killed there: nothing after that point runs).

`points(victim)` counts the calls a run makes, so a test can sweep every point:

```python
for at in range(await points(state, setup, victim)):
    ...  # a fresh store, setup, then: await at_call(state, victim, at, intruder)
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager

HOOKED = (
    "get",
    "get_entry",
    "get_many",
    "exists",
    "list_keys",
    "save",
    "save_many",
    "update",
    "delete",
    "transact",
    "index_add",
    "index_remove",
    "index_range",
)
"""The `StateManager` methods the managers store and read through."""


class Crash(BaseException):  # a stand-in for a process killed at that point
    """The process running the call died here (a BaseException: no `except Exception` in the
    code under test may catch it, as none can catch a SIGKILL)."""


async def at_call(
    state: StateManager,
    victim: Callable[[], Awaitable[Any]],
    at: int,
    intruder: Callable[[], Awaitable[Any]] | None = None,
    *,
    crash: bool = False,
) -> tuple[int, Any]:
    """Run `victim()`, with `intruder()` run (or a `Crash` raised) just before its call `at`.

    Returns how many storage calls the victim made and what it returned (or raised: the
    exception is returned, not raised, but for `Crash`, which propagates).
    """
    count = 0
    inside = False
    originals = {name: getattr(state, name) for name in HOOKED}

    def hook(name: str) -> Callable[..., Any]:
        original = originals[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal count, inside
            if inside:
                return original(*args, **kwargs)
            count += 1
            if count - 1 != at:
                return original(*args, **kwargs)

            async def first_the_other() -> Any:
                nonlocal inside
                if crash:
                    raise Crash
                if intruder is not None:
                    inside = True
                    try:
                        await intruder()
                    finally:
                        inside = False
                return await original(*args, **kwargs)

            return first_the_other()

        return call

    for name in HOOKED:
        setattr(state, name, hook(name))
    try:
        try:
            result: Any = await victim()
        except Crash:
            raise
        except Exception as exc:  # noqa: BLE001  # returned to the test, which judges it
            result = exc
    finally:
        for name in HOOKED:
            delattr(state, name)  # the class's methods again
    return count, result


async def points(state: StateManager, victim: Callable[[], Awaitable[Any]]) -> int:
    """How many storage calls `victim()` makes when nothing comes in between."""
    made, _ = await at_call(state, victim, -1)
    return made
