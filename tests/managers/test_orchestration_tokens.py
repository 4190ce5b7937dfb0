"""Claim tokens against a model of task lives (hypothesis), on every backend.

Generated programs enqueue two task ids over and over (deleting, purging, recycling (a delete
and an enqueue at once) and reaping between, by `reap_expired` and by claims that find a short
lease run out),
and three workers, each with its own queue (as three processes: each remembers its own claims),
claim, heartbeat, complete and fail with every claim they ever got, stale ones included (each
call is made by the worker that got the claim). The
model numbers each life of a task (a new one after every delete or purge) and knows the claim
it is under: a call with a claim goes through exactly when the task is in that life, in
progress under that very claim; anything else is refused (`ConflictError`, or `NotFoundError`
for a task that is gone) and changes nothing. Issue #32's class: a token from an earlier life of
a task never matches again. (`test_orchestration.py` replays the issue's exact history, which
also needs the old claim's lease marker to outlive the reap: rare in generated programs.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import (
    ConflictError,
    NotFoundError,
    OrchestrationStateManager,
    TaskStatus,
    TeamState,
)
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate import StateManager, TaskClaim

IDS = ["x", "y"]
WORKERS = 3
MAX_RETRIES = 1
# Every short lease runs out before the next `reap`; its lease marker (which lives twice the
# lease) may outlive the reap, as a stalled worker's did in issue #32.
LEASE = timedelta(milliseconds=20)
REAP_WAIT = 0.021  # seconds: past every short lease
MAX_REAPS = 2  # per example: waiting for leases to run out costs real time
LONG = timedelta(minutes=5)

Op = tuple[str, int, int]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("enqueue"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("claim"), st.integers(0, WORKERS - 1), st.booleans().map(int)),
        st.tuples(st.just("claim"), st.integers(0, WORKERS - 1), st.booleans().map(int)),
        st.tuples(
            st.sampled_from(["complete", "heartbeat", "fail"]),
            st.integers(0, 7),  # which claim of the program, counting back from the newest
            st.just(0),
        ),
        st.tuples(
            st.sampled_from(["complete", "heartbeat", "fail"]),
            st.integers(0, 7),
            st.just(0),
        ),
        st.tuples(st.just("reap"), st.just(0), st.just(0)),
        st.tuples(st.just("delete"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("recycle"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("purge"), st.just(0), st.just(0)),
    ),
    min_size=12,
    max_size=40,
)


@dataclass
class Life:
    """One life of a task id, as the model has it."""

    number: int
    sequence: int
    status: TaskStatus = TaskStatus.PENDING
    token: str | None = None  # the claim it is under
    holder: int | None = None
    leased: bool = False  # claimed with the short lease (so `reap` takes it back)
    expires: datetime | None = None  # when that short lease runs out
    failures: int = 0


@dataclass
class Model:
    lives: dict[str, Life] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    sequence: int = 0
    # Every claim of the program: the worker, the task id, the life it was of, the claim.
    claims: list[tuple[int, str, int, TaskClaim]] = field(default_factory=list)

    def next_pending(self) -> str | None:
        pending = [
            (life.sequence, tid)
            for tid, life in self.lives.items()
            if life.status is TaskStatus.PENDING
        ]
        return min(pending)[1] if pending else None


async def _run(state: StateManager, team_id: str, ops: list[Op]) -> dict[str, int]:
    workers = [
        OrchestrationStateManager(state_manager=state, max_retries=MAX_RETRIES)
        for _ in range(WORKERS)
    ]
    admin = OrchestrationStateManager(state_manager=state, max_retries=MAX_RETRIES)
    await admin.create_team(TeamState(team_id=team_id))
    model = Model()
    seen = {"stale": 0, "current": 0, "reaps": 0}
    life: Life | None
    for kind, a, b in ops:
        if kind == "enqueue":
            tid = IDS[a]
            if tid in model.lives:
                with pytest.raises(ConflictError):
                    await admin.enqueue_task(team_id, {"id": tid})
                continue
            model.sequence += 1
            model.lives[tid] = Life(next(model.counter), model.sequence)
            await admin.enqueue_task(team_id, {"id": tid})
        elif kind == "claim":
            lease = LEASE if b else LONG
            life = None
            claim = await workers[a].claim_task(team_id, f"w{a}", lease=lease)
            await _reclaimed(admin, team_id, model, claim, datetime.now(UTC))
            wanted = model.next_pending()
            assert (None if claim is None else claim.task_id) == wanted
            if claim is not None:
                life = model.lives[claim.task_id]
                life.status, life.token, life.holder, life.leased = (
                    TaskStatus.IN_PROGRESS,
                    claim.lease_token,
                    a,
                    bool(b),
                )
                life.expires = claim.lease_expires_at
                model.claims.append((a, claim.task_id, life.number, claim))
        elif kind in ("complete", "heartbeat", "fail"):
            if not model.claims:
                continue
            owner, tid, number, claim = model.claims[-1 - a % len(model.claims)]
            life = model.lives.get(tid)
            holds = (
                life is not None
                and life.number == number
                and life.status is TaskStatus.IN_PROGRESS
                and life.token == claim.lease_token
            )
            seen["current" if holds else "stale"] += 1
            worker = workers[owner]
            if kind == "complete":
                call = worker.complete_task(
                    team_id, tid, {"by": owner}, lease_token=claim.lease_token
                )
            elif kind == "heartbeat":
                call = worker.heartbeat(team_id, tid, claim.lease_token, lease=LONG)
            else:
                call = worker.fail_task(team_id, tid, "boom", lease_token=claim.lease_token)
            if not holds:
                with pytest.raises((ConflictError, NotFoundError)):
                    await call
                continue
            await call
            assert life is not None
            if kind == "complete":
                life.status, life.leased = TaskStatus.COMPLETED, False  # it keeps the token
            elif kind == "heartbeat":
                life.leased = False  # the heartbeat gave it a long lease: `reap` leaves it
            else:
                life.failures += 1
                dead = life.failures > MAX_RETRIES
                life.status = TaskStatus.DEAD_LETTER if dead else TaskStatus.PENDING
                life.token, life.holder, life.leased = None, None, False
        elif kind == "reap":
            if seen["reaps"] >= MAX_REAPS:
                continue
            seen["reaps"] += 1
            await anyio.sleep(REAP_WAIT)  # the short leases run out (wall-clock expiry)
            reaped = await admin.reap_expired(team_id)
            due = sorted(
                tid
                for tid, life in model.lives.items()
                if life.status is TaskStatus.IN_PROGRESS and life.leased
            )
            assert sorted(reaped) == due
            for tid in due:
                life = model.lives[tid]
                life.status, life.token, life.holder, life.leased = (
                    TaskStatus.PENDING,
                    None,
                    None,
                    False,
                )
        elif kind == "recycle":  # delete (if there) and enqueue again at once: a new life
            tid = IDS[a]
            if tid in model.lives:
                await admin.delete_task(team_id, tid)
            model.sequence += 1
            model.lives[tid] = Life(next(model.counter), model.sequence)
            await admin.enqueue_task(team_id, {"id": tid})
        elif kind == "delete":
            tid = IDS[a]
            if tid not in model.lives:
                with pytest.raises(NotFoundError):
                    await admin.delete_task(team_id, tid)
                continue
            await admin.delete_task(team_id, tid)
            del model.lives[tid]
        else:
            finished = [
                tid
                for tid, life in model.lives.items()
                if life.status in (TaskStatus.COMPLETED, TaskStatus.DEAD_LETTER)
            ]
            assert await admin.purge_finished(team_id) == len(finished)
            for tid in finished:
                del model.lives[tid]
        await _check(admin, team_id, model)
    return seen


async def _reclaimed(
    admin: OrchestrationStateManager,
    team_id: str,
    model: Model,
    claim: TaskClaim | None,
    ended: datetime,
) -> None:
    """Put back to pending, in the model, the short leases the claim found run out and took
    back. A lease still running when the claim returned must not have been taken back (the
    `_check` after the step holds that); one that ran out before may or may not have been (a
    claim reads the in-progress index with the pending one, or uses the copy its process's
    last completion read, which may be older), so the store says which."""
    for tid, life in model.lives.items():
        if not (life.status is TaskStatus.IN_PROGRESS and life.leased):
            continue
        assert life.expires is not None
        if life.expires > ended:
            continue
        task = await admin.get_task(team_id, tid)
        taken = claim is not None and task.lease_token == claim.lease_token
        if task.status is TaskStatus.PENDING or taken:
            life.status, life.token, life.holder, life.leased = (
                TaskStatus.PENDING,
                None,
                None,
                False,
            )


async def _check(admin: OrchestrationStateManager, team_id: str, model: Model) -> None:
    """Every task as the model has it: status, holder, claim; nothing a refused call wrote."""
    for tid in IDS:
        life = model.lives.get(tid)
        if life is None:
            with pytest.raises(NotFoundError):
                await admin.get_task(team_id, tid)
            continue
        task = await admin.get_task(team_id, tid)
        holder = None if life.holder is None else f"w{life.holder}"
        assert (task.status, task.lease_token) == (life.status, life.token), tid
        if life.status is TaskStatus.IN_PROGRESS:
            assert task.assigned_to == holder, tid
        if life.status is TaskStatus.COMPLETED:
            assert task.result == {"by": life.holder}, tid


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_claims_of_an_earlier_life_never_match_again(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Any program of enqueues, claims, reaps, deletes, purges and calls with old and new
    claims: exactly the calls with the task's current claim in its current life go through."""
    ids = itertools.count()
    totals = {"stale": 0, "current": 0, "reaps": 0}
    with open_state(backend_name, request, tmp_path) as (portal, state):

        @settings(
            max_examples=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(ops=OPS)
        def check(ops: list[Op]) -> None:
            seen = portal.call(_run, state, f"team-{next(ids)}", ops)
            for name, count in seen.items():
                totals[name] += count

        check()
    assert totals["stale"] > 0, totals
    assert totals["current"] > 0, totals
