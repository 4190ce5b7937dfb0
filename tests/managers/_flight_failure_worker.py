"""A process in a single-flight race whose lock holder fails (issue 16, point 6).

Run as `python -m tests.managers._flight_failure_worker ROLE URL PREFIX`:

- `holder-raises` / `holder-cancelled`: calls `cached_call`; its tool prints `running` and
  waits for a line on stdin; then the tool raises, or the call is cancelled. Prints `done`.
- `waiter`: prints `waiting` once its `cached_call` waits on the holder's lock (seen through
  the library's `tool_call_waiting` log event), runs the tool itself when the lock is
  released, and prints the result.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from agenticstate import StateConfig, StateManager, ToolStateManager
from agenticstate.backends import open_backend

if TYPE_CHECKING:
    from collections.abc import MutableMapping

PARAMETERS = {"question": "life"}


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class _Waiting(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "tool_call_waiting" in f"{record.msg} {record.getMessage()}":
            _say("waiting")


def _report_waiting() -> None:
    """Print `waiting` at the library's tool_call_waiting event (structlog or logging)."""

    def hook(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if event.get("event") == "tool_call_waiting":
            _say("waiting")
        raise structlog.DropEvent

    structlog.configure(processors=[hook], cache_logger_on_first_use=False)
    logger = logging.getLogger("agenticstate")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_Waiting())


async def main(role: str, url: str, prefix: str) -> None:
    if role == "waiter":
        _report_waiting()
    else:
        structlog.configure(processors=[_drop], cache_logger_on_first_use=False)
    state = StateManager(StateConfig(), backend=open_backend(url, key_prefix=prefix))
    tools = ToolStateManager(state_manager=state, flight_timeout=60)
    await state.open()
    if role == "waiter":

        async def answer() -> str:
            return "answered by the waiter"

        _say(await tools.cached_call("oracle", PARAMETERS, answer))
    else:
        scope = anyio.CancelScope()
        told = anyio.Event()

        async def stuck() -> str:
            _say("running")
            await anyio.to_thread.run_sync(sys.stdin.readline)
            told.set()
            if role == "holder-raises":
                raise ConnectionError("down")
            await anyio.sleep_forever()
            return "never"

        async def call() -> None:
            with scope, contextlib.suppress(ConnectionError):
                await tools.cached_call("oracle", PARAMETERS, stuck)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await told.wait()
            if role == "holder-cancelled":
                scope.cancel()
        _say("done")
    await state.aclose()


def _drop(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    raise structlog.DropEvent


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
