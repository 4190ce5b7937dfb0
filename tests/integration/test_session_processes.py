"""Two real processes appending to one session at once lose nothing and agree on the order."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import ChangeOp, SessionManager, StateManager, open_backend
from tests.helpers import LineProcess, unique_prefix

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

MESSAGES_EACH = 150


def _redis(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"{request.getfixturevalue('redis_url')}?key_prefix={unique_prefix()}"


def _redis_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"{request.getfixturevalue('redis_cluster_url')}?key_prefix={unique_prefix()}"


def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sessions.db'}"


def _postgres(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"{request.getfixturevalue('postgres_url')}&key_prefix={unique_prefix()}"


# Every backend several processes can share, as a URL `open_backend` accepts. A new shared
# backend adds one line here.
SHARED_BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "redis": _redis,
    "redis-cluster": _redis_cluster,
    "sqlite": _sqlite,
    "postgres": _postgres,
}


@pytest.mark.redis
@pytest.mark.parametrize("kind", list(SHARED_BACKENDS))
async def test_two_processes_append_to_one_session(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two processes appending at once: every message stored once, numbered 1..N, one order."""
    url = SHARED_BACKENDS[kind](request, tmp_path)
    async with StateManager(backend=open_backend(url)) as state:
        session = await SessionManager(state_manager=state).create_session("u1")
    workers = [
        LineProcess(
            "tests.integration._session_worker", url, session.session_id, tag, str(MESSAGES_EACH)
        )
        for tag in ("a", "b")
    ]
    try:
        for worker in workers:
            assert worker.wait_lines(1), worker.close()
            assert worker.lines[0] == "ready"
        for worker in workers:  # start both at once
            assert worker.process.stdin is not None
            worker.process.stdin.write("go\n")
            worker.process.stdin.flush()
        numbers: list[list[int]] = []
        for worker in workers:
            assert worker.wait_lines(2), worker.close()
            numbers.append(json.loads(worker.lines[1].removeprefix("done ")))
        for worker in workers:
            assert worker.process.stdin is not None
            worker.process.stdin.write("read\n")
            worker.process.stdin.flush()
        orders = []
        for worker in workers:
            assert worker.wait_lines(3), worker.close()
            orders.append(json.loads(worker.lines[2].removeprefix("order ")))
            worker.stop()
            assert worker.process.returncode == 0, worker.close()
    finally:
        for worker in workers:
            worker.close()
    # Distinct numbers covering 1..2N, increasing within each writer.
    assert sorted(numbers[0] + numbers[1]) == list(range(1, 2 * MESSAGES_EACH + 1))
    assert all(seqs == sorted(seqs) for seqs in numbers)
    # The two processes read the same history, in the same order; nothing lost or doubled.
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == sorted(f"{t}-{i}" for t in "ab" for i in range(MESSAGES_EACH))
    async with StateManager(backend=open_backend(url)) as state:
        messages = await SessionManager(state_manager=state).get_messages(session.session_id)
    assert [m.seq for m in messages] == list(range(1, 2 * MESSAGES_EACH + 1))
    assert [m.content for m in messages] == orders[0]
    # Each writer's messages keep the order it wrote them in.
    for tag in "ab":
        mine = [m.content for m in messages if m.metadata["writer"] == tag]
        assert mine == [f"{tag}-{i}" for i in range(MESSAGES_EACH)]


ROUNDS = 40


@pytest.mark.redis
@pytest.mark.parametrize("kind", list(SHARED_BACKENDS))
async def test_a_delete_erases_every_write_racing_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two processes append, update, set and summarize one session while this one deletes and
    re-creates it: once a delete returns, nothing of the session is left (no message, state or
    summary written after it), a re-created session starts clean, and no writer ever meets a
    ConflictError."""
    url = SHARED_BACKENDS[kind](request, tmp_path)
    sid = "shared"
    workers = [LineProcess("tests.integration._session_race_worker", url, sid, tag) for tag in "ab"]
    try:
        for worker in workers:
            assert worker.wait_lines(1), worker.close()
        async with (
            StateManager(backend=open_backend(url)) as state,
            state.watch(f"sessions:{{{sid}}}:msg:*") as changes,
        ):
            sessions = SessionManager(state_manager=state)
            glob = f"sessions:{{{sid}}}:*"
            for round_ in range(ROUNDS):
                await sessions.create_session(f"user{round_}", session_id=sid)
                written = 0
                with anyio.fail_after(30):  # the writers land a few messages
                    while written < 3:
                        written += (await anext(changes)).op is ChangeOp.SET
                messages = await sessions.get_messages(sid)
                # Numbered and written in one step: no gap, nothing of an earlier life.
                assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
                assert await sessions.delete_session(sid)
                left = await state.list_keys(glob)
                assert left == [], f"round {round_}: the delete left {left}"
    finally:
        for worker in workers:
            worker.stop()
    for worker in workers:
        line = next(line for line in worker.lines if line.startswith("counts "))
        counts = json.loads(line.removeprefix("counts "))
        assert not [name for name in counts if name.startswith("error:")], counts
        assert counts.get("add", 0) > 0
        assert counts.get("refused", 0) > 0


CREATES = 300


@pytest.mark.redis
@pytest.mark.parametrize("kind", list(SHARED_BACKENDS))
async def test_a_delete_loop_never_touches_a_session_created_again(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """One process deletes an id in a loop while another creates it again and again: every
    session the creator made and no delete has ended since keeps its first state and is listed
    by its user (so delete_user finds it)."""
    url = SHARED_BACKENDS[kind](request, tmp_path)
    worker = "tests.integration._session_life_worker"
    deleter = LineProcess(worker, "delete", url, "s")
    creator = LineProcess(worker, "create", url, "s", str(CREATES))
    try:
        for process in (deleter, creator):
            assert process.wait_lines(1), process.close()
            assert process.lines[0] == "ready"
        assert creator.process.stdin is not None
        creator.process.stdin.write("go\n")
        creator.process.stdin.flush()
        assert creator.wait_lines(2, timeout=240), creator.close()
        result = json.loads(creator.lines[1].removeprefix("result "))
        deleter.stop()
        assert deleter.process.returncode == 0, deleter.close()
        deleted = int(deleter.lines[-1].removeprefix("deleted "))
    finally:
        deleter.close()
        creator.close()
    assert result["creates"] > 0
    assert deleted > 0
    assert (result["erased"], result["unlisted"]) == (0, 0), result


@pytest.mark.redis
@pytest.mark.parametrize("kind", list(SHARED_BACKENDS))
async def test_a_delete_killed_half_way_leaks_nothing(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A delete_session SIGKILLed after its first step: the session reads as gone, a session
    created under the id by another user shows none of its messages or summary, and the
    owner's delete_user still finds and erases all of it."""
    url = SHARED_BACKENDS[kind](request, tmp_path)
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        await sessions.create_session("alice", session_id="s")
        for n in range(12):
            await sessions.add_message("s", "user", f"alice {n}")
        await sessions.summarize("s", lambda previous, new: "alice's summary", keep_last=4)
    holder = LineProcess("tests.integration._session_life_worker", "hold-delete", url, "s")
    try:
        assert holder.wait_lines(1), holder.close()
        assert holder.lines[0] == "ready"
    finally:
        holder.kill()
    async with StateManager(backend=open_backend(url)) as state:
        sessions = SessionManager(state_manager=state)
        assert await sessions.get_session("s") is None
        assert await sessions.get_summary("s") is None
        await sessions.create_session("bob", session_id="s")
        for n in range(3):
            await sessions.add_message("s", "user", f"bob {n}")
        shown = [m.content for m in await sessions.get_messages("s", with_summary=True)]
        assert shown == ["bob 0", "bob 1", "bob 2"]
        erased = await sessions.delete_user("alice")
        assert erased.messages == 9  # alice's 4..12: bob's 1..3 replaced her 1..3
        values = await state.get_many(await state.list_keys("sessions:{s}:*"))
        assert not [key for key, value in values.items() if "alice" in repr(value)]
        shown = [m.content for m in await sessions.get_messages("s", with_summary=True)]
        assert shown == ["bob 0", "bob 1", "bob 2"]
        assert [s.session_id for s in await sessions.list_sessions("bob")] == ["s"]
