"""A process in a single-flight race whose tool runs longer than `flight_timeout`.

Run as `python -m tests.integration._long_flight_worker ROLE URL PREFIX FLIGHT_TIMEOUT`:

- `holder`: calls `cached_call`; its tool prints `running`, waits for a line on stdin (far longer
  than `flight_timeout` if the test wants), returns "answered by the holder"; prints the result.
- `waiter`: calls `cached_call` for the same parameters; prints `waiting` at each of the
  library's `tool_call_waiting` events (one per `flight_timeout` it waits on a held lock), prints
  `ran` if its own tool runs, then the result.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from agenticstate import StateManager, ToolStateManager
from agenticstate.backends import open_backend

if TYPE_CHECKING:
    from collections.abc import MutableMapping

PARAMETERS = {"question": "life"}


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _report_waiting() -> None:
    """Print `waiting` at every tool_call_waiting event (structlog or logging)."""

    def hook(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if event.get("event") == "tool_call_waiting":
            _say("waiting")
        raise structlog.DropEvent

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "tool_call_waiting" in f"{record.msg} {record.getMessage()}":
                _say("waiting")

    structlog.configure(processors=[hook], cache_logger_on_first_use=False)
    logger = logging.getLogger("agenticstate")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Waiting())


async def main(role: str, url: str, prefix: str, flight_timeout: str) -> None:
    if role == "waiter":
        _report_waiting()
    state = StateManager(backend=open_backend(url, key_prefix=prefix))
    tools = ToolStateManager(state_manager=state, flight_timeout=float(flight_timeout))
    await state.open()

    async def holder() -> str:
        _say("running")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        return "answered by the holder"

    async def waiter() -> str:
        _say("ran")
        return "answered by the waiter"

    _say(await tools.cached_call("oracle", PARAMETERS, holder if role == "holder" else waiter))
    await state.aclose()


if __name__ == "__main__":
    role, url, prefix, flight_timeout = sys.argv[1:5]
    anyio.run(main, role, url, prefix, flight_timeout)
