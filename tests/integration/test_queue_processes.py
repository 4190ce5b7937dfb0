"""The task queue and indexing counts across real processes on Redis, with workers killed."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import (
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    PostgresBackend,
    RedisBackend,
    SQLiteBackend,
    StateConfig,
    StateManager,
    TaskItem,
    TaskStatus,
    TeamState,
)
from tests.helpers import LineProcess, unique_prefix
from tests.integration._queue_worker import LEASE, TEAM

if TYPE_CHECKING:
    from agenticstate.backends import Backend

pytestmark = pytest.mark.redis

ROOT = Path(__file__).parent.parent.parent
TASKS = 1000


def Proc(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._queue_worker", *args)


@pytest.mark.parametrize("with_reaper", [True, False], ids=["reaper", "claims-only"])
async def test_workers_killed_and_reaped_lose_no_task(redis_url: str, with_reaper: bool) -> None:
    """4 worker processes x 250 tasks, one SIGKILLed every so often, with a reaper running or
    with none (the workers' claims take the dead workers' tasks back): every task completed,
    none lost, none held by two workers at once."""
    prefix = unique_prefix()
    config = StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
    async with StateManager(config) as state:
        orch = OrchestrationStateManager(state_manager=state)
        await orch.create_team(TeamState(team_id=TEAM))
        for n in range(TASKS):
            await orch.enqueue_task(TEAM, {"id": f"t{n:04d}"})

    rng = random.Random(7)
    reaper = Proc("reaper", redis_url, prefix) if with_reaper else None
    workers = {f"w{n}": Proc("worker", redis_url, prefix, f"w{n}") for n in range(4)}
    killed: list[LineProcess] = []
    try:
        for generation in range(4, 10):
            # A worker already completing tasks, killed right after its next completion: a
            # freshly started one could find the queue drained by the others (workers are fast).
            working = sorted(name for name, proc in workers.items() if proc.lines)
            victim_name = rng.choice(working or sorted(workers))
            victim = workers.pop(victim_name)
            if not victim.wait_lines(len(victim.lines) + 1, timeout=30):
                workers[victim_name] = victim  # the queue ran dry before the kill
                break
            victim.kill()
            killed.append(victim)
            workers[f"w{generation}"] = Proc("worker", redis_url, prefix, f"w{generation}")

        async with (
            StateManager(config) as state,
            state.watch(f"teams:{{{TEAM}}}:tasks:*") as changes,
        ):
            orch = OrchestrationStateManager(state_manager=state)
            completed = {task.task_id for task in (await orch.get_queue_status(TEAM)).completed}
            with anyio.fail_after(120):
                while len(completed) < TASKS:
                    change = await changes.__anext__()
                    if change.new_value and change.new_value["status"] == "completed":
                        completed.add(change.key.rsplit(":", 1)[1])
            queue = await orch.get_queue_status(TEAM)
    finally:
        for proc in workers.values():
            proc.stop()
        if reaper is not None:
            reaper.stop()
    kills = len(killed)
    finished = killed

    assert kills >= 3
    assert len(queue.completed) == TASKS
    assert queue.pending == queue.in_progress == queue.dead_letter == []
    completions = Counter(
        line.split()[1] for p in [*workers.values(), *finished] for line in p.lines
    )
    # Every task completed; a task completed twice would mean two workers held it at once
    # (the lease token makes a late completion fail instead).
    assert set(completions) <= {f"t{n:04d}" for n in range(TASKS)}
    assert max(completions.values()) == 1
    results = {task.task_id: task.result["by"] for task in queue.completed}
    for task_id, count in completions.items():
        assert count == 1
        assert task_id in results


async def test_four_indexer_processes_count_exactly(redis_url: str) -> None:
    """4 indexer processes x 150 increments: processed and failed totals are exact."""
    prefix = unique_prefix()
    config = StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
    async with StateManager(config) as state:
        kb = KnowledgeStateManager(state_manager=state)
        await kb.update_indexing_progress(
            IndexingProgress(knowledge_base_id="kb", total_documents=600)
        )
    procs = [Proc("indexer", redis_url, prefix, "150") for _ in range(4)]
    for proc in procs:
        assert proc.wait_until(lambda lines: "indexed" in lines, timeout=120), proc.close()
        proc.stop()
    async with StateManager(config) as state:
        progress = await KnowledgeStateManager(state_manager=state).get_indexing_progress("kb")
    assert progress is not None
    failed_each = len([i for i in range(150) if i % 7 == 0])
    assert progress.failed_documents == 4 * failed_each
    assert progress.processed_documents == 4 * (150 - failed_each)
    assert progress.embeddings_generated == 2 * 600


def _ask(proc: LineProcess, command: str) -> str:
    """Send one command to a holder process and return its one-line answer."""
    count = len(proc.lines)
    assert proc.process.stdin is not None
    proc.process.stdin.write(command + "\n")
    proc.process.stdin.flush()
    assert proc.wait_lines(count + 1, timeout=60), proc.close()
    return proc.lines[count]


@pytest.mark.parametrize(
    "kind", ["redis", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_reaped_process_cannot_touch_a_task_enqueued_again(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """Issue #32, across processes: worker 1 claims x and stalls, the reaper puts x back,
    worker 2 completes it, x is purged and enqueued again and worker 3 claims it; worker 1's
    complete, heartbeat and fail with its old token are refused, worker 3's accepted."""
    prefix = unique_prefix()
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        backend: Backend = RedisBackend(url=url, key_prefix=prefix)
    elif kind == "postgres":
        url = request.getfixturevalue("postgres_url")
        backend = PostgresBackend(url, key_prefix=prefix)
    else:
        url = f"sqlite:///{tmp_path / 'queue.db'}"
        backend = SQLiteBackend(tmp_path / "queue.db", key_prefix=prefix)
    holders = {name: Proc("holder", url, prefix, name) for name in ("w1", "w2", "w3")}
    try:
        async with StateManager(backend=backend) as state:
            orch = OrchestrationStateManager(state_manager=state)
            await orch.create_team(TeamState(team_id=TEAM))
            await orch.enqueue_task(TEAM, {"id": "x"})
            _, task, stale = _ask(holders["w1"], "claim 300").split()
            assert task == "x"
            await anyio.sleep(0.32)  # let the lease run out: wall-clock expiry
            assert await orch.reap_expired(TEAM) == ["x"]
            assert not await state.exists(f"teams:{{{TEAM}}}:leases:x:{stale}")
            _, _, second = _ask(holders["w2"], "claim 60000").split()
            assert _ask(holders["w2"], f"complete x {second}") == "ok"
            assert await orch.purge_finished(TEAM) == 1
            await orch.enqueue_task(TEAM, {"id": "x"})
            _, _, third = _ask(holders["w3"], "claim 60000").split()
            for command in ("complete", "heartbeat", "fail"):
                answer = _ask(holders["w1"], f"{command} x {stale}")
                assert answer == "refused ConflictError", (command, answer)
            held = await orch.get_task(TEAM, "x")
            assert (held.status, held.assigned_to, held.lease_token) == (
                TaskStatus.IN_PROGRESS,
                "w3",
                third,
            )
            assert _ask(holders["w3"], f"heartbeat x {third}") == "ok"
            assert _ask(holders["w3"], f"complete x {third}") == "ok"
            done = await orch.get_task(TEAM, "x")
            assert (done.status, done.assigned_to, done.result) == (
                TaskStatus.COMPLETED,
                "w3",
                {"by": "w3"},
            )
    finally:
        for proc in holders.values():
            proc.stop()


@pytest.mark.parametrize(
    "kind", ["redis", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_killed_worker_s_task_is_done_by_another_worker_with_no_reaper(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """Two `run_worker` processes and no reap call anywhere: while the first one's handler runs
    past its lease, its heartbeats keep the task from the second; once it is SIGKILLed mid-task,
    the second one's next claim takes the task back and completes it."""
    prefix = unique_prefix()
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        backend: Backend = RedisBackend(url=url, key_prefix=prefix)
    elif kind == "postgres":
        url = request.getfixturevalue("postgres_url")
        backend = PostgresBackend(url, key_prefix=prefix)
    else:
        url = f"sqlite:///{tmp_path / 'queue.db'}"
        backend = SQLiteBackend(tmp_path / "queue.db", key_prefix=prefix)
    key = f"teams:{{{TEAM}}}:tasks:x"
    victim = Proc("loop", url, prefix, "victim", "hang")
    rescuer: LineProcess | None = None
    try:
        async with StateManager(backend=backend) as state, state.watch(key) as changes:
            orch = OrchestrationStateManager(state_manager=state)
            await orch.create_team(TeamState(team_id=TEAM))
            await orch.enqueue_task(TEAM, {"id": "x"})
            assert victim.wait_until(lambda lines: "started x" in lines), victim.close()
            claimed = await orch.get_task(TEAM, "x")
            assert claimed.lease_expires_at is not None
            rescuer = Proc("loop", url, prefix, "rescuer")
            assert rescuer.wait_until(lambda lines: "ready" in lines), rescuer.close()
            # Heartbeats, while the rescuer claims every 20 ms: until the victim has held the
            # task for two leases, well past the lease its claim took.
            with anyio.fail_after(60):
                while True:
                    change = await changes.__anext__()
                    expires = TaskItem.model_validate(change.new_value).lease_expires_at
                    if expires is not None and expires - claimed.lease_expires_at >= 2 * LEASE:
                        break
            held = await orch.get_task(TEAM, "x")
            assert (held.assigned_to, held.attempts, held.status) == (
                "victim",
                1,
                TaskStatus.IN_PROGRESS,
            )
            assert rescuer.lines == ["ready"]
            victim.kill()
            with anyio.fail_after(60):
                while (change := await changes.__anext__()).new_value["status"] != "completed":
                    pass
            done = await orch.get_task(TEAM, "x")
    finally:
        victim.close()
        if rescuer is not None:
            rescuer.stop()
    assert (done.result, done.attempts, done.failures) == ({"by": "rescuer"}, 2, 0)
    assert rescuer.lines == ["ready", "started x"]
