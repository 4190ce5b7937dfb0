"""A process deleting, creating, or stopped half way through deleting one session id.

Run as `python -m tests.integration._session_life_worker ROLE URL SESSION_ID [COUNT]`.

- `delete`: prints `ready`, then deletes the session in a loop until its stdin closes; prints
  `deleted N`.
- `create`: prints `ready`, waits for a line on stdin, then tries `COUNT` creates of the session
  (owner `u`). After each create that went through it reads the state, then the user's listing,
  then the session record: when the record is still the one it created (no delete of it came
  since), the state must be its first state and the listing must name it. Prints `result` and
  a JSON object: creates, states erased, sessions missing from the listing.
- `hold-delete`: starts `delete_session`, and once the session record is gone (the first step
  done) prints `ready` and blocks there for good: the test kills it.
"""

from __future__ import annotations

import json
import sys

import anyio

from agenticstate import ConflictError, SessionManager, StateManager, open_backend


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def delete(url: str, sid: str) -> None:
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        say("ready")
        deleted = 0
        with anyio.CancelScope() as scope:

            async def until_stdin_closes() -> None:
                await anyio.to_thread.run_sync(sys.stdin.read)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(until_stdin_closes)
                while True:
                    deleted += await sessions.delete_session(sid)
                    await anyio.lowlevel.checkpoint()
    say(f"deleted {deleted}")


async def create(url: str, sid: str, count: int) -> None:
    result = {"creates": 0, "erased": 0, "unlisted": 0}
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        say("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for n in range(count):
            try:
                mine = await sessions.create_session("u", session_id=sid, state={"gen": n})
            except ConflictError:
                await anyio.lowlevel.checkpoint()
                continue
            result["creates"] += 1
            # The record last: a delete of this life removes it before anything else, so a
            # record still ours means that no delete of this life had begun by then.
            first = await state.get(f"sessions:{{{sid}}}:state")
            listed = [s.session_id for s in await sessions.list_sessions("u")]
            now = await sessions.get_session(sid)
            if now is not None and now.created_at == mine.created_at:
                result["erased"] += first != {"gen": n}
                result["unlisted"] += sid not in listed
    say(f"result {json.dumps(result)}")


async def hold_delete(url: str, sid: str) -> None:
    async with StateManager(backend=open_backend(url)) as state:
        listed = state.list_keys

        async def held(pattern: str = "*") -> list[str]:
            if f"{{{sid}}}" in pattern:
                say("ready")
                await anyio.sleep_forever()  # killed here
            return await listed(pattern)

        state.list_keys = held  # type: ignore[method-assign]
        await SessionManager(state_manager=state).delete_session(sid)


if __name__ == "__main__":
    role, url, sid = sys.argv[1:4]
    if role == "delete":
        anyio.run(delete, url, sid)
    elif role == "create":
        anyio.run(create, url, sid, int(sys.argv[4]))
    else:
        anyio.run(hold_delete, url, sid)
