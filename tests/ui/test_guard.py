"""The inspector's API and its guards: host (DNS rebinding), cross-site requests, token, writes."""

from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import StateConfig, StateManager, ui
from agenticstate.ui import create_app, is_loopback
from agenticstate.ui._app import InspectorSettings, _Guard
from tests.helpers import LineProcess

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

TOKEN = "a-long-enough-token-0123456789"  # noqa: S105  # a test value


@pytest.fixture
async def state() -> AsyncIterator[StateManager]:
    manager = StateManager(StateConfig(backend="memory"))
    await manager.open()
    await manager.save("agent:1", {"secret": "s3cr3t"})
    try:
        yield manager
    finally:
        await manager.aclose()


def _client(app: object, host: str = "127.0.0.1:8765") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
        base_url=f"http://{host}",
    )


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8765",
        "127.0.0.1.evil.example",
        "localhost.evil.example:8765",
        "[::2]:8765",
        "[::1]evil.example",
        "localhost:80:80",
        "localhost:http",
        "::1",
        "",
    ],
)
async def test_a_foreign_host_header_gets_no_value(state: StateManager, host: str) -> None:
    # DNS rebinding: a page on evil.example re-points its name at 127.0.0.1 and reads.
    async with _client(create_app(state)) as client:
        for path in [
            "/",
            "/api/keys",
            "/api/value?key=agent:1",
            "/api/history?key=agent:1",
            "/api/stream",
            "/api/agents",
            "/api/knowledge",
        ]:
            response = await client.get(path, headers={"host": host})
            assert response.status_code == 403, path
            assert "s3cr3t" not in response.text


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "localhost:8765", "[::1]:8765", "LOCALHOST"])
async def test_loopback_names_are_served(state: StateManager, host: str) -> None:
    async with _client(create_app(state), host) as client:
        response = await client.get("/api/value", params={"key": "agent:1"})
    assert response.status_code == 200
    assert json.loads(response.json()["json"]) == {"secret": "s3cr3t"}
    assert response.json()["version"] == 1
    async with _client(create_app(state), host) as client:
        response = await client.get("/api/history", params={"key": "agent:1"})
    [only] = response.json()["versions"]  # one version, the current one
    assert (only["version"], json.loads(only["json"])) == (1, {"secret": "s3cr3t"})
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
async def test_cross_site_requests_are_refused(state: StateManager, site: str) -> None:
    async with _client(create_app(state)) as client:
        response = await client.get("/api/keys", headers={"sec-fetch-site": site})
    assert response.status_code == 403
    assert "agent:1" not in response.text


async def test_keys_carry_version_ttl_and_stored_size(state: StateManager) -> None:
    await state.save("agent:2", {"n": 1}, ttl=60)
    await state.save("agent:2", {"n": 2}, ttl=60)
    await state.save("task:1", "x" * 1000)
    async with _client(create_app(state)) as client:
        rows = (await client.get("/api/keys", params={"pattern": "agent:*"})).json()["keys"]
        everything = (await client.get("/api/keys", params={"limit": 2})).json()
    assert [(row["key"], row["version"]) for row in rows] == [("agent:1", 1), ("agent:2", 2)]
    assert rows[0]["ttl"] is None
    assert 0 < rows[1]["ttl"] <= 60
    stored = await state.backend.get("agent:2")
    assert stored is not None
    assert rows[1]["size"] == len(stored.value)
    assert len(everything["keys"]) == 2
    assert everything["more"] is True


@pytest.mark.parametrize(
    "query",
    [
        {"pattern": "a\x01*"},
        {"pattern": "x" * 2000},
        {"limit": "0"},
        {"limit": "x"},
        {"limit": "100000"},
    ],
)
async def test_bad_listing_arguments_are_400(state: StateManager, query: dict[str, str]) -> None:
    async with _client(create_app(state)) as client:
        response = await client.get("/api/keys", params=query)
    assert response.status_code == 400
    assert response.json()["error"]


async def test_a_token_is_required_when_set(state: StateManager) -> None:
    app = create_app(state, token=TOKEN)
    async with _client(app) as client:
        assert (await client.get("/api/keys")).status_code == 401
        assert (await client.get("/")).status_code == 401
        assert (await client.get("/", params={"token": TOKEN[:-1]})).status_code == 401
        wrong = await client.get("/api/keys", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        bearer = await client.get("/api/keys", headers={"authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200
        opened = await client.get("/", params={"token": TOKEN})
        assert opened.status_code == 303
        assert opened.headers["location"] == "/"  # the token leaves the address bar
        # Named by port: two inspectors on one host keep their own cookies.
        assert opened.headers["set-cookie"].startswith(f"agenticstate_ui_token_8765={TOKEN};")
        cookie = opened.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        # The client keeps the cookie, like the browser does.
        assert (await client.get("/api/keys")).status_code == 200


async def test_read_only_refuses_writes_and_changes_nothing(state: StateManager) -> None:
    async with _client(create_app(state)) as client:
        origin = {"origin": "http://127.0.0.1:8765"}
        body = {"key": "agent:1", "value": {"secret": "changed"}, "expected_version": 1}
        put = await client.put("/api/value", json=body, headers=origin)
        delete = await client.request("DELETE", "/api/value", json=body, headers=origin)
    assert (put.status_code, delete.status_code) == (403, 403)
    assert await state.get("agent:1") == {"secret": "s3cr3t"}


async def test_writes_need_the_page_origin_and_the_version_shown(state: StateManager) -> None:
    app = create_app(state, allow_writes=True)
    body = {"key": "agent:1", "value": {"secret": "changed"}, "expected_version": 1}
    async with _client(app) as client:
        for headers in [{}, {"origin": "http://evil.example"}, {"origin": "null"}]:
            response = await client.put("/api/value", json=body, headers=headers)
            assert response.status_code == 403
        origin = {"origin": "http://127.0.0.1:8765"}
        stale = await client.put("/api/value", json={**body, "expected_version": 7}, headers=origin)
        assert stale.status_code == 409
        assert await state.get("agent:1") == {"secret": "s3cr3t"}
        missing = await client.put(
            "/api/value", json={"key": "agent:1", "value": 1}, headers=origin
        )
        assert missing.status_code == 400
        for raw in [
            '{"key": "agent:1", "value": NaN, "expected_version": 1}',
            '{"key": "agent:1", "value": {"a": 1e999}, "expected_version": 1}',
            '{"key": "\\u0000", "value": 1, "expected_version": 1}',
            '{"key": "agent:1", "value": 1, "expected_version": "1"}',
            "[1]",
            "not json",
        ]:
            bad = await client.put(
                "/api/value",
                content=raw,
                headers={**origin, "content-type": "application/json"},
            )
            assert bad.status_code == 400, (raw, bad.text)
        assert await state.get_entry("agent:1") is not None
        assert (await state.get_entry("agent:1")).version == 1  # type: ignore[union-attr]
        saved = await client.put("/api/value", json=body, headers=origin)
        assert saved.json() == {"key": "agent:1", "version": 2}
        assert await state.get("agent:1") == {"secret": "changed"}
        gone = await client.request(
            "DELETE", "/api/value", json={"key": "agent:1", "expected_version": 1}, headers=origin
        )
        assert gone.status_code == 409
        gone = await client.request(
            "DELETE", "/api/value", json={"key": "agent:1", "expected_version": 2}, headers=origin
        )
        assert gone.json() == {"key": "agent:1", "deleted": True}
    assert not await state.exists("agent:1")


def test_loopback_names() -> None:
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "::", "192.168.1.2", "example.com"])  # noqa: S104


def test_bound_elsewhere_it_prints_a_token_and_requires_it() -> None:
    server = LineProcess(
        "agenticstate.cli",
        "--url",
        "memory://",
        "ui",
        "--host",
        "0.0.0.0",  # noqa: S104  # the point of the test
        "--port",
        "0",
    )
    try:
        assert server.wait_until(lambda lines: any("?token=" in line for line in lines), 30), (
            server.close()
        )
        address = next(line for line in server.lines if "?token=" in line).split()[-1]
        port = address.split(":")[2].split("/")[0]
        token = address.split("?token=")[1]
        assert len(token) >= 16
        api = f"http://127.0.0.1:{port}/api/keys"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(api, timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        request = urllib.request.Request(api, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            assert json.load(response)["keys"] == []
    finally:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGINT)
            server.process.wait(timeout=20)
        errors = server.close()
    assert token not in errors  # printed once, on stdout, never logged


async def test_a_closed_stream_releases_its_subscription(state: StateManager) -> None:
    """The live stream: events as they commit, and nothing left subscribed once the page goes."""
    fanout = state.backend._fanout  # type: ignore[attr-defined]  # MemoryBackend's subscriptions
    addresses: list[str] = []
    listening = anyio.Event()

    def ready(address: str) -> None:
        addresses.append(address)
        listening.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(partial(ui.serve, state, port=0, ready=ready, sample_interval=0.1))
        with anyio.fail_after(10):
            await listening.wait()
        async with (
            httpx.AsyncClient(base_url=addresses[0]) as client,
            client.stream("GET", "/api/stream", params={"pattern": "agent:*"}) as response,
        ):
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.aiter_lines()
            with anyio.fail_after(10):
                assert await anext(lines) == "event: ready"
                assert fanout.has_subscribers
                await state.save("other:1", 1)
                await state.save("agent:1", {"secret": "rotated"})
                data = ""
                while not data.startswith('data: {"key"'):
                    data = await anext(lines)
            change = json.loads(data.removeprefix("data: "))
            assert (change["key"], change["op"], change["version"]) == ("agent:1", "set", 2)
            assert json.loads(change["new"]) == {"secret": "rotated"}
        with anyio.fail_after(10):
            while fanout.has_subscribers:  # noqa: ASYNC110  # a property, no event to wait on
                await anyio.sleep(0.01)
        tasks.cancel_scope.cancel()


async def test_teams_count_expired_leases_and_sample_the_queue(state: StateManager) -> None:
    from agenticstate.managers import OrchestrationStateManager, TeamState

    orchestration = OrchestrationStateManager(state_manager=state)
    await orchestration.create_team(TeamState(team_id="ops"))
    for n in range(3):
        await orchestration.enqueue_task("ops", {"task_id": f"t{n}"})
    # The long lease first: a claim takes a task whose lease ran out, so claimed after the
    # 1 ms one it took that task back when the machine was slow.
    held = await orchestration.claim_task("ops", "w2", lease=timedelta(minutes=5))
    short = await orchestration.claim_task("ops", "w1", lease=timedelta(milliseconds=1))
    assert short is not None
    assert held is not None
    # Wait for the clock, not for another task: the short lease must have run out.
    await anyio.sleep(max(0.0, (short.lease_expires_at - datetime.now(UTC)).total_seconds()))
    app = create_app(state)
    await app.state.inspector.sample_queues()
    async with _client(app) as client:
        (team,) = (await client.get("/api/teams")).json()["teams"]
    assert (team["pending"], team["in_progress"], team["expired_leases"]) == (1, 2, 1)
    assert datetime.fromisoformat(team["next_lease_expiry"]) == held.lease_expires_at
    assert [(s["pending"], s["in_progress"], s["expired_leases"]) for s in team["samples"]] == [
        (1, 2, 1)
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "port must be"),
        (["--sample-interval", "0"], "sample_interval"),
        (["--host", "no-such-host.invalid"], "cannot listen"),
    ],
)
def test_bad_ui_options_exit_2_with_a_message(args: list[str], message: str) -> None:
    server = LineProcess("agenticstate.cli", "--url", "memory://", "ui", *args)
    server.process.wait(timeout=60)
    errors = server.close()
    assert server.process.returncode == 2, errors
    assert message in errors
    assert "Traceback" not in errors


_LOOPBACK_HOST = re.compile(r"(127\.0\.0\.1|localhost|\[::1\])(:[0-9]{1,5})?")
_GUARD = _Guard(app=None, settings=InspectorSettings())  # type: ignore[arg-type]


def _refused(host: str) -> bool:
    scope = {"type": "http", "method": "GET", "path": "/api/keys", "query_string": b""}
    return _GUARD._refusal(scope, {"host": host}) is not None


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.from_regex(r"[a-z0-9.-]{1,30}(:[0-9]{1,5})?", fullmatch=True),
        st.builds(
            "{}{}".format,
            st.sampled_from(["127.0.0.1", "localhost", "[::1]", "::1", "LOCALHOST"]),
            st.text(max_size=20),
        ),
    )
)
def test_only_loopback_host_headers_pass(host: str) -> None:
    # Whatever the Host header says, it passes only if it names this machine (any port).
    if not _refused(host):
        assert _LOOPBACK_HOST.fullmatch(host.strip().lower()), host


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}\.[a-z]{2,6}", fullmatch=True), st.integers(1, 65535))
def test_any_other_site_name_is_refused(name: str, port: int) -> None:
    assert _refused(name)
    assert _refused(f"{name}:{port}")
