"""The inspector's costs are bounded by what it shows, not by the values it shows them from.

- Values are rendered as indented JSON by a bounded encoder: the text is exactly
  `json.dumps(..., indent=2)` cut at the limit (a differential property test), built only that
  far (a value at `max_value_size` viewed under a tracemalloc budget), in a worker thread while
  other requests are answered (proven with events, not timings).
- The key list reads metadata and sizes, never values: bytes sent by a real Redis are counted.
"""

from __future__ import annotations

import json
import threading
import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import httpx
import pytest
import redis as sync_redis
from hypothesis import given, settings
from hypothesis import strategies as st

import agenticstate.ui._app as app_module
from agenticstate import StateConfig, StateManager
from agenticstate.ui import create_app
from agenticstate.ui._app import MAX_KEYS, MAX_STREAM_VALUE_CHARS, MAX_VALUE_CHARS
from agenticstate.ui._render import plain, shown
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
        base_url="http://127.0.0.1:8765",
        timeout=120,
    )


# -- the bounded encoder ---------------------------------------------------------------------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.binary(max_size=40)
    | st.datetimes(timezones=st.just(UTC))
    | st.dates()
    | st.uuids()
    | st.timedeltas()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, data=st.data())
def test_shown_is_the_indented_json_cut_at_the_limit(value: Any, data: st.DataObject) -> None:
    """For any value and limit, `shown` gives json.dumps(indent=2) cut to the limit, and says
    whether it cut (the text the page showed before the encoder was bounded)."""
    full = json.dumps(value, default=plain, ensure_ascii=False, indent=2)
    limit = data.draw(st.integers(min_value=0, max_value=len(full) + 3))
    assert shown(value, limit) == (full[:limit], len(full) > limit)


def test_shown_handles_depth_and_odd_keys() -> None:
    """Any depth (an explicit stack, no recursion) and non-str dict keys, as json.dumps does."""
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    text, cut = shown(deep, 10**9)
    assert not cut
    assert text.count("[") == 5000
    odd = {1: "a", 2.5: "b", False: "c", None: "d"}
    assert shown(odd, 1000) == (json.dumps(odd, indent=2), False)


def test_shown_stops_at_the_limit_for_long_strings_bytes_and_containers() -> None:
    """A long string, byte string, list or dict is encoded only as far as the limit: the
    result has the limit's length and is a prefix of the whole encoding."""
    values: list[Any] = [
        "é" * 100_000,
        bytes(range(256)) * 1000,
        list(range(100_000)),
        {f"k{n}": {"n": n} for n in range(50_000)},
        {"x" * 50_000: 1},
    ]
    for value in values:
        full = json.dumps(value, default=plain, ensure_ascii=False, indent=2)
        assert shown(value, 1000) == (full[:1000], True)


# -- the value view ---------------------------------------------------------------------------


@pytest.fixture
async def state() -> AsyncIterator[StateManager]:
    manager = StateManager(StateConfig(backend="memory"))
    await manager.open()
    try:
        yield manager
    finally:
        await manager.aclose()


def _value_at_max_size(state: StateManager) -> dict[str, Any]:
    """A value whose encoding is exactly `max_value_size` bytes: one long string (what a
    whole-value encoding copies) and many small items (what its chunks cost)."""
    limit = state.config.max_value_size
    value: dict[str, Any] = {"items": [n % 100 for n in range(100_000)], "text": ""}
    overhead = len(state.serializer.dumps(value)) - 1  # less the format byte
    value["text"] = "x" * (limit - overhead - 4)  # a str32 header is 4 bytes more than fixstr
    assert len(state.serializer.dumps(value)) - 1 == limit
    return value


@pytest.mark.slow
async def test_viewing_a_value_at_max_size_costs_memory_bounded_by_the_display_limit(
    state: StateManager,
) -> None:
    """Viewing a value at `max_value_size` allocates at most what reading it costs plus a
    constant times the display limit (tracemalloc's peak over the request), not a multiple of
    the value."""
    await state.save("big", _value_at_max_size(state))
    app = create_app(state)
    async with _client(app) as client:
        await client.get("/api/info")  # the first request's one-time costs, not counted
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            entry = await state.get_entry("big")
            reading = tracemalloc.get_traced_memory()[1] - before
            del entry
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            response = await client.get("/api/value", params={"key": "big"})
            viewing = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    body = response.json()
    assert response.status_code == 200
    assert (body["truncated"], len(body["json"]), body["size"]) == (
        True,
        MAX_VALUE_CHARS,
        state.config.max_value_size + 1,
    )
    budget = 16 * MAX_VALUE_CHARS
    assert viewing <= reading + budget, (viewing, reading, budget)


async def test_another_request_is_answered_while_a_big_value_is_rendered(
    state: StateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The value view renders in a worker thread: while its rendering is held (by an event),
    another request is answered; the rendering goes on once released."""
    await state.save("big", {"text": "y" * 100_000})
    started, released = threading.Event(), threading.Event()
    waited: list[bool] = []
    real = shown

    def held(value: Any, limit: int) -> tuple[str, bool]:
        if limit == MAX_VALUE_CHARS:
            started.set()
            # On the event loop this would block every request: the wait then runs out.
            waited.append(released.wait(20))
        return real(value, limit)

    monkeypatch.setattr(app_module, "shown", held)
    async with _client(create_app(state)) as client, anyio.create_task_group() as tasks:
        views: list[httpx.Response] = []

        async def view() -> None:
            views.append(await client.get("/api/value", params={"key": "big"}))

        tasks.start_soon(view)
        with anyio.fail_after(30):
            assert await anyio.to_thread.run_sync(started.wait, 30)
            info = await client.get("/api/info")
            keys = await client.get("/api/keys")
        released.set()
    assert info.status_code == 200
    assert [row["key"] for row in keys.json()["keys"]] == ["big"]
    assert waited == [True]
    assert views[0].json()["json"] == json.dumps({"text": "y" * 100_000}, indent=2)


async def test_session_messages_show_a_bounded_text(state: StateManager) -> None:
    """A big message reaches the session view cut to the stream limit (the live stream cuts
    its values with the same encoder); `last` is capped."""
    from agenticstate.managers import SessionManager

    sessions = SessionManager(state_manager=state)
    session = await sessions.create_session("u1")
    await sessions.add_message(session.session_id, "user", {"text": "z" * 500_000})
    app = create_app(state)
    async with _client(app) as client:
        response = await client.get(f"/api/sessions/{session.session_id}/messages")
        [message] = response.json()["messages"]
        assert len(message["content"]) == MAX_STREAM_VALUE_CHARS
        too_many = await client.get(
            f"/api/sessions/{session.session_id}/messages", params={"last": 10_000}
        )
        assert too_many.status_code == 400


# -- the key list -----------------------------------------------------------------------------


def _bytes_sent(admin: sync_redis.Redis) -> int:
    info: dict[str, Any] = admin.info("stats")
    return int(info["total_net_output_bytes"])


@pytest.mark.redis
async def test_the_key_list_reads_no_values_from_redis(redis_url: str) -> None:
    """Listing 40 keys of 256 KB each makes Redis send far less than one value: the list
    reads versions, times and sizes (`stat_many`), not values; `limit` is capped."""
    prefix = unique_prefix()
    config = StateConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
    value_size = 256 * 1024
    async with StateManager(config) as state:
        for n in range(40):
            await state.save(f"blob:{n:02}", "v" * value_size, ttl=timedelta(hours=1))
        admin = sync_redis.Redis.from_url(redis_url)
        try:
            async with _client(create_app(state)) as client:
                await client.get("/api/keys", params={"pattern": "nothing", "limit": 1})
                before = _bytes_sent(admin)
                response = await client.get("/api/keys", params={"pattern": "blob:*", "limit": 40})
                sent = _bytes_sent(admin) - before
                refused = await client.get("/api/keys", params={"limit": MAX_KEYS + 1})
        finally:
            admin.close()
    rows = response.json()["keys"]
    assert [row["key"] for row in rows] == [f"blob:{n:02}" for n in range(40)]
    assert {row["version"] for row in rows} == {1}
    assert all(3500 < row["ttl"] <= 3600 for row in rows)
    assert all(row["size"] > value_size for row in rows)  # the stored size, header of the codec
    assert all(datetime.fromisoformat(row["updated_at"]).tzinfo is not None for row in rows)
    assert sent < value_size, f"Redis sent {sent} bytes for a list of 40 keys"
    assert refused.status_code == 400


async def test_a_save_from_the_page_reads_a_bounded_body(state: StateManager) -> None:
    """A save whose body is larger than `MAX_WRITE_BYTES` is refused (413) without being read
    whole, with or without a declared length, and nothing is written."""
    from agenticstate.ui._app import MAX_WRITE_BYTES

    await state.save("k", 1)
    app = create_app(state, allow_writes=True)
    page = {"origin": "http://127.0.0.1:8765"}
    big = b'{"key": "k", "expected_version": 1, "value": "' + b"x" * MAX_WRITE_BYTES + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    async with _client(app) as client:
        declared = await client.put("/api/value", content=big, headers=page)
        streamed = await client.put("/api/value", content=chunks(), headers=page)
        small = await client.put(
            "/api/value", json={"key": "k", "expected_version": 1, "value": 2}, headers=page
        )
    assert (declared.status_code, streamed.status_code, small.status_code) == (413, 413, 200)
    assert await state.get("k") == 2
