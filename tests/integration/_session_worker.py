"""A process appending messages to one session.

Run as `python -m tests.integration._session_worker URL SESSION_ID TAG COUNT`.

`URL` is any backend URL `open_backend` accepts (with its key prefix in it). The worker prints
`ready`, waits for a line on stdin (the start signal), appends COUNT messages `TAG-i`, prints
`done` with the numbers it was given (JSON), waits for another line, then reads the whole
history and prints `order` with the contents in the order it reads them (JSON).
"""

from __future__ import annotations

import json
import sys

import anyio

from agenticstate import SessionManager, StateManager, open_backend


async def main(url: str, session_id: str, tag: str, count: str) -> None:
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await anyio.to_thread.run_sync(sys.stdin.readline)
        numbers = [
            (await sessions.add_message(session_id, "user", f"{tag}-{i}", writer=tag)).seq
            for i in range(int(count))
        ]
        sys.stdout.write(f"done {json.dumps(numbers)}\n")
        sys.stdout.flush()
        await anyio.to_thread.run_sync(sys.stdin.readline)
        order = [message.content for message in await sessions.get_messages(session_id)]
        sys.stdout.write(f"order {json.dumps(order)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
