"""What the LangGraph checkpointer and store share: key encoding, the sync bridge, the error."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote

import anyio.from_thread

from agenticstate.exceptions import ConfigurationError, ConflictError

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

    from agenticstate.manager import StateManager

T = TypeVar("T")

_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_PLAIN = re.compile(r"[A-Za-z0-9_.~-]+")  # what quote(safe="") leaves as it is


class StaleCheckpointError(ConflictError):
    """A checkpoint was written on top of a thread head that another writer had moved.

    Raised by `CheckpointSaver.aput` when the writer loaded the thread's latest checkpoint and,
    before it wrote the next one, another writer (another process, another task) advanced the
    same thread. Nothing was written: the thread keeps the other writer's history, unforked.

    Attributes:
        thread_id: The thread.
        checkpoint_ns: The checkpoint namespace (`""` for the root graph).
        expected_head: The checkpoint the writer built on.
        actual_head: The thread's head when the write was refused (`None` if it was deleted).
    """

    def __init__(
        self,
        message: str,
        *,
        thread_id: str,
        checkpoint_ns: str,
        expected_head: str | None,
        actual_head: str | None,
    ) -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.checkpoint_ns = checkpoint_ns
        self.expected_head = expected_head
        self.actual_head = actual_head


@functools.lru_cache(maxsize=8192)
def encode(text: str) -> str:
    """Percent-encode a user string into one key segment (no `:`, `{}`, glob or control chars)."""
    # Thread ids, channel names and versions repeat on every put: the cache keeps quote() off
    # the hot path, and most of them need no escaping at all.
    if _PLAIN.fullmatch(text):
        return text
    return quote(text, safe="")


def decode(segment: str) -> str:
    """Invert `encode`."""
    return unquote(segment) if "%" in segment else segment  # most segments needed no escaping


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it is a short run of letters, digits, `_`, `.` and `-`."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise ConfigurationError(
            f"prefix must be 1-64 letters, digits, '_', '.' or '-', not {prefix!r}"
        )
    return prefix


Runner = Callable[[Callable[[Any], Coroutine[Any, Any, Any]]], Any]


def unwrap_state(state: object) -> tuple[StateManager, Runner | None]:
    """Return the async `StateManager` behind `state`, and the sync API's runner if it has one.

    `state` is a `StateManager`, or an `agenticstate.sync.StateManager` (whose loop runs in a
    thread of its own: the sync methods then run there).
    """
    from agenticstate.manager import StateManager

    if isinstance(state, StateManager):
        return state, None
    inner = getattr(state, "async_object", None)
    if isinstance(inner, StateManager):
        return inner, state.run  # type: ignore[attr-defined]
    raise ConfigurationError(
        "state must be an agenticstate.StateManager or an agenticstate.sync.StateManager, "
        f"not {type(state).__name__}"
    )


def run_sync(
    portal: BlockingPortal | None,
    fn: Callable[..., Coroutine[Any, Any, T]],
    *args: Any,
    runner: Runner | None = None,
) -> T:
    """Run the async `fn(*args)` from synchronous code on the loop that owns the state manager.

    Through the sync API's loop (`runner`, for an `agenticstate.sync.StateManager`), or a
    `portal` (`anyio.from_thread.start_blocking_portal()`); without either the call must come
    from a worker thread of that loop (`anyio.to_thread.run_sync`).
    """
    if runner is not None:
        ran: T = runner(lambda _state: fn(*args))
        return ran
    if portal is not None:
        called: T = portal.call(fn, *args)
        return called
    if _in_async_code():
        # On the event loop's own thread the call would block the loop it needs: LangGraph's
        # sync API (`graph.invoke`) was used where its async one belongs.
        raise ConfigurationError(
            "a synchronous method of the saver or store (what graph.invoke, graph.stream and "
            "graph.get_state call) was called from async code, where it would block the event "
            "loop: use the async API there, await graph.ainvoke(...) (or astream, aget_state, "
            "aupdate_state)"
        )
    try:
        result: T = anyio.from_thread.run(fn, *args)
    except RuntimeError as exc:
        if "worker thread" not in str(exc) and "event loop" not in str(exc):
            raise
        raise ConfigurationError(
            "the synchronous methods need the event loop that owns the StateManager: pass "
            "portal=anyio.from_thread.start_blocking_portal() (and open the StateManager through "
            "it), or call them from a thread started by anyio.to_thread.run_sync"
        ) from exc
    return result


def _in_async_code() -> bool:
    """Whether this thread is running an event loop (asyncio or trio) right now."""
    try:
        anyio.get_current_task()
    except RuntimeError:  # anyio's NoEventLoopError: no loop runs in this thread
        return False
    return True
