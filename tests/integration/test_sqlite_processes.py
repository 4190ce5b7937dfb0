"""Several real processes on one SQLite database: atomic updates, the change feed, kill -9,
and the managers' cross-process promises (queue claims under kills, single flight, counts)."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import (
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SQLiteBackend,
    StateConfig,
    StateManager,
    TeamState,
    ToolStateManager,
    WorkflowStateManager,
    WorkflowStatus,
)
from tests.helpers import LineProcess
from tests.helpers import json_events as events
from tests.helpers import run_workflow_worker as run_to_end
from tests.helpers import spawn_workflow_worker as spawn
from tests.helpers import stop_process as stop
from tests.helpers import wait_for_event as wait_for
from tests.integration._queue_worker import TEAM
from tests.integration._workflow_worker import STEPS, WORKFLOW

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends import Change
    from agenticstate.managers.workflows import WorkflowState

TASKS = 400


def Proc(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._sqlite_proc", *args)


def ready(proc: LineProcess) -> str:
    assert proc.wait_until(lambda lines: any(x.startswith("ready") for x in lines), 60), proc.errors
    return next(x for x in proc.lines if x.startswith("ready"))


def go(proc: LineProcess) -> None:
    assert proc.process.stdin is not None
    proc.process.stdin.write("go\n")
    proc.process.stdin.flush()


def as_line(change: Change) -> dict[str, object]:
    return {
        "key": change.key,
        "op": change.op.value,
        "old": change.old.hex() if change.old is not None else None,
        "new": change.new.hex() if change.new is not None else None,
        "version": change.version,
    }


def received(proc: LineProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in proc.lines if line.startswith("{")]


async def test_four_processes_update_one_key_to_exactly_1000(tmp_path: Path) -> None:
    """update(fn) from 4 processes x 250 on one key gives exactly 1,000 (and version 1,000)."""
    db = str(tmp_path / "state.db")
    procs = [Proc("update", db, "250") for _ in range(4)]
    try:
        for proc in procs:
            ready(proc)
        for proc in procs:  # start them together
            go(proc)
        for proc in procs:
            assert proc.wait_until(lambda lines: "done" in lines, 120), proc.errors
    finally:
        for proc in procs:
            proc.stop()
    async with StateManager(StateConfig(backend="sqlite", sqlite_path=db)) as state:
        entry = await state.get_entry("counter")
    assert entry is not None
    assert (entry.value, entry.version) == (1000, 1000)


async def test_subscriber_in_another_process_receives_every_change_in_commit_order(
    tmp_path: Path,
) -> None:
    """1,000 sets, updates and deletes: another process receives each, in order, exactly."""
    db = tmp_path / "state.db"
    subscriber = Proc("subscribe", str(db), "1000")
    rng = random.Random(3)
    made: list[Change] = []
    try:
        ready(subscriber)
        async with SQLiteBackend(db) as backend:
            while len(made) < 1000:
                key = f"k{rng.randrange(12)}"
                roll = rng.random()
                if roll < 0.15:
                    deleted = await backend.delete(key)
                    if deleted is not None:
                        made.append(deleted)
                elif roll < 0.5:
                    made.append(await backend.update(key, lambda e: (e.value if e else b"") + b"+"))
                else:
                    made.append(await backend.set(key, rng.randbytes(rng.randrange(0, 300))))
        assert subscriber.wait_until(lambda lines: len(lines) >= 1001, 60), subscriber.errors
    finally:
        subscriber.stop()
    lines = received(subscriber)
    assert [{k: v for k, v in line.items() if k != "seq"} for line in lines] == [
        as_line(change) for change in made
    ]
    seqs = [int(str(line["seq"])) for line in lines]
    assert seqs == list(range(seqs[0], seqs[0] + 1000)), "one writer: sequence without gaps"


async def test_a_subscriber_that_was_away_catches_up_or_learns_its_cursor_expired(
    tmp_path: Path,
) -> None:
    """Back with its cursor, a subscriber gets exactly what it missed; past retention, entering
    raises CursorExpiredError (never a silent gap)."""
    db = tmp_path / "state.db"
    first = Proc("subscribe", str(db), "10")
    try:
        ready(first)
        async with SQLiteBackend(db) as backend:
            for n in range(10):
                await backend.set(f"k{n % 3}", b"%d" % n)
        assert first.wait_until(lambda lines: len(lines) >= 11, 60), first.errors
    finally:
        first.stop()
    cursor = received(first)[-1]["seq"]
    async with SQLiteBackend(db) as backend:  # written while nobody listens
        missed = [await backend.set(f"k{n % 4}", b"late %d" % n) for n in range(50)]
    again = Proc("subscribe", str(db), "50", str(cursor))
    try:
        ready(again)
        assert again.wait_until(lambda lines: len(lines) >= 51, 60), again.errors
    finally:
        again.stop()
    assert [{k: v for k, v in x.items() if k != "seq"} for x in received(again)] == [
        as_line(change) for change in missed
    ]

    async with SQLiteBackend(db, change_retention=100) as backend:  # trims to the last 100
        for n in range(600):
            await backend.set(f"k{n % 5}", b"later %d" % n)
    cursor = received(again)[-1]["seq"]
    expired = Proc("subscribe", str(db), "1", str(cursor))
    try:
        assert expired.wait_until(lambda lines: "expired" in lines, 60), expired.errors
    finally:
        expired.stop()


@pytest.mark.slow
async def test_writers_killed_mid_run_lose_no_acknowledged_write(tmp_path: Path) -> None:
    """3 writer processes, one SIGKILLed 8 times mid-run: every acknowledged save is there,
    whole and readable, and the store still accepts writes."""
    db = str(tmp_path / "state.db")
    rng = random.Random(11)
    writers = {f"w{n}": Proc("writer", db, f"w{n}") for n in range(3)}
    done: list[LineProcess] = []
    try:
        for generation in range(3, 11):
            name = rng.choice(sorted(writers))
            victim = writers.pop(name)
            assert victim.wait_lines(len(victim.lines) + rng.randrange(10, 60), 60), victim.errors
            victim.kill()
            done.append(victim)
            writers[f"w{generation}"] = Proc("writer", db, f"w{generation}")
        for proc in writers.values():
            assert proc.wait_lines(len(proc.lines) + 20, 60), proc.errors
            proc.kill()
            done.append(proc)
    finally:
        for proc in writers.values():
            proc.kill()
    acked = [line.split()[1] for proc in done for line in proc.lines if line.startswith("ack ")]
    assert len(acked) > 500
    async with StateManager(StateConfig(backend="sqlite", sqlite_path=db)) as state:
        keys = await state.list_keys("*")
        values = await state.get_many(keys)  # every stored entry decodes
        missing = [key for key in acked if values.get(key) != {"key": key, "pad": "x" * 200}]
        await state.save("after", 1)
        assert await state.get("after") == 1
    assert missing == []
    assert len(values) == len(keys)


@pytest.mark.slow
async def test_queue_workers_killed_and_reaped_lose_no_task(tmp_path: Path) -> None:
    """4 worker processes on one SQLite file, one SIGKILLed every so often, a reaper running:
    every task completed exactly once, none lost, none held by two workers at once."""
    db, prefix = str(tmp_path / "state.db"), "q:"
    config = StateConfig(backend="sqlite", sqlite_path=db, key_prefix=prefix)
    async with StateManager(config) as state:
        orch = OrchestrationStateManager(state_manager=state)
        await orch.create_team(TeamState(team_id=TEAM))
        for n in range(TASKS):
            await orch.enqueue_task(TEAM, {"id": f"t{n:04d}"})
    rng = random.Random(7)
    reaper = Proc("reaper", db, prefix)
    workers = {f"w{n}": Proc("worker", db, prefix, f"w{n}") for n in range(4)}
    killed: list[LineProcess] = []
    try:
        for generation in range(4, 8):
            # The victim is a worker already completing tasks, killed right after its next
            # completion, mid-run: a freshly started one could find the queue drained by the
            # others before it printed anything (the workers got fast).
            working = sorted(name for name, proc in workers.items() if proc.lines)
            victim_name = rng.choice(working or sorted(workers))
            victim = workers.pop(victim_name)
            if not victim.wait_lines(len(victim.lines) + 1, timeout=60):
                workers[victim_name] = victim  # the queue ran dry before the kill
                break
            victim.kill()
            killed.append(victim)
            workers[f"w{generation}"] = Proc("worker", db, prefix, f"w{generation}")
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
        reaper.stop()
    assert len(killed) >= 3
    assert queue.pending == queue.in_progress == queue.dead_letter == []
    completions = Counter(line.split()[1] for p in [*workers.values(), *killed] for line in p.lines)
    assert set(completions) == {f"t{n:04d}" for n in range(TASKS)}
    assert max(completions.values()) == 1, "a task completed twice: two workers held it"


async def test_identical_calls_from_four_processes_run_the_tool_once(tmp_path: Path) -> None:
    """100 identical cached_calls over 4 processes on one SQLite file run the tool once."""
    db, prefix = str(tmp_path / "state.db"), "tools:"
    procs = [Proc("flight", db, prefix, "25") for _ in range(4)]
    try:
        for proc in procs:
            ready(proc)
        for proc in procs:
            go(proc)
        for proc in procs:
            assert proc.wait_until(lambda lines: any(x.startswith("ran") for x in lines), 60), (
                proc.errors
            )
    finally:
        for proc in procs:
            proc.stop()
    runs = sum(int(next(x for x in p.lines if x.startswith("ran")).split()[1]) for p in procs)
    assert runs == 1
    config = StateConfig(backend="sqlite", sqlite_path=db, key_prefix=prefix)
    async with StateManager(config) as sm:
        stats = await ToolStateManager(state_manager=sm).get_tool_stats("oracle")
    assert (stats.total_executions, stats.cache_misses, stats.cache_hits) == (1, 1, 99)


async def test_four_indexer_processes_count_exactly(tmp_path: Path) -> None:
    """4 indexer processes x 150 increments on one SQLite file: the totals are exact."""
    db, prefix = str(tmp_path / "state.db"), "kb:"
    config = StateConfig(backend="sqlite", sqlite_path=db, key_prefix=prefix)
    async with StateManager(config) as state:
        await KnowledgeStateManager(state_manager=state).update_indexing_progress(
            IndexingProgress(knowledge_base_id="kb", total_documents=600)
        )
    procs = [Proc("indexer", db, prefix, "150") for _ in range(4)]
    for proc in procs:
        assert proc.wait_until(lambda lines: "indexed" in lines, timeout=120), proc.errors
        proc.stop()
    async with StateManager(config) as state:
        progress = await KnowledgeStateManager(state_manager=state).get_indexing_progress("kb")
    assert progress is not None
    failed_each = len([i for i in range(150) if i % 7 == 0])
    assert progress.failed_documents == 4 * failed_each
    assert progress.processed_documents == 4 * (150 - failed_each)


async def test_second_process_pauses_and_resumes_a_runner(tmp_path: Path) -> None:
    """On one SQLite file, a runner waits at a step boundary while another process pauses it,
    and continues only when a third resumes it."""
    url, prefix = f"sqlite://{tmp_path / 'state.db'}", "wf:"

    async def stored() -> WorkflowState:
        config = StateConfig(backend="sqlite", sqlite_path=tmp_path / "state.db", key_prefix=prefix)
        async with StateManager(config) as sm:
            return await WorkflowStateManager(state_manager=sm).require(WORKFLOW)

    runner = spawn("run", url, prefix)
    seen: list[dict[str, object]] = []
    try:
        stream = events(runner)
        wait_for(stream, "holding", seen)  # 5 steps done: the runner is mid-workflow
        assert run_to_end("pause", url, prefix)[-1]["event"] == "paused"
        assert runner.stdin is not None
        runner.stdin.write("go\n")
        runner.stdin.flush()
        wait_for(stream, "workflow_waiting", seen)
        paused = await stored()
        assert paused.status is WorkflowStatus.PAUSED
        assert paused.current_step == 5
        assert run_to_end("resume", url, prefix)[-1]["event"] == "resumed"
        assert next(stream)["event"] == "workflow_continuing"  # nothing ran while paused
        wait_for(stream, "completed", seen)
        assert runner.wait(timeout=60) == 0
    finally:
        stop(runner)
    final = await stored()
    assert final.status is WorkflowStatus.COMPLETED
    assert sorted(final.steps) == list(range(1, STEPS + 1))


async def test_changes_from_three_writer_processes_arrive_in_commit_order(tmp_path: Path) -> None:
    """3 processes x 100 update(fn) on one key: another process sees versions 1..300 in order,
    each change's old value the previous change's new value."""
    db = str(tmp_path / "state.db")
    subscriber = Proc("subscribe", db, "300")
    writers = [Proc("update", db, "100") for _ in range(3)]
    try:
        ready(subscriber)
        for proc in writers:
            ready(proc)
        for proc in writers:
            go(proc)
        assert subscriber.wait_until(lambda lines: len(lines) >= 301, 120), subscriber.errors
    finally:
        for proc in [*writers, subscriber]:
            proc.stop()
    lines = received(subscriber)
    assert [line["version"] for line in lines] == list(range(1, 301))
    assert all(line["key"] == "counter" for line in lines)
    for before, after in itertools.pairwise(lines):
        assert after["old"] == before["new"]
    seqs = [int(str(line["seq"])) for line in lines]
    assert seqs == sorted(seqs)
