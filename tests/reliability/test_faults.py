"""RedisBackend through a fault-injecting TCP proxy: nothing lost, nothing applied twice.

The proxy (`_proxy.FaultProxy`) sits between the client and a redis-server of the test's own,
and adds latency, drops connections, resets them right after the server replied (the client
loses a reply the server did send), refuses new ones or blackholes everything. The workload
(`_fault_workload`) checks each call against a model as it returns, resolves every unknown
outcome over a direct connection once nothing can still be on its way, and times every call
that fails against the time the library documents for it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis.asyncio as aioredis

from agenticstate import (
    BackendTimeoutError,
    BackendUnavailableError,
    RedisBackend,
    StateConfig,
    StateManager,
    WriteOutcomeUnknownError,
)
from tests.helpers import unique_prefix
from tests.reliability._fault_server import running_server
from tests.reliability._fault_workload import Budgets, FaultWorkload, KeyState, View
from tests.reliability._proxy import FaultProxy, Faults

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from pathlib import Path

    from tests._redis_server import RedisServer

pytestmark = pytest.mark.redis

SOCKET_TIMEOUT = 0.2
READ_RETRIES = 2
MARGIN = 0.1
"""How late each timed wait in a call (a timeout, a backoff) may end: event loop scheduling on a
busy 2-core machine shared with other test runs. The worst lateness measured is reported."""
BUDGETS = Budgets(SOCKET_TIMEOUT, READ_RETRIES, MARGIN)
POOL = 8  # more connections than workers: no call ever waits for a connection

STALL = 0.35  # longer than a call waits: the stalled request runs after the caller gave up
ROUNDS: list[tuple[str, Faults, int]] = [  # name, faults, calls per worker
    ("latency and stalls", Faults(latency=(0.0, 0.03), stall=0.03, stall_delay=STALL), 80),
    ("drops", Faults(drop=0.02), 250),
    ("resets after replies", Faults(reset_reply=0.03), 250),
    ("blackhole", Faults(), 100),  # switched on, then off, while the round runs
    (
        "everything",
        Faults(
            latency=(0.0, 0.02),
            stall=0.01,
            stall_delay=STALL,
            drop=0.01,
            reset_reply=0.01,
            refuse=0.1,
        ),
        150,
    ),
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, on loopback TCP (behind the proxy) and a unix socket."""
    with running_server(tmp_path / "redis") as own:
        yield own


@pytest.fixture
async def proxy(server: RedisServer) -> AsyncIterator[FaultProxy]:
    """A fault proxy in front of the server's TCP port, healthy to begin with."""
    async with FaultProxy("127.0.0.1", server.port, seed=7) as made:
        yield made


def proxied(proxy: FaultProxy, prefix: str, *, pool: int = POOL) -> RedisBackend:
    """A backend that reaches the server through the proxy, with short timeouts."""
    return RedisBackend(
        url=proxy.url,
        key_prefix=prefix,
        connection_pool_size=pool,
        socket_timeout=SOCKET_TIMEOUT,
        connect_timeout=SOCKET_TIMEOUT,
        read_retries=READ_RETRIES,
    )


def direct(server: RedisServer, prefix: str) -> StateManager:
    """A manager on the server's unix socket: the healthy path that bypasses the proxy."""
    return StateManager(StateConfig(backend="redis", redis_url=server.unix_url, key_prefix=prefix))


async def warm_up(state: StateManager, connections: int) -> None:
    """Open the pool's connections and load the write scripts while the proxy is healthy."""
    async with anyio.create_task_group() as group:
        for _ in range(connections):
            group.start_soon(state.get, "warm-up")
    await state.save("warm-up", 1)
    await state.delete("warm-up")


async def quiesce(proxy: FaultProxy, admin: aioredis.Redis) -> None:
    """Make sure no byte sent so far can still run: close everything the proxy holds, then end
    every server-side connection but the admin's (what Redis already read has run)."""
    await proxy.sever()  # first: what the blackhole holds must never go on
    proxy.set_faults(Faults())
    await admin.client_kill_filter(_type="normal", skipme=True)


def differences(
    seen: dict[str, KeyState], expected: dict[str, KeyState]
) -> tuple[set[str], set[str]]:
    """Keys where the subscriber differs from the server: (stale at the same version, other)."""
    same_version: set[str] = set()
    other: set[str] = set()
    for key in seen.keys() | expected.keys():
        mine, truth = seen.get(key), expected.get(key)
        if mine == truth:
            continue
        if mine is not None and truth is not None and mine.version == truth.version:
            same_version.add(key)
        else:
            other.add(key)
    return same_version, other


async def blackhole_round(
    workload: FaultWorkload, proxy: FaultProxy, number: int, calls: int
) -> None:
    """Run a round; a third of the way in, blackhole everything until 24 calls have failed."""
    start = workload.calls + workload.workers * calls // 3
    end = workload.calls + workload.workers * calls
    async with anyio.create_task_group() as group:
        group.start_soon(workload.run_round, number, calls)
        await workload.wait_until(lambda w: w.calls >= start)
        proxy.set_faults(Faults(blackhole=True))
        with anyio.fail_after(30):
            await workload.wait_until(lambda w: w.round_failures >= 24 or w.calls >= end)
        proxy.set_faults(Faults())  # what it held back goes on now: late arrivals


def report(
    name: str, figures: dict[str, Any], record_property: Callable[[str, object], None]
) -> None:
    record_property("figures", figures)
    sys.stdout.write(f"{name} figures: {json.dumps(figures, default=str)}\n")


async def test_workload_through_faulty_proxy_matches_model(
    server: RedisServer, proxy: FaultProxy, record_property: Callable[[str, object], None]
) -> None:
    """Under every fault, calls act as their outcome says, fail in time and end on the model."""
    # 6 tasks, 4980 calls: latency and stalls, drops, resets after replies, a blackhole, all at
    # once. Each call took effect exactly once (returned), at most once (unknown) or not at all
    # (as its error says), failed within its documented time; the server ends equal to the
    # model and a subscriber through the proxy converges to it.
    started = time.monotonic()
    prefix = unique_prefix()
    admin = aioredis.Redis.from_url(server.unix_url)
    healthy = direct(server, prefix)
    state = StateManager(StateConfig(), backend=proxied(proxy, prefix))
    watcher = StateManager(
        StateConfig(subscriber_buffer=100_000), backend=proxied(proxy, prefix, pool=1)
    )
    workload = FaultWorkload(state, BUDGETS, seed=11)
    view = View()
    round_seconds: dict[str, float] = {}
    worst_lag = 0.0

    async def measure_lag() -> None:
        nonlocal worst_lag
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            worst_lag = max(worst_lag, time.monotonic() - before - 0.01)

    async def settle(number: int) -> None:
        await quiesce(proxy, admin)
        found = await workload.settle(healthy)
        await healthy.save("canary", number)
        canary = await healthy.get_entry("canary")
        assert canary is not None
        expected = {key: value for key, value in found.items() if value is not None}
        expected["canary"] = KeyState(canary.version, canary.value)
        # The subscriber must converge, also on keys deleted and written again (back at the
        # same version) while it was disconnected.
        with anyio.move_on_after(20):
            await view.wait_until(lambda seen: not any(differences(seen, expected)))
        stale, other = differences(view.states, expected)
        assert not other, {key: (view.states.get(key), expected.get(key)) for key in other}
        assert not stale, {key: (view.states.get(key), expected.get(key)) for key in stale}

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(view.follow, watcher)
            group.start_soon(measure_lag)
            with anyio.fail_after(10):
                await view.ready.wait()
            await warm_up(state, POOL)
            await warm_up(watcher, 1)
            await settle(0)
            for number, (name, faults, calls) in enumerate(ROUNDS, 1):
                round_started = time.monotonic()
                proxy.set_faults(faults)
                if name == "blackhole":
                    await blackhole_round(workload, proxy, number, calls)
                else:
                    await workload.run_round(number, calls)
                round_seconds[name] = round(time.monotonic() - round_started, 1)
                await settle(number)
            group.cancel_scope.cancel()
    finally:
        await state.aclose()
        await watcher.aclose()
        await healthy.aclose()
        await admin.aclose()

    worst = max(workload.timings, key=lambda t: t.over)
    by_error: dict[str, float] = {}
    for timing in workload.timings:
        label = f"{timing.kind}:{timing.error}"
        by_error[label] = max(by_error.get(label, 0.0), round(timing.seconds, 3))
    figures = {
        "calls": workload.calls,
        "outcomes": dict(sorted(workload.outcomes.items())),
        "proxy": vars(proxy.stats),
        "faults_injected": proxy.stats.injected(),
        "failed_calls": len(workload.timings),
        "worst_seconds_by_call_and_error": by_error,
        "worst_over_documented_time": {
            "call": worst.kind,
            "error": worst.error,
            "seconds": round(worst.seconds, 3),
            "documented": round(worst.budget, 3),
            "over": round(worst.over, 3),
            "allowed": round(worst.limit, 3),
        },
        "socket_timeout": SOCKET_TIMEOUT,
        "event_loop_worst_lag": round(worst_lag, 3),
        "doubts_resolved": dict(workload.resolved),
        "subscriber_events": dict(view.events),
        "round_seconds": round_seconds,
        "seconds": round(time.monotonic() - started, 1),
    }
    report("faults", figures, record_property)
    assert not workload.violations, workload.violations[:20]
    late = [t for t in workload.timings if t.seconds > t.limit]
    assert not late, late[:10]
    # The faults really happened, and each kind of outcome was met.
    assert proxy.stats.dropped
    assert proxy.stats.reset
    assert proxy.stats.blackholed
    assert proxy.stats.stalled
    errors = {timing.error for timing in workload.timings}
    assert {"WriteOutcomeUnknownError", "BackendTimeoutError"} <= errors
    assert workload.resolved["WriteOutcomeUnknownError:applied"] > 0
    assert workload.resolved["WriteOutcomeUnknownError:not applied"] > 0


# ---------------------------------------------------------------- each fault on its own


async def test_reply_lost_after_the_server_ran_the_write_is_unknown_and_applied_once(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A write whose reply is cut off raises WriteOutcomeUnknownError and ran exactly once."""
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    async with StateManager(StateConfig(), backend=proxied(proxy, prefix)) as state:
        await warm_up(state, 1)
        proxy.set_faults(Faults(reset_reply=1.0))
        started = time.monotonic()
        with pytest.raises(WriteOutcomeUnknownError):
            await state.save("k", {"n": 0}, expected_version=0)
        assert time.monotonic() - started < BUDGETS.limit("save")
        proxy.set_faults(Faults())
        entry = await healthy.get_entry("k")
        assert entry is not None
        assert (entry.version, entry.value) == (1, {"n": 0})
        # An update: its read gets through, its write's reply is cut off.
        assert await state.get("k") == {"n": 0}  # connected again
        proxy.cut_reply(after=1)
        started = time.monotonic()
        with pytest.raises(WriteOutcomeUnknownError):
            await state.update("k", lambda v: {"n": v["n"] + 1})
        assert time.monotonic() - started < BUDGETS.limit("save")
        # A write whose reply was cut ran once, never twice.
        entry = await healthy.get_entry("k")
        assert entry is not None
        assert (entry.version, entry.value) == (2, {"n": 1})
    await healthy.aclose()


async def test_request_dropped_before_the_server_is_unknown_and_not_applied(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A write whose request is dropped raises WriteOutcomeUnknownError and did not run."""
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    async with StateManager(StateConfig(), backend=proxied(proxy, prefix)) as state:
        await warm_up(state, 1)
        proxy.set_faults(Faults(drop=1.0))
        started = time.monotonic()
        with pytest.raises(WriteOutcomeUnknownError):
            await state.save("k", "v")
        assert time.monotonic() - started < BUDGETS.limit("save")
        proxy.set_faults(Faults())
        assert await state.save("k", "after") == 1
    assert await healthy.get("k") == "after"
    await healthy.aclose()


async def test_write_on_a_refused_reconnect_is_unavailable_and_not_applied(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """With new connections refused, calls raise BackendUnavailableError in time; none ran."""
    # The read retries and gives up; the save must reconnect first, so it was never sent.
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    async with StateManager(StateConfig(), backend=proxied(proxy, prefix)) as state:
        await warm_up(state, 1)
        await proxy.sever()
        proxy.set_faults(Faults(refuse=1.0))
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError):
            await state.get("k")
        assert time.monotonic() - started < BUDGETS.limit("get")
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError):
            await state.save("k", "v")
        assert time.monotonic() - started < BUDGETS.limit("save")
        proxy.set_faults(Faults())
    assert await healthy.get_entry("k") is None
    await healthy.aclose()


async def test_blackhole_on_a_held_connection_times_out_within_budget(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A silent server: unknown, then timeout errors, each in time; the held write never ran."""
    # A save sent on the open connection gets no reply (unknown); the next must reconnect and
    # cannot (timeout, not sent); a read times out after its retries. The proxy held the first
    # save and drops it with the connection: it must never have run.
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    async with StateManager(StateConfig(), backend=proxied(proxy, prefix)) as state:
        await warm_up(state, 1)
        proxy.set_faults(Faults(blackhole=True))
        for kind, error in [
            ("save", WriteOutcomeUnknownError),
            ("save", BackendTimeoutError),
            ("get", BackendTimeoutError),
        ]:
            started = time.monotonic()
            with pytest.raises(error):
                await (state.get("k") if kind == "get" else state.save("k", "v"))
            assert time.monotonic() - started < BUDGETS.limit(kind), kind
        await proxy.sever()
        proxy.set_faults(Faults())
    assert await healthy.get_entry("k") is None
    await healthy.aclose()


# ---------------------------------------------------------------- regressions
# Bugs these tests found, fixed since: kept as regression tests.


async def test_first_call_to_a_server_that_never_answers_raises_in_time(
    proxy: FaultProxy,
) -> None:
    """A new backend's first call to a server that never answers raises in time."""
    proxy.set_faults(Faults(blackhole=True))
    backend = proxied(proxy, unique_prefix())
    try:
        for kind in ("get", "save"):
            call = backend.get("k") if kind == "get" else backend.set("k", b"v")
            started = time.monotonic()
            # move_on_after: so that the test ends either way
            with anyio.move_on_after(BUDGETS.of(kind) + 2), pytest.raises(BackendTimeoutError):
                await call
            assert time.monotonic() - started < BUDGETS.limit(kind), kind
    finally:
        proxy.set_faults(Faults())
        await proxy.sever()
        await backend.aclose()


async def test_calls_queued_for_a_connection_fail_within_their_timeout(proxy: FaultProxy) -> None:
    """Writes queued for a pooled connection still fail within socket_timeout."""
    # 8 writes at once over 2 connections to a server that stopped answering: the last ones
    # wait for the first ones to time out, then time out themselves.
    backend = proxied(proxy, unique_prefix(), pool=2)
    seconds: list[float] = []

    async def write(n: int) -> None:
        started = time.monotonic()
        with pytest.raises((WriteOutcomeUnknownError, BackendTimeoutError)):
            await backend.set(f"k{n}", b"v")
        seconds.append(time.monotonic() - started)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(backend.get, "warm-up")
            group.start_soon(backend.get, "warm-up")
        proxy.set_faults(Faults(blackhole=True))
        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(write, n)
    finally:
        await proxy.sever()
        proxy.set_faults(Faults())
        await backend.aclose()
    assert max(seconds) < BUDGETS.limit("save"), sorted(seconds)


async def test_subscribing_to_a_server_that_never_answers_raises_in_time(
    proxy: FaultProxy,
) -> None:
    """Subscribing to a server that never answers raises BackendUnavailableError in time."""
    backend = proxied(proxy, unique_prefix())
    await backend.get("warm-up")  # the command connection is up; only pub/sub is new
    proxy.set_faults(Faults(blackhole=True))
    budget = 2 * SOCKET_TIMEOUT
    started = time.monotonic()
    try:
        with anyio.move_on_after(budget + 2), pytest.raises(BackendUnavailableError):
            async with backend.changes("*"):
                pass
        assert time.monotonic() - started < budget + 2 * MARGIN
    finally:
        proxy.set_faults(Faults())
        await proxy.sever()
        with anyio.move_on_after(5):
            await backend.aclose()


async def test_subscriber_converges_after_delete_and_rewrite_while_disconnected(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A key deleted and rewritten while the subscriber was away resyncs to its new value."""
    # Deleted and written again, the key is back at version 1 with another value; the resync
    # after the reconnect sees version 1, which it already delivered, and skips it.
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    watcher = StateManager(StateConfig(), backend=proxied(proxy, prefix))
    view = View()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(view.follow, watcher)
            with anyio.fail_after(10):
                await view.ready.wait()
            await healthy.save("k", "old")
            with anyio.fail_after(10):
                await view.wait_until(lambda seen: "k" in seen)
            proxy.set_faults(Faults(blackhole=True))  # hold what Redis publishes from now on
            await healthy.delete("k")
            await healthy.save("k", "new")
            await healthy.save("other", "x")
            await proxy.sever()  # ... and drop it with the connection
            proxy.set_faults(Faults())
            with anyio.fail_after(10):
                await view.wait_until(lambda seen: "other" in seen)  # resynced
            with anyio.move_on_after(1):
                await view.wait_until(lambda seen: seen["k"].value == "new")
            group.cancel_scope.cancel()
        assert view.states["k"] == KeyState(1, "new")
    finally:
        await watcher.aclose()
        await healthy.aclose()


async def test_subscriber_notices_a_silently_dropped_connection(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A subscriber whose connection silently goes half-open still converges."""
    # A NAT or load balancer forgets the idle connection: no FIN, no RST, nothing ever arrives.
    prefix = unique_prefix()
    healthy = direct(server, prefix)
    watcher = StateManager(StateConfig(), backend=proxied(proxy, prefix))
    view = View()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(view.follow, watcher)
            with anyio.fail_after(10):
                await view.ready.wait()
            await healthy.save("k", 0)
            with anyio.fail_after(10):
                await view.wait_until(lambda seen: "k" in seen)
            # The pub/sub connection, and the one the subscriber reads the feed back on.
            assert await proxy.silence() >= 1
            await healthy.save("k", 1)
            with anyio.move_on_after(5):
                await view.wait_until(lambda seen: seen["k"].value == 1)
            group.cancel_scope.cancel()
        assert view.states["k"] == KeyState(2, 1)
    finally:
        await proxy.sever()
        await watcher.aclose()
        await healthy.aclose()
