"""RedisBackend against real redis-server processes: processes, faults, restarts, TLS, ACL."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis as sync_redis
from structlog.testing import capture_logs

from agenticstate import (
    BackendTimeoutError,
    BackendUnavailableError,
    ChangeOp,
    RedisBackend,
    StateConfig,
    StateManager,
    WriteOutcomeUnknownError,
)
from agenticstate.backends.base import Get, IndexIncr
from tests._redis_server import RedisServer, make_test_ca
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.redis

ROOT = Path(__file__).parent.parent.parent


def Worker(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._redis_worker", *args)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (so it can be restarted or slowed down)."""
    own = RedisServer(
        tmp_path / "redis", extra_args=("--appendonly", "yes", "--appendfsync", "always")
    )
    own.start()
    try:
        yield own
    finally:
        own.stop()


def test_four_processes_increment_one_key_exactly(redis_url: str) -> None:
    """4 processes x 500 update() increments of one key add up to exactly 2000."""
    prefix = unique_prefix()
    workers = [Worker("increment", redis_url, prefix, "500") for _ in range(4)]
    try:
        for worker in workers:
            assert worker.wait_until(lambda lines: "done" in lines, timeout=120), worker.close()
    finally:
        errors = [worker.close() for worker in workers]
    assert all(worker.process.returncode in (0, -9) for worker in workers), errors
    client = sync_redis.Redis.from_url(redis_url)
    try:
        raw = client.get(f"{prefix}counter")
    finally:
        client.close()

    async def read() -> Any:
        config = StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
        async with StateManager(config) as state:
            return await state.get_entry("counter")

    entry = anyio.run(read)
    assert raw is not None
    assert entry is not None
    assert entry.value == 2000
    assert entry.version == 2000


def _view(lines: list[str]) -> dict[str, tuple[int, Any]]:
    """The subscriber's picture of the keys: the last version and value it reported for each."""
    view: dict[str, tuple[int, Any]] = {}
    for line in lines[1:]:
        event = json.loads(line)
        if event["value"] is None:
            view.pop(event["key"], None)
        else:
            view[event["key"]] = (event["version"], event["value"])
    return view


def _pubsub_connected(client: sync_redis.Redis, within: float = 30.0) -> bool:
    """Wait until the server has a pub/sub connection (polled: another process reconnects)."""
    deadline = time.monotonic() + within
    while not client.client_list(_type="pubsub"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling another process's state, with a deadline
    return True


async def test_subscriber_converges_although_its_connection_is_killed(redis_url: str) -> None:
    """A subscriber process ends on the final value of all 50 keys after 10,000 writes,
    although its pub/sub connection is killed 5 times along the way."""
    prefix = unique_prefix()
    subscriber = Worker("subscribe", redis_url, prefix, "k:*")
    killer = sync_redis.Redis.from_url(redis_url)
    try:
        assert subscriber.wait_until(lambda lines: lines[:1] == ["ready"], timeout=30)
        config = StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
        expected: dict[str, tuple[int, Any]] = {}
        async with StateManager(config) as state:
            for n in range(10_000):
                key = f"k:{n % 50}"
                expected[key] = (await state.save(key, n), n)
                if n % 2000 == 1000:
                    # The subscriber reconnects on its own time: kill once it is back (the
                    # 2,000 saves since the last kill can finish before it is).
                    assert _pubsub_connected(killer), "the subscriber never reconnected"
                    killed = killer.client_kill_filter(_type="pubsub")
                    assert killed >= 1
        converged = subscriber.wait_until(lambda lines: _view(lines) == expected, timeout=60)
        assert converged, {k: v for k, v in _view(subscriber.lines).items() if expected.get(k) != v}
        ops = {json.loads(line)["op"] for line in subscriber.lines[1:]}
        assert "set" in ops
    finally:
        killer.close()
        subscriber.close()


async def test_writer_and_subscriber_recover_from_a_redis_restart(server: RedisServer) -> None:
    """Redis restarts mid-run: writes fail with typed errors meanwhile, then both sides resume
    and the subscriber ends on the final state."""
    prefix = unique_prefix()
    subscriber = Worker("subscribe", server.unix_url, prefix, "r:*")
    try:
        assert subscriber.wait_until(lambda lines: lines[:1] == ["ready"], timeout=30)
        config = StateConfig(backend="redis", redis_url=server.unix_url, key_prefix=prefix)
        async with StateManager(config) as state:
            for n in range(100):
                await state.save(f"r:{n % 10}", n)
            await anyio.to_thread.run_sync(server.stop)
            with pytest.raises(BackendUnavailableError):
                await state.save("r:0", -1)
            with pytest.raises(BackendUnavailableError):
                await state.get("r:0")
            await anyio.to_thread.run_sync(server.start)
            expected: dict[str, tuple[int, Any]] = {}
            for n in range(100, 200):
                key = f"r:{n % 10}"
                expected[key] = (await state.save(key, n), n)
            assert await state.get("r:9") == 199
        assert subscriber.wait_until(lambda lines: _view(lines) == expected, timeout=60), _view(
            subscriber.lines
        )
        # The server keeps an AOF, so the change feed survives the restart: the subscriber
        # catches up from it with the real changes (no RESYNC: nothing had to be re-read).
        events = [json.loads(line) for line in subscriber.lines[1:]]
        assert {event["op"] for event in events} == {ChangeOp.SET.value}
    finally:
        subscriber.close()


async def test_connection_refused_is_a_typed_error(tmp_path: Path) -> None:
    """Nothing listening: reads retry then raise BackendUnavailableError; so do writes."""
    backend = RedisBackend(url=f"unix://{tmp_path}/nothing.sock", read_retries=2)
    try:
        with pytest.raises(BackendUnavailableError):
            await backend.get("k")
        with pytest.raises(BackendUnavailableError):
            await backend.set("k", b"v")
        with pytest.raises(BackendUnavailableError):
            [key async for key in backend.scan("*")]
    finally:
        await backend.aclose()


async def test_timeouts_and_unknown_write_outcomes(server: RedisServer) -> None:
    """A server that stops answering: a write sent on a live connection whose reply never comes
    is reported as unknown (never retried); calls that cannot even connect time out."""
    backend = RedisBackend(url=server.unix_url, socket_timeout=0.3, read_retries=1)
    admin = sync_redis.Redis.from_url(server.unix_url)
    try:
        await backend.set("k", b"before")  # leaves a live connection in the pool
        admin.client_pause(5000, all=True)  # from now on the server answers nobody else
        try:
            with pytest.raises(WriteOutcomeUnknownError) as caught:
                await backend.set("k", b"after")
            with pytest.raises(BackendTimeoutError):
                await backend.get("k")
            with pytest.raises(BackendTimeoutError):
                await backend.set("k", b"never sent")
        finally:
            admin.client_unpause()
        assert caught.value.key == "k"
        entry = await backend.get("k")
        assert entry is not None
        # Unknown means unknown: the server may or may not have run the script; either way it
        # ran at most once, so the version tells which.
        assert (entry.value, entry.version) in ((b"before", 1), (b"after", 2))
    finally:
        admin.close()
        await backend.aclose()


async def test_scripts_reload_after_script_flush(redis_url: str) -> None:
    """After SCRIPT FLUSH (or a restart), writes reload the Lua scripts by themselves."""
    async with RedisBackend(url=redis_url, key_prefix=unique_prefix()) as backend:
        await backend.set("k", b"1")
        admin = sync_redis.Redis.from_url(redis_url)
        try:
            admin.script_flush()
        finally:
            admin.close()
        changes = await backend.set_many([("k", b"2"), ("other", b"x")])
        assert [change.version for change in changes] == [2, 1]
        admin = sync_redis.Redis.from_url(redis_url)
        try:
            admin.script_flush()
        finally:
            admin.close()
        change = await backend.set("k", b"3")
        assert change.version == 3
        admin = sync_redis.Redis.from_url(redis_url)
        try:
            admin.script_flush()
        finally:
            admin.close()
        done = await backend.transact([], [Get("k"), IndexIncr("counts", "n", 1)])
        assert done.succeeded
        assert done.results[0].version == 3
        assert done.results[1] == 1.0
        assert (await backend.delete("k")) is not None


async def test_prefixes_isolate_tenants(redis_url: str) -> None:
    """Two prefixes on one server never see each other's keys or changes."""
    async with (
        RedisBackend(url=redis_url, key_prefix=unique_prefix()) as tenant_a,
        RedisBackend(url=redis_url, key_prefix=unique_prefix()) as tenant_b,
        tenant_b.changes("*") as b_changes,
    ):
        await tenant_a.set("secret", b"a-only")
        await tenant_b.set("other", b"b")
        assert await tenant_b.get("secret") is None
        assert [key async for key in tenant_b.scan("*")] == ["other"]
        assert await tenant_b.delete("secret") is None
        assert await tenant_a.get("secret") is not None
        with anyio.fail_after(5):
            first = await b_changes.__anext__()
        assert first.key == "other"


async def test_acl_user_and_password_never_leak(tmp_path: Path) -> None:
    """An ACL user with a password works; a wrong one is a typed error; the password never
    appears in reprs, error messages or logs."""
    server = RedisServer(tmp_path / "acl", extra_args=("--requirepass", "adminpw"))
    server.start()
    admin = sync_redis.Redis(unix_socket_path=str(server.socket_path), password="adminpw")  # noqa: S106
    try:
        admin.acl_setuser(
            "agent",
            enabled=True,
            passwords=["+s3cr3t-pw"],
            keys=["app:*", "__agenticstate_*"],  # the keys, and the change feed's streams
            channels=["*"],
            commands=["+@all"],
        )
        good = f"redis://agent:s3cr3t-pw@127.0.0.1:{server.port}/0"
        with capture_logs() as logs:
            async with StateManager(
                StateConfig(backend="redis", redis_url=good, key_prefix="app:")
            ) as state:
                await state.save("x", {"ok": True})
                assert await state.get("x") == {"ok": True}
                assert "s3cr3t-pw" not in repr(state)
                assert "s3cr3t-pw" not in repr(state.config)
            bad = f"redis://agent:wrong-pw@127.0.0.1:{server.port}/0"
            backend = RedisBackend(url=bad)
            with pytest.raises(BackendUnavailableError) as caught:
                await backend.get("x")
            await backend.aclose()
        assert "wrong-pw" not in str(caught.value)
        assert "wrong-pw" not in repr(backend)
        assert "s3cr3t-pw" not in repr(logs)
        assert "wrong-pw" not in repr(logs)
    finally:
        admin.close()
        server.stop()


async def test_tls_with_a_test_ca(tmp_path: Path) -> None:
    """rediss:// to a TLS-only server works with the CA made for the test."""
    cert, key, ca = make_test_ca(tmp_path / "ca")
    server = RedisServer(tmp_path / "tls", tls_files=(cert, key, ca))
    server.start()
    try:
        backend = RedisBackend(url=server.tcp_url, key_prefix="tls:", ssl_ca_certs=str(ca))
        async with StateManager(backend=backend) as state:
            await state.save("k", [1, 2, 3])
            async with state.watch("k") as changes:
                await state.save("k", [4])
                with anyio.fail_after(5):
                    change = await changes.__anext__()
            assert change.new_value == [4]
            assert await state.list_keys() == ["k"]
        untrusted = RedisBackend(url=server.tcp_url)
        with pytest.raises(BackendUnavailableError):
            await untrusted.get("k")
        await untrusted.aclose()
    finally:
        server.stop()


async def test_seed_core_examples_on_redis(redis_url: str) -> None:
    """The seed page's core examples, with StateConfig(backend="redis", ..., ttl=3600)."""
    state_manager = StateManager(
        config=StateConfig(
            backend="redis", redis_url=redis_url, key_prefix=unique_prefix(), ttl=3600
        )
    )
    seen: list[tuple[str, Any, Any]] = []
    deleted = anyio.Event()

    async def on_state_change(
        key: str, old_value: dict[str, Any], new_value: dict[str, Any]
    ) -> None:
        seen.append((key, old_value, new_value))
        if new_value is None:
            deleted.set()

    state_manager.subscribe("agent:*", on_state_change)
    await state_manager.save(
        "agent:researcher", {"status": "running", "current_task": "analyze_data", "progress": 0.45}
    )
    agent_state = await state_manager.get("agent:researcher")
    assert agent_state["status"] == "running"
    await state_manager.update("agent:researcher", {"progress": 0.75})
    entry = await state_manager.get_entry("agent:researcher")
    assert entry is not None
    assert entry.ttl is not None
    assert 3590 < entry.ttl.total_seconds() <= 3600
    keys = await state_manager.list_keys("agent:*")
    assert keys == ["agent:researcher"]
    await state_manager.delete("agent:researcher")
    with anyio.fail_after(5):
        await deleted.wait()
    state_manager.unsubscribe("agent:*", on_state_change)
    assert [new for _, _, new in seen] == [
        {"status": "running", "current_task": "analyze_data", "progress": 0.45},
        {"status": "running", "current_task": "analyze_data", "progress": 0.75},
        None,
    ]
    await state_manager.aclose()


async def test_more_callers_than_connections_wait_their_turn(redis_url: str) -> None:
    """With connection_pool_size=2, 50 concurrent writes all succeed on two connections, and
    writes cancelled while waiting or mid-command leave the backend working."""
    prefix = unique_prefix()
    async with RedisBackend(url=redis_url, key_prefix=prefix, connection_pool_size=2) as backend:
        async with anyio.create_task_group() as tg:
            for n in range(50):
                tg.start_soon(backend.set, f"k{n}", b"v")
        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(backend.set, f"cancelled{n}", b"v")
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        assert (await backend.set("after", b"v")).version == 1
        assert len([key async for key in backend.scan("k*")]) == 50
        assert len(backend._connections.made) <= 2
