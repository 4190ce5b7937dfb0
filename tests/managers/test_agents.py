"""AgentStateStore and AgentRecoveryManager on every backend."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from agenticstate import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentSnapshot,
    AgentStateStore,
    InvalidArgumentError,
    NotFoundError,
    RecoveryEvent,
    RetryExhaustedError,
    StateManager,
)


@pytest.fixture
def store(state: StateManager) -> AgentStateStore:
    return AgentStateStore(state_manager=state)


class Agent:
    """A minimal agent with the seed page's recovery interface."""

    def __init__(self, agent_id: str) -> None:
        self.id = agent_id
        self.restored: list[dict[str, Any]] = []
        self.fail_restore = False

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        if self.fail_restore:
            raise RuntimeError("cannot restore")
        self.restored.append(state)


class AsyncAgent(Agent):
    async def restore_from_checkpoint(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self.restored.append(state)


async def test_snapshot_round_trip_keeps_naive_timestamps(store: AgentStateStore) -> None:
    """A snapshot built as on the seed page (naive datetime.now()) reads back equal."""
    snapshot = AgentSnapshot(
        agent_id="researcher_01",
        timestamp=datetime.now(),  # noqa: DTZ005  # the seed page's own call
        memory_state={"facts": ["a"]},
        tool_state={"search": {"calls": 3}},
        conversation_history=[{"role": "user", "content": "hi"}],
        metadata={"version": "1.0", "task_count": 42},
    )
    await store.save_snapshot(snapshot)
    [back] = await store.list_snapshots("researcher_01")
    assert back == snapshot
    assert back.timestamp.tzinfo is None
    assert await store.get_snapshot("researcher_01", snapshot.snapshot_id) == snapshot


async def test_snapshots_list_newest_first_by_time_not_string(store: AgentStateStore) -> None:
    """Listing orders by timestamp (then step), never by the ids' string order."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    ids = ["b", "a", "c", "10", "9"]
    for offset, snapshot_id in enumerate(ids):
        await store.save_snapshot(
            AgentSnapshot(
                agent_id="a1", snapshot_id=snapshot_id, timestamp=base + timedelta(minutes=offset)
            )
        )
    listed = await store.list_snapshots("a1")
    assert [s.snapshot_id for s in listed] == list(reversed(ids))
    assert [s.snapshot_id for s in await store.list_snapshots("a1", limit=2)] == ["9", "10"]
    latest = await store.get_latest_snapshot("a1")
    assert latest is not None
    assert latest.snapshot_id == "9"


async def test_mixed_naive_and_aware_timestamps_sort(store: AgentStateStore) -> None:
    """Naive and aware timestamps in one agent's list sort without TypeError."""
    await store.save_snapshot(
        AgentSnapshot(agent_id="mix", snapshot_id="old", timestamp=datetime(2020, 1, 1))  # noqa: DTZ001
    )
    await store.save_snapshot(
        AgentSnapshot(agent_id="mix", snapshot_id="new", timestamp=datetime.now(UTC))
    )
    assert [s.snapshot_id for s in await store.list_snapshots("mix")] == ["new", "old"]


async def test_checkpoints_equal_time_order_by_step(store: AgentStateStore) -> None:
    """Checkpoints with the same timestamp list by step, highest first."""
    when = datetime(2026, 5, 5, tzinfo=UTC)
    for step in (2, 10, 1):
        await store.save_checkpoint(
            AgentCheckpoint(agent_id="a", checkpoint_id=f"s{step}", step=step, timestamp=when)
        )
    assert [c.step for c in await store.list_checkpoints("a")] == [10, 2, 1]


async def test_seed_checkpoint_example(store: AgentStateStore) -> None:
    """The seed page's checkpoint example: save, get, restore."""
    results = {"rows": 3}
    checkpoint = AgentCheckpoint(
        agent_id="researcher_01",
        checkpoint_id="task_step_5",
        step=5,
        state={
            "current_task": "data_analysis",
            "intermediate_results": results,
            "tokens_used": 15000,
        },
        recoverable=True,
    )
    await store.save_checkpoint(checkpoint)
    checkpoint2 = await store.get_checkpoint(agent_id="researcher_01", checkpoint_id="task_step_5")
    assert checkpoint2 == checkpoint
    agent = Agent("researcher_01")
    if checkpoint2:
        agent.restore_from_checkpoint(checkpoint2.state)
    assert agent.restored[0]["tokens_used"] == 15000
    assert await store.get_checkpoint("researcher_01", "missing") is None


async def test_retention_keeps_the_newest(state: StateManager) -> None:
    """max_snapshots / max_checkpoints keep only the newest N."""
    store = AgentStateStore(state_manager=state, max_snapshots=3, max_checkpoints=2)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for i in range(6):
        await store.save_snapshot(
            AgentSnapshot(agent_id="r", snapshot_id=f"s{i}", timestamp=base + timedelta(seconds=i))
        )
        await store.save_checkpoint(
            AgentCheckpoint(agent_id="r", checkpoint_id=f"c{i}", step=i, timestamp=base)
        )
    assert [s.snapshot_id for s in await store.list_snapshots("r")] == ["s5", "s4", "s3"]
    assert [c.checkpoint_id for c in await store.list_checkpoints("r")] == ["c5", "c4"]
    assert len(await state.list_keys("agents:*")) == 5


async def test_retention_by_age(state: StateManager) -> None:
    """max_age drops records older than the limit."""
    store = AgentStateStore(state_manager=state, max_age=timedelta(hours=1))
    await store.save_snapshot(
        AgentSnapshot(
            agent_id="r", snapshot_id="old", timestamp=datetime.now(UTC) - timedelta(days=1)
        )
    )
    await store.save_snapshot(AgentSnapshot(agent_id="r", snapshot_id="new"))
    assert [s.snapshot_id for s in await store.list_snapshots("r")] == ["new"]
    [key] = await state.list_keys("agents:*")
    entry = await state.get_entry(key)
    assert entry is not None
    assert entry.ttl is not None


async def test_agents_are_isolated_and_deletable(store: AgentStateStore) -> None:
    """One agent's listing never includes another's; delete_agent removes everything."""
    await store.save_snapshot(AgentSnapshot(agent_id="a*", snapshot_id="x"))
    await store.save_snapshot(AgentSnapshot(agent_id="ab", snapshot_id="y"))
    await store.save_checkpoint(AgentCheckpoint(agent_id="a*", checkpoint_id="c"))
    assert [s.snapshot_id for s in await store.list_snapshots("a*")] == ["x"]
    assert await store.list_agents() == ["a*", "ab"]
    assert await store.delete_agent("a*") == 2
    assert await store.list_snapshots("a*") == []
    assert await store.delete_snapshot("ab", "y") is True
    assert await store.delete_snapshot("ab", "y") is False


@pytest.mark.parametrize("bad", ["", "a{b", "x}"])
async def test_bad_agent_ids_are_refused(store: AgentStateStore, bad: str) -> None:
    """Empty ids and ids with hash-tag braces raise InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError):
        await store.save_snapshot(AgentSnapshot(agent_id=bad))


async def test_recover_from_latest_runs_hooks(store: AgentStateStore) -> None:
    """recover() restores the newest recoverable checkpoint and runs before/after hooks."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    await store.save_checkpoint(
        AgentCheckpoint(agent_id="r1", checkpoint_id="c1", step=1, state={"s": 1}, timestamp=base)
    )
    await store.save_checkpoint(
        AgentCheckpoint(
            agent_id="r1",
            checkpoint_id="c2",
            step=2,
            state={"s": 2},
            timestamp=base + timedelta(seconds=1),
            recoverable=False,
        )
    )
    recovery = AgentRecoveryManager(agent_store=store, auto_recover=True, max_recovery_attempts=3)
    agent = AsyncAgent("r1")
    recovery.register(agent)
    events: list[tuple[str, RecoveryEvent]] = []
    recovery.on_before_recovery(lambda event: events.append(("before", event)))

    @recovery.on_after_recovery
    async def after(event: RecoveryEvent) -> None:
        events.append(("after", event))

    assert await recovery.recover(agent_id="r1", from_checkpoint="latest") is True
    assert agent.restored == [{"s": 1}]
    assert [
        (name, e.attempt, e.checkpoint.checkpoint_id if e.checkpoint else None)
        for name, e in events
    ] == [
        ("before", 1, "c1"),
        ("after", 1, "c1"),
    ]
    record = await recovery.get_recovery_state("r1")
    assert record is not None
    assert (record.attempts, record.last_checkpoint_id, record.last_error) == (1, "c1", None)
    assert await recovery.recover("r1", from_checkpoint="c2") is False  # not recoverable


async def test_attempts_are_counted_in_the_store(store: AgentStateStore) -> None:
    """Attempts persist: a new recovery manager (a restarted process) sees earlier ones."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="r2", state={"s": 1}))
    first = AgentRecoveryManager(agent_store=store, max_recovery_attempts=2)
    first.register(Agent("r2"))
    assert await first.recover("r2") is True
    restarted = AgentRecoveryManager(agent_store=store, max_recovery_attempts=2)
    restarted.register(Agent("r2"))
    assert await restarted.recover("r2") is True
    with pytest.raises(RetryExhaustedError):
        await restarted.recover("r2")
    record = await restarted.get_recovery_state("r2")
    assert record is not None
    assert record.attempts == 2
    await restarted.reset_attempts("r2")
    assert await restarted.recover("r2") is True


async def test_failed_restore_runs_failed_hooks(store: AgentStateStore) -> None:
    """A restore that raises returns False and runs the failed hooks with the error."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="r3", state={"s": 1}))
    recovery = AgentRecoveryManager(agent_store=store)
    agent = Agent("r3")
    agent.fail_restore = True
    recovery.register(agent)
    failures: list[RecoveryEvent] = []
    recovery.on_recovery_failed(failures.append)
    assert await recovery.recover("r3") is False
    assert isinstance(failures[0].error, RuntimeError)
    record = await recovery.get_recovery_state("r3")
    assert record is not None
    assert record.last_error == "RuntimeError"


async def test_recover_without_checkpoint_or_registration(store: AgentStateStore) -> None:
    """No checkpoint: False with a failed hook; unregistered agent: NotFoundError."""
    recovery = AgentRecoveryManager(agent_store=store)
    recovery.register(Agent("r4"))
    failures: list[RecoveryEvent] = []
    recovery.on_recovery_failed(failures.append)
    assert await recovery.recover("r4") is False
    assert isinstance(failures[0].error, NotFoundError)
    with pytest.raises(NotFoundError):
        await recovery.recover("nobody")
    with pytest.raises(InvalidArgumentError):
        recovery.register(object())


async def test_guard_recovers_and_retries(store: AgentStateStore) -> None:
    """A guarded job that fails is recovered and retried; success resets the attempt count."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="g", state={"progress": 3}))
    recovery = AgentRecoveryManager(agent_store=store, max_recovery_attempts=3)
    agent = Agent("g")
    calls = 0

    @recovery.guard(agent)
    async def job(topic: str) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("flaky")
        return f"{topic} after {agent.restored[-1]['progress']}"

    assert await job("ai") == "ai after 3"
    assert calls == 3
    record = await recovery.get_recovery_state("g")
    assert record is not None
    assert record.attempts == 0


async def test_guard_gives_up_after_max_attempts(store: AgentStateStore) -> None:
    """A job that keeps failing raises RetryExhaustedError from its last exception."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="h", state={}))
    recovery = AgentRecoveryManager(agent_store=store, max_recovery_attempts=2)
    agent = Agent("h")

    async def always_fails() -> None:
        raise ValueError("broken")

    with pytest.raises(RetryExhaustedError) as caught:
        await recovery.run(agent, always_fails)
    assert isinstance(caught.value.__cause__, ValueError)
    no_auto = AgentRecoveryManager(agent_store=store, auto_recover=False)
    with pytest.raises(ValueError, match="broken"):
        await no_auto.run(agent, always_fails)


async def test_recovery_record_expires_with_max_age(state: StateManager) -> None:
    """With max_age, the recovery record gets it as its TTL, renewed by every attempt and
    reset; an abandoned agent leaves nothing behind."""
    # Two seconds: long enough that a loaded machine never lets the checkpoint expire between
    # the calls below, short enough to wait for the expiry at the end.
    max_age = timedelta(seconds=2)
    store = AgentStateStore(state_manager=state, max_age=max_age)
    recovery = AgentRecoveryManager(agent_store=store)
    recovery.register(Agent("a1"))
    await store.save_checkpoint(AgentCheckpoint(agent_id="a1", state={"s": 1}))
    assert await recovery.recover("a1") is True
    key = "agents:{a1}:recovery"
    first = await state.get_entry(key)
    assert first is not None
    assert first.expires_at is not None
    assert first.ttl is not None
    assert first.ttl <= max_age + timedelta(milliseconds=1)  # expiry is kept to the ms
    await anyio.sleep(0.05)  # let the clock move past the first expiry's millisecond
    await recovery.reset_attempts("a1")
    renewed = await state.get_entry(key)
    assert renewed is not None
    assert renewed.expires_at is not None
    assert renewed.expires_at > first.expires_at
    # Wall-clock expiry: wait past the renewed expiry (a TTL is a time, not an event).
    await anyio.sleep((renewed.expires_at - datetime.now(UTC)).total_seconds() + 0.1)
    assert await recovery.get_recovery_state("a1") is None
    assert await state.list_keys("agents:*") == []


async def test_recovery_record_without_max_age_does_not_expire(store: AgentStateStore) -> None:
    """Without max_age the recovery record keeps the store's default TTL (none here)."""
    recovery = AgentRecoveryManager(agent_store=store)
    recovery.register(Agent("a2"))
    assert await recovery.recover("a2") is False  # no checkpoint: still one attempt
    entry = await store.state.get_entry("agents:{a2}:recovery")
    assert entry is not None
    assert entry.expires_at is None


def _raising(phase: str) -> Any:
    def hook(event: RecoveryEvent) -> None:
        raise RuntimeError(f"{phase} hook broke")

    return hook


@pytest.mark.parametrize("phase", ["before", "after", "failed"])
async def test_a_raising_hook_never_changes_a_recovery(store: AgentStateStore, phase: str) -> None:
    """A hook that raises is logged and counted; the recovery's outcome stays what it was."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="k", state={"s": 1}))
    recovery = AgentRecoveryManager(agent_store=store)
    agent = Agent("k")
    agent.fail_restore = phase == "failed"
    recovery.register(agent)
    seen: list[str] = []
    register = {
        "before": recovery.on_before_recovery,
        "after": recovery.on_after_recovery,
        "failed": recovery.on_recovery_failed,
    }[phase]
    register(_raising(phase))
    register(lambda event: seen.append(phase))  # later hooks still run
    assert await recovery.recover("k") is (phase != "failed")
    assert agent.restored == ([] if phase == "failed" else [{"s": 1}])
    assert seen == [phase]
    assert recovery.hook_failures == 1
    record = await recovery.get_recovery_state("k")
    assert record is not None
    assert record.last_error == ("RuntimeError" if phase == "failed" else None)


@pytest.mark.parametrize("phase", ["before", "after", "failed"])
async def test_a_raising_hook_never_ends_the_retry_loop(store: AgentStateStore, phase: str) -> None:
    """run() retries through raising hooks and ends only by success or RetryExhaustedError."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="loop", state={"s": 1}))
    recovery = AgentRecoveryManager(agent_store=store, max_recovery_attempts=3)
    agent = Agent("loop")
    agent.fail_restore = phase == "failed"
    {
        "before": recovery.on_before_recovery,
        "after": recovery.on_after_recovery,
        "failed": recovery.on_recovery_failed,
    }[phase](_raising(phase))
    calls = 0

    async def job() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("flaky")
        return "done"

    # A failed restore does not stop the loop either: the job runs again while attempts last.
    assert await recovery.run(agent, job) == "done"
    assert calls == 3
    assert recovery.hook_failures == 2
    record = await recovery.get_recovery_state("loop")
    assert record is not None
    assert record.attempts == 0  # the job succeeded: the count starts again


async def test_raising_hooks_still_end_in_retry_exhausted(store: AgentStateStore) -> None:
    """With every hook raising, a job that keeps failing ends in RetryExhaustedError."""
    await store.save_checkpoint(AgentCheckpoint(agent_id="stuck", state={"s": 1}))
    recovery = AgentRecoveryManager(agent_store=store, max_recovery_attempts=2)
    for register in (
        recovery.on_before_recovery,
        recovery.on_after_recovery,
        recovery.on_recovery_failed,
    ):
        register(_raising("any"))

    async def always_fails() -> None:
        raise ValueError("broken")

    with pytest.raises(RetryExhaustedError) as caught:
        await recovery.run(Agent("stuck"), always_fails)
    assert isinstance(caught.value.__cause__, ValueError)
    assert recovery.hook_failures == 4  # before and after, on each of the two attempts
