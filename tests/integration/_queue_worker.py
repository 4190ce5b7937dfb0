"""Separate processes for the queue and indexing tests.

python -m tests.integration._queue_worker worker URL PREFIX NAME
    claim tasks until told to stop (stdin closes); print "done TASK" after each completion
python -m tests.integration._queue_worker reaper URL PREFIX
    put expired leases back every 50 ms until stdin closes
python -m tests.integration._queue_worker indexer URL PREFIX COUNT
    add COUNT processed documents (and every 7th a failure) one increment at a time
python -m tests.integration._queue_worker holder URL PREFIX NAME
    run one command per stdin line, print one line per command: `claim MS` (a claim under a
    lease of MS ms: "claimed TASK TOKEN" or "none"), `complete TASK TOKEN`, `heartbeat TASK
    TOKEN`, `fail TASK TOKEN` ("ok" or "refused ERROR"); URL is any backend URL
python -m tests.integration._queue_worker loop URL PREFIX NAME [hang]
    print "ready", then `run_worker` until stdin closes (then stop gracefully); the handler
    prints "started TASK" and returns {"by": NAME}, or with `hang` never returns (the test
    kills the process); URL is any backend URL. No reaper runs anywhere.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio

from agenticstate import (
    AgenticStateError,
    KnowledgeStateManager,
    OrchestrationStateManager,
    StateConfig,
    StateManager,
    open_backend,
)

if TYPE_CHECKING:
    from agenticstate import TaskItem

TEAM = "crew"
LEASE = timedelta(milliseconds=600)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def until_stdin_closes(scope: anyio.CancelScope) -> None:
    await anyio.to_thread.run_sync(sys.stdin.read)
    scope.cancel()


async def worker(orch: OrchestrationStateManager, name: str) -> None:
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(until_stdin_closes, scope)
            while True:
                claim = await orch.claim_task(TEAM, name, lease=LEASE)
                if claim is None:
                    await anyio.sleep(0.01)  # an idle worker polls the queue
                    continue
                await anyio.sleep(0.002)  # the work
                await orch.complete_task(
                    TEAM, claim.task_id, {"by": name}, lease_token=claim.lease_token
                )
                say(f"done {claim.task_id}")


async def reaper(orch: OrchestrationStateManager) -> None:
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(until_stdin_closes, scope)
            while True:
                for task_id in await orch.reap_expired(TEAM):
                    say(f"reaped {task_id}")
                await anyio.sleep(0.05)  # the reaper's period


async def indexer(kb: KnowledgeStateManager, count: int) -> None:
    for i in range(count):
        failed = 1 if i % 7 == 0 else 0
        await kb.increment_progress("kb", processed=1 - failed, failed=failed, embeddings=2)
    say("indexed")


async def holder(orch: OrchestrationStateManager, name: str) -> None:
    """One worker's calls, one per stdin line: the test decides when each happens."""
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        command, *args = line.split()
        try:
            if command == "claim":
                lease = timedelta(milliseconds=int(args[0]))
                claim = await orch.claim_task(TEAM, name, lease=lease)
                say("none" if claim is None else f"claimed {claim.task_id} {claim.lease_token}")
                continue
            task_id, token = args
            if command == "complete":
                await orch.complete_task(TEAM, task_id, {"by": name}, lease_token=token)
            elif command == "heartbeat":
                await orch.heartbeat(TEAM, task_id, token)
            else:
                await orch.fail_task(TEAM, task_id, f"failed by {name}", lease_token=token)
            say("ok")
        except AgenticStateError as exc:
            say(f"refused {type(exc).__name__}")


async def loop(orch: OrchestrationStateManager, name: str, hang: bool) -> None:
    """The documented worker loop, stopped gracefully when stdin closes."""
    stop = anyio.Event()

    async def handler(task: TaskItem) -> dict[str, str]:
        say(f"started {task.task_id}")
        if hang:
            await anyio.sleep_forever()
        return {"by": name}

    async def stop_when_stdin_closes() -> None:
        await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_stdin_closes)
        say("ready")
        # Heartbeats well inside the lease: a busy machine may hold a beat back a while.
        await orch.run_worker(
            TEAM, name, handler, lease=LEASE, heartbeat_interval=0.05, poll_interval=0.02, stop=stop
        )
        tg.cancel_scope.cancel()


async def main(mode: str, url: str, prefix: str, arg: str = "", flag: str = "") -> None:
    if mode in ("holder", "loop"):
        async with StateManager(backend=open_backend(url, key_prefix=prefix)) as state:
            orch = OrchestrationStateManager(state_manager=state)
            if mode == "holder":
                await holder(orch, arg)
            else:
                await loop(orch, arg, hang=flag == "hang")
        return
    state = StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=prefix))
    try:
        if mode == "worker":
            await worker(OrchestrationStateManager(state_manager=state), arg)
        elif mode == "reaper":
            await reaper(OrchestrationStateManager(state_manager=state))
        elif mode == "indexer":
            await indexer(KnowledgeStateManager(state_manager=state), int(arg))
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        await state.aclose()


if __name__ == "__main__":
    args = [*sys.argv[1:], "", ""]
    anyio.run(main, args[0], args[1], args[2], args[3], args[4])
