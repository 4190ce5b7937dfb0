"""Leases that run out come back on the claim path, and the worker loop, on every backend.

A claim that finds a lease run out puts its task back to pending in one atomic step and then
takes tasks in queue order, with no reaper; `run_worker` claims, runs its handler under
heartbeats, completes or fails the task, stops gracefully on `stop` and gives its task back
when cancelled. The same across processes, with SIGKILL: tests/integration/test_queue_processes.py.
"""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import (
    ConflictError,
    InvalidArgumentError,
    OrchestrationStateManager,
    TaskItem,
    TaskQueueState,
    TaskStatus,
    TeamState,
)

if TYPE_CHECKING:
    from agenticstate import StateManager

TEAM = "crew"
RAN_OUT = timedelta(microseconds=1)
"""A lease that has run out by the time anyone reads it."""


@pytest.fixture
async def admin(state: StateManager) -> OrchestrationStateManager:
    manager = OrchestrationStateManager(state_manager=state)
    await manager.create_team(TeamState(team_id=TEAM))
    return manager


def worker(state: StateManager, **options: Any) -> OrchestrationStateManager:
    """A manager of its own, as a worker in another process has (it knows no revisions)."""
    return OrchestrationStateManager(state_manager=state, **options)


async def _in_progress(state: StateManager) -> list[str]:
    return [member for member, _ in await state.index_range(f"teams:{{{TEAM}}}:in-progress")]


# ------------------------------------------------------------------ claims take leases back


async def test_a_claim_takes_back_a_task_whose_lease_ran_out(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """A holder stops heartbeating: the next claim, anywhere, gets the task under a new lease,
    with no reap call; the old holder's calls are refused."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    first = await worker(state).claim_task(TEAM, "w1", lease=RAN_OUT)
    assert first is not None
    second = await worker(state).claim_task(TEAM, "w2")
    assert second is not None
    assert (second.task_id, second.task.attempts, second.task.failures) == ("x", 2, 0)
    assert second.lease_token != first.lease_token
    assert await _in_progress(state) == [f"x:{second.lease_token}"]
    for call in (
        admin.complete_task(TEAM, "x", "late", lease_token=first.lease_token),
        admin.heartbeat(TEAM, "x", first.lease_token),
        admin.fail_task(TEAM, "x", "late", lease_token=first.lease_token),
    ):
        with pytest.raises(ConflictError):
            await call
    done = await admin.complete_task(TEAM, "x", "ok", lease_token=second.lease_token)
    assert (done.status, done.assigned_to, done.result) == (TaskStatus.COMPLETED, "w2", "ok")


@pytest.mark.parametrize(
    ("expired", "waiting", "order"),
    [
        ("low", "high", ["waiting", "expired"]),
        ("high", "low", ["expired", "waiting"]),
        ("normal", "normal", ["expired", "waiting"]),  # the expired one was enqueued first
    ],
)
async def test_a_task_taken_back_keeps_its_place_in_the_queue(
    state: StateManager,
    admin: OrchestrationStateManager,
    expired: str,
    waiting: str,
    order: list[str],
) -> None:
    """A task whose lease ran out goes back to its place (priority, then enqueue order): the
    claims that follow take it and the pending ones in queue order."""
    await admin.enqueue_task(TEAM, {"id": "expired", "priority": expired})
    assert await worker(state).claim_task(TEAM, "w1", lease=RAN_OUT) is not None
    await admin.enqueue_task(TEAM, {"id": "waiting", "priority": waiting})
    w2 = worker(state)
    taken = [await w2.claim_task(TEAM, "w2"), await w2.claim_task(TEAM, "w2")]
    assert [claim.task_id for claim in taken if claim is not None] == order
    assert await w2.claim_task(TEAM, "w2") is None


async def test_a_claim_leaves_a_heartbeated_lease_alone(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """A claim whose index says a lease ran out, where a heartbeat extended it, takes nothing and
    moves the index entry to the new expiry."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    holder = worker(state)
    claim = await holder.claim_task(TEAM, "w1", lease=RAN_OUT)
    assert claim is not None
    extended = await holder.heartbeat(TEAM, "x", claim.lease_token, lease=timedelta(minutes=5))
    assert await worker(state).claim_task(TEAM, "w2") is None
    held = await admin.get_task(TEAM, "x")
    assert (held.assigned_to, held.lease_token) == ("w1", claim.lease_token)
    entries = await state.index_range(f"teams:{{{TEAM}}}:in-progress")
    assert extended.lease_expires_at is not None
    [(member, score)] = entries
    assert member == f"x:{claim.lease_token}"
    assert score == pytest.approx(extended.lease_expires_at.timestamp())


async def test_a_claim_after_a_completion_takes_back_too(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """The claim right after a completion picks from what the completion's step read ahead
    (the queue's head and the first lease to run out): it takes back the lease that ran out,
    in queue order."""
    for task_id in ("a", "b", "c"):
        await admin.enqueue_task(TEAM, {"id": task_id})
    w2 = worker(state)
    a = await w2.claim_task(TEAM, "w2")
    assert a is not None
    assert a.task_id == "a"
    b = await worker(state).claim_task(TEAM, "w1", lease=RAN_OUT)
    assert b is not None
    assert b.task_id == "b"
    await w2.complete_task(TEAM, "a", 1, lease_token=a.lease_token)
    again = await w2.claim_task(TEAM, "w2")
    assert again is not None
    assert (again.task_id, again.task.attempts) == ("b", 2)


async def test_many_claims_take_a_run_out_lease_back_once(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """Eight workers claiming at once, one task whose lease ran out: exactly one gets it."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    assert await worker(state).claim_task(TEAM, "w0", lease=RAN_OUT) is not None
    got: list[str] = []

    async def claim(name: str) -> None:
        found = await worker(state).claim_task(TEAM, name)
        if found is not None:
            got.append(found.lease_token)

    async with anyio.create_task_group() as tg:
        for n in range(1, 9):
            tg.start_soon(claim, f"w{n}")
    assert len(got) == 1
    task = await admin.get_task(TEAM, "x")
    assert (task.lease_token, task.attempts) == (got[0], 2)
    assert await _in_progress(state) == [f"x:{got[0]}"]
    queue = await admin.get_queue_status(TEAM)
    assert [t.task_id for t in queue.in_progress] == ["x"]
    assert queue.pending == []


# ------------------------------------------------------------------ the worker loop


async def test_run_worker_completes_tasks_and_fails_what_raises(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """Returned values complete tasks; an exception fails its task through retries to the dead
    letter; `until_empty` returns with the count of handler runs."""
    await admin.enqueue_task(TEAM, {"id": "a", "data": {"n": 1}})
    await admin.enqueue_task(TEAM, {"id": "boom", "max_retries": 1})
    await admin.enqueue_task(TEAM, {"id": "b", "data": {"n": 2}})

    async def handler(task: TaskItem) -> dict[str, int]:
        if task.task_id == "boom":
            raise RuntimeError("source unavailable")
        return {"double": 2 * task.data["n"]}

    ran = await worker(state).run_worker(TEAM, "w", handler, until_empty=True)
    assert ran == 4  # a, boom, b, boom again
    queue = await admin.get_queue_status(TEAM)
    assert {t.task_id: t.result for t in queue.completed} == {
        "a": {"double": 2},
        "b": {"double": 4},
    }
    [dead] = queue.dead_letter
    assert (dead.task_id, dead.failures, dead.error) == (
        "boom",
        2,
        "RuntimeError: source unavailable",
    )


async def test_heartbeats_keep_a_task_past_its_lease(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """A handler running for several leases keeps its task: claims by another worker meanwhile
    find nothing, and the task is completed once, by its first claim."""
    lease = timedelta(milliseconds=600)  # twelve beats (one every 50 ms): room on a busy machine
    await admin.enqueue_task(TEAM, {"id": "long"})
    rival = worker(state)
    key = f"teams:{{{TEAM}}}:tasks:long"
    rival_claims: list[object] = []

    async def handler(task: TaskItem) -> str:
        assert task.lease_expires_at is not None
        async with state.watch(key) as changes:
            with anyio.fail_after(60):
                while True:
                    change = await changes.__anext__()
                    beat = TaskItem.model_validate(change.new_value)
                    rival_claims.append(await rival.claim_task(TEAM, "rival"))
                    assert beat.lease_expires_at is not None
                    if beat.lease_expires_at - task.lease_expires_at >= 2 * lease:
                        break
        assert datetime.now(UTC) > task.lease_expires_at  # the premise: it ran past its lease
        return "done"

    ran = await worker(state).run_worker(
        TEAM, "w", handler, lease=lease, heartbeat_interval=0.05, max_tasks=1
    )
    assert ran == 1
    done = await admin.get_task(TEAM, "long")
    assert (done.status, done.result, done.attempts, done.assigned_to) == (
        TaskStatus.COMPLETED,
        "done",
        1,
        "w",
    )
    assert len(rival_claims) >= 3
    assert set(rival_claims) == {None}


async def test_a_worker_whose_lease_is_lost_stops_its_handler(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """When a heartbeat finds the task gone (deleted, or taken by another worker), the handler
    is cancelled, its outcome dropped, and the worker goes on."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    started, cancelled = anyio.Event(), anyio.Event()

    async def handler(task: TaskItem) -> str:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return "never"

    async with anyio.create_task_group() as tg:

        async def run() -> None:
            ran = await worker(state).run_worker(
                TEAM,
                "w",
                handler,
                lease=timedelta(seconds=30),
                heartbeat_interval=0.01,
                until_empty=True,
            )
            assert ran == 1

        tg.start_soon(run)
        with anyio.fail_after(30):
            await started.wait()
            await admin.delete_task(TEAM, "x")
            await cancelled.wait()
    assert await admin.get_queue_status(TEAM) == TaskQueueState()


async def test_stop_lets_the_task_in_hand_finish(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """Setting `stop` while a handler runs: the task completes, no further task is claimed."""
    await admin.enqueue_task(TEAM, {"id": "first"})
    await admin.enqueue_task(TEAM, {"id": "second"})
    stop, started, go = anyio.Event(), anyio.Event(), anyio.Event()

    async def handler(task: TaskItem) -> str:
        started.set()
        await go.wait()
        return task.task_id

    ran: list[int] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            ran.append(await worker(state).run_worker(TEAM, "w", handler, stop=stop))

        tg.start_soon(run)
        with anyio.fail_after(30):
            await started.wait()
            stop.set()
            go.set()
    assert ran == [1]
    assert (await admin.get_task(TEAM, "first")).status is TaskStatus.COMPLETED
    assert (await admin.get_task(TEAM, "second")).status is TaskStatus.PENDING


async def test_stop_wakes_an_idle_worker(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """An idle worker waiting for tasks returns as soon as `stop` is set."""
    stop = anyio.Event()
    ran: list[int] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                ran.append(
                    await worker(state).run_worker(
                        TEAM, "w", lambda task: None, stop=stop, poll_interval=3600
                    )
                )

            tg.start_soon(run)
            await anyio.wait_all_tasks_blocked()
            stop.set()
    assert ran == [0]


async def test_a_cancelled_worker_gives_its_task_back(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """Cancelling a worker mid-task cancels the handler and puts the task back to pending at once,
    counting no failure; the next claim takes it."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    started = anyio.Event()

    async def handler(task: TaskItem) -> None:
        started.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker(state).run_worker, TEAM, "w", handler)
        with anyio.fail_after(30):
            await started.wait()
        tg.cancel_scope.cancel()
    task = await admin.get_task(TEAM, "x")
    assert (task.status, task.failures, task.attempts, task.assigned_to) == (
        TaskStatus.PENDING,
        0,
        1,
        None,
    )
    assert await _in_progress(state) == []
    again = await worker(state).claim_task(TEAM, "w2")
    assert again is not None
    assert again.task_id == "x"


async def test_a_plain_function_handler_runs_in_a_thread(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """A plain (blocking) function runs in a worker thread, so the loop keeps heartbeating."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    threads: list[threading.Thread] = []

    def handler(task: TaskItem) -> str:
        threads.append(threading.current_thread())
        return "blocking work done"

    assert await worker(state).run_worker(TEAM, "w", handler, until_empty=True) == 1
    assert threads[0] is not threading.main_thread()
    assert (await admin.get_task(TEAM, "x")).result == "blocking work done"


async def test_an_unstorable_result_fails_the_task(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """A handler returning what cannot be stored fails its task (naming `$.result`), and the
    worker goes on."""
    await admin.enqueue_task(TEAM, {"id": "x", "max_retries": 0})
    await admin.enqueue_task(TEAM, {"id": "y"})

    async def handler(task: TaskItem) -> object:
        return {1, 2} if task.task_id == "x" else "fine"

    assert await worker(state).run_worker(TEAM, "w", handler, until_empty=True) == 2
    x = await admin.get_task(TEAM, "x")
    assert x.status is TaskStatus.DEAD_LETTER
    assert x.error is not None
    assert "$.result" in x.error
    assert (await admin.get_task(TEAM, "y")).result == "fine"


@pytest.mark.parametrize(
    "options",
    [
        {"max_tasks": 0},
        {"max_tasks": 1.5},
        {"stop": threading.Event()},
        {"heartbeat_interval": -1},
        {"poll_interval": "fast"},
        {"lease": 30},
        {"lease": timedelta(seconds=0.5), "heartbeat_interval": 2.0},
        {"lease": timedelta(seconds=2), "heartbeat_interval": 2.0},
        {"lease": timedelta(seconds=2), "heartbeat_interval": timedelta(seconds=3)},
    ],
    # An id without the Event's address: the same in every process (pytest-xdist's workers
    # each collect the suite and must agree on the ids).
    ids=lambda options: re.sub(r" at 0x[0-9a-f]+", "", str(options)),
)
async def test_run_worker_refuses_bad_arguments(
    state: StateManager, admin: OrchestrationStateManager, options: dict[str, Any]
) -> None:
    """Bad options raise InvalidArgumentError before anything is claimed."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    with pytest.raises(InvalidArgumentError):
        await worker(state).run_worker(TEAM, "w", lambda task: None, **options)
    with pytest.raises(InvalidArgumentError):
        await worker(state).run_worker(TEAM, "w", "not callable")  # type: ignore[arg-type]
    assert (await admin.get_task(TEAM, "x")).status is TaskStatus.PENDING


async def test_release_task_gives_a_task_back(
    state: StateManager, admin: OrchestrationStateManager
) -> None:
    """`release_task` by the holder puts the task back in its place, counting no failure; the old
    claim is over."""
    await admin.enqueue_task(TEAM, {"id": "x"})
    await admin.enqueue_task(TEAM, {"id": "y"})
    w = worker(state)
    claim = await w.claim_task(TEAM, "w")
    assert claim is not None
    back = await w.release_task(TEAM, "x", lease_token=claim.lease_token)
    assert (back.status, back.failures, back.attempts, back.lease_token) == (
        TaskStatus.PENDING,
        0,
        1,
        None,
    )
    with pytest.raises(ConflictError):
        await w.heartbeat(TEAM, "x", claim.lease_token)
    again = await worker(state).claim_task(TEAM, "w2")
    assert again is not None
    assert again.task_id == "x"
