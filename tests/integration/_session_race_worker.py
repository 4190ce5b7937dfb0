"""A process writing to one session while another deletes and re-creates it.

Run as `python -m tests.integration._session_race_worker URL SESSION_ID TAG`.

`URL` is any backend URL `open_backend` accepts (with its key prefix in it). The worker prints
`ready`, then loops until its stdin closes: `add_message`, and every few rounds `update_state`,
`set_state` or `summarize`, each refused with `NotFoundError` while the session is gone. At the
end it prints `counts` and a JSON object: how many calls of each kind went through, how many
were refused, and the names of any other error (there must be none; a `summarize` that lost to
the other worker's is counted apart, as documented).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import anyio

from agenticstate import (
    AgenticStateError,
    ConflictError,
    NotFoundError,
    SessionManager,
    StateManager,
    open_backend,
)


async def main(url: str, session_id: str, tag: str) -> None:
    counts: Counter[str] = Counter()
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        with anyio.CancelScope() as scope:

            async def until_stdin_closes() -> None:
                await anyio.to_thread.run_sync(sys.stdin.read)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(until_stdin_closes)
                n = 0
                while True:
                    n += 1
                    kind = ("add", "add", "update", "add", "set", "add", "summarize")[n % 7]
                    try:
                        if kind == "add":
                            await sessions.add_message(session_id, "user", f"{tag}-{n}")
                        elif kind == "update":
                            await sessions.update_state(session_id, {tag: n})
                        elif kind == "set":
                            await sessions.set_state(session_id, {"set_by": tag, "n": n})
                        else:
                            try:
                                await sessions.summarize(
                                    session_id, lambda old, new: "s", keep_last=1
                                )
                            except ConflictError:  # the other worker's summary came first
                                counts["summarize_lost"] += 1
                                continue
                        counts[kind] += 1
                    except NotFoundError:
                        counts["refused"] += 1
                    except AgenticStateError as exc:
                        counts[f"error:{type(exc).__name__}"] += 1
                    await anyio.lowlevel.checkpoint()
    sys.stdout.write(f"counts {json.dumps(counts)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
