"""ToolStateManager on every backend: executions, cache, single-flight, retries, stats."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    RetryExhaustedError,
    RetryState,
    StateConfig,
    StateManager,
    ToolCacheEntry,
    ToolExecution,
    ToolExecutionStatus,
    ToolStateManager,
    UnsupportedTypeError,
    hash_parameters,
)
from agenticstate.backends import Backend, TxnResult
from agenticstate.backends.memory import MemoryBackend

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agenticstate.backends import TxnCompare, TxnOp


@pytest.fixture
def tools(state: StateManager) -> ToolStateManager:
    return ToolStateManager(state_manager=state, cache_results=True, cache_ttl=3600)


async def test_seed_execution_example(tools: ToolStateManager) -> None:
    """The seed page's execution tracking example, as written."""
    execution = ToolExecution(
        execution_id="exec_001",
        tool_name="search_web",
        status=ToolExecutionStatus.RUNNING,
        started_at=datetime.now(),  # noqa: DTZ005  # the seed page's own call
        parameters={"query": "AI news"},
    )
    await tools.start_execution(execution)
    await tools.complete_execution(
        execution_id="exec_001", result={"results": [...]}, duration_ms=1500
    )
    history = await tools.get_execution_history(tool_name="search_web", limit=100)
    assert [(e.execution_id, e.status, e.duration_ms) for e in history] == [
        ("exec_001", ToolExecutionStatus.COMPLETED, 1500)
    ]
    assert history[0].result == {"results": [...]}
    assert history[0].started_at.tzinfo is None


async def test_history_is_newest_first_limited_and_bounded(state: StateManager) -> None:
    """History lists newest first, honours limit, and keeps at most history_limit (+10%)
    finished executions: one still running is never pruned, however old."""
    tools = ToolStateManager(state_manager=state, history_limit=10)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for n in range(25):
        await tools.start_execution(
            ToolExecution(
                execution_id=f"e{n}", tool_name="t", started_at=base + timedelta(seconds=n)
            )
        )
        if n != 0:  # e0, the oldest, is still running
            await tools.complete_execution(f"e{n}", n)
    history = await tools.get_execution_history("t", limit=None)
    assert len(history) <= 12
    assert history[-1].execution_id == "e0"
    assert [e.execution_id for e in history[:3]] == ["e24", "e23", "e22"]
    assert [e.execution_id for e in await tools.get_execution_history("t", limit=2)] == [
        "e24",
        "e23",
    ]


async def test_execution_errors(tools: ToolStateManager) -> None:
    """Duplicate ids conflict; unknown ids raise NotFoundError; finishing twice conflicts."""
    await tools.start_execution(ToolExecution(execution_id="e", tool_name="t"))
    with pytest.raises(ConflictError):
        await tools.start_execution(ToolExecution(execution_id="e", tool_name="t"))
    with pytest.raises(NotFoundError):
        await tools.complete_execution("nope", {})
    await tools.fail_execution("e", "TimeoutError")
    with pytest.raises(ConflictError):
        await tools.complete_execution("e", {})
    execution = await tools.get_execution("e")
    assert execution is not None
    assert execution.status is ToolExecutionStatus.FAILED
    assert execution.duration_ms is not None


def test_hash_parameters_is_canonical() -> None:
    """Key order, int/float, tuples and sets do not change the hash; values do."""
    base = hash_parameters({"q": "ai", "n": 1, "opts": {"a": [1, 2], "b": None}})
    assert base == hash_parameters({"opts": {"b": None, "a": (1, 2)}, "n": 1.0, "q": "ai"})
    assert base != hash_parameters({"q": "ai", "n": 2, "opts": {"a": [1, 2], "b": None}})
    assert base != hash_parameters({"q": "ai", "n": 1, "opts": {"a": [2, 1], "b": None}})
    assert hash_parameters({"s": {3, 1, 2}}) == hash_parameters({"s": {2, 3, 1}})
    assert hash_parameters({"x": 1.5}) != hash_parameters({"x": 1})
    assert hash_parameters({"x": "1"}) != hash_parameters({"x": 1})
    special = {"d": date(2026, 1, 1), "u": UUID(int=5), "b": b"\x00", "t": datetime(2026, 1, 1)}  # noqa: DTZ001
    assert hash_parameters(special) == hash_parameters(dict(reversed(list(special.items()))))
    assert len(base) == 64
    with pytest.raises(InvalidArgumentError):
        hash_parameters({"x": float("nan")})
    with pytest.raises(UnsupportedTypeError):
        hash_parameters({"x": object()})


async def test_seed_cache_example(tools: ToolStateManager) -> None:
    """The seed page's caching example: an entry with a made-up hash is not found by parameters."""
    cache_entry = ToolCacheEntry(
        tool_name="search_web",
        parameters_hash="abc123",
        result={"results": [...]},
        created_at=datetime.now(),  # noqa: DTZ005
        ttl=3600,
    )
    await tools.cache_result(cache_entry)
    cached = await tools.get_cached_result(tool_name="search_web", parameters={"query": "AI news"})
    assert cached is None
    real = ToolCacheEntry(
        tool_name="search_web",
        parameters_hash=hash_parameters({"query": "AI news"}),
        result={"results": [1]},
    )
    await tools.cache_result(real)
    cached = await tools.get_cached_result(tool_name="search_web", parameters={"query": "AI news"})
    assert cached is not None
    assert cached.result == {"results": [1]}
    stats = await tools.get_tool_stats("search_web")
    assert (stats.cache_hits, stats.cache_misses) == (1, 1)
    assert stats.cache_hit_rate == 0.5


async def test_cache_ttl_and_invalidation(tools: ToolStateManager) -> None:
    """Entries expire after their ttl and can be invalidated one by one or all at once."""
    for n in range(3):
        await tools.cache_result(
            ToolCacheEntry(tool_name="t", parameters_hash=hash_parameters({"n": n}), result=n)
        )
    await tools.cache_result(
        ToolCacheEntry(tool_name="t", parameters_hash=hash_parameters({"n": 9}), result=9, ttl=1)
    )
    assert await tools.invalidate_cache("t", {"n": 0}) == 1
    assert await tools.get_cached_result("t", {"n": 0}) is None
    assert await tools.invalidate_cache("t") == 3
    assert await tools.get_cached_result("t", {"n": 1}) is None


async def test_cache_disabled(state: StateManager) -> None:
    """With cache_results=False nothing is cached and cached_call always runs the tool."""
    tools = ToolStateManager(state_manager=state, cache_results=False)
    calls = 0

    async def run() -> int:
        nonlocal calls
        calls += 1
        return calls

    assert await tools.cache_result(ToolCacheEntry(tool_name="t", parameters_hash="h")) is None
    assert await tools.cached_call("t", {"q": 1}, run) == 1
    assert await tools.cached_call("t", {"q": 1}, run) == 2


async def test_single_flight_runs_once_for_100_concurrent_calls(tools: ToolStateManager) -> None:
    """100 concurrent identical cached_calls run the tool once; all get its result."""
    calls = 0
    release = anyio.Event()

    async def search() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        await release.wait()
        return {"hits": 42}

    results: list[Any] = []

    async def caller() -> None:
        results.append(await tools.cached_call("search_web", {"query": "AI"}, search))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            release.set()
    assert calls == 1
    assert results == [{"hits": 42}] * 100
    assert await tools.cached_call("search_web", {"query": "AI"}, search) == {"hits": 42}
    assert calls == 1
    stats = await tools.get_tool_stats("search_web")
    assert stats.total_executions == 1
    assert (stats.cache_misses, stats.cache_hits) == (1, 100)


async def test_single_flight_shares_failures_and_releases_lock(tools: ToolStateManager) -> None:
    """If the one run fails, every waiter gets the error, and the next call runs again."""
    attempts = 0
    release = anyio.Event()

    async def flaky() -> str:
        nonlocal attempts
        attempts += 1
        await release.wait()
        if attempts == 1:
            raise ConnectionError("down")
        return "ok"

    errors: list[BaseException] = []

    async def caller() -> None:
        try:
            await tools.cached_call("t", {"x": 1}, flaky)
        except ConnectionError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            release.set()
    assert len(errors) == 5
    assert await tools.cached_call("t", {"x": 1}, flaky) == "ok"
    assert attempts == 2
    assert await tools.state.list_keys("tools:{t}:flight:*") == []


async def test_seed_retry_example_with_naive_datetimes(tools: ToolStateManager) -> None:
    """The seed page's retry example: naive next_retry_at compares with datetime.now()."""
    retry_state = RetryState(
        execution_id="exec_002",
        attempts=2,
        max_attempts=5,
        last_error="Connection timeout",
        next_retry_at=datetime.now() + timedelta(seconds=30),  # noqa: DTZ005
        backoff_factor=2.0,
    )
    await tools.update_retry_state(retry_state)
    due_now = await tools.get_pending_retries()
    assert due_now == []
    pending_retries = await tools.get_pending_retries(due_only=False)
    retried = []
    for retry in pending_retries:
        if retry.next_retry_at <= datetime.now():  # type: ignore[operator]  # noqa: DTZ005
            retried.append(retry)
    assert [r.execution_id for r in pending_retries] == ["exec_002"]
    assert retried == []
    later = datetime.now() + timedelta(minutes=1)  # noqa: DTZ005
    assert [r.execution_id for r in await tools.get_pending_retries(now=later)] == ["exec_002"]


async def test_pending_retries_ordered_and_exhausted_excluded(tools: ToolStateManager) -> None:
    """Due retries come ordered by next_retry_at (naive and aware mixed); exhausted ones don't."""
    past = datetime.now(UTC) - timedelta(minutes=10)
    await tools.update_retry_state(
        RetryState(execution_id="b", next_retry_at=past + timedelta(minutes=2))
    )
    await tools.update_retry_state(
        RetryState(execution_id="a", next_retry_at=datetime.now() - timedelta(minutes=9))  # noqa: DTZ005
    )
    await tools.update_retry_state(RetryState(execution_id="c", next_retry_at=past))
    await tools.update_retry_state(RetryState(execution_id="dead", attempts=3, max_attempts=3))
    assert [r.execution_id for r in await tools.get_pending_retries()] == ["c", "a", "b"]


async def test_run_with_retries_backs_off_and_persists(tools: ToolStateManager) -> None:
    """A flaky call is retried with backoff; its schedule is stored between attempts."""
    calls = 0
    seen: list[RetryState | None] = []

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        seen.append(await tools.get_retry_state("job-1"))
        if calls < 3:
            raise TimeoutError("slow upstream")
        return "done"

    result = await tools.run_with_retries(
        "job-1", "fetch", {"url": "x"}, flaky, max_attempts=4, base_delay=0.01, backoff_factor=2.0
    )
    assert result == "done"
    assert calls == 3
    assert seen[0] is None
    assert seen[1] is not None
    assert (seen[1].attempts, seen[1].last_error) == (1, "TimeoutError")
    assert seen[1].next_retry_at is not None
    assert seen[1].next_retry_at.tzinfo is None
    assert seen[2] is not None
    assert seen[2].attempts == 2
    assert await tools.get_retry_state("job-1") is None
    stats = await tools.get_tool_stats("fetch")
    assert (stats.total_executions, stats.successful_executions, stats.failed_executions) == (
        3,
        1,
        2,
    )


async def test_run_with_retries_resumes_a_stored_schedule(tools: ToolStateManager) -> None:
    """A restarted caller continues the stored schedule and gives up at max_attempts."""
    await tools.update_retry_state(
        RetryState(execution_id="job-2", attempts=2, max_attempts=3, base_delay=0.01)
    )

    async def broken() -> str:
        raise ValueError("still broken")

    with pytest.raises(RetryExhaustedError) as caught:
        await tools.run_with_retries("job-2", "fetch", {}, broken, base_delay=0.01)
    assert isinstance(caught.value.__cause__, ValueError)
    state = await tools.get_retry_state("job-2")
    assert state is not None
    assert state.attempts == 3
    assert state.exhausted
    with pytest.raises(RetryExhaustedError):
        await tools.run_with_retries("job-2", "fetch", {}, broken)


def test_next_delay_grows_exponentially_with_jitter() -> None:
    """Delays double per attempt, are capped, and jitter stays within half to all of it."""
    retry = RetryState(execution_id="x", base_delay=1.0, backoff_factor=2.0, max_delay=5.0)
    exact = [
        ToolStateManager.next_delay(retry.model_copy(update={"attempts": n}), jitter=False)
        for n in range(1, 6)
    ]
    assert exact == [1.0, 2.0, 4.0, 5.0, 5.0]
    for _ in range(50):
        jittered = ToolStateManager.next_delay(retry.model_copy(update={"attempts": 3}))
        assert 2.0 <= jittered <= 4.0


async def test_stats_rates_and_p95(tools: ToolStateManager) -> None:
    """Success, error and cache-hit rates, average and p95 duration add up."""
    for n in range(20):
        await tools.start_execution(ToolExecution(execution_id=f"s{n}", tool_name="calc"))
        if n < 15:
            await tools.complete_execution(f"s{n}", n, duration_ms=float(n + 1))
        else:
            await tools.fail_execution(f"s{n}", "Boom", duration_ms=100.0)
    stats = await tools.get_tool_stats("calc")
    assert stats.total_executions == 20
    assert stats.success_rate == 0.75
    assert stats.error_rate == 0.25
    assert stats.avg_duration_ms == pytest.approx((sum(range(1, 16)) + 500) / 20)
    assert stats.p95_duration_ms == 100.0
    empty = await tools.get_tool_stats("never")
    assert (empty.total_executions, empty.success_rate, empty.p95_duration_ms) == (0, 0.0, 0.0)


async def test_concurrent_stats_updates_lose_nothing(tools: ToolStateManager) -> None:
    """30 tasks finishing executions at once: the counts are exact."""

    async def one(n: int) -> None:
        await tools.start_execution(ToolExecution(execution_id=f"c{n}", tool_name="par"))
        await tools.complete_execution(f"c{n}", n, duration_ms=1.0)

    async with anyio.create_task_group() as tg:
        for n in range(30):
            tg.start_soon(one, n)
    stats = await tools.get_tool_stats("par")
    assert (stats.total_executions, stats.successful_executions) == (30, 30)


async def test_reset_stats(tools: ToolStateManager) -> None:
    """reset_stats deletes a tool's statistics (zeros until it counts again), no other's."""
    for tool in ("a", "b"):
        await tools.start_execution(ToolExecution(execution_id=f"{tool}1", tool_name=tool))
        await tools.complete_execution(f"{tool}1", duration_ms=1.0)
    assert await tools.reset_stats("a") is True
    assert (await tools.get_tool_stats("a")).total_executions == 0
    assert (await tools.get_tool_stats("b")).total_executions == 1
    assert await tools.reset_stats("a") is False
    assert await tools.reset_stats("never") is False
    await tools.get_cached_result("a", {"q": 1})
    assert (await tools.get_tool_stats("a")).cache_misses == 1
    assert await tools.state.list_keys("tools:{a}:stats") == ["tools:{a}:stats"]


async def test_clear_history_keeps_running_executions(tools: ToolStateManager) -> None:
    """clear_history deletes finished executions and their id entries; running ones stay
    (unless include_running), and other tools' history is untouched."""
    for n in range(4):
        await tools.start_execution(ToolExecution(execution_id=f"e{n}", tool_name="t*"))
    await tools.complete_execution("e0", 1)
    await tools.fail_execution("e1", "Boom")
    await tools.start_execution(ToolExecution(execution_id="other", tool_name="t2"))
    assert await tools.clear_history("t*") == 2
    assert await tools.get_execution("e0") is None
    assert sorted(e.execution_id for e in await tools.get_execution_history("t*")) == [
        "e2",
        "e3",
    ]
    assert await tools.state.list_keys("tools:execution-ids:e[01]") == []
    await tools.complete_execution("e2", 2)  # still running: its record is there
    assert await tools.clear_history("t*", include_running=True) == 2
    assert await tools.get_execution_history("t*") == []
    with pytest.raises(NotFoundError):
        await tools.complete_execution("e3", 3)
    assert await tools.clear_history("never") == 0
    assert [e.execution_id for e in await tools.get_execution_history("t2")] == ["other"]
    assert (await tools.get_tool_stats("t*")).total_executions == 3  # stats are kept


async def test_a_retired_tool_leaves_nothing(tools: ToolStateManager) -> None:
    """clear_history, reset_stats and invalidate_cache together remove every key of a tool."""

    async def search() -> str:
        return "found"

    assert await tools.cached_call("search", {"q": 1}, search) == "found"
    await tools.clear_history("search")
    await tools.reset_stats("search")
    await tools.invalidate_cache("search")
    assert await tools.state.list_keys("tools:*") == []


async def test_cached_call_keeps_fractional_ttls(tools: ToolStateManager) -> None:
    """ttl=0.5 caches for half a second and ttl=1.9 for 1.9 s, not 0 (an error) or 1."""
    for ttl in (0.5, 1.9, timedelta(milliseconds=700)):

        async def run(ttl: object = ttl) -> str:
            return f"result for {ttl}"

        assert await tools.cached_call("t", {"ttl": str(ttl)}, run, ttl=ttl) == f"result for {ttl}"
        entry = await tools.get_cached_result("t", {"ttl": str(ttl)})
        assert entry is not None
        seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
        assert entry.ttl == seconds
        stored = await tools.state.get_entry(f"tools:{{t}}:cache:{entry.parameters_hash}")
        assert stored is not None
        assert stored.ttl is not None
        assert timedelta(seconds=seconds - 0.3) < stored.ttl <= timedelta(seconds=seconds)


@pytest.mark.parametrize("ttl", [0, 0.0, -1, 1e-9, float("nan"), float("inf"), True, "5", []])
async def test_cached_call_refuses_a_bad_ttl_before_running(
    tools: ToolStateManager, ttl: Any
) -> None:
    """A bad ttl raises InvalidArgumentError before the tool runs; nothing is recorded."""
    ran = False

    async def run() -> str:
        nonlocal ran
        ran = True
        return "ran"

    with pytest.raises(InvalidArgumentError, match="ttl"):
        await tools.cached_call("t", {"q": 1}, run, ttl=ttl)
    assert ran is False
    assert await tools.state.list_keys("tools:*") == []


async def test_cancelling_the_running_caller_spares_its_waiters(tools: ToolStateManager) -> None:
    """The first caller is cancelled mid-run: a waiter runs the tool, all waiters get it."""
    gate = anyio.Event()
    running = anyio.Event()
    runs = 0

    async def search() -> dict[str, int]:
        nonlocal runs
        runs += 1
        running.set()
        await gate.wait()
        return {"hits": runs}

    results: list[Any] = []

    async def waiter() -> None:
        results.append(await tools.cached_call("search", {"q": "ai"}, search))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            first = anyio.CancelScope()

            async def first_caller() -> None:
                with first:
                    await tools.cached_call("search", {"q": "ai"}, search)

            tg.start_soon(first_caller)
            await running.wait()  # the first caller is inside the tool, holding the flight
            for _ in range(5):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            first.cancel()
            await anyio.wait_all_tasks_blocked()
            gate.set()
    assert first.cancelled_caught
    assert results == [{"hits": 2}] * 5
    history = await tools.get_execution_history("search")
    assert sorted(e.status for e in history) == [
        ToolExecutionStatus.CANCELLED,
        ToolExecutionStatus.COMPLETED,
    ]
    stats = await tools.get_tool_stats("search")
    assert (stats.total_executions, stats.cancelled_executions) == (2, 1)
    assert (stats.successful_executions, stats.failed_executions) == (1, 0)
    assert (stats.cache_misses, stats.cache_hits) == (2, 4)
    assert await tools.state.list_keys("tools:{search}:flight:*") == []


@pytest.mark.parametrize("outcome", ["raises", "cancelled"])
async def test_a_waiter_elsewhere_learns_of_a_failed_run_at_once(
    state: StateManager, outcome: str
) -> None:
    """A caller of another manager (as in another process) runs the tool itself at once when
    the lock holder's run raises or is cancelled, without waiting out flight_timeout."""
    holder = ToolStateManager(state_manager=state, flight_timeout=60)
    other = ToolStateManager(state_manager=state, flight_timeout=60)
    gate = anyio.Event()
    running = anyio.Event()

    async def failing() -> str:
        running.set()
        await gate.wait()
        raise ConnectionError("down")

    async def working() -> str:
        return "ok"

    errors: list[BaseException] = []
    results: list[str] = []

    with anyio.fail_after(10):  # far below flight_timeout
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def hold() -> None:
                with scope:
                    try:
                        await holder.cached_call("t", {"x": 1}, failing)
                    except ConnectionError as exc:
                        errors.append(exc)

            async def wait() -> None:
                results.append(await other.cached_call("t", {"x": 1}, working))

            tg.start_soon(hold)
            await running.wait()  # the holder has the lock and is inside the tool
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            assert results == []  # waiting on the holder's lock
            if outcome == "raises":
                gate.set()
            else:
                scope.cancel()
    assert results == ["ok"]
    assert len(errors) == (1 if outcome == "raises" else 0)
    stats = await holder.get_tool_stats("t")
    assert stats.total_executions == 2
    assert stats.successful_executions == 1
    assert await state.list_keys("tools:{t}:flight:*") == []


def test_special_values_never_hash_like_the_dicts_that_spell_them() -> None:
    """A set, datetime, date, UUID or bytes differs from a dict written like its tag."""
    when = datetime(2026, 1, 1, tzinfo=UTC)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"a": {1, 2}}, {"a": {"$set": [1, 2]}}),
        ({"a": when}, {"a": {"$dt": when.isoformat()}}),
        ({"a": date(2026, 1, 1)}, {"a": {"$date": "2026-01-01"}}),
        ({"a": UUID(int=5)}, {"a": {"$uuid": str(UUID(int=5))}}),
        ({"a": b"\x00"}, {"a": {"$b64": "AA=="}}),
        ({"$set": [1]}, {"$$set": [1]}),
        ({"a": {"$x": 1}}, {"a": {"$$x": 1}}),
    ]
    for special, spelled in pairs:
        assert hash_parameters(special) != hash_parameters(spelled), (special, spelled)
    # Keys without a `$` hash as they always did: cached results stay valid on upgrade.
    plain = json.dumps({"query": "AI news"}, separators=(",", ":")).encode()
    assert hash_parameters({"query": "AI news"}) == hashlib.sha256(plain).hexdigest()


async def test_cached_call_keeps_tagged_lookalikes_apart(tools: ToolStateManager) -> None:
    """A set and a dict spelled like its tag are two cache entries: the tool runs for each."""
    runs: list[str] = []

    async def run() -> int:
        runs.append("ran")
        return len(runs)

    assert await tools.cached_call("t", {"a": {1, 2}}, run) == 1
    assert await tools.cached_call("t", {"a": {"$set": [1, 2]}}, run) == 2
    assert await tools.cached_call("t", {"a": {2, 1}}, run) == 1


# The supported domain of parameter values, with dict keys that try to spell type tags.
_KEYS = st.sampled_from(["a", "$set", "$dt", "$date", "$uuid", "$b64", "$$set", "$", "$$", "x$"])
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
    st.binary(max_size=4),
    st.datetimes(timezones=st.one_of(st.none(), st.timezones())),
    st.dates(),
    st.uuids(),
)
_HASHABLE = st.one_of(
    st.integers(-5, 5), st.text(max_size=3), st.dates(), st.uuids(), st.binary(max_size=2)
)
_VALUES = st.recursive(
    st.one_of(_SCALARS, st.frozensets(_HASHABLE, max_size=3), st.sets(_HASHABLE, max_size=3)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=8,
)


def _norm(value: Any) -> Any:
    """The domain's own equality: what hash_parameters promises to treat as equal."""
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("num", value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return ("num", int(value))
        return ("float", value)
    if isinstance(value, (bytes, bytearray)):
        return ("bytes", bytes(value))
    if isinstance(value, datetime):
        return ("datetime", value.isoformat())
    if isinstance(value, date):
        return ("date", value.isoformat())
    if isinstance(value, UUID):
        return ("uuid", value)
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_norm(item) for item in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_norm(item) for item in value))
    assert isinstance(value, dict)
    return ("dict", frozenset((key, _norm(item)) for key, item in value.items()))


def _spell(value: Any) -> Any:
    """Write every special value as the plain dict that spells its tag."""
    if isinstance(value, (bytes, bytearray)):
        return {"$b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, datetime):
        return {"$dt": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, UUID):
        return {"$uuid": str(value)}
    if isinstance(value, (set, frozenset)):
        items = [_spell(item) for item in value]
        return {"$set": sorted(items, key=lambda item: json.dumps(item, sort_keys=True))}
    if isinstance(value, (list, tuple)):
        return [_spell(item) for item in value]
    if isinstance(value, dict):
        return {key: _spell(item) for key, item in value.items()}
    return value


@settings(max_examples=400, deadline=None)
@given(first=_VALUES, second=_VALUES)
def test_distinct_values_never_hash_equal(first: Any, second: Any) -> None:
    """Values the domain tells apart hash apart; values it calls equal hash equal."""
    same = _norm(first) == _norm(second)
    assert (hash_parameters({"v": first}) == hash_parameters({"v": second})) is same


@settings(max_examples=300, deadline=None)
@given(value=_VALUES)
def test_no_value_hashes_like_its_spelling(value: Any) -> None:
    """A value with special types inside never hashes like the dicts that spell them."""
    spelled = _spell(value)
    same = _norm(value) == _norm(spelled)
    assert (hash_parameters({"v": value}) == hash_parameters({"v": spelled})) is same


class _LateCaller(ToolStateManager):
    """A caller whose cache lookup misses, then stalls until another caller has finished."""

    def __init__(self, state: StateManager, other_done: anyio.Event) -> None:
        super().__init__(state_manager=state)
        self.other_done = other_done
        self.stalled = anyio.Event()

    async def _lookup_counted(self, tool_name: str, digest: str) -> ToolCacheEntry | None:
        found = await super()._lookup_counted(tool_name, digest)
        if found is None and not self.stalled.is_set():
            self.stalled.set()
            await self.other_done.wait()
        return found


async def test_a_caller_whose_lookup_missed_never_runs_a_finished_call_again(
    state: StateManager,
) -> None:
    """A caller that missed the cache just before another caller cached its result and released
    its lock takes the free lock, finds the result and never runs the tool a second time."""
    runs = 0

    async def search() -> dict[str, int]:
        nonlocal runs
        runs += 1
        return {"run": runs}

    other_done = anyio.Event()
    late = _LateCaller(state, other_done)
    first = ToolStateManager(state_manager=state)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def late_call() -> None:
                results.append(await late.cached_call("search", {"q": 1}, search))

            tg.start_soon(late_call)
            await late.stalled.wait()
            results.append(await first.cached_call("search", {"q": 1}, search))
            other_done.set()
    assert runs == 1
    assert results == [{"run": 1}, {"run": 1}]
    assert await state.list_keys("tools:{search}:flight:*") == []


class _NoTransactBackend(MemoryBackend):
    """A backend without `transact` (as a third-party one may be): the base raises for it."""

    async def transact(
        self, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp] = ()
    ) -> TxnResult:
        return await Backend.transact(self, compare, then, orelse)


async def _hits_and_misses(tools: ToolStateManager) -> tuple[int, int]:
    async def search() -> str:
        return "found"

    for _ in range(3):
        assert await tools.cached_call("search", {"q": 1}, search) == "found"
    assert await tools.get_cached_result("search", {"q": 1}) is not None
    assert await tools.get_cached_result("search", {"q": 2}) is None
    stats = await tools.get_tool_stats("search")
    return stats.cache_hits, stats.cache_misses


async def test_cache_hits_count_without_transact() -> None:
    """On a backend without `transact`, hits are counted in the statistics record as before."""
    async with StateManager(StateConfig(), backend=_NoTransactBackend()) as state:
        tools = ToolStateManager(state_manager=state)
        assert await _hits_and_misses(tools) == (3, 2)
        assert tools._transact is False
        assert await tools.reset_stats("search") is True
        assert (await tools.get_tool_stats("search")).cache_hits == 0


async def test_cache_hits_count_with_transact(tools: ToolStateManager) -> None:
    """With `transact`, hits go to the tool's counters index; the statistics add them up."""
    assert await _hits_and_misses(tools) == (3, 2)
    assert tools._transact is True
    assert await tools.state.index_range("tools:{search}:counters") == [("cache_hits", 3.0)]
    # reset_stats clears the counter with the record; a counter alone is something to reset.
    assert await tools.reset_stats("search") is True
    assert await tools.state.index_range("tools:{search}:counters") == []
    assert await tools.get_cached_result("search", {"q": 1}) is not None
    assert (await tools.get_tool_stats("search")).cache_hits == 1
    assert await tools.reset_stats("search") is True
    assert await tools.reset_stats("search") is False


async def test_hits_counted_by_older_code_still_read(tools: ToolStateManager) -> None:
    """A statistics record written before the counters index (hits inside it) reads right, and
    hits counted since add to it."""
    await tools.state.save(
        "tools:{old}:stats", {"tool_name": "old", "cache_hits": 5, "cache_misses": 1}
    )
    assert (await tools.get_tool_stats("old")).cache_hits == 5
    await tools.cached_call("old", {"ignored": True}, _never)  # a miss: runs the tool
    entry = ToolCacheEntry(tool_name="old", parameters_hash=hash_parameters({"q": 1}), result=2)
    await tools.cache_result(entry)
    assert await tools.cached_call("old", {"q": 1}, _never) == 2
    stats = await tools.get_tool_stats("old")
    assert (stats.cache_hits, stats.cache_misses) == (6, 2)


async def _never() -> int:
    return 0


async def test_concurrent_cache_hits_are_counted_exactly(tools: ToolStateManager) -> None:
    """200 hits from 50 tasks at once, with executions finishing beside them: nothing lost."""

    async def search() -> str:
        return "found"

    await tools.cached_call("search", {"q": 1}, search)

    async def hits() -> None:
        for _ in range(4):
            assert await tools.cached_call("search", {"q": 1}, search) == "found"

    async def run(n: int) -> None:
        await tools.start_execution(ToolExecution(execution_id=f"x{n}", tool_name="search"))
        await tools.complete_execution(f"x{n}", n, duration_ms=1.0)

    async with anyio.create_task_group() as tg:
        for n in range(50):
            tg.start_soon(hits)
            if n % 5 == 0:
                tg.start_soon(run, n)
    stats = await tools.get_tool_stats("search")
    assert (stats.cache_hits, stats.cache_misses, stats.total_executions) == (200, 1, 11)


async def test_a_lapsed_single_flight_lock_is_never_released_by_its_old_holder(
    state: StateManager,
) -> None:
    """Caller A's lock lapses while it runs and caller B (another process) takes the lock: A's
    release, compared on the revision it wrote, leaves B's lock alone (a version would match,
    the lock being at version 1 again)."""
    first, second = (
        ToolStateManager(state_manager=state, cache_results=True, cache_ttl=3600)
        for _ in range(2)  # two managers: two processes' flights
    )
    lock = f"tools:{{t}}:flight:{hash_parameters({'q': 1})}"
    running, finish = anyio.Event(), anyio.Event()

    async def slow() -> str:
        running.set()
        await finish.wait()
        return "a"

    async def other() -> str:
        return "b"

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.cached_call, "t", {"q": 1}, slow)
            await running.wait()
            held = await state.get_entry(lock)
            assert held is not None
            await state.delete(lock)  # A's lock lapses (its flight_timeout ran out)
            await state.save(lock, "b's process", expected_version=0)  # B takes it
            finish.set()
    entry = await state.get_entry(lock)
    assert entry is not None, "A's release deleted the lock B holds"
    assert held is not None
    assert (entry.value, entry.version) == ("b's process", held.version)
    assert await second.cached_call("t", {"q": 1}, other) == "a"  # A cached its result


@pytest.mark.parametrize("how", ["cached_call", "run_with_retries"])
async def test_a_long_call_outlives_many_quicker_ones(state: StateManager, how: str) -> None:
    """A call still running while many quicker calls of its tool push the history past its
    limit keeps its execution: it completes once, its result is kept (cached), never rerun."""
    tools = ToolStateManager(state_manager=state, history_limit=3)
    started, release = anyio.Event(), anyio.Event()
    runs = 0

    async def long() -> str:
        nonlocal runs
        runs += 1
        started.set()
        await release.wait()
        return "slow"

    outcome: list[str] = []

    async def call() -> None:
        if how == "cached_call":
            outcome.append(await tools.cached_call("t", {"q": "long"}, long))
        else:
            outcome.append(await tools.run_with_retries("long", "t", {}, long, base_delay=0))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(call)
            await started.wait()
            for n in range(12):
                await tools.cached_call("t", {"q": n}, functools.partial(_value, n))
            release.set()
    assert outcome == ["slow"]
    assert runs == 1
    if how == "cached_call":
        assert await tools.cached_call("t", {"q": "long"}, long) == "slow"
        assert runs == 1


async def _value(n: int) -> int:
    return n
