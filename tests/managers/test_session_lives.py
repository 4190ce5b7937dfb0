"""A session id deleted and created again: every life keeps to itself, at every point.

A delete and a create of the same id (an app-chosen id, a chat id) race in two processes; a
delete is killed half way. Each test here sweeps every storage call of the delete, runs the
other process's work (or a crash) just before it (`_interleave.at_call`), and checks what the
docs promise: the delete leaves alone whatever a session created again since has written, the new
session stays in its user's index, `delete_user` never erases another user's session, and what
a delete killed half way left is never shown in a later session of the id and is erased by the
owner's `delete_user`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import pytest

from agenticstate import ConflictError, NotFoundError, Session, SessionManager
from tests.managers._interleave import Crash, at_call, points

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agenticstate import StateManager


async def _old_life(sessions: SessionManager, sid: str, owner: str = "alice") -> None:
    await sessions.create_session(owner, session_id=sid, state={"old": True})
    for n in range(3):
        await sessions.add_message(sid, "user", f"old-{n}")
    await sessions.summarize(sid, lambda previous, messages: "old summary", keep_last=1)


async def _new_life(sessions: SessionManager, sid: str, owner: str) -> Session | None:
    try:
        session = await sessions.create_session(owner, session_id=sid, state={"new": owner})
    except ConflictError:
        return None  # the old life was still there: the delete had not ended it yet
    await sessions.add_message(sid, "user", f"new-{owner}")
    return session


async def _intact(sessions: SessionManager, sid: str, owner: str) -> str | None:
    """What is wrong with the new life of `sid`, or None."""
    if (await sessions.get_session(sid)) is None:
        return "the new session is gone"
    if (state := await sessions.get_state(sid)) != {"new": owner}:
        return f"its state is {state}"
    contents = [m.content for m in await sessions.get_messages(sid, with_summary=True)]
    if contents != [f"new-{owner}"]:
        return f"its messages are {contents}"
    if await sessions.get_summary(sid) is not None:
        return "it shows an earlier life's summary"
    if sid not in [s.session_id for s in await sessions.list_sessions(owner)]:
        return f"list_sessions({owner!r}) does not list it"
    return None


async def _sweep(
    state: StateManager,
    victim: Callable[[SessionManager, str], Awaitable[Any]],
    check: Callable[[SessionManager, str, Session | None], Awaitable[str | None]],
    owner: str,
) -> list[str]:
    """Run `victim` on an old life of a fresh id with a new life created by `owner` before each
    of its storage calls in turn; return what `check` found wrong at each point."""
    sessions = SessionManager(state_manager=state)
    other = SessionManager(state_manager=state)  # the other process
    await _old_life(sessions, "probe")
    total = await points(state, lambda: victim(sessions, "probe"))
    assert total > 3
    problems: list[str] = []
    for at in range(total + 1):
        sid = f"s{at}"
        await _old_life(sessions, sid)
        created: list[Session | None] = [None]

        async def create(sid: str = sid, created: list[Session | None] = created) -> None:
            created[0] = await _new_life(other, sid, owner)

        _, outcome = await at_call(state, functools.partial(victim, sessions, sid), at, create)
        if isinstance(outcome, Exception):
            problems.append(f"at call {at}: the delete raised {outcome!r}")
        wrong = await check(other, sid, created[0])
        if wrong is not None:
            problems.append(f"at call {at}: {wrong}")
        # Whatever happened, the owners' delete_user leaves nothing of the id.
        await other.delete_user("alice")
        await other.delete_user(owner)
        if left := await state.list_keys(f"sessions:{{{sid}}}:*"):
            problems.append(f"at call {at}: after delete_user, {left} are left")
    return problems


async def _kept(sessions: SessionManager, sid: str, created: Session | None) -> str | None:
    """A new life created while the delete ran is left whole (and listed)."""
    if created is None:
        return None
    return await _intact(sessions, sid, created.user_id)


async def _whole_or_gone(sessions: SessionManager, sid: str, created: Session | None) -> str | None:
    """The user's own new life may be erased by their delete_user, but wholly or not at all."""
    if created is None or await sessions.get_session(sid) is None:
        if await sessions.state.list_keys(f"sessions:{{{sid}}}:*"):
            return "the session is gone but some of its keys are left"
        return None
    return await _intact(sessions, sid, created.user_id)


async def _delete_session(sessions: SessionManager, sid: str) -> object:
    return await sessions.delete_session(sid)


async def _delete_alice(sessions: SessionManager, sid: str) -> object:
    return await sessions.delete_user("alice")


@pytest.mark.parametrize("owner", ["alice", "bob"])
async def test_delete_session_never_touches_a_session_created_again_meanwhile(
    state: StateManager, owner: str
) -> None:
    """A create (and first message) of the same id, by the same user or another, at any point
    of delete_session: the new session keeps its state and message, shows no summary of the
    old life, and stays listed; the owners' delete_user then leaves no key of the id."""
    assert await _sweep(state, _delete_session, _kept, owner) == []


async def test_delete_user_never_erases_another_users_session_created_meanwhile(
    state: StateManager,
) -> None:
    """bob creating an id at any point of delete_user(alice) over alice's session of that id:
    bob's session is left whole."""
    assert await _sweep(state, _delete_alice, _kept, "bob") == []


async def test_delete_user_erases_its_own_new_session_wholly_or_not_at_all(
    state: StateManager,
) -> None:
    """alice creating the id again at any point of delete_user(alice): her new session is
    either erased with every key, or left whole and listed."""
    assert await _sweep(state, _delete_alice, _whole_or_gone, "alice") == []


async def test_a_stale_index_entry_never_lets_delete_user_erase_another_users_session(
    state: StateManager,
) -> None:
    """alice's index names an id that has no session (a creation that stopped half way left
    its state); bob creates that id at any point of delete_user(alice): bob's session is left
    whole, and alice's leftover is erased."""
    sessions = SessionManager(state_manager=state)
    bob = SessionManager(state_manager=state)

    async def stale(sid: str) -> None:
        await state.index_add("sessions:users:{alice}", {sid: -1.0})
        await state.save(f"sessions:{{{sid}}}:state", {"alice": "half"}, ttl=None)

    await stale("probe")
    total = await points(state, lambda: sessions.delete_user("alice"))
    problems = []
    for at in range(total):
        sid = f"x{at}"
        await stale(sid)
        made: list[Session | None] = [None]

        async def create(sid: str = sid, made: list[Session | None] = made) -> None:
            made[0] = await _new_life(bob, sid, "bob")

        await at_call(state, lambda: sessions.delete_user("alice"), at, create)
        if made[0] is None:
            problems.append(f"at call {at}: bob could not create {sid}")
        elif (wrong := await _intact(bob, sid, "bob")) is not None:
            problems.append(f"at call {at}: {wrong}")
        await bob.delete_user("bob")
        if left := await state.list_keys(f"sessions:{{{sid}}}:*"):
            problems.append(f"at call {at}: {left} are left")
    assert problems == []


async def _bob_creates(sessions: SessionManager, sid: str) -> bool:
    """bob creates a session under the id (False: alice's is still there) with two messages."""
    try:
        await sessions.create_session("bob", session_id=sid, state={"new": "bob"})
    except ConflictError:
        return False  # alice's session is still there: the delete had not begun
    for n in range(2):
        await sessions.add_message(sid, "user", f"bob-{n}")
    return True


async def _shows_nothing_of_alice(sessions: SessionManager, sid: str) -> str | None:
    """What bob's session under the id shows of alice's, or None."""
    shown = [m.content for m in await sessions.get_messages(sid, with_summary=True)]
    if shown != ["bob-0", "bob-1"]:
        return f"bob's session shows {shown}"
    if await sessions.get_summary(sid) is not None:
        return "bob's session has alice's summary"
    if (got := await sessions.get_state(sid)) != {"new": "bob"}:
        return f"bob's state is {got}"
    return None


@pytest.mark.parametrize("victim", ["delete_session", "delete_user"])
async def test_a_delete_killed_at_any_point_leaks_nothing(state: StateManager, victim: str) -> None:
    """A delete killed before any of its storage calls: the session is either still whole, or
    gone for every reader; alice's delete_user then erases all that is left of it (it still
    finds it), and a session bob creates under the id meanwhile shows none of it."""
    sessions = SessionManager(state_manager=state)

    def run(sid: str) -> Awaitable[object]:
        if victim == "delete_session":
            return sessions.delete_session(sid)
        return sessions.delete_user("alice")

    await _old_life(sessions, "probe")
    total = await points(state, lambda: run("probe"))
    problems = []
    for at in range(total):
        for then_bob in (False, True):
            sid = f"k{at}{'b' if then_bob else ''}"
            await _old_life(sessions, sid)
            with pytest.raises(Crash):
                await at_call(state, functools.partial(run, sid), at, crash=True)
            after = SessionManager(state_manager=state)  # a process started afterwards
            if (session := await after.get_session(sid)) is None:
                with pytest.raises(NotFoundError):
                    await after.get_messages(sid)
                assert await after.get_summary(sid) is None
            else:
                assert [m.content for m in await after.get_messages(sid)] == [
                    f"old-{n}" for n in range(3)
                ]
            bob = then_bob and await _bob_creates(after, sid)
            if bob and (wrong := await _shows_nothing_of_alice(after, sid)) is not None:
                problems.append(f"killed at call {at}: {wrong}")
            await after.delete_user("alice")
            left = await state.get_many(await state.list_keys(f"sessions:{{{sid}}}:*"))
            if any("old" in repr(value) for value in left.values()):
                problems.append(f"killed at call {at}: alice's {sorted(left)} are left")
            if bob:
                if (wrong := await _shows_nothing_of_alice(after, sid)) is not None:
                    problems.append(f"killed at call {at}, after delete_user: {wrong}")
                await after.delete_user("bob")
            elif session is not None and await after.get_session(sid) is not None:
                problems.append(f"killed at call {at}: delete_user left the session")
    assert problems == []
