"""A queue worker for bench_queue_peers: agenticstate, arq or SAQ, draining a queue of no-op jobs.

`python -m bench._queue_peer_worker KIND URL QUEUE NAME` (KIND: agenticstate, arq or saq) sets up,
prints `ready`, waits for `go` on stdin, processes jobs until the queue is empty, and prints
`COUNT LAST` as its last line: how many jobs it completed and the `time.monotonic()` reading
right after its last completion (0 if none). `time.monotonic()` is one clock for every process on
Linux, so the parent can time the whole run from its `go` to the last completion of any worker,
leaving out start-up and each library's way of noticing the queue is empty (arq re-counts the
queue; SAQ waits out a dequeue timeout).

For agenticstate QUEUE is the key prefix (the team is "bench"); for arq and SAQ it is the queue
name. arq and SAQ run their own defaults (10 jobs at a time per worker) except for arq's
`poll_delay`, 0.5 s by default, which would cap it at about a queue read per half second: the
bench polls without a pause, arq's fastest setting.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import anyio

from agenticstate import OrchestrationStateManager, StateConfig, StateManager

SAQ_DEQUEUE_TIMEOUT = 0.2  # seconds an empty queue is waited on before a burst SAQ worker stops


async def noop(ctx: Any, **_: Any) -> None:
    """The job every library runs: nothing."""


async def wait_for_go() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await anyio.to_thread.run_sync(sys.stdin.readline)


async def run_agenticstate(url: str, queue: str, name: str) -> tuple[int, float]:
    config = StateConfig(backend="redis", redis_url=url, key_prefix=queue)
    done, last = 0, 0.0
    async with StateManager(config) as state:
        orch = OrchestrationStateManager(state_manager=state)
        await wait_for_go()
        while (claim := await orch.claim_task("bench", name)) is not None:
            await orch.complete_task("bench", claim.task_id, None, lease_token=claim.lease_token)
            done += 1
            last = time.monotonic()
    return done, last


async def run_arq(url: str, queue: str, name: str) -> tuple[int, float]:
    from arq.connections import RedisSettings, create_pool
    from arq.worker import Worker

    stamps: list[float] = []

    async def after_job_end(ctx: Any) -> None:  # after the result is recorded
        stamps.append(time.monotonic())

    pool = await create_pool(RedisSettings.from_dsn(url), default_queue_name=queue)
    worker = Worker(
        functions=[noop],
        redis_pool=pool,
        queue_name=queue,
        burst=True,
        handle_signals=False,
        poll_delay=0,
        after_job_end=after_job_end,
    )
    await wait_for_go()
    await worker.main()
    await worker.close()
    return worker.jobs_complete, max(stamps, default=0.0)


async def run_saq(url: str, queue: str, name: str) -> tuple[int, float]:
    from saq import Queue, Worker
    from saq.job import Status

    stamps: list[float] = []

    async def after_process(ctx: Any) -> None:  # after the job's final status is stored
        job = ctx.get("job")
        if job is not None and job.status == Status.COMPLETE:
            stamps.append(time.monotonic())

    connection = Queue.from_url(url, name=queue)
    await connection.connect()
    worker = Worker(
        connection,
        functions=[noop],
        burst=True,
        dequeue_timeout=SAQ_DEQUEUE_TIMEOUT,
        after_process=after_process,
    )
    await wait_for_go()
    await worker.start()
    await connection.disconnect()
    return len(stamps), max(stamps, default=0.0)


RUNNERS = {"agenticstate": run_agenticstate, "arq": run_arq, "saq": run_saq}


def main(kind: str, url: str, queue: str, name: str) -> None:
    # SAQ warns when a burst worker cancels its idle upkeep tasks on the way out: not news here.
    logging.getLogger("saq").setLevel(logging.ERROR)
    done, last = asyncio.run(RUNNERS[kind](url, queue, name))
    sys.stdout.write(f"{done} {last!r}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:5])
